"""One rank of the `parallelize` equivalence tests (spawned by tests/test_parallelize.py via xstage_dit.comm.launcher).

Every rank builds the same tiny pipeline (same seed) and parallelizes it; rank 0 computes the single-process
output first, generates again in parallel with the others, restores, and generates a third time, and writes, per
case, the largest difference to the single-process output (parallel, and after restore) as JSON. The other ranks
run only the parallel call: only rank 0's results are written, so one-process runs of theirs would be CPU spent
for nothing (four ranks share the 2-core CI machine).

    python tests/_parallelize_worker.py OUT.json CASE [CASE ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

PROMPT = "a red fox in the snow"
NEG = "blurry"


def _wider(pipe, heads: int, seed: int = 1):
    """Replace the tiny transformer by one with `heads` heads (same head_dim), so sp=4 can split them."""
    from xstage_dit.families.build import build_module

    old = pipe.transformer
    cfg = {k: v for k, v in old.config.items() if not k.startswith("_")}
    cfg["num_attention_heads"] = heads
    if "num_key_value_heads" in cfg and cfg["num_key_value_heads"]:
        cfg["num_key_value_heads"] = heads // 2
    pipe.transformer = build_module(lambda: type(old).from_config(cfg), seed=seed, device="cpu", dtype=torch.float32)
    return pipe


def _flux(heads=4, guidance_embeds=True):
    from xstage_dit.families import load_pipeline
    from xstage_dit.families.build import build_module

    pipe = load_pipeline("tiny-flux", seed=0)
    cfg = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    cfg.update(num_attention_heads=heads, guidance_embeds=guidance_embeds)
    cls = type(pipe.transformer)
    pipe.transformer = build_module(lambda: cls.from_config(cfg), seed=1, device="cpu", dtype=torch.float32)
    return pipe


def _gen(seed=0):
    return torch.Generator("cpu").manual_seed(seed)


# name -> (build pipeline, call kwargs, ParallelConfig kwargs as a function of world)
CASES = {
    # FLUX.1 (guidance-distilled like FLUX.1-dev): 64x64 -> 16 image + 8 text tokens (even pieces: Ulysses op)
    "flux": (lambda: _flux(), dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, max_sequence_length=8,
                                   guidance_scale=3.5), lambda w: dict(sp=w)),
    # same, with the transformer under torch.compile (dynamo only: backend="eager"); graph breaks counted
    "flux-compile": (lambda: _flux(), dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2,
                                           max_sequence_length=8, guidance_scale=3.5), lambda w: dict(sp=w)),
    # 48x48 -> 9 image + 7 text tokens: pieces not divisible by sp (gather-KV path)
    "flux-uneven": (lambda: _flux(), dict(prompt=PROMPT, height=48, width=48, num_inference_steps=2,
                                          max_sequence_length=7, guidance_scale=3.5), lambda w: dict(sp=w)),
    # FLUX without guidance embedding + true CFG (two calls per step): cfg=2 paired
    "flux-cfg": (lambda: _flux(guidance_embeds=False), dict(prompt=PROMPT, negative_prompt=NEG, true_cfg_scale=2.0,
                 height=64, width=64, num_inference_steps=2, max_sequence_length=8),
                 lambda w: dict(sp=w // 2, cfg=2)),
    # the same under apply_compile (full, dynamo only, warm guards; 3 steps so calls run warm): CFG parallel's
    # pairing hook stays Python around the compiled forward
    "flux-cfg-compile": (lambda: _flux(guidance_embeds=False), dict(prompt=PROMPT, negative_prompt=NEG,
                         true_cfg_scale=2.0, height=64, width=64, num_inference_steps=3, max_sequence_length=8),
                         lambda w: dict(sp=w // 2, cfg=2)),
    # HunyuanVideo (our plan), transformer only: 3 frames x 4x4 patches = 48 video + 12 text tokens
    "hunyuan": (lambda: _hunyuan(), {}, lambda w: dict(sp=w)),
    "hunyuan-full": (lambda: _hunyuan(padded=False), {}, lambda w: dict(sp=w)),  # no padding: mask dropped
    "wan": (lambda: _wider(__import__("xstage_dit.families", fromlist=["x"]).load_pipeline("tiny-wan", seed=0), 4),
            dict(prompt=PROMPT, negative_prompt=NEG, height=32, width=32, num_frames=5, num_inference_steps=2,
                 guidance_scale=1.0, max_sequence_length=8), lambda w: dict(sp=w)),
    "wan-cfg": (lambda: _wider(__import__("xstage_dit.families", fromlist=["x"]).load_pipeline("tiny-wan", seed=0), 4),
                dict(prompt=PROMPT, negative_prompt=NEG, height=32, width=32, num_frames=5, num_inference_steps=2,
                     guidance_scale=5.0, max_sequence_length=8), lambda w: dict(sp=w // 2, cfg=2)),
    "nucleusmoe": (lambda: _wider(__import__("xstage_dit.families", fromlist=["x"]).load_pipeline("tiny-nucleusmoe", seed=0), 4),
                   dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                        max_sequence_length=8), lambda w: dict(sp=w, ep=w)),
    # CFG's pair as one batch of two over the sharded sequence (the commands' default, --cfg-batch auto)
    "nucleusmoe-cfgbatch": (lambda: _wider(__import__("xstage_dit.families", fromlist=["x"]).load_pipeline("tiny-nucleusmoe", seed=0), 4),
                            dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
                                 max_sequence_length=8), lambda w: dict(sp=w, ep=w, cfg_batch="auto")),
    "hidream": (lambda: _wider(__import__("xstage_dit.families", fromlist=["x"]).load_pipeline("tiny-hidream", seed=0), 4),
                dict(prompt=PROMPT, height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                     max_sequence_length=8), lambda w: dict(sp=w, ep=w)),
    "hidream-cfg": (lambda: _wider(__import__("xstage_dit.families", fromlist=["x"]).load_pipeline("tiny-hidream", seed=0), 4),
                    dict(prompt=PROMPT, negative_prompt=NEG, height=64, width=64, num_inference_steps=2,
                         guidance_scale=5.0, max_sequence_length=8), lambda w: dict(sp=w // 2, ep=w // 2, cfg=2)),
}


class _TransformerCase:
    """A bare transformer called on fixed random inputs (models without a tiny pipeline: HunyuanVideo)."""

    def __init__(self, model, inputs):
        self.transformer, self.inputs = model, inputs

    def set_progress_bar_config(self, **kw):
        pass

    def __call__(self, **kw):
        with torch.no_grad():
            return self.transformer(**self.inputs)[0]


def _hunyuan(padded: bool = True):
    from tests.helpers.tiny_transformers import hunyuan_video_transformer

    model = hunyuan_video_transformer()
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(1, 12)
    if padded:
        mask[:, 9:] = 0  # padded prompt: the text mask must follow the text tokens into their shards
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 8, 8, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 32, generator=g), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(1, 32, generator=g), guidance=torch.tensor([3500.0]), return_dict=False)
    return _TransformerCase(model, inputs)


def _output(pipe, kwargs) -> np.ndarray:
    if isinstance(pipe, _TransformerCase):
        return pipe().numpy()
    kwargs = dict(kwargs)
    out = pipe(**kwargs, generator=_gen(), output_type="np")
    arr = out.frames if hasattr(out, "frames") else out.images
    return np.asarray(arr, dtype=np.float32)


def _die_case(info) -> int:
    """Rank 1 fails after joining; the others wait in a collective that can never complete."""
    import torch.distributed as dist

    if info.rank == 1:
        # Gone at once, its sockets closed by its exit: a normal interpreter exit tears the process group down
        # first, and rank 0, told of the closed connection then, could exit before this rank does (seen once on
        # CI's 2 cores: the supervisor reported rank 0's code 1, the first exit, instead of this rank's 3).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    dist.barrier()
    return 0


def main() -> int:
    out_path, names = sys.argv[1], sys.argv[2:]
    from xstage_dit.comm.distributed import init_distributed

    info = init_distributed(backend="gloo", timeout_s=float(os.environ.get("XSTAGE_TEST_TIMEOUT", "60")))
    torch.set_num_threads(1)
    if names == ["die"]:
        return _die_case(info)
    import xstage_dit.ops.attention as attention_ops
    from xstage_dit.features import ParallelConfig, parallelize

    # What the custom op is handed (its eager implementation runs in eager and in compiled graphs alike).
    op_schedules: list[str] = []
    impl = attention_ops.ulysses_attention_impl

    def spy(*args, schedule, **kwargs):
        op_schedules.append(schedule)
        return impl(*args, schedule=schedule, **kwargs)

    attention_ops.ulysses_attention_impl = spy
    results = {}
    for name in names:
        build, kwargs, degrees = CASES[name]
        t0 = time.perf_counter()
        pipe = build()
        pipe.set_progress_bar_config(disable=True)
        ref = _output(pipe, kwargs) if info.rank == 0 else None  # only rank 0 writes: see the module docstring
        handle = parallelize(pipe, ParallelConfig(**degrees(info.world_size)))
        compiled = None
        if name.endswith("-compile"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            if "-cfg" in name:
                from xstage_dit.features.compile import apply_compile

                compiled = apply_compile(pipe, "full", backend="eager", guards="warm")
            else:
                pipe.transformer.compile(backend="eager")
        op_schedules.clear()
        par = _output(pipe, kwargs)
        graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) if name.endswith("-compile") else None
        paths = dict(handle.attention_paths)
        choices = {str(k): v.name for k, v in handle.schedule_choices.items()}
        ran = sorted(set(op_schedules))
        cfg_stats = dict(handle.cfg_hook.stats) if handle.cfg_hook is not None else {}
        moe_layers = handle.num_moe_layers
        try:
            parallelize(pipe, ParallelConfig(**degrees(info.world_size)))
            twice = "no error"
        except RuntimeError as exc:
            twice = str(exc)
        warm_calls = len(compiled.warm_keys) if compiled is not None else None
        if compiled is not None:
            compiled.restore()
        handle.restore()
        if info.rank != 0:
            continue
        back = _output(pipe, kwargs)
        results[name] = {
            "max_abs_parallel": float(np.abs(par - ref).max()),
            "max_abs_restored": float(np.abs(back - ref).max()),
            "finite": bool(np.isfinite(par).all()),
            "shape": list(ref.shape),
            "ref_std": float(ref.std()),
            "twice": twice,
            "paths": paths,
            "schedule_choices": choices,
            "op_schedules": ran,
            "cfg": cfg_stats,
            "moe_layers": moe_layers,
            "graph_breaks": graph_breaks,
            "warm_keys": warm_calls,
            "seconds": time.perf_counter() - t0,
        }
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    try:
        code = main()
        from xstage_dit.comm.distributed import close_distributed

        close_distributed()  # only after a normal return: a failing rank keeps its exit code first
        sys.exit(code)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
