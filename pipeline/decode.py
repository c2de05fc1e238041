"""Decode final latents x_T into images with a model's own VAE (what the pipeline does after the loop)."""

from __future__ import annotations

import torch

from pipeline.models import LoadedModel

__all__ = ["decode_latents"]


def decode_latents(model: LoadedModel, latents: torch.Tensor, *, height: int, width: int) -> torch.Tensor:
    """float32 images [B, 3, H, W] in [0, 1] from x_T [B, *latent_shape] (image families: sd3, flux).

    sd3: x / scaling_factor + shift_factor through vae.decode; flux: the packed [B, seq, C]
    latents are unpacked first (FluxPipeline._unpack_latents). No gradients.
    """
    pipeline, _ = model.snapshot()
    vae = pipeline.vae
    if model.family == "flux":
        latents = pipeline._unpack_latents(latents, height, width, pipeline.vae_scale_factor)  # [B, C, h, w]
    elif model.family != "sd3":
        raise ValueError(f"decoding is available for the sd3 and flux families, not {model.family!r}")
    with torch.inference_mode():
        z = latents.to(device=model.device, dtype=vae.dtype) / vae.config.scaling_factor  # [B, C, h, w]
        z = z + (vae.config.shift_factor or 0.0)
        images = vae.decode(z, return_dict=False)[0]  # [B, 3, H, W] in about [-1, 1]
    return (images.float().cpu() / 2 + 0.5).clamp(0, 1)
