"""What every rank does at start-up: an `Engine` loads the pipeline and applies the feature stack: parallelism
over the ranks (at world 1 too: torch SDPA, or FA4 where the kernel sweep measured it faster; MoE layers per kind
at world 1, NucleusMoE's on the fused expert-choice path, HiDream's diffusers' own:
`schedule.moe.choose_moe_world1`), batch invariance for image models, compile last; and (rank 0)
collect the calibration and schedule report shown at `GET /v1/calibration` and logged at start-up (the
schedules and attention kernels as of the request: each shape is decided, with its reasons, at its first call)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from xstage_dit.calibration.provider import params_for
from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import DEFAULT_MAX_SHAPES, CompileConfig, default_compile_mode
from xstage_dit.features.config import ParallelConfig
from xstage_dit.jsonable import to_jsonable
from xstage_dit.server.config import ServedModel
from xstage_dit.server.ranks import LoadedModel, RankContext
from xstage_dit.server.recovery import Recovery

log = logging.getLogger(__name__)


def calibration_report(device: torch.device, handle: Any = None) -> dict:
    """The X-Stage numbers the schedules use: the ``ChosenParams`` ``parallelize`` resolved (one rank of
    several), or, with no handle, ``params_for`` on this one rank (the cache, measured on a miss)."""
    chosen = getattr(handle, "calibration", None)
    if handle is not None and chosen is None:
        return {"available": False, "reason": "attention schedule fixed by the user: no calibration needed"}
    if chosen is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            # params_for is collective and this runs on rank 0 only: never load behind the other ranks' backs.
            return {"available": False, "reason": "ranks without a parallelize handle: calibration not resolved"}
        chosen = params_for(device, None, allow_measure=True)
    report = {"available": chosen.params is not None, **chosen.describe()}
    if chosen.params is None:
        report["reason"] = chosen.source
    result = chosen.result
    if result is not None:
        report["machine_key"] = result.machine_key
        report["targets"] = {target: to_jsonable(p) for target, p in result.params.items()}
        report["summary"] = to_jsonable(result.summary())
    return report


def schedule_report(handle: Any) -> Any:
    """The schedules `parallelize` chose (per distinct layer shape, with reasons), when it reports them."""
    if handle is None:
        return {"note": "one rank: no sequence or expert parallelism, so no communication schedule to choose"}
    for name in ("schedules", "schedule_choices", "choices"):
        value = getattr(handle, name, None)
        if value is not None:
            return to_jsonable(value() if callable(value) else value)
    return {"note": f"{type(handle).__name__} does not report its schedule choices"}


def kernel_report(handle: Any) -> dict:
    """The attention kernel sweep behind the "auto" schedules (``handle.attention_kernels.report()``): the
    shape families timed or read from the cache, their timings and the cache file; per shape, the kernel
    chosen and why is in the schedules report, and for world-1 calls with a key-padding mask ("masked_choices":
    torch SDPA with the mask or cuDNN's padded kernels) here."""
    chooser = getattr(handle, "attention_kernels", None)
    if chooser is None:
        return {"note": "no automatic attention schedule (fixed by the user, or no parallelize handle): no kernel "
                        "sweep"}
    masked = getattr(handle, "masked_choices", None)
    return to_jsonable({**chooser.report(), **({"masked_choices": masked} if masked else {})})


def model_loader(model: str, parallel: ParallelConfig, *, dtype: torch.dtype | None = None,
                 weights_seed: int = 0, compile: str | None = None,
                 max_compiled_shapes: int = DEFAULT_MAX_SHAPES,
                 compile_guards: str = "full", compile_extras: tuple[str, ...] = (),
                 features: dict | None = None, lora: dict | None = None) -> Callable[[RankContext], LoadedModel]:
    """The factory every rank calls once the ranks have joined (see `Worker`): an `Engine` loads the model and
    applies the feature stack (parallelism at world 1 too: the measured attention kernel; the pipeline patches;
    batch invariance for an image model, whose requests the server batches; compile last).

    parallel: the command's one ParallelConfig (its world size must be the ranks').
    dtype: None picks bfloat16 on a GPU and float32 on a CPU.
    weights_seed: seed of a built-in model's random weights (not of the images: requests carry their seeds).
    compile: a mode of `xstage_dit.features.compile.COMPILE_MODES`; None: regional on a GPU, off on a CPU.
        The worker's warm-up compiles the warm-up shapes.
    max_compiled_shapes / compile_guards / compile_extras: `CompileConfig`'s max_shapes, guards and extras.
    features: `EngineConfig` switches (host_syncs, text_depth, prompt_cache, one_frame_vae, batch_invariance)
        that differ from their defaults.
    lora: `EngineConfig`'s LoRA fields (lora_dir, max_loras, max_lora_rank, max_loras_per_request, preload_loras,
        lora_mode); None or {}: no LoRA. The manager goes to ``LoadedModel.adapters`` and ``ServedModel.lora``.
    """
    compile_options = dict(max_shapes=max_compiled_shapes, guards=compile_guards, extras=tuple(compile_extras))
    if compile is not None:
        CompileConfig(compile, **compile_options)  # a bad mode or option fails here, before any rank loads
    switches = {**(features or {}), **(lora or {})}

    def load(ctx: RankContext) -> LoadedModel:
        from xstage_dit.families import model_spec

        parallel.check_world(ctx.world_size)
        spec = model_spec(model)
        name = model if not os.path.isdir(model) else os.path.basename(os.path.normpath(model))
        served = ServedModel.from_spec(name, spec, sp=parallel.sp)
        device = torch.device(ctx.device)
        compiled = CompileConfig(compile or default_compile_mode(device), **compile_options)
        engine = Engine(EngineConfig(model=model, device=device, dtype=dtype, weights_seed=weights_seed,
                                     parallel=parallel, compile=compiled, **switches), rank=ctx.rank)
        # With ep > 1 each rank creates or reads only its experts; the stack then binds them to the EP group.
        stack = engine.apply(engine.load(), kind=spec.kind)
        served = replace(served, lora=stack.lora)
        report_parallel = {"sp": parallel.sp, "ep": parallel.ep, "cfg": parallel.cfg, "world_size": ctx.world_size,
                           "mode": "parallelized", "moe_layers_swapped": stack.num_moe_layers,
                           "experts_loaded": ("all" if engine.expert_shard is None
                                              else f"shard {engine.expert_shard[0]} of {engine.expert_shard[1]}")}
        described = engine.describe()
        report = {"model": served.name, "parallel": report_parallel, "device": str(device),
                  "dtype": str(engine.config.dtype), "compile": described["compile"], "features": described["features"]}
        if described["batch_invariance"] is not None:
            report["batch_invariance"] = described["batch_invariance"]
        if stack.lora is not None:
            report["lora"] = {**stack.lora.config.facts(), "graph_variants": stack.lora.graph_variants}
        if ctx.rank == 0:
            report["calibration"] = calibration_report(device, stack)
            log.info("calibration: %s", report["calibration"])

        def describe() -> dict:
            now = engine.stack  # a recovery (`server.recovery`) applies the stack again
            return {**report, "compile": engine.describe()["compile"], "schedules": schedule_report(now),
                    "attention_kernels": kernel_report(now), "outside_transformer": now.describe_pipeline()}

        loaded = LoadedModel(engine.pipe, served, report, describe, engine=engine, adapters=stack.lora)
        if ctx.world_size > 1:
            loaded.recovery = Recovery(loaded, spec.kind)
        return loaded

    return load
