"""Fused LoRA under sequence parallelism (tiny FLUX, sp=2): the image with adapters merged is one process's fused
image; a merge that fails on one rank (a test double raising half way through its deltas) fails the activation on
both with the same error, and every rank's weights keep their bytes from before (the rank that had merged puts its
weights back), so the next image is the one before.

Run as its own rank program (``python FILE OUT WORLD``) by `tests.helpers.family_harness.launch_ranks`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.helpers.family_harness import launch_ranks  # noqa: E402
from tests.helpers.tolerances import TOL  # noqa: E402

MODEL = "tiny-flux"


def _engine(lora_dir: Path, parallel):
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.compile import CompileConfig

    engine = Engine(EngineConfig(model=MODEL, device="cpu", parallel=parallel, batch_invariance=False,
                                 compile=CompileConfig("off"), lora_dir=str(lora_dir), lora_mode="fused"))
    engine.apply(engine.load())
    return engine


def rank_main(out: str, world: int) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import ParallelConfig
    from xstage_dit.features.lora import fused as fused_ops
    from tests.helpers.lora import QV_ONLY, image, linear_weights, same_bytes, write_peft

    info = init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    lora_dir = Path(f"{out}.loras{info.rank}")
    shapes = load_pipeline(MODEL, dtype=torch.float32, device="cpu", seed=0).transformer
    write_peft(shapes, lora_dir / "a.safetensors", rank=4, seed=1)  # the same bytes on every rank
    write_peft(shapes, lora_dir / "b.safetensors", rank=2, seed=2, words=QV_ONLY)
    ab = [("a", 0.8), ("b", -0.5)]

    single = _engine(lora_dir, None)
    plain = image(single.pipe, MODEL)
    single.activate_loras(ab)
    want = image(single.pipe, MODEL)
    single.restore()

    engine = _engine(lora_dir, ParallelConfig(sp=world))
    results = {"plain_vs_lora": float(np.abs(want - plain).max())}
    engine.activate_loras(ab)
    got = image(engine.pipe, MODEL)
    results["max_abs"] = float(np.abs(got - want).max())
    results["mode"] = engine.lora.mode_in_use
    weights = linear_weights(engine.pipe.transformer)
    real, calls = fused_ops.delta_weight, [0]

    def fails_on_the_last_rank(layer, scale):
        calls[0] += 1
        if info.rank == world - 1 and calls[0] == 3:
            raise RuntimeError(f"merge broke on rank {info.rank}")
        return real(layer, scale)

    fused_ops.delta_weight = fails_on_the_last_rank
    try:
        engine.activate_loras([("b", 1.0)])
        results["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads which error every rank ended with
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        fused_ops.delta_weight = real
    results["changed_weights"] = same_bytes(linear_weights(engine.pipe.transformer), weights)
    results["active"] = [list(a) for a in engine.lora.active]
    results["merged"] = [list(a) for a in engine.lora.fused.merged]
    results["same_after_failure"] = bool(np.array_equal(image(engine.pipe, MODEL), got))
    engine.restore()
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


def test_fused_adapters_under_sequence_parallelism_are_one_process_image(tmp_path):
    world = 2
    ranks = launch_ranks(__file__, "lora-fused", world, tmp_path)
    for rank, r in enumerate(ranks):
        assert r["plain_vs_lora"] > 1e-3 and r["mode"] == "fused", r  # the adapters change the image
        assert r["max_abs"] <= TOL.fp32_pipeline, (rank, r)
        assert r["changed_weights"] == [], (rank, r["changed_weights"][:5])  # every byte as before the failure
        assert r["active"] == r["merged"] == [["a", 0.8], ["b", -0.5]], (rank, r)
        assert r["same_after_failure"], (rank, r)
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1, errors  # the same error on every rank
    error = errors.pop()
    assert f"failed on rank {world - 1} of {world}: RuntimeError: merge broke on rank {world - 1}" in error, error


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2])))
