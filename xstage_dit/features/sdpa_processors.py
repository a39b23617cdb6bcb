"""xstage replacements for the diffusers 0.42 processors of SD3 and CogVideoX, which call
``F.scaled_dot_product_attention`` themselves (so the attention-backend registry cannot reach them).

Each reproduces its original's math line for line and calls `xstage_attention` (layout
``(batch, seq, heads, head_dim)``) where the original calls SDPA on ``(batch, heads, seq, head_dim)``.
They carry ``_attention_backend`` / ``_parallel_config`` like diffusers' dispatching processors, so
`sequence_parallel` configures them alike. The family records name them (``"module:attribute"`` processor swaps).
"""

from __future__ import annotations

import torch

from xstage_dit.features.attention_backend import xstage_attention


class _Routed:
    _attention_backend = None
    _parallel_config = None

    @classmethod
    def from_processor(cls, processor):
        return cls()

    def _attend(self, query, key, value, mask=None):
        """q, k, v: (batch, heads, seq, head_dim) as the original SDPA call had them."""
        out = xstage_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask,
                               _parallel_config=self._parallel_config)
        return out.transpose(1, 2)


def _project_heads(attn, hidden_states, batch_size: int):
    """q, k, v of ``hidden_states`` as (batch, heads, seq, head_dim), with the module's q/k norms, and head_dim:
    the projection both diffusers processors below start with."""
    query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    head_dim = key.shape[-1] // attn.heads
    query, key, value = (t.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    return query, key, value, head_dim


class XStageJointAttnProcessor(_Routed):
    """``JointAttnProcessor2_0`` (SD3 / SD3.5 joint and dual attention) routed to xstage."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        query, key, value, head_dim = _project_heads(attn, hidden_states, batch_size)
        if encoder_hidden_states is not None:
            eq = attn.add_q_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ek = attn.add_k_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ev = attn.add_v_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query = torch.cat([query, eq], dim=2)
            key = torch.cat([key, ek], dim=2)
            value = torch.cat([value, ev], dim=2)

        hidden_states = self._attend(query, key, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = hidden_states[:, : residual.shape[1]], hidden_states[:, residual.shape[1]:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class XStageCogVideoXAttnProcessor(_Routed):
    """``CogVideoXAttnProcessor2_0`` routed to xstage: joint [text, video] attention, RoPE on the video part."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch_size, sequence_length, _ = hidden_states.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        query, key, value, head_dim = _project_heads(attn, hidden_states, batch_size)
        if image_rotary_emb is not None:
            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)

        hidden_states = self._attend(query, key, value, attention_mask)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
        )
        return hidden_states, encoder_hidden_states
