"""Row-wise FP8 with fused activation quantization (`xstage_dit.features.fp8_fused`), on the CPU: the fused forwards of
FLUX's feed-forwards and single blocks (and Wan's feed-forwards) give torchao's unfused output bit for bit (the op's
CPU path is torchao's formula exactly), compile with fullgraph, touch only what they can reproduce, and undo.

torchao refuses row-wise FP8 without an FP8 GPU; its hardware check is patched here (the CPU's ``torch._scaled_mm``
runs row-wise scales), so the layers are torchao's own ``Float8Tensor`` weights, as on an H100."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.features.fp8 import Fp8Config, Fp8Handle
from xstage_dit.features.fp8_fused import fuse_rows, fused_linear, row_wise_fp8
from xstage_dit.runtime.generation import call_kwargs

torchao = pytest.importorskip("torchao", reason="torchao is a pinned dependency: the FP8 feature needs it")


@pytest.fixture(autouse=True)
def _fp8_on_the_cpu(monkeypatch):
    import torchao.quantization.quant_api as quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


def _latents(pipe, spec, seed=3):
    kwargs = call_kwargs(pipe, spec, prompt="a fox in the snow", seed=seed, steps=2, height=64, width=64)
    with torch.inference_mode():
        out = pipe(**{**kwargs, "output_type": "latent"})
    return out.frames if hasattr(out, "frames") else out.images


# FLUX (both fused forwards), Wan (its zero-padded text rows), and three more families whose feed-forwards fuse. Every
# tiny text-to-X family was checked once the same way (2026-12-07): bit for bit, no NaN.
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan", "tiny-sd3", "tiny-qwenimage", "tiny-hunyuanvideo15"])
def test_fused_row_quantization_gives_torchaos_output_bit_for_bit(model):
    pipe, spec = load_pipeline(model, dtype=torch.bfloat16, device="cpu", seed=0), model_spec(model)
    transformer = pipe.transformer
    handle = Fp8Handle(transformer, Fp8Config("row", fuse_rows=False))
    assert handle.fused == [] and all("forward" not in vars(m) for m in transformer.modules())
    unfused = _latents(pipe, spec)
    handle.restore()

    handle = Fp8Handle(transformer, Fp8Config("row"))
    assert handle.fused and set(handle.fused) <= {p for p, m in transformer.named_modules()
                                                  if type(m).__name__ in ("FeedForward", "FluxSingleTransformerBlock")}
    assert handle.describe()["fused_row_quantization"] == len(handle.fused)
    if model == "tiny-flux":  # every double block's two feed-forwards and every single block
        assert len(handle.fused) == 2 * len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    fused = _latents(pipe, spec)
    assert not fused.isnan().any()  # Wan's zero-padded text rows: NaN without the feature's amax floor
    assert torch.equal(fused.view(torch.int16), unfused.view(torch.int16))
    handle.restore()
    assert all("forward" not in vars(m) for m in transformer.modules())  # the classes' forwards show through again


def test_a_fused_single_block_compiles_whole_and_matches_its_eager_self():
    pipe = load_pipeline("tiny-flux", dtype=torch.bfloat16, device="cpu", seed=0)
    block = pipe.transformer.single_transformer_blocks[0]
    Fp8Handle(pipe.transformer, Fp8Config("row"))
    dim = block.proj_out.out_features
    gen = torch.Generator().manual_seed(1)
    img, txt = (torch.randn(1, n, dim, generator=gen).to(torch.bfloat16) for n in (16, 7))
    temb = torch.randn(1, dim, generator=gen).to(torch.bfloat16)
    eager = block(img, txt, temb)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(img, txt, temb)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def test_only_what_the_fused_forward_reproduces_is_fused():
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ffs = {"tanh": FeedForward(64, activation_fn="gelu-approximate"),
           "exact_gelu": FeedForward(64, activation_fn="gelu"),
           "dropout": FeedForward(64, activation_fn="gelu-approximate", dropout=0.1),
           "geglu": FeedForward(64, activation_fn="geglu"),
           "tensor_wise": FeedForward(64, activation_fn="gelu-approximate")}
    model = torch.nn.ModuleDict(ffs).to(torch.bfloat16)
    from torchao.quantization import quantize_

    quantize_(model, Fp8Config("row").torchao_config(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear)
              and not fqn.startswith("tensor_wise"))
    quantize_(model, Fp8Config("tensor").torchao_config(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear)
              and fqn.startswith("tensor_wise"))
    assert row_wise_fp8(ffs["tanh"].net[2]) and not row_wise_fp8(ffs["tensor_wise"].net[2])
    assert not row_wise_fp8(torch.nn.Linear(4, 4))
    paths, undo = fuse_rows(model)
    assert paths == ["tanh"]
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    fused = ffs["tanh"](x)
    layer = ffs["tanh"].net[2]  # 256 -> 64
    a = torch.randn(56, 15).to(torch.bfloat16).t()  # (15, 56), its columns not one after another
    b = torch.randn(15, 200).to(torch.bfloat16)
    assert torch.equal(fused_linear(layer, a, b, gelu_b=True), fused_linear(layer, a.contiguous(), b, gelu_b=True))
    undo()
    assert "forward" not in vars(ffs["tanh"])
    assert torch.equal(fused, ffs["tanh"](x))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan"])
def test_on_the_gpu_fusion_moves_the_output_far_less_than_fp8_itself(model):
    """On a GPU the fused quantization is approximate (the hardware tanh: one e4m3 step off torchao's bytes in
    0.02-0.16 % of them). Bound: the fused run's distance to the unfused FP8 run is under a tenth of FP8's own
    distance to bf16, on the same seed."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores)")
    pipe, spec = load_pipeline(model, dtype=torch.bfloat16, device="cuda", seed=0), model_spec(model)
    bf16 = _latents(pipe, spec).float()
    handle = Fp8Handle(pipe.transformer, Fp8Config("row", fuse_rows=False))
    unfused = _latents(pipe, spec).float()
    handle.restore()
    handle = Fp8Handle(pipe.transformer, Fp8Config("row"))
    assert handle.fused
    fused = _latents(pipe, spec).float()
    handle.restore()
    fp8_error = (unfused - bf16).norm() / bf16.norm()
    fusion_error = (fused - unfused).norm() / bf16.norm()
    assert 0 < fp8_error and fusion_error < 0.1 * fp8_error, (float(fusion_error), float(fp8_error))
