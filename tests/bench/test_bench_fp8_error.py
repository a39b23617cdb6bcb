"""benchmarks/bench_fp8_error.py on the tiny FLUX (CPU: weight-only FP8, the mode a CPU runs): one row per seed and
variant, each a real relative L2 against the fp32-transformer run, and the summary their mean and ratio; the results
on disk after every seed, a time budget that stops before a seed, and the blockwise fp32 reference (the same bits as
the whole transformer in fp32, the transformer as it was after)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

pytest.importorskip("torchao", reason="torchao is a pinned dependency: the FP8 feature needs it")


TINY = ["--model", "tiny-flux", "--steps", "1", "--height", "32", "--width", "32", "--variants", "bf16,fp8-weight",
        "--device", "cpu", "--tag", "cpu"]


def _record(tmp_path) -> dict:
    return json.loads((tmp_path / "fp8-error-tiny-flux-cpu.json").read_text())


def test_fp8_error_rows_and_summary(tmp_path):
    from benchmarks import bench_fp8_error

    assert bench_fp8_error.main(TINY + ["--seeds", "2", "--out-dir", str(tmp_path)]) == 0
    record = _record(tmp_path)
    rows = record["rows"]
    assert [(r["variant"], r["seed"]) for r in rows] == [("bf16", 0), ("fp8-weight", 0), ("bf16", 1), ("fp8-weight", 1)]
    assert all(0 < r["rel_l2_vs_fp32"] < 0.5 for r in rows)
    summary = record["summary"]
    assert (summary["seeds_asked"], summary["seeds_finished"], summary["stopped"]) == (2, 2, None)
    assert summary["reference"] == "blockwise"
    stats = summary["variants"]
    for variant in ("bf16", "fp8-weight"):
        values = [r["rel_l2_vs_fp32"] for r in rows if r["variant"] == variant]
        assert stats[variant]["mean"] == pytest.approx(sum(values) / 2) and stats[variant]["seeds"] == 2
    assert stats["fp8-weight"]["over_bf16"] == pytest.approx(stats["fp8-weight"]["mean"] / stats["bf16"]["mean"])
    assert "2 of 2 seeds finished" in (tmp_path / "fp8-error-tiny-flux-cpu.md").read_text()
    # FLUX has no expert-choice layers: no routing figure, no column
    assert all(r["routing_agreement_vs_fp32"] is None for r in rows) and "routing_agreement" not in stats["bf16"]


def test_an_expert_choice_model_reports_how_many_expert_picks_match_fp32(tmp_path):
    from benchmarks import bench_fp8_error

    args = ["--model", "tiny-nucleusmoe", "--steps", "2", "--variants", "bf16", "--device", "cpu", "--tag", "cpu",
            "--seeds", "1", "--out-dir", str(tmp_path)]
    assert bench_fp8_error.main(args) == 0
    record = json.loads((tmp_path / "fp8-error-tiny-nucleusmoe-cpu.json").read_text())
    (row,) = record["rows"]
    assert 0 < row["routing_agreement_vs_fp32"] <= 1  # the share of (expert, token) picks fp32 made too
    assert record["summary"]["variants"]["bf16"]["routing_agreement"] == row["routing_agreement_vs_fp32"]
    assert "| routing_agreement |" in (tmp_path / "fp8-error-tiny-nucleusmoe-cpu.md").read_text()


def test_a_run_failing_in_its_second_seed_leaves_the_first_on_disk(tmp_path, monkeypatch):
    from benchmarks import bench_fp8_error

    real, calls = bench_fp8_error.latents, []

    def fails_in_seed_1(pipe, spec, seed, args):
        calls.append(seed)
        if calls.count(1) == 3:  # seed 1's reference and bf16 ran: its fp8-weight run fails
            raise RuntimeError("killed in seed 1")
        return real(pipe, spec, seed, args)

    monkeypatch.setattr(bench_fp8_error, "latents", fails_in_seed_1)
    with pytest.raises(RuntimeError, match="killed in seed 1"):
        bench_fp8_error.main(TINY + ["--seeds", "3", "--out-dir", str(tmp_path)])
    record = _record(tmp_path)
    assert [(r["variant"], r["seed"]) for r in record["rows"]] == [("bf16", 0), ("fp8-weight", 0)]  # whole seeds
    summary = record["summary"]
    assert (summary["seeds_asked"], summary["seeds_finished"]) == (3, 1)
    assert summary["stopped"].startswith("not finished: written after seed 0")
    assert summary["variants"]["fp8-weight"]["seeds"] == 1
    assert "1 of 3 seeds finished; stopped: not finished" in (tmp_path / "fp8-error-tiny-flux-cpu.md").read_text()


def test_a_budget_that_cannot_fit_a_second_seed_stops_after_the_first_saying_why(tmp_path, capsys):
    from benchmarks import bench_fp8_error

    assert bench_fp8_error.main(TINY + ["--seeds", "3", "--time-budget-s", "0.001", "--out-dir", str(tmp_path)]) == 0
    record = _record(tmp_path)
    assert [(r["variant"], r["seed"]) for r in record["rows"]] == [("bf16", 0), ("fp8-weight", 0)]
    summary = record["summary"]
    assert (summary["seeds_asked"], summary["seeds_finished"]) == (3, 1)
    assert re.fullmatch(r"time budget: seed 1 needs ~\d+\.\d s \(seed 0's\), 0\.0 s left", summary["stopped"])
    assert f"stopped: {summary['stopped']}" in (tmp_path / "fp8-error-tiny-flux-cpu.md").read_text()
    assert f"no more seeds: {summary['stopped']}" in capsys.readouterr().out


@pytest.mark.parametrize("model,frames,lists", [
    ("tiny-flux", None, ("transformer_blocks", "single_transformer_blocks")), ("tiny-wan", 5, ("blocks",))])
def test_the_blockwise_reference_is_the_whole_fp32_one_bit_for_bit(model, frames, lists):
    import torch

    from benchmarks import bench_fp8_error
    from xstage_dit.families import load_pipeline, model_spec

    pipe = load_pipeline(model, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
    transformer, spec = pipe.transformer, model_spec(model)
    args = argparse.Namespace(prompt="a fox", steps=1, height=32, width=32, frames=frames)
    before = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    blocks = bench_fp8_error.repeated_blocks(transformer)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    assert blocks == [block for name in lists for block in getattr(transformer, name)] and len(blocks) >= 2
    seen = []

    def probe(block):  # on a module inside `block`: runs while the block's forward does
        def hook(module, inputs, output):
            seen.append((id(block), {p.dtype for p in block.parameters()},
                         {p.dtype for b in blocks if b is not block for p in b.parameters()},
                         {p.dtype for p in transformer.parameters() if id(p) not in in_blocks}))
        inner = next(m for m in block.modules() if m is not block and list(m.parameters(recurse=False)))
        return inner.register_forward_hook(hook)

    hooks = bench_fp8_error.casting_hooks(transformer, torch.bfloat16)
    try:
        with bench_fp8_error.float32_transformer(transformer, "whole"):
            whole = bench_fp8_error.latents(pipe, spec, 0, args)
        hooks += [probe(block) for block in blocks]
        with bench_fp8_error.float32_transformer(transformer, "blockwise"):
            blockwise = bench_fp8_error.latents(pipe, spec, 0, args)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(blockwise, whole)
    # one fp32 block at a time, the rest of the transformer fp32 throughout
    assert {s[0] for s in seen} == {id(b) for b in blocks}
    assert all((own, others, rest) == ({torch.float32}, {torch.bfloat16}, {torch.float32})
               for _, own, others, rest in seen)
    after = transformer.state_dict()
    assert {p.dtype for p in transformer.parameters()} == {torch.bfloat16}
    assert not any(t.is_inference() for t in [*transformer.parameters(), *transformer.buffers()])  # as before
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())  # Wan's fp32 rope too
    # and "whole" is the transformer as `.to(torch.float32)` leaves it (which on the way back would round Wan's rope)
    hooks = bench_fp8_error.casting_hooks(transformer.to(torch.float32), torch.bfloat16)
    try:
        assert torch.equal(bench_fp8_error.latents(pipe, spec, 0, args), whole)
    finally:
        for hook in hooks:
            hook.remove()


def test_blockwise_restores_after_a_failing_block_and_refuses_a_dtype_read_inside_the_blocks():
    import torch

    from benchmarks import bench_fp8_error

    def toy(blocks_first: bool) -> torch.nn.Module:
        model = torch.nn.Module()
        for name in (("blocks", "proj") if blocks_first else ("proj", "blocks")):
            layer = torch.nn.Linear(4, 4)
            setattr(model, name, layer if name == "proj" else torch.nn.ModuleList([layer]))
        return model.to(torch.bfloat16)

    model = toy(blocks_first=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError):  # (1, 5) @ (5, 4)^T: the block's forward raises after its pre-hook ran
        with bench_fp8_error.float32_transformer(model, "blockwise"):
            model.blocks[0](torch.ones(1, 5))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # casting_hooks would hand the inputs bf16 (the first parameter is a block's): refused, and the model as it was
    model = toy(blocks_first=True)
    with pytest.raises(ValueError, match=r"outside its blocks, got \['torch.bfloat16'\]: use --reference whole"):
        with bench_fp8_error.float32_transformer(model, "blockwise"):
            pass
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_unknown_variant_and_a_negative_budget_are_refused_naming_them(capsys):
    from benchmarks import bench_fp8_error

    with pytest.raises(SystemExit):
        bench_fp8_error.main(["--variants", "bf16,fp8-col"])
    assert "fp8-col" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_fp8_error.main(["--time-budget-s", "-5"])
    assert "expected --time-budget-s >= 0 (0 = none), got -5.0" in capsys.readouterr().err


def test_fp8_attention_variants_ask_for_each_kernel_through_the_backend():
    import torch

    from benchmarks import bench_fp8_error

    assert {"fp8-row+cudnn-fp8", "fp8-row+sage", "fp8-tensor+sage"} <= set(bench_fp8_error.VARIANTS)
    config = bench_fp8_error.engine_config("fp8-row+sage", torch.device("cpu"))
    assert (config.quantize, config.fp8_granularity, config.fp8_attention) == ("fp8", "row", "sage")
    assert config.parallel is not None and config.parallel.sp == 1  # the attention backend at world 1
    plain = bench_fp8_error.engine_config("fp8-tensor", torch.device("cpu"))
    assert plain.parallel is None and plain.fp8_attention == "off"


def test_the_attention_table_refuses_unknown_shapes_and_a_cpu(capsys):
    import torch

    from benchmarks import _fp8_attention, bench_fp8_error

    assert set(_fp8_attention.SHAPES) == {"flux", "wan", "nucleus"}
    assert _fp8_attention.SHAPES["flux"][:3] == (4608, 24, 128) and _fp8_attention.SHAPES["wan"][:3] == (32760, 40, 128)
    with pytest.raises(SystemExit, match="expected --attention-shapes from flux,wan,nucleus, got 'flux,sd3'"):
        bench_fp8_error.main(["--attention", "--attention-shapes", "flux,sd3"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="expected a CUDA device"):
            bench_fp8_error.main(["--attention", "--attention-shapes", "flux"])
