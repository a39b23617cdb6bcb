"""FP8 expert MLPs (``ops/moe/fp8_experts.py``, ``features/fp8_experts.py``).

CPU: the quantizers' layouts and error bounds (power-of-two scales per expert column and per token, the grouped
GEMM's column-major weight view), the emulated FP8 SwiGLU against the bf16 experts (lossy by e4m3's rounding, within
its bound), the SwiGLU between the GEMMs quantized alike eager and compiled, and the feature's selection on the
tiny NucleusMoE: the family record's expert class found, a CPU refused naming why with nothing changed, and (the
GEMM swapped for its emulation) the module's grouped path replaced, its output the emulation's, and restore putting
back the bf16 experts bit for bit and the grouped path that was there (compile_fixes').
GPU (marked `gpu`): ``torch._scaled_grouped_mm`` against the emulation and the bf16 experts at the NucleusMoE shape
and awkward ones (uneven counts, an empty expert).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.tolerances import TOL, rel_err
from xstage_dit.ops.moe import fp8_experts as fx

FP8_EXPERTS_BOUND = TOL.fp8_experts


def _experts(num_experts, hidden, inter, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(num_experts, hidden, 2 * inter, generator=gen, device=device) / hidden ** 0.5
    down = torch.randn(num_experts, inter, hidden, generator=gen, device=device) / inter ** 0.5
    return gate_up.to(torch.bfloat16), down.to(torch.bfloat16)


def _bf16_experts(x, counts, gate_up, down):
    """The experts in fp32 from the bf16 values (the reference FP8 is read against)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (x[start:start + n].float() @ gate_up[e].float()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ down[e].float())
        start += n
    return torch.cat(outs)


def test_weights_quantize_per_expert_column_into_the_grouped_gemms_layout():
    gate_up, _ = _experts(3, 64, 48)
    w8, descale = fx.quantize_expert_weight(gate_up)
    assert w8.shape == gate_up.shape and w8.dtype == torch.float8_e4m3fn
    assert w8.stride(-2) == 1 and w8.stride(-1) == 64  # (E, K, N) column-major: an (E, N, K) tensor transposed
    assert descale.shape == (3, 96) and descale.dtype == torch.float32
    assert torch.equal(descale, torch.exp2(torch.round(torch.log2(descale))))  # powers of two
    back = w8.float() * descale[:, None, :]
    assert bool(((back - gate_up.float()).abs() <= gate_up.float().abs() / 16 + descale[:, None, :] * 2 ** -9).all())
    x8, x_descale = fx.quantize_rows(torch.randn(10, 64).to(torch.bfloat16))
    assert x8.shape == (10, 64) and x8.is_contiguous() and x_descale.shape == (10,)
    with pytest.raises(ValueError, match=r"expected expert weights \(experts, in, out\), got \(64, 96\)"):
        fx.quantize_expert_weight(gate_up[0])


@pytest.mark.parametrize("counts", [[16, 16, 16, 16], [5, 0, 31, 12]])
def test_the_emulated_fp8_experts_are_lossy_within_their_bound(counts):
    gate_up, down = _experts(4, 64, 48)
    x = torch.randn(sum(counts), 64).to(torch.bfloat16)
    n = torch.tensor(counts)
    fp8 = fx.fp8_swiglu_experts_emulated(x, n, fx.quantize_expert_weight(gate_up), fx.quantize_expert_weight(down))
    exact = _bf16_experts(x, counts, gate_up, down)
    assert fp8.shape == x.shape and fp8.dtype == x.dtype
    assert 0.01 < rel_err(fp8, exact) < FP8_EXPERTS_BOUND, rel_err(fp8, exact)
    assert rel_err(exact.to(torch.bfloat16), exact) < 0.005  # bf16's own rounding: far below FP8's


def _tiny_nucleus():
    from xstage_dit.families import load_pipeline

    return load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device="cpu", seed=0).transformer


def test_the_swiglu_between_the_gemms_quantizes_the_same_eager_and_compiled():
    """Inductor keeps silu(gate) * up in fp32; the eager path must too (``fp8_experts.swiglu``), or a bf16 rounding
    in between flips e4m3 roundings (H100: rel L2 0.017 between eager and compiled). Here on the CPU's Inductor."""
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(96, 2 * 160, generator=gen) * 3).to(torch.bfloat16)

    def quantized(h):
        h8, descale = fx.quantize_rows(fx.swiglu(h))
        return h8.float() * descale[:, None]

    eager = quantized(h)
    assert fx.swiglu(h).dtype == torch.float32
    assert torch.equal(torch.compile(quantized, backend="inductor", fullgraph=True)(h), eager)
    gate, up = h.chunk(2, dim=-1)  # the bf16 intermediate it replaced: a different quantization
    assert not torch.equal(fx.quantize_rows(F.silu(gate) * up)[0].float(), fx.quantize_rows(fx.swiglu(h))[0].float())


def test_the_records_expert_class_is_found_and_a_cpu_refused_with_nothing_changed():
    from xstage_dit.families import load_pipeline
    from xstage_dit.features.fp8_experts import Fp8ExpertsHandle, expert_modules

    transformer = _tiny_nucleus()
    found = expert_modules(transformer)
    assert found and all(type(m).__name__ == "SwiGLUExperts" for _, m in found)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    handle = Fp8ExpertsHandle(transformer)
    assert handle.converted == [] and len(handle.kept) == len(found)
    assert all("needs a CUDA device, got cpu" in why for _, why in handle.kept)
    assert all(torch.equal(v, before[k]) for k, v in transformer.state_dict().items())
    flux = load_pipeline("tiny-flux", dtype=torch.bfloat16, device="cpu", seed=0).transformer
    assert expert_modules(flux) == []


def test_the_grouped_path_is_swapped_and_restore_is_bit_exact(monkeypatch):
    from xstage_dit.features import fp8_experts as feature
    from xstage_dit.features.compile_fixes import fix_grouped_mm_offsets

    transformer = _tiny_nucleus()
    undo_fixes, fixed = fix_grouped_mm_offsets(transformer)  # what the stack applies before fp8
    (path, module), *_ = feature.expert_modules(transformer)
    fixed_path = module.__dict__["_run_experts_grouped_mm"]
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    counts = torch.tensor([3, 0, 7, 6])
    x = torch.randn(16, module.gate_up_proj.shape[1]).to(torch.bfloat16)
    # No grouped FP8 GEMM on a CPU: its definition stands in for it; everything around it is the real feature.
    monkeypatch.setattr(feature, "_refusal", lambda m: None)
    monkeypatch.setattr(fx, "fp8_swiglu_experts", fx.fp8_swiglu_experts_emulated)
    handle = feature.Fp8ExpertsHandle(transformer)
    assert path in handle.converted and handle.kept == []
    assert module.gate_up_proj.dtype == torch.float8_e4m3fn and module.down_proj.dtype == torch.float8_e4m3fn
    assert module.__dict__["_run_experts_grouped_mm"] is not fixed_path
    want = fx.fp8_swiglu_experts_emulated(x, counts, fx.quantize_expert_weight(before[f"{path}.gate_up_proj"]),
                                          fx.quantize_expert_weight(before[f"{path}.down_proj"]))
    assert torch.equal(module._run_experts_grouped_mm(x, counts), want)
    handle.restore()
    after = transformer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(v, before[k]) and v.dtype == before[k].dtype
                                                 for k, v in after.items())
    assert module.__dict__["_run_experts_grouped_mm"] is fixed_path  # compile_fixes' path, as it was
    undo_fixes()
    assert fixed > 0 and "_run_experts_grouped_mm" not in module.__dict__


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts, hidden, inter, counts", [
    (64, 2048, 1344, [128] * 64),               # NucleusMoE 1024^2 (expert choice: capacity rows each)
    (4, 256, 96, [5, 0, 131, 17]),              # uneven, an empty expert
    (8, 512, 1344, [64] * 8),
])
def test_grouped_fp8_gemm_matches_its_emulation_and_the_bf16_experts(num_experts, hidden, inter, counts):
    reason = fx.grouped_fp8_unavailable(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    gate_up, down = _experts(num_experts, hidden, inter, device="cuda")
    x = torch.randn(sum(counts), hidden, device="cuda").to(torch.bfloat16)
    n = torch.tensor(counts, device="cuda")
    qgu, qd = fx.quantize_expert_weight(gate_up), fx.quantize_expert_weight(down)
    fast = fx.fp8_swiglu_experts(x, n, qgu, qd)
    emulated = fx.fp8_swiglu_experts_emulated(x, n, qgu, qd)
    exact = _bf16_experts(x, counts, gate_up, down)
    print(f"fp8 experts {num_experts}x{hidden}->{inter}: rel vs bf16 experts {rel_err(fast, exact):.4f}, vs emulation "
          f"{rel_err(fast, emulated):.4f}")
    assert fast.shape == x.shape and not torch.isnan(fast).any()
    assert rel_err(fast, emulated) < 0.02  # the same roundings; the GEMM accumulates in its own order
    assert rel_err(fast, exact) < FP8_EXPERTS_BOUND
    compiled = torch.compile(fx.fp8_swiglu_experts)(x, n, qgu, qd)
    assert rel_err(compiled, fast) < 0.01  # the same quantized values (fp32 SwiGLU); only the GEMMs' order differs
