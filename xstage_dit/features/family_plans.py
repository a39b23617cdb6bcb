"""Sequence-parallel plans for the diffusers 0.42 families that ship no usable ``_cp_plan``, and the plan
Helios ships with a hard-coded block count, derived here from the module tree.

Every plan is built from the model instance (``build(model) -> SequenceParallelSpec``): block counts
come from the model's own ``ModuleList`` (``len(model.blocks)``), never from a literal. The vocabulary
is diffusers' (``ContextParallelInput`` / ``ContextParallelOutput``):

- a split entry on the first block splits the sequence the model built outside any module (joint
  text + image sequences, Z-Image's unified sequence); per-block inputs that the forward hands to
  every block (rotary tables, masks, per-token modulation) get a wildcard entry ("blocks.*");
- the gather sits on the first module after the blocks whose input is per token, or on the last
  block when the model adds full-length per-token terms after it (SkyReels-V2 diffusion forcing).
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from xstage_dit import _diffusers_private as private
from xstage_dit.families import sharding
from xstage_dit.families.sp_plan import SequenceParallelSpec, SequenceState


def _rope_split(cpi, split_dim: int, expected_dims: int) -> dict:
    """The plan entry of a rotary-embedding module returning (cos, sin): both outputs split along split_dim."""
    return {i: cpi(split_dim=split_dim, expected_dims=expected_dims, split_output=True) for i in (0, 1)}


def _blocks(model: torch.nn.Module, name: str) -> int:
    blocks = getattr(model, name, None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"expected {type(model).__name__}.{name} to be a non-empty ModuleList, got {type(blocks).__name__}")
    return len(blocks)


# ---- Helios: diffusers' plan names blocks.0 .. blocks.39; ours follows len(model.blocks) -------------------

def helios_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    shipped = private.shipped_cp_plan(type(model)) or {}
    plan = {k: v for k, v in shipped.items() if "*" in k}  # the split entries (wildcards)
    if set(plan) != {"blocks.*.attn1", "blocks.*.attn2", "blocks.*.ffn"}:
        raise ValueError(f"expected Helios' _cp_plan to split blocks.*.attn1/attn2/ffn, got {sorted(plan)}")
    for i in range(_blocks(model, "blocks")):
        for part in ("attn1", "attn2", "ffn"):
            plan[f"blocks.{i}.{part}"] = cpo(gather_dim=1, expected_dims=3)
    # Each attention sees the whole sequence again after its own gather, so its keys are local.
    return SequenceParallelSpec(cp_plan=plan, kv_layouts={"blocks.*.attn2": "replicated"})


# ---- SD3 / SD3.5: patch embedding + context embedder split, joint attention ---------------------------------

def sd3_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    from xstage_dit.features.sdpa_processors import XStageJointAttnProcessor

    cpi, cpo = private.cp_types()
    return SequenceParallelSpec(
        cp_plan={
            # pos_embed adds the learned positions of the whole grid before this split
            "pos_embed": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "context_embedder": {0: cpi(split_dim=1, expected_dims=3, split_output=True)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        processor_swaps={"JointAttnProcessor2_0": XStageJointAttnProcessor.from_processor},
    )


# ---- CogVideoX: one [text, video] embedding, cut in two outside any module ---------------------------------

def cogvideox_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    from xstage_dit.features.sdpa_processors import XStageCogVideoXAttnProcessor

    cpi, cpo = private.cp_types()
    _blocks(model, "transformer_blocks")
    rope = [cpi(split_dim=0, expected_dims=2), cpi(split_dim=0, expected_dims=2)]  # (cos, sin), (S_video, d)
    return SequenceParallelSpec(
        cp_plan={
            "transformer_blocks.0": {
                "hidden_states": cpi(split_dim=1, expected_dims=3),
                "encoder_hidden_states": cpi(split_dim=1, expected_dims=3),
            },
            # the forward hands the whole rotary table to every block
            "transformer_blocks.*": {"image_rotary_emb": rope},
            "norm_final": cpo(gather_dim=1, expected_dims=3),
        },
        processor_swaps={"CogVideoXAttnProcessor2_0": XStageCogVideoXAttnProcessor.from_processor},
    )


# ---- Z-Image: refiners on whole pieces, then one unified [image, caption] sequence -------------------------

def z_image_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    _blocks(model, "layers")
    return SequenceParallelSpec(
        cp_plan={
            "layers.0": {"x": cpi(split_dim=1, expected_dims=3)},
            # the unified mask (batch, seq), rotary table (batch, seq, d/2) and omni noise mask go to every layer
            "layers.*": {
                "attn_mask": cpi(split_dim=1, expected_dims=2),
                "freqs_cis": cpi(split_dim=1, expected_dims=3),
                "noise_mask": cpi(split_dim=1, expected_dims=2),
            },
            "all_final_layer.*": cpo(gather_dim=1, expected_dims=3),
        },
        # the noise / caption / SigLIP refiners attend their own whole piece, before the split
        local_attention=("noise_refiner.*", "context_refiner.*", "siglip_refiner.*"),
    )


# ---- Wan-VACE: Wan, plus the control branch whose hints are added block by block --------------------------

def wan_vace_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    _blocks(model, "vace_blocks")
    rope = _rope_split(cpi, 1, 4)
    return SequenceParallelSpec(
        cp_plan={
            "": {"timestep": cpi(split_dim=1, expected_dims=2)},  # per-token timesteps (Wan 2.2 TI2V style)
            "rope": rope,
            "vace_blocks.0": {"control_hidden_states": cpi(split_dim=1, expected_dims=3)},
            # every VACE block is handed the whole video tokens (the first adds them to the control tokens)
            "vace_blocks.*": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            "blocks.0": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        kv_layouts={"blocks.*.attn2": "replicated", "vace_blocks.*.attn2": "replicated"},
    )


# ---- SkyReels-V2: Wan-like; diffusion forcing adds per-token modulation and a block-causal mask ------------

def skyreels_v2_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    last = _blocks(model, "blocks") - 1
    rope = _rope_split(cpi, 1, 4)
    return SequenceParallelSpec(
        cp_plan={
            "rope": rope,
            "blocks.0": {"hidden_states": cpi(split_dim=1, expected_dims=3)},
            # diffusion forcing: temb (batch, 6, seq, dim) per token and a (1, 1, seq_q, seq_k) block-causal mask,
            # whose query rows follow the tokens (its key columns stay whole: the backend gathers the keys)
            "blocks.*": {
                "temb": cpi(split_dim=2, expected_dims=4),
                "attention_mask": cpi(split_dim=2, expected_dims=4),
            },
            # norm_out then adds a full-length per-token shift in diffusion forcing: gather before it
            f"blocks.{last}": cpo(gather_dim=1, expected_dims=3),
        },
        kv_layouts={"blocks.*.attn2": "replicated"},
    )


# ---- LTX-2: diffusers' plan splits the video; the audio stream stays whole on every rank --------------------

def ltx2_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    """diffusers' LTX-2 plan, completed: the rotary tables of the cross-modal attentions follow the video
    shards too, and the tables' sequence dim is the one of the model's rope type ("split" tables are
    (batch, heads, seq, d/2), "interleaved" ones (batch, seq, d)). Audio queries and keys are whole on
    every rank, so the attentions whose keys are audio (or audio text) are local ("replicated")."""
    cpi, cpo = private.cp_types()
    shipped = private.shipped_cp_plan(type(model)) or {}
    if "" not in shipped or "proj_out" not in shipped:
        raise ValueError(f"expected LTX-2's _cp_plan to split at the root and gather at proj_out, got {sorted(shipped)}")
    split_rope = getattr(model.config, "rope_type", "interleaved") == "split"
    dim, dims = (2, 4) if split_rope else (1, 3)
    rope = _rope_split(cpi, dim, dims)
    plan = {"": shipped[""], "rope": rope, "cross_attn_rope": dict(rope), "proj_out": shipped["proj_out"]}
    return SequenceParallelSpec(
        cp_plan=plan,
        kv_layouts={
            "transformer_blocks.*.audio_attn1": "replicated",
            "transformer_blocks.*.audio_attn2": "replicated",
            "transformer_blocks.*.audio_to_video_attn": "replicated",
        },
    )


# ---- HunyuanImage 2.1: dual + single blocks on [image, text]; the key mask is built from full lengths -------

class _ImageTokens(ModelHook):
    """Remembers the full image token count (x_embedder's output) for the block mask hook."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def post_forward(self, module, output):
        self.state.named["image"] = output.shape[1]
        return output


class _ShardedJointMask(ModelHook):
    """Blocks get ``attention_mask`` (batch, 1, 1, image + text) over the whole sequence; each rank's keys are
    [its image shard, its text shard], so the mask becomes [image part shard, text part shard]."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None:
            image = self.state.named["image"]
            rank, world = self.state.rank, self.state.world
            kwargs["attention_mask"] = torch.cat(
                [sharding.shard(mask[..., :image], mask.dim() - 1, rank, world),
                 sharding.shard(mask[..., image:], mask.dim() - 1, rank, world)], dim=-1)
        return args, kwargs


def hunyuan_image_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    _blocks(model, "transformer_blocks")
    rope = _rope_split(cpi, 0, 2)
    extra = [("x_embedder", _ImageTokens), ("transformer_blocks.*", _ShardedJointMask)]
    if len(getattr(model, "single_transformer_blocks", ())):
        extra.append(("single_transformer_blocks.*", _ShardedJointMask))
    return SequenceParallelSpec(
        cp_plan={
            "rope": rope,  # (cos, sin), (S_image, d)
            "transformer_blocks.0": {
                "hidden_states": cpi(split_dim=1, expected_dims=3),
                "encoder_hidden_states": cpi(split_dim=1, expected_dims=3),
            },
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        # the token refiner attends the whole prompt inside context_embedder, before the split
        local_attention=("context_embedder.*",),
        extra_hooks=extra,
    )


# ---- HunyuanVideo 1.5: [video, reordered text] blocks; the processor masks valid_q & valid_k ---------------

def hunyuan_video15_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    cpi, cpo = private.cp_types()
    _blocks(model, "transformer_blocks")
    rope = _rope_split(cpi, 0, 2)
    return SequenceParallelSpec(
        cp_plan={
            "rope": rope,  # (cos, sin), (S_video, d)
            "transformer_blocks.0": {
                "hidden_states": cpi(split_dim=1, expected_dims=3),
                "encoder_hidden_states": cpi(split_dim=1, expected_dims=3),
            },
            # the forward hands every block the (batch, text) mask of its reordered [image, ByT5, LLM] text;
            # the processor pads it with the (local) video tokens and masks valid_q & valid_k
            "transformer_blocks.*": {"attention_mask": cpi(split_dim=1, expected_dims=2)},
            "proj_out": cpo(gather_dim=1, expected_dims=3),
        },
        local_attention=("context_embedder.*",),  # the token refiner, on the whole prompt before the split
    )


# ---- Qwen-Image 2.1: one block-causal [text prefix, target image] sequence; the target is split -------------
#
# The prefix (text, and condition images in edit mode) stays whole on every rank: its keys are what the KV
# cache holds after the first step (later steps run the target only), and its block-causal segments attend
# only to the prefix, so every rank computes them alike, without communication. Only the target image (the
# tokens of every step, the bulk of the sequence) is split; its queries attend [whole prefix, all targets]
# through the "replicated_head" key layout.

class _Qwen21Layout(ModelHook):
    """Records, per forward, the target tokens (the last ``prod(img_shapes[0][-1])`` of the joint sequence)
    and the replicated key prefix (the joint length minus them: every vision slot of ``img_mask`` stands for
    2x2 latent tokens), in both the prefill and the cached decode (whose keys are [cached prefix, target])."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        img_shapes, img_mask = kwargs.get("img_shapes"), kwargs.get("img_mask")
        if img_shapes is None or img_mask is None:
            raise ValueError("expected QwenImage21Transformer2DModel to be called with img_shapes= and img_mask= "
                             f"keywords (as its pipeline does), got keywords {sorted(kwargs)}")
        target = 1
        for n in img_shapes[0][-1]:
            target *= int(n)
        joint = img_mask.shape[1] + 3 * int(img_mask[0].sum())
        sharding.check_splittable(target, self.state.world, "Qwen-Image 2.1's target image tokens")
        self.state.record(target)
        self.state.named.update(target=target, kv_head=joint - target)
        return args, kwargs


def _shard_last(x: torch.Tensor, dim: int, state: SequenceState) -> torch.Tensor:
    """[x's leading part, this rank's shard of its last ``state.named['target']`` entries] along `dim`."""
    target = state.named["target"]
    head = x.shape[dim] - target
    if head < 0:
        raise ValueError(f"expected at least the {target} target tokens along dim {dim}, got shape {tuple(x.shape)}")
    return torch.cat([x.narrow(dim, 0, head), sharding.shard(x.narrow(dim, head, target), dim, state.rank, state.world)],
                     dim=dim)


class _Qwen21Block(ModelHook):
    """Every block gets the per-token tables of the whole sequence (rotary (seq, d/2) complex, the target
    token mask (seq,), the key validity (batch, keys)) and, in the cached decode, the key padding mask
    (batch, 1, 1, keys): each keeps its prefix and this rank's target shard. The first block also splits
    the hidden states; after the last one, [prefix, target shard] becomes [prefix, all targets] on every
    rank (the final norm and projection run on the whole sequence, as the pipeline reads its tail)."""

    def __init__(self, state: SequenceState, first: bool, last: bool) -> None:
        super().__init__()
        self.state = state
        self.first, self.last = first, last

    def pre_forward(self, module, *args, **kwargs):
        if args:
            raise NotImplementedError(f"expected Qwen-Image 2.1 blocks to be called with keywords (inference, no "
                                      f"gradient checkpointing), got {len(args)} positional arguments")
        for name, dim in (("rotary_emb", 0), ("target_token_mask", 0), ("key_valid", 1), ("hidden_states", 1)):
            if kwargs.get(name) is not None and (name != "hidden_states" or self.first):
                kwargs[name] = _shard_last(kwargs[name], dim, self.state)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            kwargs["attention_mask"] = _shard_last(mask, mask.dim() - 1, self.state)
        elif mask is not None:
            raise NotImplementedError(f"Qwen-Image 2.1 under sequence parallelism runs QwenImage21AttnProcessor "
                                      f"(segment prefill); got an attention_mask of type {type(mask).__name__}")
        return args, kwargs

    def post_forward(self, module, output):
        if not self.last:
            return output
        target = self.state.named["target"]
        local = sharding.split_sizes(target, self.state.world)[self.state.rank]
        head = output.shape[1] - local
        full = sharding.gather(output[:, head:], 1, self.state.group, target)
        return torch.cat([output[:, :head], full], dim=1)


def qwenimage21_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    from xstage_dit.features.processors import qwenimage21_processor

    count = _blocks(model, "transformer_blocks")
    for i, block in enumerate(model.transformer_blocks):
        processor = block.attn.processor
        if type(processor).__name__ != "QwenImage21AttnProcessor" or not type(processor).__module__.startswith("diffusers."):
            # the flex processor's prefill calls flex_attention itself (backend="flex"), and a subclass may
            # dispatch with backend=None too: either would attend the local shard only, so both are refused
            raise ValueError(f"expected diffusers' QwenImage21AttnProcessor in every Qwen-Image 2.1 block under "
                             f"sequence parallelism, got {type(processor).__name__} in transformer_blocks.{i}.attn")

    def block_hook(i: int):
        return lambda state: _Qwen21Block(state, first=i == 0, last=i == count - 1)

    return SequenceParallelSpec(
        cp_plan={},
        kv_layouts={"transformer_blocks.*.attn": "replicated_head"},
        processor_swaps={"QwenImage21AttnProcessor": qwenimage21_processor},
        extra_hooks=[("", _Qwen21Layout), *[(f"transformer_blocks.{i}", block_hook(i)) for i in range(count)]],
    )


# ---- MiniMax-H3: diffusers' plan on the packed sequence; the token refiner runs before the split -------------

def minimax_h3_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    """diffusers' MiniMax-H3 plan (the packed ``[text | keyframes | audio | video]`` sequence is split at the
    first block, with the per-row rotary table, AdaLN rows and ``norm_out`` timestep rows; both output heads
    gather), completed: the token refiner attends the whole prompt inside the forward, before that split, so
    its attention is local. Routed through the sequence-parallel backend it would take every rank's copy of
    the same prompt as a shard of a world-times longer one: the same numbers (every key duplicated alike) for
    a collective and world times the attention work per refiner layer."""
    shipped = private.shipped_cp_plan(type(model)) or {}
    expected = {"rope", "transformer_blocks.0", "transformer_blocks.*", "norm_out", "proj_out", "audio_proj_out"}
    if set(shipped) != expected:
        raise ValueError(f"expected MiniMax-H3's _cp_plan to name {sorted(expected)}, got {sorted(shipped)}")
    _blocks(model, "transformer_blocks")
    return SequenceParallelSpec(cp_plan=dict(shipped), local_attention=("token_refiner.*",))
