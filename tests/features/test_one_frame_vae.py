"""`patches.one_frame_vae`: a video VAE's one-frame decode as a 2-D network (convolutions in 2-D, no frame cache),
the same values, compiled whole."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from torch.overrides import TorchFunctionMode

from xstage_dit.families import load_pipeline
from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.compile import apply_compile
from xstage_dit.features.one_frame_vae import (OneFrameDecode, one_frame_conv2d, one_frame_convs_as_2d,
                                           one_frame_decode, one_frame_decode_of)


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
            assert one_frame_decode_of(pipe.vae).calls == (1 if frames == 1 else 0)
        finally:
            handle.restore()
        assert not any("forward" in vars(m) for m in pipe.vae.modules())
        assert "_decode" not in vars(pipe.vae) and one_frame_decode_of(pipe.vae) is None
        again = pipe.vae.decode(latents).sample
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("model,dtype", [("tiny-nucleusmoe", torch.bfloat16), ("tiny-wan", torch.float32)])
def test_on_the_gpu_the_2d_path_agrees_with_cudnn_3d(model, dtype):
    pipe = load_pipeline(model, dtype=dtype, device=torch.device("cuda"), seed=0)
    vae = pipe.vae.to(dtype)
    latents = torch.randn(2, vae.config.z_dim, 1, 32, 48, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    # cuDNN convolves float32 in TF32 by default (torch.backends.cudnn.allow_tf32), and the 2-D and 3-D
    # convolutions then round differently (tiny Wan on an H100: 2.4e-3 max, a third of the values past 1e-4):
    # the float32 case compares the math in full float32, which is what the 2-D path claims to keep.
    with torch.inference_mode(), torch.backends.cudnn.flags(enabled=True, allow_tf32=dtype != torch.float32):
        expected = vae.decode(latents).sample.float()
        undo, count = one_frame_convs_as_2d(vae)
        got = vae.decode(latents).sample.float()
        undo()
    assert count > 0
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


class CacheClones(TorchFunctionMode):
    """Counts Tensor.clone calls (the frame cache's copies)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.clone:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", ["tiny-nucleusmoe", "tiny-wan"])
def test_a_one_frame_latent_decodes_without_the_frame_cache_bit_for_bit(model):
    pipe = load_pipeline(model, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    vae = pipe.vae
    latents = torch.randn(2, vae.config.z_dim, 1, 6, 10, generator=torch.Generator().manual_seed(7))
    video = torch.randn(1, vae.config.z_dim, 3, 6, 10, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        with CacheClones() as before:
            expected = vae.decode(latents).sample
        expected_video = vae.decode(video).sample
        one = one_frame_decode(vae)
        try:
            with CacheClones() as after:
                got = vae.decode(latents).sample
            got_video = vae.decode(video).sample  # several frames: the cached path, as before
            assert one.calls == 1
        finally:
            one.restore()
    assert before.count > 0 and after.count == 0
    assert torch.equal(got, expected) and torch.equal(got_video, expected_video)


def test_a_tiled_one_frame_decode_takes_the_path_per_tile():
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    vae = pipe.vae
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                      tile_sample_stride_width=24)
    latents = torch.randn(1, vae.config.z_dim, 1, 8, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = vae.decode(latents).sample
        one = one_frame_decode(vae)
        got = vae.decode(latents).sample
        one.restore()
    assert one.calls > 1
    assert torch.equal(got, expected)


def test_one_frame_decode_refuses_other_vaes_and_a_second_wrap():
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    flux = load_pipeline("tiny-flux", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    assert one_frame_decode(flux.vae) is None
    with pytest.raises(ValueError, match="expected a VAE from"):
        OneFrameDecode(flux.vae)
    one = one_frame_decode(pipe.vae)
    with pytest.raises(RuntimeError, match="restore it first"):
        OneFrameDecode(pipe.vae)
    one.restore()
    one.restore()


def test_the_one_frame_decoder_is_compiled_under_the_shape_bound(caplog):
    import logging

    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    vae = pipe.vae
    handle = parallelize(pipe, ParallelConfig())
    compiled = apply_compile(pipe, "regional", backend="eager", max_shapes=1)
    try:
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="xstage_dit.features.compile"):
            for size in (8, 12, 12):  # a second latent size: past the bound of 1, eager, logged once
                vae.decode(torch.randn(1, vae.config.z_dim, 1, size, size))
        assert (len(compiled.vae_compiled_shapes), len(compiled.vae_eager_shapes)) == (1, 1)
        assert sum("vae decoder" in r.getMessage() for r in caplog.records) == 1
        assert one_frame_decode_of(vae).calls == 3
    finally:
        compiled.restore()
        handle.restore()


def eager_decode(model: str, frames: int, seed: int):
    """(pipe, vae, latents, the VAE's own decode of them) for a tiny model, before any patch."""
    pipe = load_pipeline(model, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    vae = pipe.vae
    latents = torch.randn(1, vae.config.z_dim, frames, 8, 8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return pipe, vae, latents, vae.decode(latents).sample


def test_apply_compile_compiles_the_one_frame_decoder_whole():
    pipe, vae, latents, expected = eager_decode("tiny-nucleusmoe", frames=1, seed=4)
    handle = parallelize(pipe, ParallelConfig())
    compiled = apply_compile(pipe, "regional", backend="eager")
    try:
        one = one_frame_decode_of(vae)
        assert one.compiled and "one-frame" in compiled.how
        torch._dynamo.utils.counters.clear()
        with torch.no_grad():
            got = vae.decode(latents).sample
            again = vae.decode(latents).sample
        assert one.calls == 2
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0  # one graph: no break
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    finally:
        compiled.restore()
        handle.restore()
    assert not one.compiled
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, got)


@pytest.mark.gpu
def test_on_the_gpu_the_compiled_one_frame_decode_agrees_with_diffusers():
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    vae = pipe.vae
    latents = torch.randn(1, vae.config.z_dim, 1, 32, 32, generator=torch.Generator().manual_seed(2)).to(
        "cuda", torch.bfloat16)
    with torch.inference_mode():
        expected = vae.decode(latents).sample.float()
    handle = parallelize(pipe, ParallelConfig())
    compiled = apply_compile(pipe, "regional")
    try:
        with torch.inference_mode():
            got = vae.decode(latents).sample.float()
        assert one_frame_decode_of(vae).calls == 1
    finally:
        compiled.restore()
        handle.restore()
    # bfloat16 through Inductor's fused norms: a few bf16 steps apart at most (0.045 max over a 1024² decode of the
    # tiny VAE on the CPU), far from what a wrong convolution slice or a dropped cache gives
    difference = (got - expected).abs()
    assert difference.mean() < 4e-3 and difference.max() < 0.1, (difference.mean(), difference.max())


def test_a_vae_shared_by_two_parallelized_pipelines_is_wrapped_once():
    from diffusers import NucleusMoEImagePipeline

    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    other = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=1)
    other = NucleusMoEImagePipeline(**{**other.components, "vae": pipe.vae})  # its own transformer, pipe's VAE
    first = parallelize(pipe, ParallelConfig())
    second = parallelize(other, ParallelConfig())
    try:
        assert second.one_frame_decode is first.one_frame_decode and second.vae_convs_2d == 0
        second.restore()
        assert one_frame_decode_of(pipe.vae) is first.one_frame_decode  # the first pipeline's, still in place
    finally:
        second.restore()
        first.restore()
    assert one_frame_decode_of(pipe.vae) is None and not any("forward" in vars(m) for m in pipe.vae.modules())


def test_video_vae_extra_compiles_the_chunked_decode_in_three_graphs():
    """``extras=("video-vae",)``: a latent of several frames decodes chunk by chunk through the compiled decoder
    (first chunk, second, the rest: three graphs, no break), the eager frames; a second decode compiles nothing."""
    from torch._dynamo.utils import counters

    pipe, vae, video, expected = eager_decode("tiny-wan", frames=5, seed=6)
    handle = parallelize(pipe, ParallelConfig())
    plain = apply_compile(pipe, "regional", backend="eager")
    assert not one_frame_decode_of(vae).chunks_compiled  # off unless asked
    plain.restore()
    compiled = apply_compile(pipe, "regional", backend="eager", extras=("video-vae",))
    try:
        one = one_frame_decode_of(vae)
        assert one.chunks_compiled and "several frames (chunked)" in compiled.how
        counters.clear()
        with torch.no_grad():
            got = vae.decode(video).sample
            graphs = counters["stats"]["unique_graphs"]
            again = vae.decode(video).sample
        assert graphs == 3 and counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    finally:
        compiled.restore()
        handle.restore()
    assert not one.chunks_compiled
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # the first frame's 2-D convolutions
    assert torch.equal(again, got)
    with pytest.raises(ValueError, match="expected compile extras from text-encoder, video-vae, got 'vae'"):
        apply_compile(pipe, "regional", extras=("vae",))
