"""Qwen-Image 2.1 text-to-image (`QwenImage21Pipeline`): tiny (2 single-stream block-causal blocks, 4 heads x
16, a 2-layer Qwen3-VL text encoder (language model and a 1-layer vision tower, as the real class has one)
behind the in-code Qwen3-VL processor of NucleusMoE, a 5-level Qwen-Image 2.1 VAE (16x spatial as the real one:
the pipeline hard-codes that factor); random weights, CPU seconds) and full (Qwen-Image-2.1 dimensions, the
class defaults of diffusers 0.42.1: 32 blocks, 32 heads x 128, context 4096 from Qwen3-VL-8B; the class
defaults of `AutoencoderKLQwenImage21`).

The pipeline prefills the text keys/values on its first step and decodes from that KV cache afterwards
(``use_kv_cache=True``, the default), runs true CFG as two calls with separate caches, and passes the
prompt padding mask (``encoder_hidden_states_mask``) only when a batch of prompts is padded.

The record: our plan (the target image split, the text prefix whole on every rank; see `_sequence_plan`), no CFG
parallel (each cfg group would need its own branch's KV cache).
"""

from __future__ import annotations

import torch

from xstage_dit.families import latent_decode, sharding
from xstage_dit.families.build import build_module
from xstage_dit.families.nucleusmoe import TEXT as QWEN3VL_TEXT, VISION, qwen3vl_text_encoder
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.sp_plan import PlanHook, SequenceParallelSpec, SequenceState, blocks_of
from xstage_dit.families.spec import ModelSpec

TEXT = {
    "full": QWEN3VL_TEXT["full"],  # Qwen3-VL-8B, as NucleusMoE's
    # the pipeline reads hidden_states[-1] (before the final norm): 2 layers suffice
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3],
                                      mrope_interleaved=True)),
}

TRANSFORMER = {
    "full": dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128, num_attention_heads=32,
                 context_in_dim=QWEN3VL_TEXT["full"]["hidden_size"], mlp_ratio=3, axes_dims_rope=(16, 56, 56)),
    "tiny": dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                 num_attention_heads=4, context_in_dim=TEXT["tiny"]["hidden_size"], mlp_ratio=2,
                 axes_dims_rope=(4, 6, 6)),
}

# five levels = four 2x downsamples: the 16x the pipeline assumes (vae_scale_factor = 16)
VAE = {
    "full": dict(),  # the class defaults (64 latent channels, 16x spatial)
    "tiny": dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                 attn_scales=[], temperal_downsample=[False, True, True, True],
                 latents_mean=[0.51, 0.77, -0.06, 1.35], latents_std=[1.9, 1.7, 2.1, 1.6]),
}

SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    from diffusers import QwenImage21Transformer2DModel

    return build_module(lambda: QwenImage21Transformer2DModel(**TRANSFORMER[size]), seed=seed, device=device,
                        dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    proc, text_encoder = qwen3vl_text_encoder(TEXT[size], VISION[size], seed=seed + 1, device=device, dtype=dtype)
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=build_module(lambda: AutoencoderKLQwenImage21(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        text_encoder=text_encoder,
        processor=proc,
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
    )


# ---- the record ---------------------------------------------------------------------------------------------
#
# One block-causal [text prefix, target image] sequence; the target is split. The prefix (text, and condition
# images in edit mode) stays whole on every rank: its keys are what the KV cache holds after the first step
# (later steps run the target only), and its block-causal segments attend only to the prefix, so every rank
# computes them alike, without communication. Only the target image (the tokens of every step, the bulk of the
# sequence) is split; its queries attend [whole prefix, all targets] through the "replicated_head" key layout.

class _Layout(PlanHook):
    """Records, per forward, the target tokens (the last ``prod(img_shapes[0][-1])`` of the joint sequence)
    and the replicated key prefix (the joint length minus them: every vision slot of ``img_mask`` stands for
    2x2 latent tokens), in both the prefill and the cached decode (whose keys are [cached prefix, target])."""

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


class _Block(PlanHook):
    """Every block gets the per-token tables of the whole sequence (rotary (seq, d/2) complex, the target
    token mask (seq,), the key validity (batch, keys)) and, in the cached decode, the key padding mask
    (batch, 1, 1, keys): each keeps its prefix and this rank's target shard. The first block also splits
    the hidden states; after the last one, [prefix, target shard] becomes [prefix, all targets] on every
    rank (the final norm and projection run on the whole sequence, as the pipeline reads its tail)."""

    def __init__(self, state: SequenceState, first: bool, last: bool) -> None:
        super().__init__(state)
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


def sequence_plan(model: torch.nn.Module) -> SequenceParallelSpec:
    """The plan (module comment above); ValueError unless every block runs diffusers' QwenImage21AttnProcessor."""
    count = blocks_of(model, "transformer_blocks")
    for i, block in enumerate(model.transformer_blocks):
        processor = block.attn.processor
        if type(processor).__name__ != "QwenImage21AttnProcessor" or not type(processor).__module__.startswith("diffusers."):
            # the flex processor's prefill calls flex_attention itself (backend="flex"), and a subclass may
            # dispatch with backend=None too: either would attend the local shard only, so both are refused
            raise ValueError(f"expected diffusers' QwenImage21AttnProcessor in every Qwen-Image 2.1 block under "
                             f"sequence parallelism, got {type(processor).__name__} in transformer_blocks.{i}.attn")

    def block_hook(i: int):
        return lambda state: _Block(state, first=i == 0, last=i == count - 1)

    return SequenceParallelSpec(
        cp_plan={},
        kv_layouts={"transformer_blocks.*.attn": "replicated_head"},
        processor_swaps={"QwenImage21AttnProcessor": "xstage_dit.features.processors:qwenimage21_processor"},
        extra_hooks=[("", _Layout), *[(f"transformer_blocks.{i}", block_hook(i)) for i in range(count)]],
    )


SPECS = (
    ModelSpec(
        name="tiny-qwenimage21", family="qwenimage21", size="tiny", kind="image",
        pipeline_class="QwenImage21Pipeline", patch_multiple=32, height=64, width=64, steps=2, guidance=1.0,
        description="Qwen-Image 2.1 architecture (block-causal, KV cache), 2 blocks, 4 heads x 16, Qwen3-VL text "
        "encoder, random weights",
    ),
    ModelSpec(
        name="full-qwenimage21", family="qwenimage21", size="full", kind="image",
        pipeline_class="QwenImage21Pipeline", patch_multiple=32, height=1024, width=1024, steps=40, guidance=1.0,
        description="Qwen-Image 2.1 dimensions (32 blocks, 32 heads x 128), Qwen3-VL-8B, random weights",
    ),
)

RECORD = FamilyRecord(
    name="qwenimage21", title="Qwen-Image 2.1", kind="image",
    pipelines={"QwenImage21Pipeline": "t2i"},
    transformers=("QwenImage21Transformer2DModel",),
    sp=SequenceParallelFacts(plan_source="xstage (target split, prefix whole)", build=sequence_plan, cfg=None),
    limits=SizeLimits(patch_multiple=32), specs=SPECS,
    latent_decode=latent_decode.qwenimage21,
    build=build, build_transformer=build_transformer, transformer_dims=TRANSFORMER,
    real_weights_example="Qwen-Image-2.1", pipeline_worlds=(2, 4),
)
