"""The rollout loop: run a diffusers flow-match pipeline and capture its trajectory.

The pipeline's own `__call__` runs (encoding, CFG, latent preparation); a per-call
`RolloutScheduler` hands every step to `_Driver`, which advances the step with
`stepping.advance` (the function the replay uses too), captures x_i, scores
log p(x_{i+1} | x_i) with `kernels.step_log_prob` and fails the rollout (`RolloutNonFinite`)
at the first non-finite latent or log-prob. `rollout_metadata` is the contract's
`sigmaflight.rollout` object for the run.

Seeds and noise: see pipeline/seeds.py; validation and sizes: pipeline/validation.py; the
pipeline call: pipeline/calls.py. Their public names are re-exported here, as before the split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from sigmaflight.pipeline.calls import call_kwargs, call_overrides
from sigmaflight.pipeline.conditioning import (
    TransformerRecorder,
    branch_conditioning,
    conditioning_from_calls,
)
from sigmaflight.pipeline.kernels import step_log_prob, stochastic_transitions
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.schedules import RolloutScheduler, make_rollout_scheduler, per_call_pipeline
from sigmaflight.pipeline.seeds import derive_seeds, noise_seed, sample_seeds
from sigmaflight.pipeline.spec import (
    RolloutCancelled,
    RolloutNonFinite,
    RolloutSpec,
    ScheduleSnapshot,
    StepCapture,
)
from sigmaflight.pipeline.stepping import advance
from sigmaflight.pipeline.validation import (
    capture_dtype,
    captured_steps,
    estimate_latent_bytes,
    latent_shape,
    requested_sde_steps,
    validate_spec,
)

__all__ = [
    "RolloutResult",
    "derive_seeds",
    "noise_seed",
    "sample_seeds",
    "validate_spec",
    "latent_shape",
    "estimate_latent_bytes",
    "run_rollout",
    "rollout_metadata",
    "parent_metadata",
]


@dataclass(frozen=True, kw_only=True)
class RolloutResult:
    snapshot: ScheduleSnapshot
    captures: tuple[StepCapture, ...]
    """The StepCaptures in ascending step order (empty with keep=False or capture=False)."""
    log_probs: torch.Tensor
    """float32 [B, T] on CPU; NaN on deterministic transitions or when not requested."""
    seeds: tuple[int, ...]
    final_latents: torch.Tensor
    """x_T [B, *latent_shape] in the model's dtype, on the model's device."""
    digest: str
    """Weights digest of the model that ran."""
    conditioning: Mapping[str, torch.Tensor] | None = None
    """With `return_conditioning`: the tensors the transformer consumed, keyed by the stock
    `__call__` keyword (`sigmaflight.pipeline.conditioning.CONDITIONING_NAMES`), B rows prompt-major, on CPU."""
    prompt_index: tuple[int, ...] = ()
    """Index into the prompts of each sample (the parent row's for a branch)."""
    parent_sample: tuple[int, ...] | None = None
    """Branch rollouts: the parent sample of each sample; None otherwise."""


class _Driver:
    """Applies the kernel at every step, captures x_i and scores log-probs."""

    def __init__(
        self,
        model: LoadedModel,
        spec: RolloutSpec,
        seeds: tuple[int, ...],
        digest: str,
        *,
        weights_version: int = 0,
        components: Mapping[str, str] | None = None,
        on_schedule: Callable[[ScheduleSnapshot], None] | None,
        on_step: Callable[[StepCapture], None] | None,
        on_progress: Callable[[int, int], None] | None,
        should_stop: Callable[[], bool] | None,
        keep: bool,
        original_scheduler: Any,
    ) -> None:
        self.model = model
        self.spec = spec
        self.sampler = spec.sampler
        self.seeds = seeds
        self.digest = digest
        self.weights_version = weights_version
        self.components = dict(components) if components else None
        self.T = spec.num_inference_steps
        self.steps = frozenset(captured_steps(spec)) if spec.capture else frozenset()
        self.sde_steps = frozenset(requested_sde_steps(spec))
        self.on_schedule = on_schedule
        self.on_step = on_step
        self.on_progress = on_progress
        self.should_stop = should_stop
        self.keep = keep
        self.original_scheduler = original_scheduler
        self.capture_dtype = capture_dtype(model, spec)
        self.captures: list[StepCapture] = []
        self.log_probs = torch.full((len(seeds), self.T), float("nan"), dtype=torch.float32)
        self.snapshot: ScheduleSnapshot | None = None
        self.sigmas: torch.Tensor | None = None
        self.recorder: TransformerRecorder | None = None
        self.conditioning: dict[str, torch.Tensor] | None = None

    def on_set_timesteps(self, scheduler: RolloutScheduler) -> None:
        self.snapshot = None  # the last schedule wins; reported at the first step
        b = self.spec.branch_from
        if b is not None:  # the parent's schedule, bit for bit, from step k
            scheduler.start_at(b.step, b.sigmas, b.timesteps, dict(b.set_timesteps_kwargs))

    def _take_conditioning(self) -> None:
        if self.recorder is not None and self.conditioning is None:
            self.conditioning = conditioning_from_calls(self.model.family, self.recorder.stop(), len(self.seeds))

    def _report_schedule(self, scheduler: RolloutScheduler, sample: torch.Tensor) -> None:
        assert scheduler.sigmas_snapshot is not None and scheduler.timesteps_snapshot is not None
        sigmas = scheduler.sigmas_snapshot
        if sigmas.shape[0] != self.T + 1:
            raise RuntimeError(f"the pipeline ran {sigmas.shape[0] - 1} steps, the request asked for {self.T}")
        self.sigmas = sigmas
        self.sde_steps = stochastic_transitions(self.sde_steps, sigmas, sampler=self.sampler)
        self.snapshot = ScheduleSnapshot(
            sigmas=sigmas,
            timesteps=scheduler.timesteps_snapshot,
            set_timesteps_kwargs=dict(scheduler.set_timesteps_kwargs or {}),
            scheduler_class=type(self.original_scheduler).__name__,
            scheduler_config=_json_config(self.original_scheduler.config),
            sde_steps=tuple(sorted(self.sde_steps)),
            steps=tuple(sorted(self.steps)),
            seeds=self.seeds,
            num_outputs_per_prompt=self.spec.num_outputs_per_prompt,
            latent_shape=tuple(sample.shape[1:]),
            latent_dtype=self.capture_dtype,
            native_dtype=sample.dtype,
            model_digest=self.digest,
            model_weights_version=self.weights_version,
            model_components=self.components,
            start_step=self.spec.start_step,
            prompt_index=self.spec.prompt_indices(),
            parent_sample=self.spec.parent_samples(),
            conditioning=self.conditioning,
        )
        if self.on_schedule is not None:
            self.on_schedule(self.snapshot)

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """x on CPU in the capture dtype: a reference on CPU/native, one copy otherwise."""
        return x.to("cpu", self.capture_dtype).contiguous()

    def _emit(self, step: int, latent: torch.Tensor, log_prob: torch.Tensor | None,
              velocity: torch.Tensor | None = None) -> None:
        cap = StepCapture(step=step, latent=latent, log_prob=log_prob, velocity=velocity)
        if self.keep:
            self.captures.append(cap)
        if self.on_step is not None:
            self.on_step(cap)

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        if self.snapshot is None:
            self._take_conditioning()
            self._report_schedule(scheduler, sample)
        assert self.sigmas is not None
        stored_i = self._store(sample) if i in self.steps else None  # [B, ...]
        stochastic = i in self.sde_steps
        x_next = advance(scheduler, i, sample, velocity, self.sigmas, sampler=self.sampler, seeds=self.seeds,
                         stochastic=stochastic)
        lp: torch.Tensor | None = None
        if stochastic and self.spec.return_log_probs:
            # Score the stored values with the public replay function (same code path as replay).
            lp = step_log_prob(sample, x_next, velocity, self.sigmas, i, sampler=self.sampler).to("cpu")  # [B]
            if not bool(torch.isfinite(lp).all()):
                raise RolloutNonFinite(i, "log_prob")
            self.log_probs[:, i] = lp
        if not bool(torch.isfinite(x_next).all()):
            raise RolloutNonFinite(i + 1, "latent")
        if stored_i is not None:
            v = velocity.to("cpu", torch.float32).contiguous() if self.spec.return_velocities else None
            self._emit(i, stored_i, lp, v)
        if i == self.T - 1 and self.T in self.steps:
            self._emit(self.T, self._store(x_next), None)
        if self.on_progress is not None:
            self.on_progress(i + 1, self.T)
        if i + 1 < self.T and self.should_stop is not None and self.should_stop():
            raise RolloutCancelled(f"cancelled after step {i + 1} of {self.T}")
        return x_next


def _json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)):
            # diffusers builds _use_default_values from a set: sort it so metadata is the same in every process
            out[k] = sorted(v) if k == "_use_default_values" else list(v)
        else:
            out[k] = str(v)
    return out


def run_rollout(
    model: LoadedModel,
    spec: RolloutSpec,
    *,
    on_schedule: Callable[[ScheduleSnapshot], None] | None = None,
    on_step: Callable[[StepCapture], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    keep: bool = True,
    per_sample_model_calls: bool = False,
) -> RolloutResult:
    """Run one rollout; see the module docstring and docs/pipeline.md for semantics.

    Thread-safe: each call builds its own scheduler and pipeline copy over the shared modules.
    """
    validate_spec(model, spec)
    seeds = sample_seeds(spec)
    policy = model.policy()  # pipeline, digest and weights_version read together
    pipeline, digest = policy.pipeline, policy.digest
    if should_stop is not None and should_stop():
        raise RolloutCancelled("cancelled before the first step")
    driver = _Driver(
        model,
        spec,
        seeds,
        digest,
        weights_version=policy.weights_version,
        components=policy.components,
        on_schedule=on_schedule,
        on_step=on_step,
        on_progress=on_progress,
        should_stop=should_stop,
        keep=keep,
        original_scheduler=pipeline.scheduler,
    )
    scheduler = make_rollout_scheduler(pipeline.scheduler, driver)
    overrides = call_overrides(model, pipeline, per_sample_model_calls)
    if spec.return_conditioning:
        driver.recorder = TransformerRecorder(overrides.get("transformer", pipeline.transformer))
        overrides["transformer"] = driver.recorder
    pipe = per_call_pipeline(pipeline, scheduler, overrides)
    with torch.inference_mode():
        cond = branch_conditioning(model, pipe, spec) if spec.branch_from is not None else None
        out = pipe(**call_kwargs(model, spec, seeds, conditioning=cond))
    final = out.frames if model.defaults.is_video else out.images
    assert driver.snapshot is not None
    return RolloutResult(
        snapshot=driver.snapshot,
        captures=tuple(driver.captures),
        log_probs=driver.log_probs,
        seeds=seeds,
        final_latents=final,
        digest=digest,
        conditioning=driver.conditioning,
        prompt_index=driver.snapshot.prompt_index,
        parent_sample=driver.snapshot.parent_sample,
    )


def _request_metadata(spec: RolloutSpec) -> dict[str, Any]:
    """The request as JSON: every RolloutSpec field, `branch_from` as its parent reference."""
    request: dict[str, Any] = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in ("sampler", "branch_from")}
    request["sampler"] = spec.sampler.to_json()
    for key in ("prompts", "seeds", "return_steps"):
        if request[key] is not None:
            request[key] = list(request[key])
    request["branch_from"] = parent_metadata(spec)
    return request


def parent_metadata(spec: RolloutSpec) -> dict[str, Any] | None:
    """The contract's `sigmaflight.parent` object of a branch rollout, {"rollout", "step",
    "samples"}; None for a rollout from x_0. A separate metadata entry for the data plane."""
    b = spec.branch_from
    if b is None:
        return None
    return {"rollout": b.rollout, "step": b.step, "samples": [int(j) for j in b.samples]}


def rollout_metadata(model: LoadedModel, spec: RolloutSpec, snapshot: ScheduleSnapshot) -> dict[str, Any]:
    """The contract's `sigmaflight.rollout` object (without `id`, which control/ assigns)."""
    request = _request_metadata(spec)
    return {
        "model": {
            "id": model.id,
            "dtype": str(model.dtype).removeprefix("torch."),
            "digest": snapshot.model_digest or model.digest,
            "weights_version": snapshot.model_weights_version,
            **({"components": dict(snapshot.model_components)} if snapshot.model_components else {}),
        },
        "scheduler": {
            "class": snapshot.scheduler_class,
            "config": dict(snapshot.scheduler_config),
            "set_timesteps": dict(snapshot.set_timesteps_kwargs),
        },
        "sampler": request["sampler"],
        "request": request,
        "seeds": list(snapshot.seeds),
        "num_samples": len(snapshot.seeds),
        "num_outputs_per_prompt": snapshot.num_outputs_per_prompt,
        "latent_dtype": str(snapshot.latent_dtype).removeprefix("torch."),
        "native_dtype": str(snapshot.native_dtype).removeprefix("torch."),
    }
