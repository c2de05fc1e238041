"""Decode final latents x_T with a model's own VAE, as the stock diffusers pipelines do after their loop.

The steps are those of the pipeline's `__call__` once the loop has ended: the family's
`vae_input` (sigmaflight.pipeline.families: sd3 x / scaling_factor + shift_factor; flux unpacks
its [B, seq, C] latents first, then as sd3; wan x / (1 / latents_std) + latents_mean), then
vae.decode, then image_processor.postprocess (video_processor.postprocess_video for a video
family). Built-in and local (`--model-dir`) models go the same way: the family comes from the
pipeline class. Other pipelines raise ValueError saying why (callers draw that reason instead).

`decode_uint8` is the public entry point for images users look at (plots, an outputs
stream): its bytes equal `numpy.asarray` of the stock pipeline's `output_type="pil"` images,
or of each of its `output_type="pil"` video frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sigmaflight.pipeline.families import FAMILIES, family_named
from sigmaflight.pipeline.models import LoadedModel

__all__ = ["DECODABLE_FAMILIES", "decode_latents", "decode_uint8"]

DECODABLE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.vae_input is not None)


def _vae_output(model: LoadedModel, pipeline: Any, latents: torch.Tensor, height: int | None,
                width: int | None) -> torch.Tensor:
    """vae.decode of x_T: images [B, 3, H, W] or video [B, 3, F, H, W], about [-1, 1], the VAE's dtype."""
    vae = getattr(pipeline, "vae", None)
    if vae is None:
        raise ValueError(f"model {model.id!r} has no VAE to decode with")
    vae_input = family_named(model.family).vae_input
    if vae_input is None:
        raise ValueError(f"no decode for the {model.family!r} family ({type(pipeline).__name__}); "
                         f"decodable: {', '.join(DECODABLE_FAMILIES)}")
    with torch.inference_mode():
        z = vae_input(pipeline, vae, latents.to(device=model.device), height, width)
        out: torch.Tensor = vae.decode(z, return_dict=False)[0]
    return out


def decode_latents(model: LoadedModel, latents: torch.Tensor, *, height: int | None = None,
                   width: int | None = None) -> torch.Tensor:
    """float32 in [0, 1] on the CPU: images [B, 3, H, W] (sd3, flux) or video [B, F, 3, H, W] (wan).

    `height`/`width` (pixels) are needed for flux only. No gradients.
    """
    pipeline, _ = model.snapshot()
    out = _vae_output(model, pipeline, latents, height, width)
    with torch.inference_mode():
        out = (out / 2 + 0.5).clamp(0, 1)  # VaeImageProcessor.denormalize, in the VAE's dtype
        if family_named(model.family).is_video:
            out = out.permute(0, 2, 1, 3, 4)  # [B, F, 3, H, W]
        return out.float().cpu()


def decode_uint8(model: LoadedModel, latents: torch.Tensor, *, height: int | None = None,
                 width: int | None = None) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """x_T [B, ...] -> uint8 images [B, H, W, 3] (sd3, flux) or video frames [B, F, H, W, 3] (wan).

    Both equal `numpy.asarray` of what the stock pipeline returns with `output_type="pil"` (the
    contract's "outputs/v1"): the image_processor / video_processor postprocess to "np", then
    (x * 255).round() as their numpy_to_pil does, per image or per frame. (diffusers'
    export_to_video truncates instead: frames written to a video file can differ by 1.)
    Raises ValueError (with the reason) for a model without a decodable VAE.
    """
    pipeline, _ = model.snapshot()
    out = _vae_output(model, pipeline, latents, height, width)
    with torch.inference_mode():
        if family_named(model.family).is_video:
            video = pipeline.video_processor.postprocess_video(out, output_type="np")  # [B, F, H, W, 3]
            return np.asarray((video * 255).round().astype(np.uint8))
        images = pipeline.image_processor.postprocess(out, output_type="np")  # [B, H, W, 3] in [0, 1]
        return np.asarray((images * 255).round().astype(np.uint8))
