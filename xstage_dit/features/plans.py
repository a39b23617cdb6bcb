"""What `parallelize` needs to know about a transformer: its `ModelPlan`, read from the family record of its class
(`xstage_dit.families.registry.record_for_transformer`: a subclass of a registered class, a user's
``class MyFlux(FluxTransformer2DModel)``, resolves to its nearest registered base class). The plans themselves
live in the family files (``families/<family>.py``): diffusers' own ``_cp_plan`` where it ships a usable one,
ours otherwise; how each attention's keys/values are laid out under that plan, processor replacements for
models that call SDPA directly, the MoE layers to swap for EP layers, and how its pipeline runs classifier-free
guidance ("paired": two transformer calls per step, cond then uncond; "batched": one call on a (uncond, cond)
batch; None: no CFG to parallelize).

`supported_models()` is the table the README shows (``python -m xstage_dit.features.plans``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xstage_dit.families.registry import NOT_SUPPORTED, record_for_transformer, records
from xstage_dit.families.sp_plan import SequenceParallelSpec


@dataclass(frozen=True)
class ModelPlan:
    """Everything `parallelize` needs to know about one transformer class (from its family record)."""

    class_name: str
    family: str  # the family's title ("FLUX.1")
    plan_source: str  # "diffusers" (shipped _cp_plan) or "xstage" (ours)
    build_sp: Callable[[torch.nn.Module], SequenceParallelSpec]
    moe_layers: tuple[tuple[str, str], ...] = ()  # (diffusers class name, "xstage module:EP class")
    cfg: str | None = "paired"
    cfg_batch_dims: dict[str, int] = field(default_factory=dict)  # batched CFG: input name -> batch dim
    check: Callable[[torch.nn.Module, Any], None] | None = None
    tested: bool = False  # covered by a CPU equivalence test (transformer or pipeline level, world 2 and 4)
    pipeline_worlds: tuple[int, ...] = ()  # worlds of the CPU pipeline-level test (tests/features/test_families*.py)


def plan_of_record(record, class_name: str) -> ModelPlan:
    """The `ModelPlan` of transformer class `class_name` from its family record's parallel facts."""
    sp = record.sp
    moe = () if record.experts is None else ((record.experts.layer_class, record.experts.ep_layer),)
    return ModelPlan(class_name, record.title, sp.plan_source, sp.build, moe_layers=moe, cfg=sp.cfg,
                     cfg_batch_dims=dict(sp.cfg_batch_dims), check=sp.check, tested=True,
                     pipeline_worlds=record.pipeline_worlds)


def plan_for(model: torch.nn.Module) -> ModelPlan:
    """The plan for `model`'s class, or for its nearest registered base class (subclasses resolve to their
    family); ValueError naming the class (and the supported ones) if no family record names it."""
    record = record_for_transformer(model)
    name = type(model).__name__
    if record is not None:
        return plan_of_record(record, name)
    why = NOT_SUPPORTED.get(name)
    supported = sorted(p.class_name for p in supported_models())
    raise ValueError(
        f"expected a supported transformer ({', '.join(supported)}) or a subclass of one, got {name}"
        + (f" ({why})" if why else "")
    )


def supported_models() -> list[ModelPlan]:
    """Every transformer `parallelize` supports: each family record's transformer classes, in registry order."""
    return [plan_of_record(r, name) for r in records().values() for name in r.transformers]


def supported_models_markdown() -> str:
    """The README table of supported transformers, generated from the family records: what `parallelize` does
    (Python), which pipelines `generate` / `serve --model DIR` run from a local folder, the built-in models."""
    rows = [
        "| transformer | family | sequence plan | expert parallel | CFG parallel | CPU-tested | pipeline test (CPU) "
        "| generate / serve (local folder) | built-in |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records().values():
        served = ", ".join(f"`{c}`" for c in r.served_pipelines) or "- (Python only)"
        builtin = ", ".join(s.name for s in r.specs) or "-"
        for name in r.transformers:
            p = plan_of_record(r, name)
            ep = ", ".join(c for c, _ in p.moe_layers) or "-"
            worlds = "world " + " and ".join(map(str, p.pipeline_worlds)) if p.pipeline_worlds else "-"
            rows.append(
                f"| `{p.class_name}` | {p.family} | {p.plan_source} | {ep} | {p.cfg or '-'} | "
                f"{'yes' if p.tested else 'no'} | {worlds} | {served} | {builtin} |"
            )
    return "\n".join(rows)


def not_supported_markdown() -> str:
    """The line under the README table: transformers with a pipeline that `parallelize` refuses, and why."""
    return "Not supported: " + "; ".join(f"`{k}` ({v})" for k, v in NOT_SUPPORTED.items()) + "."


README_BEGIN = "<!-- supported-models:begin (generated: python -m xstage_dit.features.plans --readme README.md) -->"
README_END = "<!-- supported-models:end -->"


def update_readme(path: str) -> bool:
    """Write the table between the README markers (appending a section if absent); True if changed."""
    from pathlib import Path

    readme = Path(path)
    text = readme.read_text() if readme.exists() else ""
    block = f"{README_BEGIN}\n{supported_models_markdown()}\n\n{not_supported_markdown()}\n{README_END}"
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        new = head + block + rest.split(README_END, 1)[1]
    else:
        new = text.rstrip("\n") + ("\n\n" if text else "") + "## Models `parallelize` supports\n\n" + block + "\n"
    if new != text:
        readme.write_text(new)
    return new != text


if __name__ == "__main__":  # pragma: no cover
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--readme":
        print("updated" if update_readme(sys.argv[2]) else "up to date", sys.argv[2])
    else:
        print(supported_models_markdown())
