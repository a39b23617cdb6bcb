"""A video VAE decoding one frame, as the 2-D network it then is (`parallelize` applies it, `apply_compile`
compiles it).

Why: the VAEs of Qwen-Image (``AutoencoderKLQwenImage``: NucleusMoE, Qwen-Image) and of Wan
(``AutoencoderKLWan``: Wan, SkyReels, ChronoEdit, Helios) decode one latent frame at a time through causal
3-D convolutions and a frame cache. An image is one latent frame, and so is a video's first chunk. Two costs
follow that one frame does not need:

- **The zero frames.** Each causal convolution pads its input with ``kt - 1`` zero frames in front (``kt``:
  the kernel's frames, 3 for the resblocks' 3x3x3) and runs ``nn.Conv3d``: with one real frame, the output
  is the 2-D convolution of that frame with the kernel's last temporal slice, and cuDNN multiplies the zeros
  too, 3x the work (plus the padded copy of the input). In one compiled 4-step NucleusMoE 1024² call on the
  H200 the VAE decode took 33.6 ms of GPU time in 37 cuDNN convolutions, 32 of them these
  (`benchmarks/results/serving/served-path-nucleusmoe-h200-f6c8114-profile-bare.txt`); the full-size
  Qwen-Image VAE's decode at 256² in bfloat16 took 1082 ms with them and 542 ms without on the 2-core CPU
  machine. diffusers' own Qwen-Image 2.1 VAE is written with 2-D convolutions.
- **The frame cache.** Every causal convolution's input is cloned into the cache for the next frame; a decode
  of one frame has no next frame. Decoding that frame without the cache (``feat_cache=None``) computes the same
  values (the upsamplers skip their time convolution on a first frame either way) without the clones, and
  makes the decoder a plain function of its input, which torch.compile traces whole (the cache is a list
  mutated in place): `apply_compile` compiles this one-frame path (`OneFrameDecode.compile`).

`one_frame_convs_as_2d` patches each causal convolution (its own path for inputs with several frames or a
cache: a video's later frames, the encoder). `OneFrameDecode` wraps ``vae._decode`` (which knows whether the
latent has one frame) and ``vae.decoder.forward``: a decode of a one-frame latent runs its decoder call(s)
(one, or one per tile) without the cache. The 2-D convolution sums in another order: equal to float32
rounding, not bit for bit (``tests/features/test_one_frame_vae.py``).

    undo, count = one_frame_convs_as_2d(pipe.vae)   # count: the convolutions patched
    one = OneFrameDecode(pipe.vae)                  # None-safe: `one_frame_decode(pipe.vae)` returns None
    one.compile(backend="inductor")                 # the one-frame decoder compiled (apply_compile does this)
    one.restore(); undo()
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from xstage_dit.families.registry import causal_conv_classes, records, video_vae_facts
from xstage_dit.features.instance_attr import set_on_instance

log = logging.getLogger(__name__)

__all__ = ["OneFrameDecode", "one_frame_convs_as_2d", "one_frame_conv2d", "one_frame_decode", "apply"]

# Which VAEs and convolutions qualify is a fact of the family records (`VideoVAEFacts`): diffusers' causal 3-D
# convolutions that pad time with zeros in front (``_padding[4] == 2 * padding[0]``) and take the previous chunk's
# frames as ``cache_x`` (not LTX's, HunyuanVideo's or CogVideoX's: those pad with copies of the first frame), and
# the VAEs whose ``_decode`` runs ``decoder(frame, feat_cache=..., feat_idx=...)`` once per latent frame and whose
# decoder computes a first frame without the cache the same way as with a fresh one.
_MARK = "_xstage_one_frame_decode"


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


def _conv_forward(module: torch.nn.Conv3d, original: Callable, slice_: _WeightSlice, x, cache_x=None):
    if x.dim() == 5 and x.shape[2] == 1 and cache_x is None and not torch.is_grad_enabled():
        # Traced by torch.compile, the slice is part of the graph (no Python-side cache in it).
        weight = module.weight[:, :, -1] if torch.compiler.is_compiling() else slice_.get(module)
        return one_frame_conv2d(module, x, weight)
    return original(x, cache_x)


def one_frame_convs_as_2d(model: torch.nn.Module) -> tuple[Callable[[], None], int]:
    """Patch every causal convolution of `model` (a family record's ``VideoVAEFacts.causal_conv_class``, zero
    padding in time) so a one-frame input without cache runs as a 2-D convolution (module docstring); outside
    autograd only (the slice kept for it is detached). Returns (undo, number of modules patched)."""
    undos = []
    classes = causal_conv_classes()
    for module in model.modules():
        if type(module).__name__ not in classes or "forward" in vars(module) or not _takes_2d(module):
            continue  # an own forward: patched already, or by someone else whose forward this would hide
        undos.append(set_on_instance(module, "forward",
                                     functools.partial(_conv_forward, module, module.forward, _WeightSlice())))
    patched = len(undos)

    def undo() -> None:
        while undos:
            undos.pop()()

    if patched:
        log.info("%s: %d causal 3-D convolutions run one-frame inputs as 2-D convolutions", type(model).__name__,
                 patched)
    return undo, patched


class OneFrameDecode:
    """``vae._decode`` and ``vae.decoder.forward`` wrapped so a one-frame latent decodes without the frame cache.

    calls: the decoder calls that took the one-frame path. compiled: whether that path runs compiled.
    compile(wrap=None, **torch_compile_kwargs) / uncompile(): the one-frame decoder through ``torch.compile`` (one
    graph per latent size: ``dynamic=False`` unless given). restore(): the VAE's own methods again (idempotent)."""

    def __init__(self, vae: torch.nn.Module) -> None:
        if not _decodes_one_frame(vae):
            raise ValueError(f"expected a VAE from {_one_frame_vaes()} (family records that take a one-frame "
                             f"decode), got {type(vae).__name__}")
        if getattr(vae, _MARK, None) is not None:
            raise RuntimeError(f"expected a {type(vae).__name__} without a one-frame decode yet: restore it first")
        self.vae = vae
        self.decoder = vae.decoder
        self.calls = 0
        self._decode = vae._decode
        self._forward = vae.decoder.forward
        self._plain = functools.partial(self._forward, feat_cache=None)
        self._fast: Callable[[torch.Tensor], torch.Tensor] = self._plain
        self._chunked: Callable[..., torch.Tensor] = self._forward  # a latent of several frames, chunk by chunk
        self._one_frame = False
        self._undo = [set_on_instance(vae, "_decode", self._decode_call),
                      set_on_instance(self.decoder, "forward", self._forward_call),
                      set_on_instance(vae, _MARK, self)]

    @property
    def compiled(self) -> bool:
        return self._fast is not self._plain

    @property
    def chunks_compiled(self) -> bool:
        return self._chunked is not self._forward

    def _decode_call(self, z: torch.Tensor, *args, **kwargs):
        self._one_frame = z.dim() == 5 and z.shape[2] == 1
        try:
            return self._decode(z, *args, **kwargs)
        finally:
            self._one_frame = False

    def _forward_call(self, x, feat_cache=None, feat_idx=[0], *args, **kwargs):  # noqa: B006 - diffusers' signature
        # first_chunk (Wan) only changes how later chunks are cached: a lone frame runs the same layers without it.
        if self._one_frame and x.dim() == 5 and x.shape[2] == 1 and not args and set(kwargs) <= {"first_chunk"} \
                and not torch.is_grad_enabled():
            self.calls += 1
            return self._fast(x, **kwargs)
        return self._chunked(x, feat_cache, feat_idx, *args, **kwargs)

    def compile(self, wrap: Callable[[Callable, Callable], Callable] | None = None, chunks: bool = False,
                compile_fn: Callable[..., Callable] | None = None, **kwargs: Any) -> None:
        """Compile the one-frame decoder path (``compile_fn(..., **kwargs)``, torch.compile unless given: the
        compile feature hands its own, whose graphs its restore drops; ``dynamic`` defaults to False).
        wrap(eager, compiled) -> callable: what runs instead of the compiled path (`apply_compile`'s bound on
        compiled shapes). chunks: also the decoder's own path for a latent of several frames, one chunk a call
        with the frame cache (Dynamo follows the cache list: three graphs a size, for the first chunk, the
        second and the rest; one graph, no break, on the tiny Wan VAE)."""
        compile_fn = torch.compile if compile_fn is None else compile_fn
        kwargs.setdefault("dynamic", False)
        compiled = compile_fn(self._plain, **kwargs)
        self._fast = compiled if wrap is None else wrap(self._plain, compiled)
        if chunks:
            chunked = compile_fn(self._forward, **kwargs)
            self._chunked = chunked if wrap is None else wrap(self._forward, chunked)

    def uncompile(self) -> None:
        self._fast = self._plain
        self._chunked = self._forward

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.uncompile()


def _decodes_one_frame(vae: Any) -> bool:
    facts = video_vae_facts(vae)
    return facts is not None and facts.one_frame_decode


def _one_frame_vaes() -> str:
    names = {r.facts.video_vae.vae_class for r in records().values()
             if r.facts.video_vae is not None and r.facts.video_vae.one_frame_decode}
    return ", ".join(sorted(names))


def one_frame_decode(vae: Any) -> OneFrameDecode | None:
    """A `OneFrameDecode` of `vae` where its family record takes a one-frame decode (``VideoVAEFacts``), else None.
    Not for Wan 2.2's residual VAE (``is_residual``: its up blocks' shortcut drops frames of a first chunk; not
    tested here)."""
    if not isinstance(vae, torch.nn.Module) or not _decodes_one_frame(vae):
        return None
    if getattr(getattr(vae, "config", None), "is_residual", False):
        return None
    return OneFrameDecode(vae)


def one_frame_decode_of(vae: Any) -> OneFrameDecode | None:
    """The `OneFrameDecode` applied to `vae`, if any (what `apply_compile` compiles)."""
    return getattr(vae, _MARK, None)


def apply(pipe: Any, enabled: bool, ctx) -> Callable[[], None] | None:
    """The stack's one-frame VAE: a pipeline's video VAE runs one-frame inputs as 2-D convolutions
    (``ctx.vae_convs_2d``) and decodes a one-frame latent without the frame cache (``ctx.one_frame_decode``,
    which the compile feature compiles). A VAE shared with a pipeline patched before (diffusers' from_pipe
    shares components) keeps that pipeline's decode wrapping, which its stack undoes."""
    vae = getattr(pipe, "vae", None) if ctx.is_pipeline else None
    if not isinstance(vae, torch.nn.Module):
        return None
    undo, ctx.vae_convs_2d = one_frame_convs_as_2d(vae)
    ctx.one_frame_decode = one_frame_decode_of(vae)
    if ctx.one_frame_decode is not None:
        return undo
    ctx.one_frame_decode = one_frame_decode(vae)
    if ctx.one_frame_decode is None:
        return undo
    restore = ctx.one_frame_decode.restore

    def undo_both() -> None:
        restore()
        undo()

    return undo_both
