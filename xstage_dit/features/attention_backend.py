"""The ``xstage_ulysses`` diffusers attention backend: every attention call of a sequence-parallel
transformer goes through `xstage_dit.ops.attention` on the rank's sequence shard.

Each patched processor carries an `AttentionContext` in its ``_parallel_config`` slot (diffusers passes
that object to the backend untouched). The context says how the key/value tokens are laid out:

- ``"sharded"``: q, k, v are all this rank's sequence shard (FLUX joint attention, Wan self-attention).
  Ulysses: ``ulysses_attention(q, k, v, group=sp_group)``.
- ``"replicated"``: k, v are the same full sequence on every rank (Wan cross-attention to the text):
  no communication at all, local attention of the rank's queries against all keys.
- ``"replicated_tail"``: k, v = [sharded image tokens (as many as the queries), replicated text]
  (NucleusMoE: image queries attend to image + text keys). The text tail is cut to this rank's
  share with the one split rule, so after the All-to-All every key appears exactly once.
- ``"replicated_head"``: k, v = [a replicated prefix, sharded tokens (as many as the queries)]
  (Qwen-Image 2.1: the target image attends to the whole text prefix and itself). The prefix
  length is the plan's fact for this forward (``state.named["kv_head"]``, the same on every rank);
  a call whose keys all lie inside the prefix (the prefix's own block-causal segments, whose
  queries are replicated too) is local attention; otherwise the prefix is cut to this rank's share
  as the tail is above.

The op takes equal chunks of one sequence. A rank's attention sequence is a concatenation of
several split pieces (FLUX: its text shard then its image shard), which is an equal chunk exactly
when every piece divides by sp (the served shapes: 512 text + 4096 image tokens over 2/4/8). When
some piece does not (decided from the split totals, the same on every rank), or a mask is given, the call takes the gather-KV path instead
(keys, values and mask all-gathered, local queries): correct for any layout, logged once. So does
cross-attention with more local queries than keys (LTX's video attending its sharded text). Masks of
every shape diffusers passes are taken (`_attention_mask`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import xstage_dit.ops.attention as attention_ops
from xstage_dit.ops.attention import takes_traced_fp8, ulysses_attention
from xstage_dit.families import sharding
from xstage_dit.features.attention_schedules import AttentionSchedules
from xstage_dit.features.qk_bounds import amax_bounds

log = logging.getLogger(__name__)

KV_LAYOUTS = ("sharded", "replicated", "replicated_tail", "replicated_head")


@dataclass(eq=False)
class AttentionContext:
    """What the backend needs to know about one attention module (stored on its processor).

    group: the sp process group (None at world 1); rank/world: this rank's place in it.
    schedules: the schedule per layer shape, shared by all contexts of one `parallelize` call (decided
    and logged once per shape). kv_layout: one of KV_LAYOUTS (see module docstring). name: the module's
    qualified name (logs).
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    schedules: AttentionSchedules
    kv_layout: str = "sharded"
    name: str = ""
    state: object | None = None  # the SequenceState of the model's split hooks (split totals)
    qk_norms: tuple | None = None  # `qk_bounds.qk_norms`: the norms bounding q and k (FP8 attention's scales)

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"expected kv_layout in {KV_LAYOUTS}, got {self.kv_layout!r}")


def _schedule_for(ctx: AttentionContext, q: torch.Tensor, seq_total: int) -> str:
    """The schedule name for q's shape over ``seq_total`` tokens (the user's, or decided once per shape)."""
    batch, _, heads, head_dim = q.shape
    return ctx.schedules.for_shape(batch, seq_total, heads, head_dim, q.dtype, q.device)


def _attention_mask(mask: torch.Tensor, batch: int, seq_k: int, *, sharded_keys: bool = False) -> torch.Tensor:
    """Normalise a diffusers attention mask to 4-D ``(batch | 1, heads | 1, seq_q | 1, seq_k)``.

    Takes every shape diffusers passes: key padding ``(batch, seq_k)``, ``(batch, 1, seq_k)``,
    ``(batch, 1, 1, seq_k)``, expanded per head ``(batch, heads, 1, seq_k)`` (LTX), and query-dependent
    ``(batch | 1, heads | 1, seq_q, seq_k)`` (SkyReels-V2's block-causal mask). Boolean (True keeps)
    masks stay boolean, integer ones become boolean; floating masks stay additive, as SDPA reads them
    (LTX adds -10000 to padded keys: a bias, not -inf, so it is not turned into a boolean). ``seq_k``
    is the key count of this call; with ``sharded_keys`` the mask may instead span the whole key
    sequence (checked after the gather).
    """
    given = tuple(mask.shape)
    if mask.ndim == 2:
        mask = mask[:, None, None, :]
    elif mask.ndim == 3:
        mask = mask[:, None, :, :]
    if mask.ndim != 4 or (mask.shape[-1] != seq_k and not sharded_keys) or mask.shape[0] not in (1, batch):
        raise NotImplementedError(
            f"xstage sequence parallel takes attention masks (batch, seq_k), (batch, 1, seq_k) or "
            f"(batch | 1, heads | 1, seq_q | 1, seq_k) with batch={batch}, seq_k={seq_k}, got {given}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        mask = mask.bool()
    return mask


def _replicated_head(ctx: AttentionContext, seq_q: int, seq_k: int) -> int:
    """The replicated prefix length of this call's keys, or -1 when every key lies inside the prefix."""
    head = getattr(ctx.state, "named", {}).get("kv_head")
    if not isinstance(head, int) or head < 0:
        raise ValueError(f"attention {ctx.name}: expected the plan to record the replicated key prefix "
                         f"(state.named['kv_head']) this forward, got {head!r}")
    if seq_k <= head:
        return -1
    if seq_k - head != seq_q:
        raise ValueError(f"attention {ctx.name}: expected keys = {head} replicated + the queries' {seq_q} sharded, "
                         f"got {seq_k} keys")
    return head


def _key_padding(mask: torch.Tensor | None) -> bool:
    """Whether a normalised mask (`_attention_mask`) is a boolean key-padding mask, (B | 1, 1, 1, S_k)."""
    return mask is not None and mask.dtype == torch.bool and mask.shape[1] == 1 and mask.shape[2] == 1


def _world_one(ctx: AttentionContext, query, key, value, mask, scale) -> torch.Tensor | None:
    """A world-1 call through one of our kernels, or None for diffusers' own SDPA call.

    Without a mask, self-attention takes the op where its schedule is not "serial" (the kernel sweep's choice), and
    a call with more keys than queries (NucleusMoE's image queries over image + text keys) takes the compiled
    cudnn-fp8 path where its queries' self-attention shape chose cudnn-fp8. With a key-padding mask the masked choice
    decides (`AttentionSchedules.masked_kernel`: timed against torch SDPA with the mask, on masked inputs): cuDNN's
    padding mask over per-sample key lengths in 16 bits (``cudnn_padded``) or, compiled, in FP8 (``fp8_traced``).
    Other masks (additive, per query) and more queries than keys stay torch's SDPA."""
    seq_q, seq_k = query.shape[1], key.shape[1]
    if seq_q > seq_k or not (mask is None or _key_padding(mask)):
        return None
    if mask is None:
        if seq_q != seq_k and (ctx.schedules.kernels.fp8_attention == "off" or not torch.compiler.is_compiling()):
            return None  # only the compiled cudnn-fp8 path takes more keys than queries: decide nothing else
        schedule = _schedule_for(ctx, query, seq_q)
        traced = takes_traced_fp8(schedule, ctx.world)
        if schedule == "serial" or (seq_q != seq_k and not traced):
            return None
        ctx.schedules.note_path("ulysses", ctx.name)
        # cudnn-fp8 compiled: q's and k's scales from their norms' weights, no pass over q and k first
        bounds = amax_bounds(ctx.qk_norms, query.device) if ctx.qk_norms and traced else None
        if seq_q != seq_k:
            return attention_ops.cudnn_fp8_attention(query, key, value, scale=scale, amax_bounds=bounds)
        return ulysses_attention(query, key, value, group=ctx.group, schedule=schedule, scale=scale,
                                 fp8_amax_bounds=bounds)
    batch, _, heads, head_dim = query.shape
    kernel = ctx.schedules.masked_kernel(batch, seq_q, heads, head_dim, query.dtype, query.device)
    if kernel == "cudnn-padded":
        return attention_ops.cudnn_padded_attention(query, key, value, mask, scale=scale)
    if kernel == "cudnn-fp8" and torch.compiler.is_compiling():
        bounds = amax_bounds(ctx.qk_norms, query.device) if ctx.qk_norms else None
        return attention_ops.cudnn_fp8_attention(query, key, value, scale=scale, amax_bounds=bounds, key_mask=mask)
    return None


def _sdpa(q, k, v, mask, scale):
    """Local attention, (B, S, H, D) layout; mask: bool or additive (B|1, H|1, S_q|1, S_k), or None."""
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def _even_pieces(ctx: AttentionContext, *extra_totals: int) -> bool:
    """True when every split piece of this forward divides by the sp degree (rank-independent)."""
    totals = list(getattr(ctx.state, "totals", ())) + list(extra_totals)
    return all(t % ctx.world == 0 for t in totals)


def _gather_kv_attention(q, k, v, mask, scale, ctx: AttentionContext, why: str):
    """Fallback: all-gather k, v (and mask) over the sp group; local queries attend to all keys."""
    ctx.schedules.note_path("gather_kv", f"{ctx.name} ({why}: keys/values all-gathered instead of the Ulysses op)")
    k_all = sharding.gather(k, 1, ctx.group)
    v_all = sharding.gather(v, 1, ctx.group)
    if mask is not None and mask.shape[-1] not in (k.shape[1], k_all.shape[1]):
        raise NotImplementedError(
            f"attention {ctx.name}: expected a mask over this rank's {k.shape[1]} keys or all {k_all.shape[1]}, "
            f"got {tuple(mask.shape)}"
        )
    if mask is None or mask.shape[-1] == k_all.shape[1]:
        # a mask over the whole key sequence already (built from full lengths, e.g. a block-causal mask
        # whose query rows the plan split): the same decision on every rank, since each holds >= 1 key
        m_all = mask
    elif mask.shape[2] == 1:
        m_all = sharding.gather(mask.contiguous(), 3, ctx.group)
    elif (valid := _symmetric_padding(mask, q.shape[1])) is not None:
        # HunyuanVideo 1.5 masks self-attention with valid_q & valid_k over the rank's own tokens: gather
        # the validity of the keys and rebuild the rows of this rank's queries against all keys
        valid_all = sharding.gather(valid.contiguous(), 1, ctx.group)
        m_all = valid[:, None, :, None] & valid_all[:, None, None, :]
    else:
        raise NotImplementedError(
            f"attention {ctx.name}: a query-dependent mask over this rank's keys only cannot be gathered, got "
            f"{tuple(mask.shape)} for {k.shape[1]} local of {k_all.shape[1]} keys"
        )
    return _sdpa(q, k_all, v_all, m_all, scale)


def _symmetric_padding(mask: torch.Tensor, seq_q: int) -> torch.Tensor | None:
    """``valid (batch, seq)`` when a bool (batch, 1, seq, seq) mask over the rank's own tokens is
    ``valid_q & valid_k`` (read off its diagonal and checked), else None."""
    if mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[2] != seq_q or mask.shape[3] != seq_q:
        return None
    valid = torch.diagonal(mask[:, 0], dim1=1, dim2=2)
    if not torch.equal(mask[:, 0], valid[:, :, None] & valid[:, None, :]):
        return None
    return valid


def xstage_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    _parallel_config: AttentionContext | None = None,
) -> torch.Tensor:
    """Attention over the whole (sharded) sequence for the rank's queries.

    query: (batch, seq_q_local, heads, head_dim); key, value: (batch, seq_k_local, heads_kv, head_dim)
    laid out as ``_parallel_config.kv_layout`` says. Returns (batch, seq_q_local, heads, head_dim).
    """
    ctx = _parallel_config
    if dropout_p != 0.0 or is_causal:
        raise NotImplementedError(
            f"xstage attention is full non-causal attention without dropout, got dropout_p={dropout_p}, "
            f"is_causal={is_causal}"
        )
    if key.shape[2] != query.shape[2]:
        if query.shape[2] % key.shape[2] != 0:
            raise ValueError(f"expected query heads divisible by kv heads, got {query.shape[2]} and {key.shape[2]}")
        rep = query.shape[2] // key.shape[2]
        key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
    batch, seq_q = query.shape[:2]
    sharded_keys = ctx is not None and ctx.world > 1 and ctx.kv_layout == "sharded"
    mask = None if attn_mask is None else _attention_mask(attn_mask, batch, key.shape[1], sharded_keys=sharded_keys)
    if ctx is None or ctx.world == 1 or ctx.kv_layout == "replicated":
        if ctx is not None and ctx.world == 1:
            out = _world_one(ctx, query, key, value, mask, scale)
            if out is not None:
                return out
            # World 1, serial: exactly diffusers' own SDPA call (no custom-op hop, no .contiguous() copy
            # of the output), so parallelize at world 1 costs nothing over plain diffusers.
        if ctx is not None:
            ctx.schedules.note_path("local", ctx.name)
        return _sdpa(query, key, value, mask, scale)

    tail = 0
    if ctx.kv_layout == "replicated_head":
        head = _replicated_head(ctx, seq_q, key.shape[1])
        if head < 0:  # the prefix's own segments: replicated queries and keys
            ctx.schedules.note_path("local", ctx.name)
            return _sdpa(query, key, value, mask, scale)
        tail = head  # one more split piece for the even-pieces rule
        key = torch.cat([sharding.shard(key[:, :head], 1, ctx.rank, ctx.world), key[:, head:]], dim=1)
        value = torch.cat([sharding.shard(value[:, :head], 1, ctx.rank, ctx.world), value[:, head:]], dim=1)
        if mask is not None:
            mask = torch.cat([sharding.shard(mask[..., :head], 3, ctx.rank, ctx.world), mask[..., head:]], dim=3)
    if ctx.kv_layout == "replicated_tail":
        tail = key.shape[1] - seq_q
        if tail < 0:
            raise ValueError(f"expected keys = queries' shard + replicated tail, got {key.shape[1]} keys for {seq_q} queries")
        key = torch.cat([key[:, :seq_q], sharding.shard(key[:, seq_q:], 1, ctx.rank, ctx.world)], dim=1)
        value = torch.cat([value[:, :seq_q], sharding.shard(value[:, seq_q:], 1, ctx.rank, ctx.world)], dim=1)
        if mask is not None:
            mask = torch.cat([mask[..., :seq_q], sharding.shard(mask[..., seq_q:], 3, ctx.rank, ctx.world)], dim=3)

    if mask is not None:
        return _gather_kv_attention(query, key, value, mask, scale, ctx, "attention mask")
    if not _even_pieces(ctx, *([tail] if tail else [])):
        return _gather_kv_attention(query, key, value, None, scale, ctx, "sequence pieces not divisible by sp")

    seq_k = key.shape[1]
    if seq_q > seq_k:
        # Cross-attention to a shorter sharded sequence (LTX video queries to its text keys, unmasked):
        # the op's one layout cannot hold both; the keys are few, gather them (same on every rank: even pieces).
        return _gather_kv_attention(query, key, value, None, scale, ctx, "more queries than keys (cross-attention)")
    q = query
    if seq_q != seq_k:
        # The op attends q, k, v of one sequence layout: give the extra key rows dummy queries and
        # drop their outputs (costs (seq_k - seq_q) / seq_k extra query rows, no extra exchange).
        q = torch.cat([query, query.new_zeros((batch, seq_k - seq_q, *query.shape[2:]))], dim=1)
    schedule = _schedule_for(ctx, q, seq_k * ctx.world)
    ctx.schedules.note_path("ulysses", ctx.name)
    out = ulysses_attention(q, key, value, group=ctx.group, schedule=schedule, scale=scale, seq_len=seq_k * ctx.world)
    return out[:, :seq_q] if seq_q != seq_k else out
