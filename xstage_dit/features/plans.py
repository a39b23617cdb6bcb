"""Model facts for `parallelize`, in one registry keyed by transformer class name.

A subclass of a registered class (a user's ``class MyFlux(FluxTransformer2DModel)``) resolves to its
nearest registered base class (`plan_for` walks the MRO). Per transformer: its sequence-parallel plan
(diffusers' own ``_cp_plan`` where it ships one, ours for HunyuanVideo, NucleusMoE, HiDream and the
families of `family_plans`), how each attention's keys/values are laid out under that plan,
processor replacements for models that call SDPA directly, the MoE layers to swap for EP layers, and
how its pipeline runs classifier-free guidance ("paired": two transformer calls per step, cond then
uncond; "batched": one call on a (uncond, cond) batch; None: no CFG to parallelize).

`supported_models()` is the table the README shows (``python -m xstage_dit.features.plans``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from diffusers.hooks import ModelHook

from xstage_dit import _diffusers_private as private
from xstage_dit.families import sharding
from xstage_dit.families.registry import record_for_transformer
from xstage_dit.families.sp_plan import SequenceParallelSpec, SequenceState


@dataclass(frozen=True)
class ModelPlan:
    """Everything `parallelize` needs to know about one transformer class."""

    class_name: str
    family: str
    plan_source: str  # "diffusers" (shipped _cp_plan) or "xstage" (ours)
    build_sp: Callable[[torch.nn.Module], SequenceParallelSpec]
    moe_layers: tuple[tuple[str, str], ...] = ()  # (diffusers class name, "xstage module:EP class")
    cfg: str | None = "paired"
    cfg_batch_dims: dict[str, int] = field(default_factory=dict)  # batched CFG: input name -> batch dim
    cfg_unbatched: tuple[str, ...] = ()  # batched CFG: tensor inputs that carry no batch dim
    check: Callable[[torch.nn.Module, Any], None] | None = None
    tested: bool = False  # covered by a CPU equivalence test (transformer or pipeline level, world 2 and 4)
    pipeline_worlds: tuple[int, ...] = ()  # worlds of the CPU pipeline-level test (tests/features/test_families*.py)


def _shipped(kv_layouts: dict[str, str] | None = None) -> Callable[[torch.nn.Module], SequenceParallelSpec]:
    def build(model: torch.nn.Module) -> SequenceParallelSpec:
        plan = private.shipped_cp_plan(type(model))
        if not plan:
            raise ValueError(f"expected {type(model).__name__} to ship a _cp_plan, got none")
        return SequenceParallelSpec(cp_plan=dict(plan), kv_layouts=dict(kv_layouts or {}))

    return build


# ---- FLUX.1 ------------------------------------------------------------------------------------------------

def _check_flux(model: torch.nn.Module, config) -> None:
    if config.cfg > 1 and getattr(model.config, "guidance_embeds", False):
        raise ValueError(
            "CFG parallel does not apply to guidance-distilled FLUX (guidance_embeds=True, e.g. FLUX.1-dev): its "
            f"pipeline runs one branch per step; expected cfg=1, got cfg={config.cfg}"
        )


# ---- NucleusMoE (our plan) ----------------------------------------------------------------------------------

def _nucleusmoe_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    return SequenceParallelSpec(
        cp_plan={
            # image tokens are the sequence; the text stays whole on every rank (it is only keys/values)
            "": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            # (image freqs (S_img, d), text freqs (T, d)): split the image ones like the tokens
            "pos_embed": {0: cpi(split_dim=0, expected_dims=2, split_output=True)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        # keys/values = [image shard, whole text]: the backend cuts the text to this rank's share
        kv_layouts={"transformer_blocks.*.attn": "replicated_tail"},
    )


def _check_nucleusmoe(model: torch.nn.Module, config) -> None:
    if config.sp > 1 and config.ep != config.sp:
        raise ValueError(
            "NucleusMoE routes by expert choice over the whole sequence: under sequence parallelism the MoE "
            f"layers must be the EP layers over the sp group; expected ep == sp == {config.sp}, got ep={config.ep}"
        )


# ---- HiDream (our plan) -------------------------------------------------------------------------------------

class _HiDreamImageSplit(ModelHook):
    """Splits x_embedder's output (image tokens) and remembers the full image length for the ids hook."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def post_forward(self, module, output):
        sharding.check_splittable(output.shape[1], self.state.world, "HiDream's image tokens")
        self.state.named["image"] = output.shape[1]
        self.state.record(output.shape[1])
        return sharding.shard(output, 1, self.state.rank, self.state.world)


class _HiDreamIdsSplit(ModelHook):
    """pe_embedder gets ids = [full image ids, local text ids]: keep this rank's image ids only.

    Text ids are all zero in HiDream, so every text token has the same rotary embedding and the local
    text ids need no cutting (their count already equals the local text tokens).
    """

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, ids):
        total = self.state.named["image"]
        img = sharding.shard(ids[:, :total], 1, self.state.rank, self.state.world)
        return (torch.cat([img, ids[:, total:]], dim=1),), {}


class _HiDreamMaskCheck(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        masks = kwargs.get("hidden_states_masks")
        if masks is not None or (hidden_states is not None and hidden_states.ndim == 4 and hidden_states.shape[-1] != hidden_states.shape[-2]):
            raise NotImplementedError(
                "HiDream under sequence parallelism supports square latents (no hidden_states_masks); got latents "
                f"of shape {tuple(hidden_states.shape) if hidden_states is not None else None}"
            )
        return args, kwargs


def _hidream_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    from xstage_dit.features.processors import XStageHiDreamAttnProcessor

    cpi, cpo = private.cp_types()
    if getattr(model, "caption_projection", None) is None:
        raise ValueError("expected a HiDream transformer with caption_projection layers, got caption_projection=None")
    return SequenceParallelSpec(
        cp_plan={
            # every text piece (T5 and each Llama layer) is split after its projection
            "caption_projection.*": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "final_layer": cpo(gather_dim=1, expected_dims=3),
        },
        processor_swaps={"HiDreamAttnProcessor": XStageHiDreamAttnProcessor.from_processor},
        extra_hooks=[
            ("x_embedder", _HiDreamImageSplit),
            ("pe_embedder", _HiDreamIdsSplit),
            ("", lambda state: _HiDreamMaskCheck()),
        ],
    )


# ---- HunyuanVideo (our plan) --------------------------------------------------------------------------------

class _HunyuanMaskRoot(ModelHook):
    """Records the text padding mask at entry; None when every text token is real (one check per forward)."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        mask = kwargs.get("encoder_attention_mask", args[3] if len(args) > 3 else None)
        self.state.named["text_mask"] = None if mask is None or bool(mask.bool().all()) else mask.bool()
        return args, kwargs


class _HunyuanBlockMask(ModelHook):
    """Blocks get a mask built from local lengths; replace it by [image shard ones, text mask shard]."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, hidden_states, encoder_hidden_states, temb, attention_mask=None, *rest, **kwargs):
        text_mask = self.state.named.get("text_mask")
        if text_mask is None:
            attention_mask = None
        else:
            local_text = sharding.shard(text_mask, 1, self.state.rank, self.state.world)
            ones = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([ones, local_text], dim=1)[:, None, None, :]
        return (hidden_states, encoder_hidden_states, temb, attention_mask, *rest), kwargs


def _hunyuan_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    return SequenceParallelSpec(
        cp_plan={
            "x_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "context_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "rope": {
                0: cpi(split_dim=0, expected_dims=2, split_output=True),
                1: cpi(split_dim=0, expected_dims=2, split_output=True),
            },
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        # the token refiner attends the whole text inside context_embedder, before the split
        local_attention=("context_embedder.*",),
        extra_hooks=[
            ("transformer_blocks.*", _HunyuanBlockMask),
            ("single_transformer_blocks.*", _HunyuanBlockMask),
            ("", _HunyuanMaskRoot),
        ],
    )


from xstage_dit.features import family_plans as fam  # noqa: E402

_NUCLEUS_EP = ("NucleusMoELayer", "xstage_dit.features.ep_layers:NucleusMoEEPLayer")
_HIDREAM_EP = ("MOEFeedForwardSwiGLU", "xstage_dit.features.ep_layers:HiDreamMoEEPLayer")

_WAN_KV = {"blocks.*.attn2": "replicated"}
_PW = (2, 4)  # pipeline-level CPU test at world 2 and 4

_PLANS: dict[str, ModelPlan] = {
    p.class_name: p
    for p in (
        ModelPlan("FluxTransformer2DModel", "FLUX.1", "diffusers", _shipped(), check=_check_flux, tested=True,
                  pipeline_worlds=(2, 4)),
        ModelPlan("Flux2Transformer2DModel", "FLUX.2", "diffusers", _shipped(), tested=True, pipeline_worlds=_PW),
        ModelPlan("QwenImageTransformer2DModel", "QwenImage", "diffusers", _shipped(), tested=True,
                  pipeline_worlds=_PW),
        # paired CFG would need each cfg group to keep its own branch's KV cache: not done, cfg=None
        ModelPlan("QwenImage21Transformer2DModel", "Qwen-Image 2.1", "xstage (target split, prefix whole)",
                  fam.qwenimage21_sp, cfg=None, tested=True, pipeline_worlds=_PW),
        ModelPlan("WanTransformer3DModel", "Wan 2.1 / 2.2", "diffusers", _shipped(_WAN_KV), tested=True,
                  pipeline_worlds=(2, 4)),
        ModelPlan("ChronoEditTransformer3DModel", "ChronoEdit", "diffusers", _shipped(_WAN_KV), tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("HeliosTransformer3DModel", "Helios", "diffusers (blocks from the model)", fam.helios_sp, tested=True,
                  pipeline_worlds=_PW),
        # LTX pipelines run CFG as one (uncond, cond) batch, not as the two calls "paired" expects: no CFG parallel
        ModelPlan("LTXVideoTransformer3DModel", "LTX-Video", "diffusers", _shipped(), cfg=None, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("LTX2VideoTransformer3DModel", "LTX-2", "diffusers (completed: cross-modal rotary, audio local)",
                  fam.ltx2_sp, cfg=None, tested=True, pipeline_worlds=_PW),
        # guidance-distilled: one call per step (batch 1), no CFG to parallelize; a modular pipeline (no DiffusionPipeline)
        ModelPlan("MiniMaxH3Transformer3DModel", "MiniMax-H3", "diffusers (completed: token refiner local)",
                  fam.minimax_h3_sp, cfg=None, tested=True, pipeline_worlds=_PW),
        ModelPlan("HunyuanVideoTransformer3DModel", "HunyuanVideo", "xstage", _hunyuan_sp, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("SD3Transformer2DModel", "SD3 / SD3.5", "xstage", fam.sd3_sp, cfg=None, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("CogVideoXTransformer3DModel", "CogVideoX", "xstage", fam.cogvideox_sp, cfg=None, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("ZImageTransformer2DModel", "Z-Image", "xstage", fam.z_image_sp, cfg=None, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("WanVACETransformer3DModel", "Wan-VACE", "xstage", fam.wan_vace_sp, cfg=None, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan("HunyuanVideo15Transformer3DModel", "HunyuanVideo 1.5", "xstage", fam.hunyuan_video15_sp, cfg=None,
                  tested=True, pipeline_worlds=_PW),
        ModelPlan("HunyuanImageTransformer2DModel", "HunyuanImage 2.1", "xstage", fam.hunyuan_image_sp, cfg=None,
                  tested=True, pipeline_worlds=_PW),
        ModelPlan("SkyReelsV2Transformer3DModel", "SkyReels-V2", "xstage", fam.skyreels_v2_sp, cfg=None, tested=True,
                  pipeline_worlds=_PW),
        ModelPlan(
            "NucleusMoEImageTransformer2DModel", "NucleusMoE", "xstage", _nucleusmoe_sp,
            moe_layers=(_NUCLEUS_EP,), check=_check_nucleusmoe, tested=True, pipeline_worlds=(2, 4),
        ),
        ModelPlan(
            "HiDreamImageTransformer2DModel", "HiDream-I1", "xstage", _hidream_sp,
            moe_layers=(_HIDREAM_EP,), cfg="batched",
            # encoder_hidden_states_llama3 is (layers, batch, seq, dim); the rest lead with batch
            cfg_batch_dims={"hidden_states": 0, "timesteps": 0, "encoder_hidden_states_t5": 0,
                            "encoder_hidden_states_llama3": 1, "pooled_embeds": 0, "img_ids": 0,
                            "img_sizes": 0, "hidden_states_masks": 0},
            tested=True, pipeline_worlds=(2, 4),
        ),
    )
}

# Transformers with a diffusers pipeline that `parallelize` refuses, and why (shown under the README table).
NOT_SUPPORTED = {
    "Cosmos3OmniTransformer": "Cosmos 3: a mixture-of-transformers model (separate experts per modality inside "
                              "each block, its context parallelism written inside the model), not a DiT plan",
}


def plan_for(model: torch.nn.Module) -> ModelPlan:
    """The plan for `model`'s class, or for its nearest registered base class (subclasses resolve to their
    family); ValueError naming the class (and the supported ones) if there is none."""
    for cls in type(model).__mro__:
        plan = _PLANS.get(cls.__name__)
        # the name must be the registered diffusers class itself, not an unrelated class of the same name
        if plan is not None and cls.__module__.startswith("diffusers."):
            return plan
    record = record_for_transformer(model)
    if record is not None:
        return plan_of_record(record, type(model).__name__)
    name = type(model).__name__
    why = NOT_SUPPORTED.get(name)
    raise ValueError(
        f"expected a supported transformer ({', '.join(sorted(_PLANS))}) or a subclass of one, got {name}"
        + (f" ({why})" if why else "")
    )


def plan_of_record(record, class_name: str) -> ModelPlan:
    """The `ModelPlan` a family record's parallel facts stand for (the bridge until every family is a record)."""
    sp = record.sp
    return ModelPlan(class_name, record.title, sp.plan_source, sp.build, moe_layers=sp.moe_layers, cfg=sp.cfg,
                     cfg_batch_dims=dict(sp.cfg_batch_dims), check=sp.check, tested=True,
                     pipeline_worlds=record.pipeline_worlds)


def supported_models() -> list[ModelPlan]:
    """Every transformer `parallelize` supports, in registry order (then the family records' not listed above)."""
    from xstage_dit.families.registry import records

    extra = [plan_of_record(r, name) for r in records().values() for name in r.transformers if name not in _PLANS]
    return list(_PLANS.values()) + extra


def supported_models_markdown() -> str:
    """The README table of supported transformers, generated from the registry."""
    rows = [
        "| transformer | family | sequence plan | expert parallel | CFG parallel | CPU-tested | pipeline test (CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in supported_models():
        ep = ", ".join(c for c, _ in p.moe_layers) or "-"
        worlds = "world " + " and ".join(map(str, p.pipeline_worlds)) if p.pipeline_worlds else "-"
        rows.append(
            f"| `{p.class_name}` | {p.family} | {p.plan_source} | {ep} | {p.cfg or '-'} | {'yes' if p.tested else 'no'} "
            f"| {worlds} |"
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
