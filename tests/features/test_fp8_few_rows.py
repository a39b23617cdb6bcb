"""Row-wise FP8's biased long layers on few rows (`xstage_dit.features.fp8_few_rows`): which layers take the few-rows
class, that under `FEW_ROWS` rows their GEMM runs without the bias (which cuBLASLt refuses there, fp8/NOTES.md) and
adds it after, that more rows run torchao's own layer unchanged, the same in the fused feed-forward and under batch
invariance's linear rule, and the undo.
On the CPU (torchao's hardware check patched, as in test_fp8_fused.py: the CPU's ``torch._scaled_mm`` runs row-wise
scales); on a GPU the shapes the H100 refused run."""

from __future__ import annotations

import pytest
import torch

from xstage_dit.features import fp8_few_rows, fp8_fused
from xstage_dit.features.fp8 import Fp8Config, Fp8Handle
from xstage_dit.features.fp8_few_rows import FEW_ROWS, LONGEST_RUNNING, Fp8FewRowsLinear

torchao = pytest.importorskip("torchao", reason="torchao is a pinned dependency: the FP8 feature needs it")
LONG = LONGEST_RUNNING + 16  # the least multiple of 16 past the longest biased contraction measured to run


@pytest.fixture
def fp8_on_the_cpu(monkeypatch):
    import torchao.quantization.quant_api as quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


@pytest.fixture
def biases_seen(monkeypatch):
    """The bias argument of every ``torch._scaled_mm`` call (torchao's layers and `fused_linear` both end there)."""
    seen, real = [], torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("bias"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return seen


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "long": torch.nn.Linear(LONG, 32),                        # biased, long: few rows go bias-apart
        "long_unbiased": torch.nn.Linear(LONG, 32, bias=False),   # nothing to move
        "short": torch.nn.Linear(LONGEST_RUNNING, 32),            # biased, measured to run at one row
    }).to(torch.bfloat16)


def test_only_biased_layers_past_the_measured_length_take_the_few_rows_class(fp8_on_the_cpu):
    model = _model()
    handle = Fp8Handle(model, Fp8Config("row"))
    assert handle.describe()["bias_apart_under_rows"] == {"layers": 1, "rows": FEW_ROWS}
    assert {name: type(m) for name, m in model.items()} == {
        "long": Fp8FewRowsLinear, "long_unbiased": torch.nn.Linear, "short": torch.nn.Linear}
    assert all("forward" not in vars(m) for m in model.values())  # a class: one Dynamo guard for every block
    handle.restore()
    assert all(type(m) is torch.nn.Linear and not hasattr(m, "fp8_bias_apart") for m in model.values())
    assert handle.describe()["bias_apart_under_rows"] == {"layers": 0, "rows": FEW_ROWS}
    handle = Fp8Handle(model, Fp8Config("weight"))  # no FP8 GEMM: nothing to move
    assert "bias_apart_under_rows" not in handle.describe() and type(model["long"]) is torch.nn.Linear
    handle.restore()


@pytest.mark.parametrize("rows", [1, 16, FEW_ROWS - 1])
def test_few_rows_run_the_gemm_without_its_bias_and_add_it_after(fp8_on_the_cpu, biases_seen, rows):
    model = _model()
    layer = model["long"]
    Fp8Handle(model, Fp8Config("row"))
    x = torch.randn(1, rows, LONG).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        product = torch.nn.functional.linear(x, layer.weight, None)  # torchao's layer without the bias
    assert biases_seen[0] is None and out.shape == (1, rows, 32)
    assert torch.equal(out, product + layer.bias)


def test_many_rows_and_shorter_layers_run_torchaos_layer_as_it_was(fp8_on_the_cpu, biases_seen):
    model = _model()
    x_many = torch.randn(2, FEW_ROWS // 2, LONG).to(torch.bfloat16)  # FEW_ROWS rows in all
    x_short = torch.randn(1, LONGEST_RUNNING).to(torch.bfloat16)
    Fp8Handle(model, Fp8Config("row"))
    with torch.inference_mode():
        many, short = model["long"](x_many), model["short"](x_short)
        own = torch.nn.Linear.forward(model["long"], x_many)  # nn.Linear's forward: torchao's dispatch
    assert [b is not None for b in biases_seen] == [True, True, True]
    assert torch.equal(many, own) and short.shape == (1, 32)


def test_the_fused_feed_forward_moves_the_bias_the_same_way(fp8_on_the_cpu, monkeypatch):
    from diffusers.models.attention import FeedForward

    seen, real = [], fp8_fused.scaled_mm
    monkeypatch.setattr(fp8_fused, "scaled_mm", lambda *a, **k: seen.append(k["bias"]) or real(*a, **k))
    torch.manual_seed(0)
    ff = FeedForward(64, inner_dim=LONG, activation_fn="gelu-approximate").to(torch.bfloat16)  # net[2]: LONG -> 64
    assert ff.net[2].in_features == LONG
    handle = Fp8Handle(ff, Fp8Config("row"))
    assert handle.fused == [""]
    with torch.inference_mode():
        few = ff(torch.randn(1, 3, 64).to(torch.bfloat16))
        many = ff(torch.randn(1, FEW_ROWS, 64).to(torch.bfloat16))
    assert seen[0] is None and seen[1] is ff.net[2].bias
    assert few.isfinite().all() and many.isfinite().all()
    handle.restore()


def test_only_marked_layers_move_their_bias_and_only_under_few_rows():
    layers = [torch.nn.Linear(LONG, 8), torch.nn.Linear(LONGEST_RUNNING, 8), torch.nn.Linear(LONG, 8, bias=False)]
    assert not fp8_few_rows.bias_apart(layers[0], 1)  # not marked: a bf16 layer keeps its own GEMM
    count, undo = fp8_few_rows.add_bias_apart_on_few_rows(layers)
    assert count == 1 and [type(m) for m in layers] == [Fp8FewRowsLinear, torch.nn.Linear, torch.nn.Linear]
    assert fp8_few_rows.bias_apart(layers[0], 1) and fp8_few_rows.bias_apart(layers[0], FEW_ROWS - 1)
    assert not fp8_few_rows.bias_apart(layers[0], FEW_ROWS)
    assert not fp8_few_rows.bias_apart(layers[1], 1) and not fp8_few_rows.bias_apart(layers[2], 1)
    undo()
    assert type(layers[0]) is torch.nn.Linear and not fp8_few_rows.bias_apart(layers[0], 1)


def test_batch_invariances_linear_rule_keeps_the_bias_apart(fp8_on_the_cpu, biases_seen):
    """Batch invariance after FP8 (the stack's order) swaps the few-rows class for its own and pads few-row inputs
    to its SMALL_ROWS: still under FEW_ROWS, so the GEMM still runs without the bias; its restore gives the few-rows
    class back, FP8's then nn.Linear."""
    from xstage_dit.features import batch_invariance

    model = _model()
    handle = Fp8Handle(model, Fp8Config("row"))
    layer = model["long"]
    batch_invariance.make_invariant(layer)
    assert type(layer) is batch_invariance.InvariantLinear
    with torch.inference_mode():
        out = layer(torch.randn(3, LONG).to(torch.bfloat16))
    assert out.shape == (3, 32) and biases_seen == [None]
    layer.__class__ = Fp8FewRowsLinear  # what batch invariance's restore does (it swapped from this class)
    handle.restore()
    assert type(layer) is torch.nn.Linear


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(8192, 2048), (12288, 3072), (13824, 5120), (15360, 3072)])
def test_the_shapes_cublaslt_refused_on_few_rows_now_run_near_bf16(k, n):
    """The biased shapes torch's row-wise FP8 GEMM refused under 26-64 rows on an H100 (probe-rows, 7588008): at
    1, 16 and 4096 rows they run, finite and near the bf16 layer (FP8's rounding), eager and compiled."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("gpu: needs a CUDA GPU of compute capability >= 8.9")
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n).to("cuda", torch.bfloat16)
    xs = {rows: torch.randn(rows, k, device="cuda").to(torch.bfloat16) for rows in (1, 16, 4096)}
    with torch.inference_mode():
        reference = {rows: layer(x).float() for rows, x in xs.items()}
        handle = Fp8Handle(torch.nn.Sequential(layer), Fp8Config("row"))
        compiled = torch.compile(layer)
        for rows, x in xs.items():
            for out in (layer(x), compiled(x)):
                rel = ((out.float() - reference[rows]).norm() / reference[rows].norm()).item()
                assert out.isfinite().all() and rel < 0.1, (k, n, rows, rel)
        handle.restore()
