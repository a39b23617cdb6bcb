"""One rank of the expert-sharded loading tests (spawned by tests/test_ep_loading.py via xstage_dit.comm.launcher).

For each MoE family, every rank:
1. builds the full pipeline (4-head tiny transformer so sp=4 splits the heads), computes the single-process
   output, parallelizes it with sp=ep=world (experts swapped by `from_layer`), generates, restores;
2. builds the transformer with only its experts (``build_with_experts(..., shard=(rank, world))``), parallelizes
   (binding the loaded shards), generates, restores, and checks the unbound layers refuse to run;
3. loads the transformer from the safetensors folder the test saved, reading only its experts, and generates.
Rank 0 writes the differences and what each rank held as JSON.

    python tests/_ep_loading_worker.py OUT.json FOLDER FAMILY [FAMILY ...]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PROMPT = "a red fox in the snow"
CALL = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, guidance_scale=1.0, max_sequence_length=8)
MODELS = {"nucleusmoe": "tiny-nucleusmoe", "hidream": "tiny-hidream"}
TRANSFORMER_SEED = 1


def wide_factory(family: str):
    """The tiny transformer of `family` with 4 heads (2 KV heads), so sp=4 can split them."""
    import importlib

    import diffusers

    module = importlib.import_module(f"xstage_dit.families.{family}")
    cfg = dict(module.TRANSFORMER["tiny"], num_attention_heads=4)
    if "num_key_value_heads" in cfg:
        cfg["num_key_value_heads"] = 2
    cls = getattr(diffusers, "NucleusMoEImageTransformer2DModel" if family == "nucleusmoe" else "HiDreamImageTransformer2DModel")
    return lambda: cls(**cfg)


def build_transformer(family: str, shard):
    from xstage_dit.families.build import build_module
    from xstage_dit.families.experts import build_with_experts

    return build_with_experts(wide_factory(family), family, seed=TRANSFORMER_SEED, shard=shard,
                              build_module=build_module, device="cpu", dtype=torch.float32)


def _output(pipe) -> np.ndarray:
    out = pipe(**CALL, generator=torch.Generator("cpu").manual_seed(0), output_type="np")
    return np.asarray(out.images, dtype=np.float32)


def _ep_layers(model):
    return [m for m in model.modules() if hasattr(m, "bind")]


def _held(model) -> dict:
    """What this rank holds: EP layers' shards and expert-tensor shapes, full diffusers MoE layers left."""
    layers = _ep_layers(model)
    shapes = [[list(p.shape) for n, p in m.named_parameters(recurse=False)] for m in layers]
    full = [type(m).__name__ for m in model.modules() if type(m).__name__ in ("NucleusMoELayer", "MOEFeedForwardSwiGLU")]
    return {"shards": sorted({tuple(m.shard) for m in layers}), "expert_shapes": shapes, "full_moe_layers": full,
            "num_experts_per_rank": sorted({m.num_experts_per_rank for m in layers})}


def _expert_values_match(sharded, full, rank: int) -> bool:
    """The loaded shard holds exactly experts [rank*El, (rank+1)*El) of the full model's EP layers."""
    a, b = _ep_layers(sharded), _ep_layers(full)
    if len(a) != len(b) or not a:
        return False
    for x, y in zip(a, b):
        for (nx, px), (ny, py) in zip(x.named_parameters(recurse=False), y.named_parameters(recurse=False)):
            if nx != ny or not torch.equal(px, py):
                return False
    return True


def main() -> int:
    out_path, folder, families = sys.argv[1], sys.argv[2], sys.argv[3:]
    from xstage_dit.comm.distributed import init_distributed
    from xstage_dit.families import load_pipeline
    from xstage_dit.families.experts import load_transformer_sharded
    from xstage_dit.features import ParallelConfig, parallelize
    from tests.helpers.expert_loads import count_expert_loads

    info = init_distributed(backend="gloo", timeout_s=float(os.environ.get("XSTAGE_TEST_TIMEOUT", "60")))
    torch.set_num_threads(1)
    w, r = info.world_size, info.rank
    results = {}
    for family in families:
        t0 = time.perf_counter()
        pipe = load_pipeline(MODELS[family], seed=0)
        pipe.set_progress_bar_config(disable=True)
        full_t = build_transformer(family, None)
        pipe.transformer = full_t
        ref = _output(pipe)
        handle = parallelize(pipe, ParallelConfig(sp=w, ep=w))
        par_full = _output(pipe)
        full_ep_transformer = pipe.transformer  # holds the from_layer EP layers while patched
        full_ep_held_ok = None
        res = {"ref_std": float(ref.std()), "max_abs_full": float(np.abs(par_full - ref).max())}

        # 2. built-in random weights, only this rank's experts created
        with count_expert_loads() as seen:
            sharded = build_transformer(family, (r, w))
        res["built_expert_bytes"] = seen["expert_bytes"]
        res["built_values_match"] = _expert_values_match(sharded, full_ep_transformer, r)
        handle.restore()
        full_expert_bytes = sum(p.numel() * p.element_size() for n, p in full_t.named_parameters() if ".experts." in n)
        res["full_expert_bytes"] = full_expert_bytes
        pipe.transformer = sharded
        res["built_held"] = _held(sharded)
        handle = parallelize(pipe, ParallelConfig(sp=w, ep=w))
        res["built_moe_layers"] = handle.num_moe_layers
        res["max_abs_built"] = float(np.abs(_output(pipe) - ref).max())
        res["built_vs_full_parallel"] = float(np.abs(_output(pipe) - par_full).max())
        handle.restore()
        res["restored_same_objects"] = all(not m.bound for m in _ep_layers(pipe.transformer))
        try:
            _output(pipe)
            res["unbound_run"] = "ran"
        except RuntimeError as exc:
            res["unbound_run"] = str(exc)
        try:  # ep=1 on a pipeline loaded for ep=w
            parallelize(pipe, ParallelConfig(sp=w, ep=1))
            res["wrong_ep"] = "accepted"
        except ValueError as exc:
            res["wrong_ep"] = str(exc)

        # 3. local safetensors folder, only this rank's experts read
        with count_expert_loads() as seen:
            local = load_transformer_sharded(os.path.join(folder, family), family, (r, w), dtype=torch.float32,
                                             device="cpu")
        res["local_expert_bytes"] = seen["expert_bytes"]
        res["local_tensors_read"] = seen["expert_tensors_read"]
        res["local_values_match"] = _expert_values_match(local, sharded, r)
        res["local_held"] = _held(local)
        pipe.transformer = local
        handle = parallelize(pipe, ParallelConfig(sp=w, ep=w))
        res["max_abs_local"] = float(np.abs(_output(pipe) - ref).max())
        handle.restore()
        res["seconds"] = time.perf_counter() - t0
        gathered = [None] * w
        dist.all_gather_object(gathered, res)
        results[family] = gathered
    if r == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    from xstage_dit.comm.distributed import close_distributed

    code = main()
    close_distributed()  # only after a normal return: a failing rank keeps its exit code first
    sys.exit(code)
