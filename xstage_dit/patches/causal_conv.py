"""A causal video-VAE convolution over one frame, run as the 2-D convolution it is (`parallelize` applies it).

Why: the VAEs of Qwen-Image (``AutoencoderKLQwenImage``: NucleusMoE, Qwen-Image) and of Wan
(``AutoencoderKLWan``: Wan, SkyReels, ChronoEdit, Helios) decode through causal 3-D convolutions. Each pads
its input with ``kt - 1`` zero frames in front (``kt``: the kernel's frames, 3 for the resblocks' 3x3x3) and
runs ``nn.Conv3d`` on the result. An image is one latent frame, and so is a video's first (nothing cached
yet): the padded input then holds ``kt`` frames of which ``kt - 1`` are zeros, and the one output frame is the
2-D convolution of the real frame with the kernel's last temporal slice. cuDNN does not know the zeros and
multiplies them: 3x the work of the 2-D convolution for a 3x3x3 kernel. In one compiled 4-step NucleusMoE
1024² call on the H200, the VAE decode took 33.6 ms of GPU time in 37 cuDNN convolutions, 32 of them these
(`benchmarks/results/serving/served-path-nucleusmoe-h200-f6c8114-profile-bare.txt`). diffusers' own
Qwen-Image 2.1 VAE is written with 2-D convolutions for the same reason.

Here each such module's forward takes the 2-D path when its input is one frame with no cached frames, and its
own path otherwise (a video's later frames, whose cache holds real frames; the encoder's multi-frame chunks).
The result is the same convolution summed in another order: equal to float32 rounding, not bit for bit
(``tests/patches/test_causal_conv.py``). The 2-D weight (the last temporal slice, made contiguous) is kept per
module and made again when the weight's storage or in-place version changes.

    undo, count = one_frame_convs_as_2d(pipe.vae)   # count: the modules patched
    undo()
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = ["CAUSAL_CONV_CLASSES", "one_frame_convs_as_2d", "one_frame_conv2d"]

# diffusers' causal 3-D convolutions that pad time with zeros in front (``_padding[4] == 2 * padding[0]``) and
# take the previous chunk's frames as ``cache_x``. Not LTX's, HunyuanVideo's or CogVideoX's: those pad with
# copies of the first frame, so the padded frames are not zeros.
CAUSAL_CONV_CLASSES = ("QwenImageCausalConv3d", "WanCausalConv3d")


def one_frame_conv2d(module: torch.nn.Conv3d, x: torch.Tensor, weight_2d: torch.Tensor | None = None) -> torch.Tensor:
    """The module's causal convolution of a one-frame input without cache, as one 2-D convolution.

    x: (batch, in_channels, 1, height, width). Returns (batch, out_channels, 1, height_out, width_out), what
    ``module(x)`` returns (zero frames in front, then the 3-D convolution) up to summation order.
    weight_2d: the weight's last temporal slice, contiguous (made here when not given)."""
    if x.dim() != 5 or x.shape[2] != 1:
        raise ValueError(f"expected a one-frame input (batch, channels, 1, height, width), got {tuple(x.shape)}")
    if weight_2d is None:
        weight_2d = module.weight[:, :, -1].contiguous()
    w_left, w_right, h_top, h_bottom = module._padding[:4]
    frame = x[:, :, 0]
    if (w_left, h_top) == (w_right, h_bottom):
        out = F.conv2d(frame, weight_2d, module.bias, stride=module.stride[1:], padding=(h_top, w_left),
                       dilation=module.dilation[1:], groups=module.groups)
    else:
        out = F.conv2d(F.pad(frame, (w_left, w_right, h_top, h_bottom)), weight_2d, module.bias,
                       stride=module.stride[1:], dilation=module.dilation[1:], groups=module.groups)
    return out.unsqueeze(2)


def _takes_2d(module: torch.nn.Conv3d) -> bool:
    """The module's geometry makes a one-frame output the last temporal slice's 2-D convolution."""
    frames = module.kernel_size[0]
    padding = getattr(module, "_padding", None)
    return (isinstance(padding, tuple) and len(padding) == 6 and padding[4] == frames - 1 and padding[5] == 0
            and tuple(module.padding) == (0, 0, 0) and module.dilation[0] == 1
            and module.padding_mode == "zeros")


class _WeightSlice:
    """The 2-D weight of one module, made again when the weight's storage or in-place version changes."""

    def __init__(self) -> None:
        self.key = None
        self.weight: torch.Tensor | None = None

    def get(self, module: torch.nn.Conv3d) -> torch.Tensor:
        w = module.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self.key:
            self.weight = w.detach()[:, :, -1].contiguous()
            self.key = key
        return self.weight


def _forward(module: torch.nn.Conv3d, original: Callable, slice_: _WeightSlice, x, cache_x=None):
    if x.dim() == 5 and x.shape[2] == 1 and cache_x is None and not torch.is_grad_enabled():
        weight = module.weight[:, :, -1] if torch.compiler.is_compiling() else slice_.get(module)
        return one_frame_conv2d(module, x, weight)
    return original(x, cache_x)


def one_frame_convs_as_2d(model: torch.nn.Module) -> tuple[Callable[[], None], int]:
    """Patch every causal convolution of `model` (`CAUSAL_CONV_CLASSES`, zero padding in time) so a one-frame
    input without cache runs as a 2-D convolution (module docstring); outside autograd only (the slice kept
    for it is detached). Returns (undo, number of modules patched)."""
    patched = []
    for module in model.modules():
        if type(module).__name__ not in CAUSAL_CONV_CLASSES or "forward" in vars(module):
            continue
        if not _takes_2d(module):
            continue
        module.forward = functools.partial(_forward, module, module.forward, _WeightSlice())
        patched.append(module)

    def undo() -> None:
        for module in patched:
            vars(module).pop("forward", None)
        patched.clear()

    if patched:
        log.info("%s: %d causal 3-D convolutions run one-frame inputs as 2-D convolutions", type(model).__name__,
                 len(patched))
    return undo, len(patched)
