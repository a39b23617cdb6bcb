"""Random inputs of one FLUX transformer denoising step, shaped as `FluxPipeline` makes them.

Used by the step benchmark and the GPU tests: a transformer step needs no text encoder, only prompt
embeddings of the right shapes.
"""

from __future__ import annotations

import torch


def image_ids(h: int, w: int, *, device, dtype) -> torch.Tensor:
    """Position ids of packed latents, (h*w, 3): (0, row, column), as FluxPipeline makes them."""
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(h * w, 3)


def transformer_inputs(config, *, height: int, width: int, text_tokens: int = 512, batch: int = 1,
                       dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0,
                       vae_scale_factor: int = 8) -> dict:
    """Keyword arguments of ``FluxTransformer2DModel.forward`` for a ``height x width`` image.

    hidden_states: (batch, (H/16)*(W/16), in_channels) packed latents; encoder_hidden_states:
    (batch, text_tokens, joint_attention_dim); pooled_projections: (batch, pooled_projection_dim);
    img_ids: ((H/16)*(W/16), 3); txt_ids: (text_tokens, 3); timestep, guidance: (batch,).
    """
    multiple = vae_scale_factor * 2
    for label, value in (("height", height), ("width", width)):
        if value < multiple or value % multiple:
            raise ValueError(f"expected {label} to be a positive multiple of {multiple}, got {value}")
    if text_tokens < 1 or batch < 1:
        raise ValueError(f"expected text_tokens >= 1 and batch >= 1, got {text_tokens} and {batch}")
    gen = torch.Generator(device).manual_seed(seed)
    h, w = height // multiple, width // multiple
    num_image_tokens = h * w

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    inputs = dict(
        hidden_states=randn(batch, num_image_tokens, config.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, config.joint_attention_dim),
        pooled_projections=randn(batch, config.pooled_projection_dim),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        img_ids=image_ids(h, w, device=device, dtype=dtype),
        txt_ids=torch.zeros(text_tokens, 3, device=device, dtype=dtype),
    )
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5, device=device, dtype=torch.float32)
    return inputs
