"""LoRA under sequence, CFG and expert parallelism: at world 2 (tiny FLUX, sp=2), 4 (tiny Qwen-Image, sp=4, four
heads), CFG parallel (tiny Wan, cfg=2) and expert parallel (tiny HiDream, sp=ep=2: its MoE experts sharded) the image
with an adapter is one process's image; an adapter that fails to load on one rank (its file corrupt there) fails
the activation on every rank with the same error, and every rank keeps the adapter set it had (the next image is
the one before, byte for byte).

Run as its own rank program (``python FILE OUT WORLD CASE``) by `tests.helpers.family_harness.launch_ranks`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.family_harness import launch_ranks  # noqa: E402
from tests.helpers.tolerances import TOL  # noqa: E402

# case -> (model, world, ParallelConfig fields)
CASES = {"sp2": ("tiny-flux", 2, dict(sp=2)), "sp4": ("tiny-qwenimage", 4, dict(sp=4)),
         "cfg2": ("tiny-wan", 2, dict(cfg=2)), "ep2": ("tiny-hidream", 2, dict(sp=2, ep=2))}


def _engine(model: str, lora_dir: Path, parallel, rank: int = 0):
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.compile import CompileConfig

    engine = Engine(EngineConfig(model=model, device="cpu", parallel=parallel, batch_invariance=False,
                                 compile=CompileConfig("off"), lora_dir=str(lora_dir)), rank=rank)
    engine.apply(engine.load())
    return engine


def rank_main(out: str, world: int, case: str) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import ParallelConfig
    from tests.helpers.lora import ATTN_MLP, image, write_peft

    info = init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    model, _, fields = CASES[case]
    lora_dir = Path(f"{out}.loras{info.rank}")
    shapes = load_pipeline(model, dtype=torch.float32, device="cpu", seed=0).transformer
    # the same bytes on every rank; under EP on the attention, dense and shared-expert layers (routed experts are
    # sharded: an adapter "e" on them is refused by name)
    words = (".attn", "ff_t", "shared_experts") if case == "ep2" else ATTN_MLP
    write_peft(shapes, lora_dir / "a.safetensors", rank=4, seed=1, words=words)
    write_peft(shapes, lora_dir / "e.safetensors", rank=4, seed=3, words=("ff_i.experts.",))
    x = write_peft(shapes, lora_dir / "x.safetensors", rank=4, seed=2, words=words)
    if info.rank == world - 1:
        x.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")  # corrupt on the last rank only

    single = _engine(model, lora_dir, None)
    plain = image(single.pipe, model)
    single.activate_loras([("a", 0.8)])
    want = image(single.pipe, model)
    single.restore()

    engine = _engine(model, lora_dir, ParallelConfig(**fields), info.rank)  # the rank's expert shard under EP
    results = {"plain_vs_lora": float(np.abs(want - plain).max())}
    engine.activate_loras([("a", 0.8)])
    got = image(engine.pipe, model)
    results["max_abs"] = float(np.abs(got - want).max())
    try:
        engine.activate_loras([("a", 0.8), ("x", 1.0)])
        results["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads which error every rank ended with
        results["error"] = f"{type(exc).__name__}: {exc}"
    if case == "ep2":
        try:
            engine.activate_loras([("e", 1.0)])
            results["expert_error"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the refusal
            results["expert_error"] = f"{type(exc).__name__}: {exc}"
    results["resident"] = engine.lora.resident()
    results["active"] = [list(a) for a in engine.lora.active]
    results["same_after_failure"] = bool(np.array_equal(image(engine.pipe, model), got))
    engine.restore()
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_under_sequence_cfg_and_expert_parallelism_is_one_process_image(case, tmp_path):
    world = CASES[case][1]
    ranks = launch_ranks(__file__, "lora", world, tmp_path, case)
    for rank, r in enumerate(ranks):
        assert r["plain_vs_lora"] > 1e-3, r  # the adapter changes the image
        assert r["max_abs"] <= TOL.fp32_pipeline, (rank, r)
        assert r["resident"] == ["a"] and r["active"] == [["a", 0.8]], (rank, r)  # the state before the failure
        assert r["same_after_failure"], (rank, r)
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1, errors  # the same error on every rank
    error = errors.pop()
    assert error.startswith("AdapterError: ") and f"on rank {world - 1} of {world}" in error, error
    assert "adapter 'x': could not be read as a LoRA" in error and str(tmp_path) not in error, error
    if case == "ep2":
        error = ranks[0]["expert_error"]
        assert {r["expert_error"] for r in ranks} == {error}, ranks
        assert re.search(r"adapter 'e': targets '[\w.]+ff_i\.experts\.0\.w1', a routed expert of '[\w.]+ff_i', "
                         r"whose experts expert parallelism shards over 2 ranks", error), error


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
