"""What every rank does at start-up: load the pipeline, parallelize it over the ranks (at world 1 too: torch
SDPA, or FA4 where the kernel sweep measured it faster; MoE layers per kind at world 1, NucleusMoE's on the
fused expert-choice path, HiDream's diffusers' own: `schedule.moe.choose_moe_world1`), compile it, and (rank 0)
collect the calibration and schedule report shown at `GET /v1/calibration` and logged at start-up (the
schedules and attention kernels as of the request: each shape is decided, with its reasons, at its first call)."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from xstage_dit.calibration.provider import params_for
from xstage_dit.jsonable import to_jsonable
from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.compile import DEFAULT_MAX_SHAPES, apply_compile, check_compile_mode, default_compile_mode
from xstage_dit.server.config import ServedModel
from xstage_dit.server.ranks import LoadedModel, RankContext

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
    chosen and why is in the schedules report."""
    chooser = getattr(handle, "attention_kernels", None)
    if chooser is None:
        return {"note": "no automatic attention schedule (fixed by the user, or no parallelize handle): no kernel "
                        "sweep"}
    return to_jsonable(chooser.report())


def model_loader(model: str, parallel: ParallelConfig, *, dtype: torch.dtype | None = None,
                 weights_seed: int = 0, compile: str | None = None,
                 max_compiled_shapes: int = DEFAULT_MAX_SHAPES,
                 compile_guards: str = "full", compile_extras: tuple[str, ...] = ()
                 ) -> Callable[[RankContext], LoadedModel]:
    """The factory every rank calls once the ranks have joined (see `Worker`).

    parallel: the command's one ParallelConfig (its world size must be the ranks'), handed to `parallelize`.
    dtype: None picks bfloat16 on a GPU and float32 on a CPU.
    weights_seed: seed of a built-in model's random weights (not of the images: requests carry their seeds).
    compile: a mode of `xstage_dit.features.compile.COMPILE_MODES`; None: regional on a GPU, off on a CPU.
        Applied after `parallelize`; the worker's warm-up compiles the warm-up shapes.
    max_compiled_shapes: transformer input shapes compiled before further ones run eager.
    compile_guards: "full" or "warm" (`apply_compile`'s guards).
    compile_extras: more to compile (`apply_compile`'s extras: text-encoder, video-vae).
    """
    if compile is not None:
        check_compile_mode(compile)

    def load(ctx: RankContext) -> LoadedModel:
        from xstage_dit.families import load_pipeline, model_spec

        parallel.check_world(ctx.world_size)
        spec = model_spec(model)
        name = model if not os.path.isdir(model) else os.path.basename(os.path.normpath(model))
        served = ServedModel.from_spec(name, spec, sp=parallel.sp)
        device = torch.device(ctx.device)
        want = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        # With ep > 1 each rank creates or reads only its experts; parallelize then binds them to the EP group.
        expert_shard = parallel.expert_shard(ctx.rank)
        pipe = load_pipeline(model, dtype=want, device=device, seed=weights_seed, expert_shard=expert_shard)
        report_parallel = {"sp": parallel.sp, "ep": parallel.ep, "cfg": parallel.cfg, "world_size": ctx.world_size}
        # World 1 as well: the measured attention kernel; MoE layers per kind (`choose_moe_world1`).
        handle = parallelize(pipe, parallel)
        report_parallel["mode"] = "parallelized"
        report_parallel["moe_layers_swapped"] = handle.num_moe_layers
        mode = compile or default_compile_mode(device)
        compiled = apply_compile(pipe, mode, max_shapes=max_compiled_shapes, guards=compile_guards,
                                 extras=compile_extras)
        report_parallel["experts_loaded"] = ("all" if expert_shard is None
                                             else f"shard {expert_shard[0]} of {expert_shard[1]}")
        report = {"model": served.name, "parallel": report_parallel, "device": str(device), "dtype": str(want),
                  "compile": compiled.describe()}
        if ctx.rank == 0:
            report["calibration"] = calibration_report(device, handle)
            log.info("calibration: %s", report["calibration"])

        def describe() -> dict:
            return {**report, "compile": compiled.describe(), "schedules": schedule_report(handle),
                    "attention_kernels": kernel_report(handle), "outside_transformer": handle.describe_pipeline()}

        return LoadedModel(pipe, served, report, describe)

    return load
