"""xstage replacements for attention processors that call SDPA directly instead of going through
diffusers' ``dispatch_attention_fn`` (so the backend registry cannot reach them).

Each replacement reproduces the original processor's math line for line and calls
`xstage_attention` (the same function the ``xstage_ulysses`` backend runs) where the original calls
``F.scaled_dot_product_attention``. They carry ``_attention_backend`` / ``_parallel_config`` like the
diffusers processors, so `sequence_parallel` treats them alike.
"""

from __future__ import annotations

import torch

from xstage_dit.features.attention_backend import xstage_attention


class XStageHiDreamAttnProcessor:
    """HiDream's ``HiDreamAttnProcessor`` with the attention call routed to xstage (diffusers 0.42)."""

    _attention_backend = None
    _parallel_config = None

    @classmethod
    def from_processor(cls, processor) -> "XStageHiDreamAttnProcessor":
        return cls()

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        hidden_states_masks: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor = None,
        *args,
        **kwargs,
    ):
        from diffusers.models.transformers.transformer_hidream_image import apply_rope

        dtype = hidden_states.dtype
        batch_size = hidden_states.shape[0]

        query_i = attn.q_rms_norm(attn.to_q(hidden_states)).to(dtype=dtype)
        key_i = attn.k_rms_norm(attn.to_k(hidden_states)).to(dtype=dtype)
        value_i = attn.to_v(hidden_states)

        inner_dim = key_i.shape[-1]
        head_dim = inner_dim // attn.heads

        query_i = query_i.view(batch_size, -1, attn.heads, head_dim)
        key_i = key_i.view(batch_size, -1, attn.heads, head_dim)
        value_i = value_i.view(batch_size, -1, attn.heads, head_dim)
        if hidden_states_masks is not None:
            key_i = key_i * hidden_states_masks.view(batch_size, -1, 1, 1)

        if not attn.single:
            query_t = attn.q_rms_norm_t(attn.to_q_t(encoder_hidden_states)).to(dtype=dtype)
            key_t = attn.k_rms_norm_t(attn.to_k_t(encoder_hidden_states)).to(dtype=dtype)
            value_t = attn.to_v_t(encoder_hidden_states)

            query_t = query_t.view(batch_size, -1, attn.heads, head_dim)
            key_t = key_t.view(batch_size, -1, attn.heads, head_dim)
            value_t = value_t.view(batch_size, -1, attn.heads, head_dim)

            num_image_tokens = query_i.shape[1]
            num_text_tokens = query_t.shape[1]
            query = torch.cat([query_i, query_t], dim=1)
            key = torch.cat([key_i, key_t], dim=1)
            value = torch.cat([value_i, value_t], dim=1)
        else:
            query, key, value = query_i, key_i, value_i

        if query.shape[-1] == image_rotary_emb.shape[-3] * 2:
            query, key = apply_rope(query, key, image_rotary_emb)
        else:
            query_1, query_2 = query.chunk(2, dim=-1)
            key_1, key_2 = key.chunk(2, dim=-1)
            query_1, key_1 = apply_rope(query_1, key_1, image_rotary_emb)
            query = torch.cat([query_1, query_2], dim=-1)
            key = torch.cat([key_1, key_2], dim=-1)

        hidden_states = xstage_attention(query, key, value, _parallel_config=self._parallel_config)

        hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if not attn.single:
            hidden_states_i, hidden_states_t = torch.split(hidden_states, [num_image_tokens, num_text_tokens], dim=1)
            return attn.to_out(hidden_states_i), attn.to_out_t(hidden_states_t)
        return attn.to_out(hidden_states)


def qwenimage21_processor(processor):
    """Qwen-Image 2.1's ``QwenImage21AttnProcessor`` whose every attention call reaches the xstage backend.

    Its block-causal prefill calls ``dispatch_attention_fn(..., backend=None)`` once per prefix segment and
    once for the target image: ``backend=None`` means diffusers' active backend, not the processor's
    ``_attention_backend`` (which only its cached decode reads). The replacement runs the original
    ``__call__`` unchanged with the processor's backend made the active one for the call's duration.
    """
    from diffusers import attention_backend
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    class XStageQwenImage21AttnProcessor(QwenImage21AttnProcessor):
        def __call__(self, attn, hidden_states, **kwargs):
            with attention_backend(self._attention_backend):
                return super().__call__(attn, hidden_states, **kwargs)

    return XStageQwenImage21AttnProcessor()
