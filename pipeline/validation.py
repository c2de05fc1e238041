"""Request validation and size estimates: what `run_rollout` refuses, and what it will hold.

`validate_spec` raises `RolloutInputError(field, reason)` naming the first bad field with the
request path control/ reports as `details[].loc` ("sampler.noise_level", "guidance_scale",
...). `latent_shape` / `estimate_latent_bytes` size a rollout from the request alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from sigmaflight.pipeline.conditioning import check_conditioning
from sigmaflight.pipeline.families import family_named
from sigmaflight.pipeline.models import LoadedModel, max_image_size, max_num_frames
from sigmaflight.pipeline.seeds import SEED_MASK
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec

__all__ = [
    "GUIDANCE_SCALE_MAX",
    "LATENT_DTYPES",
    "validate_spec",
    "captured_steps",
    "requested_sde_steps",
    "capture_dtype",
    "latent_shape",
    "estimate_latent_bytes",
    "loop_latent_bytes",
]

LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GUIDANCE_SCALE_MAX = 100.0
"""Largest accepted CFG scale. Practical scales are 1-20; far larger ones only overflow the
combined velocity (1e308 made NaN latents) and are refused up front."""


def captured_steps(spec: RolloutSpec) -> tuple[int, ...]:
    """Absolute latent indices the rollout captures: `return_steps`, or all 0..T."""
    t = spec.num_inference_steps
    return tuple(range(spec.start_step, t + 1)) if spec.return_steps is None else tuple(spec.return_steps)


def requested_sde_steps(spec: RolloutSpec) -> tuple[int, ...]:
    """Requested stochastic transitions, ascending (before dropping std-0 ones; "ode": none)."""
    if spec.sampler.type == "ode":
        return ()
    t = spec.num_inference_steps
    if spec.sampler.sde_steps is None:
        return tuple(range(spec.start_step, t))
    return tuple(sorted(spec.sampler.sde_steps))


def _indices_ok(values: Sequence[int], hi: int, lo: int = 0) -> str | None:
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        return "must be integers"
    if any(v < lo or v > hi for v in values):
        return f"each must be in {lo}..{hi}"
    if len(set(values)) != len(values):
        return "each index at most once"
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate_sampler(spec: RolloutSpec) -> None:
    s, t = spec.sampler, spec.num_inference_steps
    if s.type not in ("sde", "cps", "ode"):
        raise RolloutInputError("sampler.type", f"unknown kernel {s.type!r}; use 'sde', 'cps' or 'ode'")
    if not _is_number(s.noise_level) or s.noise_level < 0:
        raise RolloutInputError("sampler.noise_level", "must be a finite number >= 0")
    if s.type == "cps" and s.noise_level > 1:
        # std = sigma' sin(a pi / 2): a in [0, 1] spans std 0..sigma'; beyond 2 it turns negative.
        raise RolloutInputError("sampler.noise_level", f"{s.noise_level} is outside [0, 1], the range of the cps kernel")
    if s.log_prob not in ("density", "no_const"):
        raise RolloutInputError("sampler.log_prob", f"unknown log_prob {s.log_prob!r}; use 'density' or 'no_const'")
    if s.sde_steps is not None:
        why = _indices_ok(s.sde_steps, t - 1, spec.start_step)
        if why:
            raise RolloutInputError("sampler.sde_steps", f"{why} (absolute transition indices, T={t})")


def _validate_size(model: LoadedModel, spec: RolloutSpec) -> None:
    d = model.defaults
    for name in ("height", "width"):
        value = getattr(spec, name)
        if value is None:
            continue
        if not isinstance(value, int) or value <= 0 or value % d.size_multiple:
            raise RolloutInputError(name, f"must be a positive multiple of {d.size_multiple} for {model.id}")
        limit = max_image_size(model.pipeline)
        if limit is not None and value > limit:
            raise RolloutInputError(name, f"{value} exceeds {limit}, the largest size {model.id}'s position embedding covers")
    if spec.num_frames is not None:
        if not d.is_video:
            raise RolloutInputError("num_frames", f"{model.id} is an image model")
        if spec.num_frames < 1 or (spec.num_frames - 1) % 4:
            raise RolloutInputError("num_frames", "must be 4k + 1")
        frames = max_num_frames(model.pipeline)
        if frames is not None and spec.num_frames > frames:
            raise RolloutInputError("num_frames", f"{spec.num_frames} exceeds {frames}, the most frames {model.id}'s "
                                    "position embedding covers")


def _validate_seeds(spec: RolloutSpec) -> None:
    if spec.seeds is not None:
        if len(spec.seeds) != spec.num_samples:
            raise RolloutInputError("seeds", f"need exactly one seed per sample ({spec.num_samples}), got {len(spec.seeds)}")
        if any(not isinstance(x, int) or x < 0 or x > SEED_MASK for x in spec.seeds):
            raise RolloutInputError("seeds", "each seed must be an integer in 0..2**63-1")
    if spec.seed is not None and not isinstance(spec.seed, int):
        raise RolloutInputError("seed", "must be an integer")


def validate_spec(model: LoadedModel, spec: RolloutSpec) -> None:
    """Raise RolloutInputError naming the first bad field; None when the request can run.

    `return_steps` must be ascending and unique (the stream holds them ascending);
    `sampler.sde_steps` must be unique, any order; cps `noise_level` in [0, 1];
    `guidance_scale` finite in [0, GUIDANCE_SCALE_MAX].
    """
    if not spec.prompts:
        raise RolloutInputError("prompts", "at least one prompt is required")
    if not all(isinstance(p, str) for p in spec.prompts):
        raise RolloutInputError("prompts", "prompts must be strings")
    if spec.num_outputs_per_prompt < 1:
        raise RolloutInputError("num_outputs_per_prompt", "must be >= 1")
    t = spec.num_inference_steps
    if not isinstance(t, int) or t < 1:
        raise RolloutInputError("num_inference_steps", "must be an integer >= 1")
    if spec.branch_from is not None:
        _validate_branch(model, spec)
    _validate_sampler(spec)
    if spec.return_steps is not None:
        why = _indices_ok(spec.return_steps, t, spec.start_step)
        if why:
            raise RolloutInputError("return.steps", f"{why} (absolute latent indices, T={t})")
        if list(spec.return_steps) != sorted(spec.return_steps):
            raise RolloutInputError("return.steps", "must be ascending")
    if spec.latent_dtype not in ("native", *LATENT_DTYPES):
        raise RolloutInputError("latent_dtype", f"unknown latent dtype {spec.latent_dtype!r}")
    _validate_size(model, spec)
    g = spec.guidance_scale
    if g is not None and (not _is_number(g) or not 0 <= g <= GUIDANCE_SCALE_MAX):
        raise RolloutInputError("guidance_scale", f"must be a finite number in [0, {GUIDANCE_SCALE_MAX:g}]")
    _validate_seeds(spec)
    if spec.return_conditioning and not family_named(model.family).conditioning_names:
        raise RolloutInputError("return.conditioning", f"not available for family {model.family!r}")


def _validate_branch(model: LoadedModel, spec: RolloutSpec) -> None:
    """`branch_from.*`: k in 0..T-1, one prompt index and one x_k row per parent sample, the
    parent's schedule with T+1 sigmas and T timesteps."""
    b, t = spec.branch_from, spec.num_inference_steps
    assert b is not None
    if not family_named(model.family).conditioning_names:
        raise RolloutInputError("branch_from", f"branch rollouts are not available for family {model.family!r}")
    if not isinstance(b.step, int) or isinstance(b.step, bool) or not 0 <= b.step < t:
        raise RolloutInputError("branch_from.step", f"{b.step!r} is out of range: must be in 0..{t - 1} (T={t})")
    if not b.samples or any(not isinstance(j, int) or j < 0 for j in b.samples):
        raise RolloutInputError("branch_from.samples", "must be one or more parent sample indices >= 0")
    if len(b.prompt_index) != len(b.samples) or any(not 0 <= j < len(spec.prompts) for j in b.prompt_index):
        raise RolloutInputError("branch_from.prompt_index", f"need one index into the {len(spec.prompts)} prompts per parent sample")
    shape = (len(b.samples), *latent_shape(model, spec))
    if not isinstance(b.latents, torch.Tensor) or tuple(b.latents.shape) != shape:
        got = tuple(b.latents.shape) if isinstance(b.latents, torch.Tensor) else type(b.latents).__name__
        raise RolloutInputError("branch_from.latents", f"must be the parent's x_k rows {shape}, got {got}")
    if tuple(b.sigmas.shape) != (t + 1,) or tuple(b.timesteps.shape) != (t,):
        raise RolloutInputError("branch_from.sigmas", f"the parent's schedule must have T+1 = {t + 1} sigmas and T timesteps")
    if b.conditioning is not None:
        check_conditioning(model.family, b.conditioning, len(b.samples), field="branch_from.conditioning")


def capture_dtype(model: LoadedModel, spec: RolloutSpec) -> torch.dtype:
    """dtype of the stored latents: the requested lossy one, or ("native") the widest the loop
    holds them in: the model's, or its family's loop dtype when that is wider (a bf16 Wan's x_0 is
    float32, its later x_i bfloat16: all stored as float32, each exactly)."""
    if spec.latent_dtype != "native":
        return LATENT_DTYPES[spec.latent_dtype]
    return loop_dtype(model)


def loop_dtype(model: LoadedModel) -> torch.dtype:
    """The widest dtype the denoising loop holds latents in: the model's, or its family's loop
    dtype when that is wider."""
    loop = family_named(model.family).loop_dtype
    return model.dtype if loop is None else torch.promote_types(model.dtype, loop)


def loop_latent_bytes(model: LoadedModel, spec: RolloutSpec) -> int:
    """Bytes of one x_i of every sample, as the loop holds it: what any rollout of this size
    allocates, whatever it streams (`return.steps` [] captures nothing)."""
    return math.prod(latent_shape(model, spec)) * spec.num_samples * loop_dtype(model).itemsize


def latent_shape(model: LoadedModel, spec: RolloutSpec) -> tuple[int, ...]:
    """Per-sample latent shape as the model consumes it, computed from the request."""
    d = model.defaults
    return family_named(model.family).latent_shape(
        model.pipeline, spec.height or d.height, spec.width or d.width, spec.num_frames or d.num_frames or 1
    )


def estimate_latent_bytes(model: LoadedModel, spec: RolloutSpec) -> int:
    """Bytes of the captured latents (all requested steps, all samples) and, with
    `return_velocities`, of the float32 velocities, before running."""
    if not spec.capture:
        return 0
    elements = math.prod(latent_shape(model, spec)) * spec.num_samples
    steps = captured_steps(spec)
    total = len(steps) * elements * capture_dtype(model, spec).itemsize
    if spec.return_velocities:  # float32, at every captured step but T
        total += sum(1 for s in steps if s < spec.num_inference_steps) * elements * 4
    return total
