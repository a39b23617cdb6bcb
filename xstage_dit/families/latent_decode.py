"""The decode tails of the text-to-image pipelines: step latents -> the VAE's output, as each pipeline's
``__call__`` does it after its denoising loop (the lines under ``if output_type != "latent"``, diffusers 0.42.1).

A family record names its pipeline's tail as ``FamilyRecord.latent_decode``; the server calls it on the latents a
step callback sees (``callback_kwargs["latents"]``) to send a stream's partial images (`server.previews`). Every
function has the signature ``(pipe, latents, height, width) -> image`` where

- latents: the pipeline's own layout at a step callback (packed ``(batch, tokens, channels)`` for FLUX,
  Qwen-Image, ...; ``(batch, channels, h, w)`` for SD3, Sana, ...),
- height, width: the request's pixel size (what the pipeline was called with),
- image: ``(batch, channels, height, width)``, the VAE decoder's output before ``image_processor.postprocess``
  (values around [-1, 1]).

Applied to the last step's latents, each returns what the pipeline itself decodes (tests/server/
test_previews.py holds that equality for every image family). No diffusers import here: only the pipeline's
own methods (its private latent-layout ones through `_diffusers_private.latent_layout`) and its VAE's config.
"""

from __future__ import annotations

import torch

from xstage_dit._diffusers_private import latent_layout


def _decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    return vae.decode(latents.to(device=_vae_device(vae)), return_dict=False)[0]


def _vae_device(vae) -> torch.device:
    return next(vae.parameters()).device


def scaled_shifted(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """SD3, HiDream, Lumina 2, Z-Image: ``latents / scaling_factor + shift_factor`` (in the VAE's dtype)."""
    config = pipe.vae.config
    return _decode(pipe, latents.to(pipe.vae.dtype) / config.scaling_factor + config.shift_factor)


def scaled(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Sana, HunyuanImage 2.1: ``latents / scaling_factor``; Sana's resolution binning crops back to the size."""
    image = _decode(pipe, latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor)
    if tuple(image.shape[-2:]) != (height, width) and hasattr(pipe.image_processor, "resize_and_crop_tensor"):
        image = pipe.image_processor.resize_and_crop_tensor(image, width, height)
    return image


def flux(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """FLUX.1: unpack the 2x2 patches, then ``/ scaling_factor + shift_factor``."""
    config = pipe.vae.config
    latents = latent_layout(pipe, "_unpack_latents")(latents, height, width, pipe.vae_scale_factor)
    return _decode(pipe, latents / config.scaling_factor + config.shift_factor)


def flux2(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """FLUX.2: scatter the tokens by their grid ids, undo the VAE's batch norm, unpatchify."""
    rows, cols = height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2)
    grid = latents.new_empty(latents.shape[0], 1, rows, cols)
    ids = latent_layout(pipe, "_prepare_latent_ids")(grid).to(latents.device)
    latents = latent_layout(pipe, "_unpack_latents_with_ids")(latents, ids)
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(latents.device, latents.dtype)
    return _decode(pipe, latent_layout(pipe, "_unpatchify_latents")(latents * std + mean))


def _qwen_stats(pipe, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = pipe.vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
    std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
    return mean, std


def qwenimage(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Qwen-Image: unpack to one video frame, ``latents / (1 / std) + mean``, decode, take the frame."""
    latents = latent_layout(pipe, "_unpack_latents")(latents, height, width, pipe.vae_scale_factor).to(pipe.vae.dtype)
    mean, std = _qwen_stats(pipe, latents)
    return _decode(pipe, latents / (1.0 / std) + mean)[:, :, 0]


def nucleusmoe(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """NucleusMoE-Image: Qwen-Image's tail with the transformer's patch size in the unpacking."""
    patch = pipe.transformer.config.patch_size
    unpack = latent_layout(pipe, "_unpack_latents")
    latents = unpack(latents, height, width, patch, pipe.vae_scale_factor).to(pipe.vae.dtype)
    mean, std = _qwen_stats(pipe, latents)
    return _decode(pipe, latents / (1.0 / std) + mean)[:, :, 0]


def qwenimage21(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Qwen-Image 2.1: unpack to one video frame, ``latents * std + mean``, decode, take the frame."""
    latents = latent_layout(pipe, "_unpack_latents")(latents, height, width, pipe.vae_scale_factor).to(pipe.vae.dtype)
    mean, std = _qwen_stats(pipe, latents)
    return _decode(pipe, latents * std + mean)[:, :, 0]
