"""The checks of `--sp / --ep / --cfg` (and guidance) that the model's config alone decides, made in the
command's own process before any rank starts: one line, exit status 2, in about the time of
`--help`. Without them each rank would find the same error after importing diffusers and building the
pipeline, print it once per rank and add "rank exited" lines, 10-14 s later.

The facts come from the transformer's config (a built-in model's config dict, or a local folder's
`transformer/config.json`), read with the keys and rules of its family record, never from building it:
importing diffusers alone takes longer than the whole budget on a 2-core machine (the family records import
no diffusers). The rules are those of `xstage_dit.features.check_degrees` and of the expert shards
(`xstage_dit.families.experts.ExpertShard`), said in the same words;
tests/cli/test_first_hour_validate.py holds both to the same verdict on every built-in model.

Example::

    check_parallel(model_spec("tiny-flux"), ParallelConfig(sp=3))   # UsageError: --sp: expected at most ...
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage_dit.errors import UsageError
from xstage_dit.families.record import FamilyRecord
from xstage_dit.families import registry
from xstage_dit.families.registry import record
from xstage_dit.families.spec import ModelSpec
from xstage_dit.features.config import ParallelConfig


@dataclass(frozen=True)
class TransformerFacts:
    """What the degree rules read off a transformer config (keys named by the family record).

    heads: attention heads (every attention of the built-in families has this many; ``sp.heads_key``).
    guidance_distilled: a guidance-distilled checkpoint (``sp.guidance_distilled_key`` true, e.g. FLUX.1-dev):
        one branch per step, no CFG.
    num_experts: experts per MoE layer (``experts.count_key``); None for a dense model.
    """

    heads: int
    guidance_distilled: bool
    num_experts: int | None


def transformer_config(spec: ModelSpec) -> dict:
    """The transformer config of a built-in model (its family record's dims) or of a local folder
    (`registry.transformer_config`); `UsageError` naming --model when it cannot be read."""
    try:
        return registry.transformer_config(spec)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def transformer_facts(spec: ModelSpec, family: FamilyRecord | None = None) -> TransformerFacts:
    family = family or record(spec.family)
    config = transformer_config(spec)
    key = family.experts.count_key if family.experts is not None else None
    distilled = family.sp.guidance_distilled_key
    return TransformerFacts(heads=int(config[family.sp.heads_key]),
                            guidance_distilled=bool(distilled and config.get(distilled, False)),
                            num_experts=int(config[key]) if key and key in config else None)


def check_parallel(spec: ModelSpec, config: ParallelConfig, guidance: float | None = None) -> None:
    """Raise `UsageError` (one line naming the option) when `spec` cannot run with `config`'s degrees
    (the command's one ParallelConfig, itself already valid).

    guidance: the guidance scale asked for (None: the model's default), checked with cfg=2.
    """
    family = record(spec.family)
    facts = transformer_facts(spec, family)
    if facts.heads < config.sp:
        raise UsageError(f"--sp: expected at most {facts.heads} (the attention heads of {spec.name}: Ulysses gives "
                         f"each rank >= 1 head), got --sp {config.sp}")
    if config.ep > 1:
        if facts.num_experts is None:
            raise UsageError(f"--ep: expected --ep 1 for {spec.name} (no MoE layers to shard), got {config.ep}")
        if facts.num_experts % config.ep:
            raise UsageError(f"--ep: expected a divisor of the {facts.num_experts} experts of {spec.name}, "
                             f"got {config.ep}")
    if family.experts is not None and family.experts.ep_equals_sp and config.sp > 1 and config.ep != config.sp:
        raise UsageError(f"--ep: expected --ep {config.sp} (equal to --sp: {family.title} routes by expert choice "
                         f"over the whole sequence), got {config.ep}")
    if config.cfg > 1:
        if family.sp.cfg is None:
            raise UsageError(f"--cfg: expected 1 for {spec.name}: CFG parallel does not apply to its pipeline, "
                             f"got --cfg {config.cfg}")
        if facts.guidance_distilled:
            raise UsageError(f"--cfg: expected 1 for {spec.name}: it is guidance-distilled (one branch per step, "
                             f"nothing to run in parallel), got --cfg {config.cfg}")
        scale = spec.guidance if guidance is None else guidance
        if family.sp.cfg_needs_guidance and not scale > 1:
            raise UsageError(f"--cfg: expected --guidance > 1 with --cfg 2 (classifier-free guidance on), got "
                             f"guidance {scale}")
