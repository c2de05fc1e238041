"""Co-batching: which rollouts may share one diffusers call, and the record of with whom one ran.

Rollouts share a call when everything the call takes once is the same for them (contract,
"co-batched rollouts"): model and its weights (read once at the call's start), the step count and
the schedule that runs, the size, the guidance scale, the sampler's kernel and noise level, the
log-prob kind, the latent dtype and the start step (a branch batches only with branches from the
same step of a parent with the same schedule). `batch_key` is that list as a value: equal keys,
one call. Everything else stays each rollout's own (prompts, negative prompt, seeds, sde window,
return options), so `run_batch` (pipeline/rollout.py) lays their rows out one after another and
keeps a trajectory per member.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable

from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.spec import BatchInfo, RolloutSpec

__all__ = ["BatchInfo", "batch_key"]


def _schedule_digest(spec: RolloutSpec) -> str | None:
    """A branch's recorded schedule and start step, by content (None for a rollout from x_0)."""
    b = spec.branch_from
    if b is None:
        return None
    h = hashlib.sha256()
    h.update(str(b.step).encode())
    h.update(b.sigmas.contiguous().numpy().tobytes())
    h.update(b.timesteps.contiguous().numpy().tobytes())
    h.update(json.dumps(dict(b.set_timesteps_kwargs), sort_keys=True, default=str).encode())
    return h.hexdigest()


def batch_key(model: LoadedModel, spec: RolloutSpec) -> Hashable:
    """What `spec` must share with the other members of its call, as one hashable value (defaults
    resolved: a request that leaves guidance unset batches with one that gives the default)."""
    d = model.defaults
    s = spec.sampler
    return (
        spec.model,
        spec.num_inference_steps,
        spec.height or d.height,
        spec.width or d.width,
        (spec.num_frames or d.num_frames) if d.is_video else None,
        d.guidance_scale if spec.guidance_scale is None else float(spec.guidance_scale),
        s.type,
        float(s.noise_level),
        s.log_prob,
        spec.latent_dtype,
        spec.start_step,
        _schedule_digest(spec),
    )
