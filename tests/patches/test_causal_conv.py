"""`patches.causal_conv`: a video VAE's causal convolution of one frame as a 2-D convolution, the same values."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from torch.overrides import TorchFunctionMode

from xstage_dit.models import load_pipeline
from xstage_dit.patches import ParallelConfig, parallelize
from xstage_dit.patches.causal_conv import one_frame_conv2d, one_frame_convs_as_2d


class Convs(TorchFunctionMode):
    """Counts 2-D and 3-D convolution calls."""

    def __init__(self):
        super().__init__()
        self.counts = {"conv2d": 0, "conv3d": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def conv(cls, cin, cout, kernel, stride=1, padding=0, seed=0):
    torch.manual_seed(seed)
    return cls(cin, cout, kernel, stride=stride, padding=padding).eval()


# (class, in, out, kernel, stride, padding): the resblocks' 3x3x3, the 1x1x1 shortcuts and post-quant convs,
# a strided one, odd channel counts
GEOMETRIES = [
    (QwenImageCausalConv3d, 8, 16, 3, 1, 1),
    (QwenImageCausalConv3d, 5, 3, 1, 1, 0),
    (WanCausalConv3d, 6, 10, 3, 1, 1),
    (WanCausalConv3d, 4, 4, (3, 3, 3), (1, 2, 2), (1, 1, 1)),
    (WanCausalConv3d, 3, 7, (3, 5, 3), 1, (1, 2, 1)),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g[0].__name__}-{g[1]}x{g[2]}-k{g[3]}-s{g[4]}")
@pytest.mark.parametrize("size", [(1, 9, 7), (2, 16, 16)], ids=["odd", "batch2"])
def test_one_frame_equals_the_3d_convolution_over_zero_frames(geometry, size):
    cls, cin, cout, kernel, stride, padding = geometry
    module = conv(cls, cin, cout, kernel, stride, padding)
    batch, height, width = size
    x = torch.randn(batch, cin, 1, height, width, generator=torch.Generator().manual_seed(batch * height))
    with torch.no_grad():
        expected = module(x)
        got = one_frame_conv2d(module, x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_asymmetric_spatial_padding_is_padded_before_the_convolution():
    module = conv(WanCausalConv3d, 4, 6, 3, 1, 1)
    module._padding = (0, 2, 1, 0, 2, 0)  # (w_left, w_right, h_top, h_bottom, t_front, t_back)
    x = torch.randn(1, 4, 1, 8, 9)
    with torch.no_grad():
        torch.testing.assert_close(one_frame_conv2d(module, x), module(x), rtol=1e-5, atol=1e-5)


def test_the_patched_module_takes_2d_only_for_one_frame_without_cache():
    module = conv(QwenImageCausalConv3d, 8, 8, 3, 1, 1)
    one = torch.randn(1, 8, 1, 10, 10)
    frames = torch.randn(1, 8, 3, 10, 10)
    cache = torch.randn(1, 8, 2, 10, 10)
    with torch.no_grad():
        expected = [module(one), module(frames), module(one, cache)]
        undo, count = one_frame_convs_as_2d(torch.nn.Sequential(module))
        assert count == 1
        with Convs() as convs:
            got_one = module(one)
        assert convs.counts == {"conv2d": 1, "conv3d": 0}
        with Convs() as convs:
            got = [module(frames), module(one, cache)]
        assert convs.counts == {"conv2d": 0, "conv3d": 2}
    torch.testing.assert_close(got_one, expected[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got, expected[1:]):
        assert torch.equal(a, b)  # the module's own path, bit for bit
    with Convs() as convs:
        module(one)  # autograd on: the module's own path (the kept slice is detached)
    assert convs.counts["conv3d"] == 1
    undo()
    assert "forward" not in vars(module)


def test_a_changed_weight_makes_a_new_slice():
    module = conv(WanCausalConv3d, 4, 4, 3, 1, 1)
    one_frame_convs_as_2d(torch.nn.Sequential(module))
    x = torch.randn(1, 4, 1, 6, 6)
    with torch.no_grad():
        before = module(x)
        module.weight.mul_(2.0)
        after = module(x)
        bias = module.bias.view(1, -1, 1, 1, 1)
    torch.testing.assert_close(after - bias, 2 * (before - bias), rtol=1e-5, atol=1e-5)


def test_replicate_padded_vaes_are_left_alone():
    pipe = load_pipeline("tiny-ltx", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    assert one_frame_convs_as_2d(pipe.vae)[1] == 0  # LTX pads time with copies of the first frame, not zeros


@pytest.mark.parametrize("model", ["tiny-nucleusmoe", "tiny-wan"])
def test_the_vae_decode_is_the_same_through_parallelize(model):
    pipe = load_pipeline(model, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    z_dim = pipe.vae.config.z_dim
    frames = 3 if model == "tiny-wan" else 1  # a video: its first latent frame takes the 2-D path, the rest not
    latents = torch.randn(1, z_dim, frames, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = pipe.vae.decode(latents).sample
        handle = parallelize(pipe, ParallelConfig())
        try:
            assert handle.vae_convs_2d > 0
            got = pipe.vae.decode(latents).sample
        finally:
            handle.restore()
        assert not any("forward" in vars(m) for m in pipe.vae.modules())
        again = pipe.vae.decode(latents).sample
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("model,dtype", [("tiny-nucleusmoe", torch.bfloat16), ("tiny-wan", torch.float32)])
def test_on_the_gpu_the_2d_path_agrees_with_cudnn_3d(model, dtype):
    pipe = load_pipeline(model, dtype=dtype, device=torch.device("cuda"), seed=0)
    vae = pipe.vae.to(dtype)
    latents = torch.randn(2, vae.config.z_dim, 1, 32, 48, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    with torch.inference_mode():
        expected = vae.decode(latents).sample.float()
        undo, count = one_frame_convs_as_2d(vae)
        got = vae.decode(latents).sample.float()
        undo()
    assert count > 0
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
