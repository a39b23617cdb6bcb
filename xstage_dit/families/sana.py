"""SANA text-to-image (`SanaPipeline`): tiny (CPU seconds) and full (Sana_1600M_1024px dimensions).

Full size: a linear-attention DiT of 20 blocks, 70 heads x 32 (2240 wide) with 20 x 112 cross-attention heads to
the text, a depthwise 3x3 convolution in every feed-forward (GLUMBConv); the 32x, 32-channel DC-AE; a Gemma-2-2B
text encoder; flow DPM-Solver (shift 3). Tiny: the same classes, 2 blocks, 4 heads x 8, a 2-layer Gemma-2 over the
in-code Gemma tokenizer, a DC-AE of six levels (so the 32x factor, and the 32-pixel size rule, are real).

Sequence parallel (our plan): the image tokens are split by whole latent rows (the feed-forward's 3x3 convolution
needs its neighbour rows, one halo row from each neighbouring rank before it and cropped after); the linear
self-attention sums ``K^T V`` over this rank's tokens, and the sums of all ranks are added (one small all-gather
of ``(batch, heads, head_dim + 1, head_dim)`` per block, whatever the token count); the cross-attention to the
text needs no exchange (every rank holds the whole text): it stays diffusers' own. Nothing goes through the
Ulysses op; sp is bounded by the rows (at least one latent row a rank) and, by `parallelize`'s general rule, by
the fewest heads of any attention (the 20 cross-attention heads at full size). CFG is one call on an (uncond,
cond) batch ("batched").

The pipeline's resolution binning is turned off (``use_resolution_binning=False``): a request is generated at
the size it names (a multiple of 32), not at the nearest trained aspect ratio then resized.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from xstage_dit.families import latent_decode, sharding
from xstage_dit.families.build import build_module, check_vocab
from xstage_dit.families.record import FamilyRecord, SequenceParallelFacts, SizeLimits
from xstage_dit.families.spec import ModelSpec
from xstage_dit.families.tokenizers import gemma_tokenizer

if TYPE_CHECKING:  # diffusers (through sp_plan) is imported when a plan is built, not with the record: the CLI's
    # pre-checks read the records and must answer before diffusers would have loaded
    from xstage_dit.families.sp_plan import SequenceParallelSpec, SequenceState

TRANSFORMER = {
    # Sana_1600M_1024px_diffusers/transformer/config.json
    "full": dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                 num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                 caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
                 norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None),
    "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=2,
                 num_cross_attention_heads=4, cross_attention_head_dim=8, cross_attention_dim=32,
                 caption_channels=32, mlp_ratio=2.5, attention_bias=False, sample_size=4, patch_size=1,
                 norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None),
}

# Gemma-2-2B (the decoder, as the pipeline loads it: Gemma2Model); Lumina-Image 2.0 reads the same encoder.
GEMMA2 = {
    "full": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                 query_pre_attn_scalar=256, sliding_window=4096),
    "tiny": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, query_pre_attn_scalar=16,
                 sliding_window=4096),
}

_DC_LEVELS = 6  # 2 ** (levels - 1) = 32: the pipeline's vae_scale_factor
VAE = {
    # dc-ae-f32c32-sana-1.x (AutoencoderDC)
    "full": dict(in_channels=3, latent_channels=32, attention_head_dim=32,
                 encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
                 decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
                 encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                 decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
                 encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
                 encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
                 decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
                 upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
                 decoder_act_fns="silu", scaling_factor=0.41407),
    # the same block kinds, one layer a level and 8-16 channels
    "tiny": dict(in_channels=3, latent_channels=4, attention_head_dim=8,
                 encoder_block_types=("ResBlock",) * 5 + ("EfficientViTBlock",),
                 decoder_block_types=("ResBlock",) * 5 + ("EfficientViTBlock",),
                 encoder_block_out_channels=(8, 8, 8, 8, 16, 16), decoder_block_out_channels=(8, 8, 8, 8, 16, 16),
                 encoder_layers_per_block=(1,) * _DC_LEVELS, decoder_layers_per_block=(1,) * _DC_LEVELS,
                 encoder_qkv_multiscales=((),) * 5 + ((5,),), decoder_qkv_multiscales=((),) * 5 + ((5,),),
                 upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
                 decoder_act_fns="silu", scaling_factor=0.41407),
}

SCHEDULER = dict(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")

# generated at the size asked for (see the module docstring)
CALL_KWARGS = {"use_resolution_binning": False}


def gemma2_text_encoder(size: str, *, seed: int, device, dtype: torch.dtype):
    """(the in-code Gemma tokenizer, a `Gemma2Model` of ``GEMMA2[size]`` with random weights): the text encoder of
    SANA and Lumina-Image 2.0 (both load Gemma-2-2B's decoder)."""
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = gemma_tokenizer(GEMMA2[size]["max_position_embeddings"])
    check_vocab(tokenizer, GEMMA2[size]["vocab_size"], "Gemma-2")
    config = Gemma2Config(**GEMMA2[size])
    return tokenizer, build_module(lambda: Gemma2Model(config), seed=seed, device=device, dtype=dtype)


def build_transformer(size: str, *, dtype: torch.dtype, device, seed: int = 0):
    """The `SanaTransformer2DModel` alone (what a denoising-step benchmark needs)."""
    from diffusers import SanaTransformer2DModel

    return build_module(lambda: SanaTransformer2DModel(**TRANSFORMER[size]), seed=seed, device=device, dtype=dtype)


def build(size: str, *, dtype: torch.dtype, device, seed: int):
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline

    tokenizer, text_encoder = gemma2_text_encoder(size, seed=seed + 1, device=device, dtype=dtype)
    return SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=build_module(lambda: AutoencoderDC(**VAE[size]), seed=seed + 2, device=device, dtype=dtype),
        transformer=build_transformer(size, dtype=dtype, device=device, seed=seed),
        scheduler=DPMSolverMultistepScheduler(**SCHEDULER),
    )


# ---- sequence parallel: rows split, linear attention summed over the ranks, cross-attention local --------------
# The hooks below are plain classes, made diffusers `ModelHook`s (`_hook`) when a plan is built.


@functools.cache
def _hook(cls: type) -> type:
    """`cls` with diffusers' ``ModelHook`` as its base (imported here, on first use)."""
    from diffusers.hooks import ModelHook

    return type(cls.__name__, (cls, ModelHook), {"__doc__": cls.__doc__})


class _RowSplit:
    """On ``patch_embed``: reads the latent grid (rows x cols after patching) from its input and keeps this rank's
    whole rows of its output tokens ``(batch, rows * cols, dim)``, rows split by the one split rule."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, latent, *args, **kwargs):
        patch = module.patch_size
        rows, cols = latent.shape[-2] // patch, latent.shape[-1] // patch
        sharding.check_splittable(rows, self.state.world, "SANA's latent rows")
        offsets = sharding.split_offsets(rows, self.state.world)
        start, stop = offsets[self.state.rank], offsets[self.state.rank + 1]
        self.state.named.update(cols=cols, rows=stop - start, first_row=start, all_rows=rows)
        if rows % self.state.world == 0:
            # equal row shards are the token split's own shards: the exit gather needs no size exchange
            self.state.record(rows * cols)
        return (latent, *args), kwargs

    def post_forward(self, module, output):
        cols, first, rows = self.state.named["cols"], self.state.named["first_row"], self.state.named["rows"]
        return output.narrow(1, first * cols, rows * cols)


class _BlockRows:
    """On each block: its ``height`` argument (the rows its feed-forward unflattens the tokens into) becomes this
    rank's row count. Block signature: (hidden_states, attention_mask, encoder_hidden_states,
    encoder_attention_mask, timestep, height, width)."""

    _HEIGHT = 5

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        rows, cols = self.state.named["rows"], self.state.named["cols"]
        tokens = (args[0] if args else kwargs["hidden_states"]).shape[1]
        if tokens != rows * cols:
            raise ValueError(f"expected {rows} rows x {cols} tokens on rank {self.state.rank}, got {tokens} tokens")
        if "height" in kwargs or len(args) <= self._HEIGHT:
            kwargs["height"] = rows
        else:
            args = (*args[:self._HEIGHT], rows, *args[self._HEIGHT + 1:])
        return args, kwargs


class _RowHalo:
    """On the feed-forward's depthwise convolution (``(batch, channels, rows_local, cols)``): the rows of the
    neighbouring ranks its kernel reaches are fetched before it (zeros at the image's own edges, as its padding)
    and the output rows they produce are cropped after it. One all-gather of every rank's first and last rows."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def pre_forward(self, module, x, *args, **kwargs):
        halo, rank, world = module.padding[0], self.state.rank, self.state.world
        rows = self.state.named["all_rows"]
        if rows // world < halo:  # decided from the whole grid: the same on every rank
            raise ValueError(f"expected at least {halo} latent rows a rank for the feed-forward's {halo}-row halos, "
                             f"got {rows} rows over sp={world}")
        edges = torch.stack([x[:, :, :halo], x[:, :, -halo:]]).contiguous()  # (2, B, C, halo, W): first, last
        every = sharding.all_gather_dim0(edges, self.state.group)  # (2 * world, ...): rank r at 2r, 2r + 1
        above = every[2 * rank - 1] if rank > 0 else torch.zeros_like(edges[0])
        below = every[2 * rank + 2] if rank < world - 1 else torch.zeros_like(edges[0])
        return (torch.cat([above, x, below], dim=2), *args), kwargs

    def post_forward(self, module, output):
        halo = module.padding[0]
        return output[:, :, halo:-halo]


class _NoControlNet:
    def pre_forward(self, module, *args, **kwargs):
        if kwargs.get("controlnet_block_samples") is not None:
            raise NotImplementedError("SANA under sequence parallelism takes no controlnet_block_samples (the "
                                      "ControlNet residuals are whole-image tokens); got some")
        return args, kwargs


class SanaLinearAttention:
    """``SanaLinearAttnProcessor2_0`` (ReLU linear self-attention) with its key-value sums added over the sp ranks.

    Per head: ``out_i = (sum_j v_j k_j^T) q_i / (sum_j k_j^T q_i)`` with ReLU'd q, k; the sums over the tokens j
    are one ``(batch, heads, head_dim + 1, head_dim)`` product (the ones row appended to v gives the normaliser),
    which each rank computes over its own tokens; the ranks' products are all-gathered and added in rank order
    (the same bits on every rank), then applied to the rank's own queries. The processor's ``_parallel_config``
    (set by the sequence-parallel feature) names the group, rank and world.
    """

    _attention_backend = None
    _parallel_config = None

    @classmethod
    def from_processor(cls, processor) -> "SanaLinearAttention":
        return cls()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self._parallel_config
        world = getattr(ctx, "world", 1)
        if encoder_hidden_states is not None and world > 1:
            raise NotImplementedError("SANA's linear attention is summed over the sp ranks for self-attention only; "
                                      "got encoder_hidden_states")
        original_dtype = hidden_states.dtype
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        # (batch, heads, head_dim, tokens), keys transposed to (batch, heads, tokens, head_dim)
        query = query.transpose(1, 2).unflatten(1, (attn.heads, -1))
        key = key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)
        value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))
        query, key = torch.relu(query), torch.relu(key)
        query, key, value = query.float(), key.float(), value.float()
        value = torch.nn.functional.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)
        scores = torch.matmul(value, key)  # (batch, heads, head_dim + 1, head_dim) over this rank's tokens
        if world > 1:
            scores = sharding.all_gather_dim0(scores.unsqueeze(0).contiguous(), ctx.group).sum(dim=0)
        hidden_states = torch.matmul(scores, query)
        hidden_states = hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + 1e-15)
        hidden_states = hidden_states.flatten(1, 2).transpose(1, 2).to(original_dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if original_dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states


def _check_row_convs(model: torch.nn.Module) -> None:
    for i, block in enumerate(model.transformer_blocks):
        conv = block.ff.conv_depth
        k, pad = conv.kernel_size[0], conv.padding[0] if isinstance(conv.padding, tuple) else None
        if (pad is None or k != 2 * pad + 1 or conv.stride != (1, 1) or conv.dilation != (1, 1)
                or conv.padding_mode != "zeros"):
            raise ValueError(
                f"expected SANA's feed-forward conv to keep the grid (odd kernel, padding k // 2, stride 1, zero "
                f"padding), got kernel {conv.kernel_size}, padding {conv.padding}, stride {conv.stride} in "
                f"transformer_blocks.{i}")


def sana_sp(model: torch.nn.Module) -> SequenceParallelSpec:
    """The plan of `SanaTransformer2DModel` (see the module docstring); ValueError naming what does not fit."""
    from xstage_dit import _diffusers_private as private
    from xstage_dit.families.sp_plan import SequenceParallelSpec

    _, cpo = private.cp_types()
    if not isinstance(getattr(model, "transformer_blocks", None), torch.nn.ModuleList) or not model.transformer_blocks:
        raise ValueError(f"expected {type(model).__name__}.transformer_blocks to be a non-empty ModuleList")
    _check_row_convs(model)
    return SequenceParallelSpec(
        cp_plan={"proj_out": cpo(gather_dim=1, expected_dims=3)},  # per token, after the last block
        processor_swaps={"SanaLinearAttnProcessor2_0": SanaLinearAttention.from_processor},
        extra_hooks=[
            ("patch_embed", _hook(_RowSplit)),
            ("transformer_blocks.*", _hook(_BlockRows)),
            ("transformer_blocks.*.ff.conv_depth", _hook(_RowHalo)),
            ("", lambda state: _hook(_NoControlNet)()),
        ],
        # the image queries attend the whole text, which every rank holds: nothing to exchange
        local_attention=("transformer_blocks.*.attn2",),
    )


def _check(model: torch.nn.Module, config) -> None:
    if config.cfg > 1 and getattr(model.config, "guidance_embeds", False):
        raise ValueError("CFG parallel does not apply to guidance-distilled SANA (guidance_embeds=True, SANA-Sprint): "
                         f"its pipeline runs one branch per step; expected cfg=1, got cfg={config.cfg}")


RECORD = FamilyRecord(
    name="sana",
    title="SANA",
    kind="image",
    pipelines={"SanaPipeline": "t2i"},
    transformers=("SanaTransformer2DModel",),
    sp=SequenceParallelFacts(
        plan_source="xstage (rows split, linear attention summed over ranks, cross-attention local)",
        build=sana_sp, check=_check, cfg="batched", cfg_needs_guidance=True,
        # its cross-attention has fewer heads than its linear self-attention: sp must split those
        heads_key="num_cross_attention_heads",
        cfg_batch_dims={"hidden_states": 0, "encoder_hidden_states": 0, "timestep": 0, "guidance": 0,
                        "encoder_attention_mask": 0, "attention_mask": 0},
    ),
    limits=SizeLimits(patch_multiple=32),
    specs=(
        ModelSpec(name="tiny-sana", family="sana", size="tiny", kind="image", pipeline_class="SanaPipeline",
                  patch_multiple=32, height=128, width=128, steps=2, guidance=4.5, max_sequence_length=32,
                  call_kwargs=CALL_KWARGS,
                  description="SANA architecture (linear attention, GLUMBConv), 2 blocks, 4 heads x 8, Gemma-2 text "
                  "encoder, DC-AE (32x), random weights (CPU seconds)"),
        ModelSpec(name="full-sana", family="sana", size="full", kind="image", pipeline_class="SanaPipeline",
                  patch_multiple=32, height=1024, width=1024, steps=20, guidance=4.5, max_sequence_length=300,
                  call_kwargs=CALL_KWARGS,
                  description="Sana_1600M_1024px dimensions (1.6B transformer: 20 blocks, 70 x 32 linear attention), "
                  "Gemma-2-2B, DC-AE f32c32, random weights"),
    ),
    latent_decode=latent_decode.scaled,
    build=build,
    build_transformer=build_transformer,
    transformer_dims=TRANSFORMER,
    real_weights_example="Sana_1600M_1024px_diffusers",
    pipeline_worlds=(1, 2, 4),
)
