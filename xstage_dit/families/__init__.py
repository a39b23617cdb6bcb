"""Model families: one record per family (``families/<family>.py``, `registry`), their built-in pipelines (real
pipeline classes with random weights and in-code tokenizers) and local diffusers folders.

``load_pipeline("tiny-flux")`` builds a FLUX.1 pipeline that runs in seconds on a CPU; ``full-*`` models
have the published architecture dimensions (for latency benchmarks on a GPU; timing does not depend on
weight values); a path to a local diffusers folder whose model_index.json names a pipeline class of a family
record loads real weights with the same call.

Example::

    pipe = load_pipeline("tiny-flux", seed=0)
    spec = model_spec("tiny-flux")
    image = pipe("a red fox", height=spec.height, width=spec.width, num_inference_steps=spec.steps).images[0]
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from xstage_dit.families.record import SERVED_TASKS
from xstage_dit.families.registry import MODELS, record, record_for_pipeline, supported_pipelines
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import quiet_prompt_truncation

__all__ = ["ModelSpec", "MODELS", "load_pipeline", "load_transformer", "model_spec", "model_names"]


def model_names() -> list[str]:
    """Built-in model names, in registry order."""
    return list(MODELS)


def _local_class_name(path: Path) -> str:
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(f"expected a diffusers folder with model_index.json, got {str(path)!r}")
    try:
        return json.loads(index.read_text())["_class_name"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"expected a model_index.json with '_class_name' in {str(path)!r}, got {exc}") from exc


def _is_local(model: str) -> bool:
    return os.sep in model or model.startswith(".") or Path(model).is_dir()


def model_spec(model: str) -> ModelSpec:
    """The `ModelSpec` of a built-in model name or of a local diffusers folder.

    A local folder takes the defaults of the full-size model of its pipeline's family record (size ``local``).
    Raises ValueError naming the model when it is neither, and naming the pipeline class when no family record
    serves it (unknown, or a task `generate` / `serve` do not run).
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"expected a model name or a folder path, got {model!r}")
    if model in MODELS:
        return MODELS[model]
    if _is_local(model):
        path = Path(model).expanduser()
        class_name = _local_class_name(path)
        found = record_for_pipeline(class_name)
        if found is None or class_name not in found.served_pipelines:
            why = ""
            if found is not None:
                tasks = " and ".join(t for t, k in SERVED_TASKS.items() if k == found.kind)
                why = (f" (an {found.pipelines[class_name]!r} pipeline of the family {found.name!r}; `generate` and "
                       f"`serve` run the {tasks} ones of a {found.kind} family)")
            raise ValueError(f"expected a pipeline class in {sorted(supported_pipelines())}, got {class_name!r} in "
                             f"{str(path)!r}{why}")
        # the defaults of the built-in full model of the same pipeline, else of the family's first full model
        full = found.spec("full", class_name) or found.spec("full")
        if full is None:
            raise ValueError(f"expected a full-size built-in model of the family {found.name!r} for the defaults of "
                             f"{str(path)!r}, got none")
        return dataclasses.replace(full, name=str(path), size="local", description=f"{class_name} from {path}",
                                   pipeline_class=class_name, variant="")
    raise ValueError(f"expected a model in {model_names()} or a local diffusers folder, got {model!r}")


def _check_expert_shard(spec: ModelSpec, expert_shard):
    """None, or the validated `ExpertShard` of a MoE family (ValueError naming the model otherwise)."""
    if expert_shard is None:
        return None
    from xstage_dit.families.experts import ExpertShard

    shard = ExpertShard.of(expert_shard)
    if record(spec.family).experts is None:
        raise ValueError(f"expected expert_shard=None for {spec.name} (no MoE layers to shard), got {expert_shard!r}")
    return shard


def load_pipeline(model: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                  expert_shard: tuple[int, int] | None = None):
    """Build (or load) the diffusers pipeline for ``model`` on ``device`` in ``dtype``.

    model: a name from ``model_names()`` (random weights, deterministic in ``seed``) or a local diffusers
        folder (real weights, loaded with ``DiffusionPipeline.from_pretrained``; ``seed`` unused).
    device: where the weights are created (``"meta"`` builds the architecture only, e.g. to count parameters).
    expert_shard: (rank, world) for a MoE model (NucleusMoE, HiDream): this process creates or reads only
        experts ``[rank*E/world, (rank+1)*E/world)`` of every MoE layer, which become EP layers to be bound by
        ``parallelize(pipe, ParallelConfig(sp=world, ep=world))`` on the rank with EP-group rank ``rank``
        (see `xstage_dit.families.experts`). world must divide the expert count. None: every expert.
    Returns the pipeline with every component on ``device``, progress bar off.

    Example (rank r of 4)::

        pipe = load_pipeline("full-nucleusmoe", dtype=torch.bfloat16, device="cuda", expert_shard=(r, 4))
        handle = parallelize(pipe, ParallelConfig(sp=4, ep=4))
    """
    spec = model_spec(model)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"expected a floating torch dtype, got {dtype!r}")
    shard = _check_expert_shard(spec, expert_shard)
    device = torch.device(device)
    if spec.size == "local" and shard is not None:
        from diffusers import DiffusionPipeline

        from xstage_dit.families.experts import load_transformer_sharded

        transformer = load_transformer_sharded(spec.name, spec.family, shard, dtype=dtype, device=device)
        pipe = DiffusionPipeline.from_pretrained(spec.name, dtype=dtype, transformer=transformer).to(device)
    elif spec.size == "local":
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(spec.name, dtype=dtype).to(device)
    else:
        extra = {} if shard is None else {"expert_shard": shard}
        if spec.variant:
            extra["variant"] = spec.variant
        pipe = record(spec.family).build(spec.size, dtype=dtype, device=device, seed=int(seed), **extra)
    pipe.set_progress_bar_config(disable=True)  # callers that want a bar (the CLI) turn it on
    quiet_prompt_truncation(pipe)
    return pipe


def load_transformer(model: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     seed: int = 0, expert_shard: tuple[int, int] | None = None) -> torch.nn.Module:
    """Only the denoising transformer of a built-in model (what step and layer benchmarks need).

    Same weights as ``load_pipeline(model, seed=seed, expert_shard=...).transformer``; no text encoder or VAE.
    """
    spec = model_spec(model)
    if spec.size == "local":
        raise ValueError(f"expected a built-in model name for load_transformer, got the folder {model!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"expected a floating torch dtype, got {dtype!r}")
    shard = _check_expert_shard(spec, expert_shard)
    extra = {} if shard is None else {"expert_shard": shard}
    if spec.variant:
        extra["variant"] = spec.variant
    return record(spec.family).build_transformer(spec.size, dtype=dtype, device=torch.device(device), seed=int(seed),
                                                 **extra)
