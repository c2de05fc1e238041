"""Model families: everything sigmaflight knows about one kind of diffusers pipeline, in one place.

A `ModelFamily` is one row of the table: how a pipeline is recognised (its class-name prefix),
its geometry (size multiple, latent shape, the defaults a local directory gets), the batch
arguments of its transformer and its text encoders (per-row model calls), how its conditioning
is named, recorded and encoded, and how its final latents reach the VAE. The modules that run a
rollout ask the table; none of them branches on a family's name:

| module | asks the family for |
| --- | --- |
| `models` | `family_of_pipeline` (local and hub pipelines), `size_multiple`, `local_defaults` |
| `validation` | `latent_shape` |
| `calls` | `transformer_batch_args`, `text_encoders` (per-row model calls) |
| `conditioning` | `conditioning_names`, `required_conditioning`, `paired_conditioning`, `name_conditioning`, `encode_prompts` |
| `decode` | `vae_input`, `is_video` |

Adding a family: write its functions and one `ModelFamily(...)` below, and add it to `FAMILIES`.
A pipeline that matches no family is `OTHER`: it runs (generic image geometry) but has no
per-row calls, conditioning, branches or decode.

Each function takes the pipeline object (duck-typed, as the stock diffusers classes are), never a
`LoadedModel`, so this module imports nothing else of the package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["FAMILIES", "FLUX", "OTHER", "SD3", "WAN", "ModelFamily", "LocalDefaults", "family_named",
           "family_of_pipeline"]

Calls = list[dict[str, torch.Tensor]]
"""The text inputs of one step's transformer calls, as `conditioning.TransformerRecorder` keeps them."""


class PromptEncoder(Protocol):
    def __call__(self, pipe: Any, *, prompts: list[str], negative_prompt: str | None, cfg: bool,
                 device: torch.device, extra: dict[str, Any]) -> dict[str, torch.Tensor]: ...


VaeInput = Callable[[Any, Any, torch.Tensor, "int | None", "int | None"], torch.Tensor]
"""(pipeline, vae, x_T, height, width) -> what `vae.decode` takes."""


@dataclass(frozen=True, kw_only=True)
class LocalDefaults:
    """Request defaults of a pipeline loaded from a directory or the hub (not a built-in's)."""

    size: int
    guidance_scale: float
    num_frames: int | None


def _cpu(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu").clone().contiguous()


# --------------------------------------------------------------------------- generic image geometry

def _image_size_multiple(pipeline: Any) -> int:
    """VAE factor x the transformer's (int) patch size."""
    vae = getattr(pipeline, "vae_scale_factor", 8)
    patch = getattr(getattr(pipeline, "transformer", None), "config", {}).get("patch_size", 1)
    return int(vae) * int(patch if isinstance(patch, int) else 1)


def _image_latent_shape(pipe: Any, height: int, width: int, num_frames: int) -> tuple[int, ...]:
    vae = int(getattr(pipe, "vae_scale_factor", 8))
    cin = int(pipe.transformer.config.in_channels)
    return (cin, height // vae, width // vae)  # [C, h, w]


def _sample_size(pipeline: Any) -> int:
    """default_sample_size x VAE factor: the pixel size the pipeline's own `__call__` defaults to."""
    vae = int(getattr(pipeline, "vae_scale_factor", 8))
    return int(getattr(pipeline, "default_sample_size", 64)) * vae


def _scaled_vae_input(pipeline: Any, vae: Any, z: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor:
    """x / scaling_factor + shift_factor in the VAE's dtype (StableDiffusion3Pipeline after its loop)."""
    z = z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)  # [B, C, h, w]
    return z.to(dtype=vae.dtype)


# --------------------------------------------------------------------------- the table row

@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One family of diffusers pipelines. Empty tuples / None mean "not available for this family"."""

    name: str
    """The family name: `LoadedModel.family`, GET /v1/models `family`, the "model loaded" log line."""
    class_prefix: str
    """A pipeline whose class name starts with this belongs to the family (e.g. "Flux": FluxPipeline)."""
    is_video: bool = False
    """Video pipeline: `num_frames`, `num_videos_per_prompt`, `.frames`, the video processor."""
    size_multiple: Callable[[Any], int] = _image_size_multiple
    """height and width must be multiples of this (pixels), from the pipeline."""
    latent_shape: Callable[[Any, int, int, int], tuple[int, ...]] = _image_latent_shape
    """Per-sample latent shape as the transformer consumes it: (pipeline, height, width, num_frames)."""
    loop_dtype: torch.dtype | None = None
    """The dtype the stock loop draws x_0 in whatever the transformer's (Wan: float32, and the
    scheduler's steps then give the transformer's dtype); None: the transformer's own."""
    local_size: Callable[[Any], int] = _sample_size
    """Default height and width of a local pipeline."""
    local_guidance_scale: float = 5.0
    local_num_frames: int | None = None
    transformer_batch_args: tuple[str, ...] = ()
    """Batch arguments of the transformer call, sliced row by row with per-sample model calls."""
    text_encoders: tuple[str, ...] = ()
    """Text encoder components, called as encoder(input_ids, ...) with batch-first positional tensors."""
    conditioning_names: tuple[str, ...] = ()
    """The stock `__call__` keywords that take the transformer's text tensors (the negative ones only with CFG)."""
    required_conditioning: tuple[str, ...] = ()
    """Names a conditioning set must hold."""
    paired_conditioning: tuple[str, ...] = ()
    """Names that come all together or not at all."""
    name_conditioning: Callable[[Calls, int], dict[str, torch.Tensor]] | None = None
    """(recorded calls of the first step, B) -> conditioning, B rows each, on the CPU."""
    encode_prompts: PromptEncoder | None = None
    """The pipeline's own `encode_prompt`, called as its `__call__` calls it, one row per prompt."""
    vae_input: VaeInput | None = None
    """x_T -> what `vae.decode` takes, as the stock pipeline computes it after its loop."""

    def local_defaults(self, pipeline: Any) -> LocalDefaults:
        return LocalDefaults(size=self.local_size(pipeline), guidance_scale=self.local_guidance_scale,
                             num_frames=self.local_num_frames)


# --------------------------------------------------------------------------- sd3: StableDiffusion3Pipeline

def _sd3_name_conditioning(calls: Calls, batch: int) -> dict[str, torch.Tensor]:
    ehs, pooled = calls[0]["encoder_hidden_states"], calls[0]["pooled_projections"]
    if ehs.shape[0] == 2 * batch:  # CFG: torch.cat([negative, positive])
        return {
            "prompt_embeds": _cpu(ehs[batch:]),
            "pooled_prompt_embeds": _cpu(pooled[batch:]),
            "negative_prompt_embeds": _cpu(ehs[:batch]),
            "negative_pooled_prompt_embeds": _cpu(pooled[:batch]),
        }
    return {"prompt_embeds": _cpu(ehs), "pooled_prompt_embeds": _cpu(pooled)}


def _sd3_encode_prompts(pipe: Any, *, prompts: list[str], negative_prompt: str | None, cfg: bool,
                        device: torch.device, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    pe, ne, pp, npp = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                         num_images_per_prompt=1, do_classifier_free_guidance=cfg,
                                         negative_prompt=negative_prompt, **extra)
    out = {"prompt_embeds": pe, "pooled_prompt_embeds": pp}
    if cfg:
        out.update(negative_prompt_embeds=ne, negative_pooled_prompt_embeds=npp)
    return out


SD3 = ModelFamily(
    name="sd3",
    class_prefix="StableDiffusion3",
    transformer_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections"),
    text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
    conditioning_names=("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                        "negative_pooled_prompt_embeds"),
    required_conditioning=("prompt_embeds", "pooled_prompt_embeds"),
    paired_conditioning=("negative_prompt_embeds", "negative_pooled_prompt_embeds"),
    name_conditioning=_sd3_name_conditioning,
    encode_prompts=_sd3_encode_prompts,
    vae_input=_scaled_vae_input,
)


# --------------------------------------------------------------------------- flux: FluxPipeline (packed latents)

def _flux_size_multiple(pipeline: Any) -> int:
    """VAE factor x 2: FluxPipeline packs 2x2 latent patches into its sequence."""
    return int(getattr(pipeline, "vae_scale_factor", 8)) * 2


def _flux_latent_shape(pipe: Any, height: int, width: int, num_frames: int) -> tuple[int, ...]:
    vae = int(getattr(pipe, "vae_scale_factor", 8))
    cin = int(pipe.transformer.config.in_channels)
    lh, lw = 2 * (height // (vae * 2)), 2 * (width // (vae * 2))
    return ((lh // 2) * (lw // 2), cin)  # [seq, C]: packed


def _flux_name_conditioning(calls: Calls, batch: int) -> dict[str, torch.Tensor]:
    return {"prompt_embeds": _cpu(calls[0]["encoder_hidden_states"]),
            "pooled_prompt_embeds": _cpu(calls[0]["pooled_projections"])}


def _flux_encode_prompts(pipe: Any, *, prompts: list[str], negative_prompt: str | None, cfg: bool,
                         device: torch.device, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    pe, pp, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device, num_images_per_prompt=1, **extra)
    return {"prompt_embeds": pe, "pooled_prompt_embeds": pp}


def _flux_vae_input(pipeline: Any, vae: Any, z: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor:
    if height is None or width is None:
        raise ValueError("height and width are needed to unpack FLUX latents")
    z = pipeline._unpack_latents(z, height, width, pipeline.vae_scale_factor)  # [B, C, h, w]
    return _scaled_vae_input(pipeline, vae, z, height, width)


FLUX = ModelFamily(
    name="flux",
    class_prefix="Flux",
    size_multiple=_flux_size_multiple,
    latent_shape=_flux_latent_shape,
    local_size=lambda pipeline: 32 * _flux_size_multiple(pipeline),
    local_guidance_scale=3.5,
    transformer_batch_args=("hidden_states", "timestep", "guidance", "pooled_projections", "encoder_hidden_states"),
    text_encoders=("text_encoder", "text_encoder_2"),
    conditioning_names=("prompt_embeds", "pooled_prompt_embeds"),
    required_conditioning=("prompt_embeds", "pooled_prompt_embeds"),
    name_conditioning=_flux_name_conditioning,
    encode_prompts=_flux_encode_prompts,
    vae_input=_flux_vae_input,
)


# --------------------------------------------------------------------------- wan: WanPipeline (video)

def _wan_size_multiple(pipeline: Any) -> int:
    """Spatial VAE factor x the transformer's (t, h, w) patch."""
    patch = tuple(pipeline.transformer.config.patch_size)
    return int(pipeline.vae_scale_factor_spatial) * int(max(patch[1], patch[2]))


def _wan_latent_shape(pipe: Any, height: int, width: int, num_frames: int) -> tuple[int, ...]:
    cin = int(pipe.transformer.config.in_channels)
    sv = int(getattr(pipe, "vae_scale_factor_spatial", 8))
    st = int(getattr(pipe, "vae_scale_factor_temporal", 4))
    return (cin, (num_frames - 1) // st + 1, height // sv, width // sv)  # [C, f, h, w]


def _wan_name_conditioning(calls: Calls, batch: int) -> dict[str, torch.Tensor]:
    out = {"prompt_embeds": _cpu(calls[0]["encoder_hidden_states"])}
    if len(calls) > 1:  # WanPipeline: cond call, then the uncond call (CFG)
        out["negative_prompt_embeds"] = _cpu(calls[1]["encoder_hidden_states"])
    return out


def _wan_encode_prompts(pipe: Any, *, prompts: list[str], negative_prompt: str | None, cfg: bool,
                        device: torch.device, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    pe, ne = pipe.encode_prompt(prompt=prompts, negative_prompt=negative_prompt, do_classifier_free_guidance=cfg,
                                num_videos_per_prompt=1, device=device, **extra)
    dtype = pipe.transformer.dtype  # WanPipeline.__call__ casts to the transformer's dtype
    return {"prompt_embeds": pe.to(dtype), **({"negative_prompt_embeds": ne.to(dtype)} if cfg else {})}


def _wan_vae_input(pipeline: Any, vae: Any, z: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor:
    z = z.to(dtype=vae.dtype)  # [B, C, f, h, w]
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return z / inv_std + mean


WAN = ModelFamily(
    name="wan",
    class_prefix="Wan",
    is_video=True,
    size_multiple=_wan_size_multiple,
    latent_shape=_wan_latent_shape,
    loop_dtype=torch.float32,  # WanPipeline.prepare_latents(..., torch.float32, ...)
    local_num_frames=9,
    transformer_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
    text_encoders=("text_encoder",),
    conditioning_names=("prompt_embeds", "negative_prompt_embeds"),
    required_conditioning=("prompt_embeds",),
    name_conditioning=_wan_name_conditioning,
    encode_prompts=_wan_encode_prompts,
    vae_input=_wan_vae_input,
)


# --------------------------------------------------------------------------- the table

OTHER = ModelFamily(name="other", class_prefix="")
"""Any other flow-match pipeline: generic image geometry; no per-row calls, conditioning, branches or decode."""

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (SD3, FLUX, WAN)}
"""The known families by name, in the order they are tried."""


def family_named(name: str) -> ModelFamily:
    """The family called `name` (`LoadedModel.family`); OTHER for "other" or any unknown name."""
    return FAMILIES.get(name, OTHER)


def family_of_pipeline(pipeline: Any) -> ModelFamily:
    """The family of a pipeline object, by its class name; OTHER when none matches."""
    name = type(pipeline).__name__
    for family in FAMILIES.values():
        if name.startswith(family.class_prefix):
            return family
    return OTHER
