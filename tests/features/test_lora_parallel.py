"""LoRA under sequence parallelism: at world 2 (tiny FLUX, sp=2) and 4 (tiny Qwen-Image, sp=4, four heads) the image
with an adapter is one process's image; an adapter that fails to load on one rank (its file corrupt there) fails
the activation on every rank with the same error, and every rank keeps the adapter set it had (the next image is
the one before, byte for byte).

Run as its own rank program (``python FILE OUT WORLD``) by `tests.helpers.family_harness.launch_ranks`."""

from __future__ import annotations

import json
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

MODELS = {2: "tiny-flux", 4: "tiny-qwenimage"}


def _engine(model: str, lora_dir: Path, parallel):
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.compile import CompileConfig

    engine = Engine(EngineConfig(model=model, device="cpu", parallel=parallel, batch_invariance=False,
                                 compile=CompileConfig("off"), lora_dir=str(lora_dir)))
    engine.apply(engine.load())
    return engine


def rank_main(out: str, world: int) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.families import load_pipeline
    from xstage_dit.features import ParallelConfig
    from tests.helpers.lora import image, write_peft

    info = init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    model = MODELS[world]
    lora_dir = Path(f"{out}.loras{info.rank}")
    shapes = load_pipeline(model, dtype=torch.float32, device="cpu", seed=0).transformer
    write_peft(shapes, lora_dir / "a.safetensors", rank=4, seed=1)  # the same bytes on every rank
    x = write_peft(shapes, lora_dir / "x.safetensors", rank=4, seed=2)
    if info.rank == world - 1:
        x.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")  # corrupt on the last rank only

    single = _engine(model, lora_dir, None)
    plain = image(single.pipe, model)
    single.activate_loras([("a", 0.8)])
    want = image(single.pipe, model)
    single.restore()

    engine = _engine(model, lora_dir, ParallelConfig(sp=world))
    results = {"plain_vs_lora": float(np.abs(want - plain).max())}
    engine.activate_loras([("a", 0.8)])
    got = image(engine.pipe, model)
    results["max_abs"] = float(np.abs(got - want).max())
    try:
        engine.activate_loras([("a", 0.8), ("x", 1.0)])
        results["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads which error every rank ended with
        results["error"] = f"{type(exc).__name__}: {exc}"
    results["resident"] = engine.lora.resident()
    results["active"] = [list(a) for a in engine.lora.active]
    results["same_after_failure"] = bool(np.array_equal(image(engine.pipe, model), got))
    engine.restore()
    Path(f"{out}.{info.rank}").write_text(json.dumps(results))
    close_distributed()
    return 0


@pytest.mark.parametrize("world", [2, 4])
def test_an_adapter_under_sequence_parallelism_is_one_process_image(world, tmp_path):
    ranks = launch_ranks(__file__, "lora", world, tmp_path)
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


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2])))
