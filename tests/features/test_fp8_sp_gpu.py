"""FP8 (issue 41) across ranks and with 8-bit attention, on a GPU (marked `gpu`: skipped, and counted, without one).

A tiny FLUX whose attention the 8-bit kernels take (4 heads x 64), 256 image + 64 text tokens (320: a whole number of
SageAttention's 64-key blocks, ``ops/attention/sage.py``), 4 steps, eager:

- world 1: FP8 linear layers (row-wise) plus each 8-bit attention kernel asked for by name, composed with regional
  compile: every attention shape runs it ("fused:<kernel>"), the latents stay near bf16's, restore gives the bf16
  latents back bit for bit; "auto" times the 8-bit kernels in the sweep's "-fp8" family.
- two processes sharing the GPU at sp = 2 (gloo for control, symmetric memory and the peer window for data) with
  FP8 linear layers, alone and with each 8-bit attention kernel: their latents against this (one) process's
  latents with the same FP8 configuration, within the FP8 configuration's own run-to-run spread, measured here:
  the same one-process run repeated with the transformer's activations (hidden_states, encoder_hidden_states)
  perturbed by one bf16 rounding step at every call (relative 2**-8, a fixed sign pattern per call: what sharding
  changes in a forward is of that order). Bound: max and mean
  absolute difference at most 2x the larger of the two perturbed runs' (and exact equality if those are 0).
  Printed per case (``pytest -s``).

This file is also the rank program (``python tests/features/test_fp8_sp_gpu.py OUT CASES``, two ranks).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

STEPS, SIZE, TEXT = 4, 256, 64  # 256 x 256: 256 image tokens (tiny VAE), + 64 text tokens
TOKENS = 256 + TEXT
CASES = {"fp8-linear": "off", "fp8+cudnn-fp8": "cudnn-fp8", "fp8+sage": "sage"}
SPREAD_FACTOR = 2.0
PERTURB = 2.0 ** -8


def _pipeline(device):
    import diffusers

    from xstage_dit.families import load_pipeline
    from xstage_dit.families.build import build_module
    from xstage_dit.families.flux import TRANSFORMER

    pipe = load_pipeline("tiny-flux", dtype=torch.bfloat16, device=device, seed=0)
    pipe.set_progress_bar_config(disable=True)
    dims = dict(TRANSFORMER["tiny"], num_attention_heads=4, attention_head_dim=64, axes_dims_rope=(16, 24, 24))
    pipe.register_modules(transformer=build_module(lambda: diffusers.FluxTransformer2DModel(**dims), seed=0,
                                                   device=device, dtype=torch.bfloat16))
    return pipe


def _kernel_refusal(name: str, device) -> str | None:
    from xstage_dit.ops.attention.kernels import make_kernel
    from xstage_dit.ops.attention.window import WindowGeometry

    geom = WindowGeometry(2, 1, TOKENS, 4, 64, TOKENS // 2 * 4 * 64)
    return make_kernel(name).supports(geom, torch.bfloat16, torch.device(device), True)


ACTIVATIONS = ("hidden_states", "encoder_hidden_states")


def _perturbing_hook(transformer, seed: int):
    """Every forward's activations (`ACTIVATIONS`) times (1 + 2**-8 * s), s = +-1 from a generator seeded per call;
    timesteps, guidance and positions as they were."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + calls[0])

        def nudge(t):
            sign = torch.randint(0, 2, t.shape, generator=gen).to(t.device, torch.float32) * 2 - 1
            return (t.float() * (1 + PERTURB * sign)).to(t.dtype)

        if args or not all(name in kwargs for name in ACTIVATIONS):
            raise RuntimeError(f"expected the pipeline to pass {ACTIVATIONS} by keyword, got {len(args)} positional "
                               f"and {sorted(kwargs)}")
        return args, {k: nudge(v) if k in ACTIVATIONS else v for k, v in kwargs.items()}

    return transformer.register_forward_pre_hook(hook, with_kwargs=True)


def latents(pipe, parallel, fp8_attention: str | None, *, compile_mode: str = "off", perturb: int | None = None):
    """(final latents as float32 numpy, the attention decisions' names) of one call under the engine."""
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.compile import CompileConfig

    config = EngineConfig(device=pipe.transformer.device, dtype="bfloat16", parallel=parallel,
                          compile=CompileConfig(compile_mode), quantize="none" if fp8_attention is None else "fp8",
                          fp8_attention=fp8_attention or "off", batch_invariance=False)
    engine = Engine(config)
    stack = engine.apply(pipe, kind="image")
    handle = _perturbing_hook(pipe.transformer, perturb) if perturb is not None else None
    try:
        out = pipe(prompt="a red fox in the snow", num_inference_steps=STEPS, height=SIZE, width=SIZE,
                   guidance_scale=3.5, max_sequence_length=TEXT, output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(7))
        names = sorted({d.name for d in stack.schedule_choices.values()})
    finally:
        if handle is not None:
            handle.remove()
        engine.restore()
    return out.images.float().cpu().numpy(), names


def rank_main(out: str, cases: str) -> int:
    from xstage_dit.comm.distributed import close_distributed, init_distributed
    from xstage_dit.features import ParallelConfig

    info = init_distributed(timeout_s=600)
    pipe = _pipeline(str(info.device))
    results = {}
    for case in cases.split(","):
        lat, names = latents(pipe, ParallelConfig(sp=2, calibrate=False), CASES[case])
        np.save(f"{out}.{case}.{info.rank}.npy", lat)
        results[case] = names
    Path(f"{out}.{info.rank}.json").write_text(json.dumps(results))
    close_distributed()
    return 0


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    d = np.abs(a - b)
    return float(d.max()), float(d.mean())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn-fp8", "sage"])
def test_world1_fp8_attention_by_name_composes_with_compile_and_restores(kernel):
    from xstage_dit.features import ParallelConfig

    reason = _kernel_refusal(kernel, "cuda")
    if reason:
        pytest.skip(f"{kernel} refuses: {reason}")
    pipe = _pipeline("cuda")
    parallel = ParallelConfig(sp=1, calibrate=False)
    bf16, _ = latents(pipe, parallel, None)
    fp8, names = latents(pipe, parallel, kernel, compile_mode="regional")
    assert names == [f"fused:{kernel}"], names
    rel = float(np.linalg.norm(fp8 - bf16) / np.linalg.norm(bf16))
    print(f"world 1 fp8 linear + {kernel}, regional compile: latents rel L2 vs bf16 {rel:.4f}")
    assert np.isfinite(fp8).all() and 0 < rel < 0.3, rel
    again, _ = latents(pipe, parallel, None)
    assert np.array_equal(again, bf16)  # restore: the bf16 pipeline, bit for bit


@pytest.mark.gpu
def test_auto_times_the_8bit_kernels_beside_the_16bit_ones(tmp_path, monkeypatch):
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features import ParallelConfig
    from xstage_dit.features.compile import CompileConfig

    if all(_kernel_refusal(k, "cuda") for k in CASES.values() if k != "off"):
        pytest.skip("no 8-bit kernel takes the shape here")
    monkeypatch.setenv("XSTAGE_DIT_CACHE", str(tmp_path))
    pipe = _pipeline("cuda")
    engine = Engine(EngineConfig(device="cuda", dtype="bfloat16", parallel=ParallelConfig(sp=1, calibrate=False),
                                 compile=CompileConfig("off"), quantize="fp8", fp8_attention="auto"))
    stack = engine.apply(pipe, kind="image")
    # The kernel sweep only (calibrate=True would also run the X-Stage calibration, which world 1 does not use).
    stack.attention_kernels.allow_measure = True
    try:
        pipe(prompt="a fox", num_inference_steps=1, height=SIZE, width=SIZE, max_sequence_length=TEXT,
             output_type="latent", generator=torch.Generator("cpu").manual_seed(0))
        families = stack.attention_kernels.report()["families"]
    finally:
        engine.restore()
    assert families and all(f.endswith("-fp8") for f in families), families
    timed = {k for f in families.values() for k, t in (f["timings_ms"] or {}).items() if t}
    print("fp8 sweep:", json.dumps(families))
    assert "sdpa" in timed and timed & {"cudnn-fp8", "sage"}, families


@pytest.mark.gpu
def test_two_ranks_at_sp2_with_fp8_equal_one_process_within_fp8s_own_spread(tmp_path):
    from xstage_dit.comm.launcher import launch
    from xstage_dit.features import ParallelConfig

    pipe = _pipeline("cuda")
    runnable = {case: kernel for case, kernel in CASES.items()
                if kernel == "off" or _kernel_refusal(kernel, "cuda") is None}
    one = ParallelConfig(sp=1, calibrate=False)
    refs = {case: latents(pipe, one, kernel) for case, kernel in runnable.items()}
    spreads = {case: [_diff(latents(pipe, one, kernel, perturb=seed)[0], refs[case][0]) for seed in (1, 2)]
               for case, kernel in runnable.items()}
    del pipe
    torch.cuda.empty_cache()
    out = tmp_path / "fp8-sp2"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert launch(2, [sys.executable, __file__, str(out), ",".join(runnable)], timeout_s=900, env=env) == 0
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    for case, kernel in runnable.items():
        ref, names = refs[case]
        spread_max = max(s[0] for s in spreads[case])
        spread_mean = max(s[1] for s in spreads[case])
        for rank in (0, 1):
            par = np.load(f"{out}.{case}.{rank}.npy")
            max_abs, mean_abs = _diff(par, ref)
            print(f"gpu fp8 sp=2 {case} rank {rank}: max abs {max_abs:.3e}, mean abs {mean_abs:.3e}; one-process "
                  f"spread max {spread_max:.3e}, mean {spread_mean:.3e}; schedules {ranks[rank][case]} (1 proc: {names})")
            assert np.isfinite(par).all() and par.shape == ref.shape
            assert spread_max > 0, "the perturbation changed nothing: the spread was not measured"
            assert max_abs <= SPREAD_FACTOR * spread_max and mean_abs <= SPREAD_FACTOR * spread_mean, case
        if kernel != "off":
            assert names == [f"fused:{kernel}"] and ranks[0][case] == ranks[1][case] == [f"fused:{kernel}"]


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], sys.argv[2]))
