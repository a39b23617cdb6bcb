"""The checks of `--sp / --ep / --cfg` (and guidance) that the model's config alone decides, made in the
command's own process before any rank starts: one line, exit status 2, in about the time of
`--help`. Without them each rank would find the same error after importing diffusers and building the
pipeline, print it once per rank and add "rank exited" lines, seconds later
(benchmarks/results/figures-from-code.md).

The facts come from the transformer's config (a built-in model's config dict, or a local folder's
`transformer/config.json`), never from building it: importing diffusers alone takes longer than the
whole budget on a 2-core machine. The rules are those of `xstage_dit.features.check_degrees` and of the
expert shards (`xstage_dit.families.experts.ExpertShard`), said in the same words;
tests/cli/test_first_hour_validate.py holds both to the same verdict on every built-in model.

Example::

    check_parallel(model_spec("tiny-flux"), ParallelConfig(sp=3))   # UsageError: --sp: expected at most ...
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from xstage_dit.errors import UsageError
from xstage_dit.families.registry import FAMILY_MODULES
from xstage_dit.families.spec import ModelSpec
from xstage_dit.features.config import ParallelConfig

#: config key of the expert count, per MoE family (the families `xstage_dit.families.experts` shards).
_EXPERT_KEYS = {"nucleusmoe": "num_experts", "hidream": "num_routed_experts"}
#: families whose pipeline runs CFG as a second branch (cfg=2 needs guidance on), all but FLUX.1's.
_CFG_NEEDS_GUIDANCE = ("wan", "nucleusmoe", "hidream")
#: families whose plan has no CFG parallelism (`xstage_dit.features.plans`: cfg=None).
_NO_CFG_PARALLEL = ("sd3", "cogvideox", "z-image", "wan-vace", "skyreels-v2", "ltx", "ltx2", "qwenimage21",
                    "hunyuanvideo15", "hunyuanimage")
#: config key of the fewest heads of any attention where it is not ``num_attention_heads`` (Z-Image; SANA: its
#: cross-attention has fewer heads than its linear self-attention).
_HEADS_KEYS = {"z-image": "n_heads", "sana": "num_cross_attention_heads"}


@dataclass(frozen=True)
class TransformerFacts:
    """What the degree rules read off a transformer config.

    heads: attention heads (every attention of the built-in families has this many).
    guidance_distilled: FLUX.1 with a guidance embedding (FLUX.1-dev): one branch per step, no CFG.
    num_experts: experts per MoE layer; None for a dense model.
    """

    heads: int
    guidance_distilled: bool
    num_experts: int | None


def transformer_config(spec: ModelSpec) -> dict:
    """The transformer config of a built-in model (its family module's table) or of a local folder."""
    if spec.size == "local":
        path = Path(spec.name).expanduser() / "transformer" / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"--model: expected a readable {path}, got {type(exc).__name__}: {exc}") from None
    return dict(importlib.import_module(FAMILY_MODULES[spec.family]).TRANSFORMER[spec.size])


def transformer_facts(spec: ModelSpec) -> TransformerFacts:
    config = transformer_config(spec)
    key = _EXPERT_KEYS.get(spec.family)
    return TransformerFacts(heads=int(config[_HEADS_KEYS.get(spec.family, "num_attention_heads")]),
                            guidance_distilled=spec.family == "flux" and bool(config.get("guidance_embeds", False)),
                            num_experts=int(config[key]) if key and key in config else None)


def check_parallel(spec: ModelSpec, config: ParallelConfig, guidance: float | None = None) -> None:
    """Raise `UsageError` (one line naming the option) when `spec` cannot run with `config`'s degrees
    (the command's one ParallelConfig, itself already valid).

    guidance: the guidance scale asked for (None: the model's default), checked with cfg=2.
    """
    facts = transformer_facts(spec)
    if facts.heads < config.sp:
        raise UsageError(f"--sp: expected at most {facts.heads} (the attention heads of {spec.name}: Ulysses gives "
                         f"each rank >= 1 head), got --sp {config.sp}")
    if config.ep > 1:
        if facts.num_experts is None:
            raise UsageError(f"--ep: expected --ep 1 for {spec.name} (no MoE layers to shard), got {config.ep}")
        if facts.num_experts % config.ep:
            raise UsageError(f"--ep: expected a divisor of the {facts.num_experts} experts of {spec.name}, "
                             f"got {config.ep}")
    if spec.family == "nucleusmoe" and config.sp > 1 and config.ep != config.sp:
        raise UsageError(f"--ep: expected --ep {config.sp} (equal to --sp: NucleusMoE routes by expert choice over "
                         f"the whole sequence), got {config.ep}")
    if config.cfg > 1:
        if spec.family in _NO_CFG_PARALLEL:
            raise UsageError(f"--cfg: expected 1 for {spec.name}: CFG parallel does not apply to its pipeline, "
                             f"got --cfg {config.cfg}")
        if facts.guidance_distilled:
            raise UsageError(f"--cfg: expected 1 for {spec.name}: it is guidance-distilled (one branch per step, "
                             f"nothing to run in parallel), got --cfg {config.cfg}")
        scale = spec.guidance if guidance is None else guidance
        if spec.family in _CFG_NEEDS_GUIDANCE and not scale > 1:
            raise UsageError(f"--cfg: expected --guidance > 1 with --cfg 2 (classifier-free guidance on), got "
                             f"guidance {scale}")
