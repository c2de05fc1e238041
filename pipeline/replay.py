"""Replay for trainers: score a captured trajectory with the rollout's own code.

`step_log_prob` (re-exported from kernels) scores one transition from tensors a trainer
already has. `Replayer` re-runs the model on a captured trajectory through the same pipeline
call the rollout made (same batch layout, prompts, negative prompt, CFG, per-sample
generators), feeding the captured latents back in, and scores each stochastic transition
whose x_i and x_{i+1} were both captured. Transitions between uncaptured latents are
re-sampled with the rollout's own noise (same seeds), so a gap in the capture does not
break the chain.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sigmaflight.pipeline.calls import call_kwargs, call_overrides
from sigmaflight.pipeline.conditioning import branch_conditioning, check_conditioning
from sigmaflight.pipeline.kernels import step_log_prob, stochastic_transitions
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.schedules import RolloutScheduler, make_rollout_scheduler, per_call_pipeline
from sigmaflight.pipeline.spec import RolloutSpec
from sigmaflight.pipeline.stepping import advance
from sigmaflight.pipeline.validation import requested_sde_steps, validate_spec

__all__ = ["Replayer", "ReplayResult", "step_log_prob"]


class _ReplayDriver:
    def __init__(
        self,
        spec: RolloutSpec,
        latents: dict[int, torch.Tensor],
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        seeds: tuple[int, ...],
        grad: bool = False,
    ) -> None:
        self.spec = spec
        self.grad = grad
        self.T = spec.num_inference_steps
        self.latents = latents
        self.sigmas = sigmas
        self.timesteps = timesteps
        self.seeds = seeds
        self.sde_steps = stochastic_transitions(requested_sde_steps(spec), sigmas, sampler=spec.sampler)
        self.log_probs = torch.full((len(seeds), self.T), float("nan"), dtype=torch.float32)
        self.velocities: dict[int, torch.Tensor] = {}

    def on_set_timesteps(self, scheduler: RolloutScheduler) -> None:
        if self.sigmas.shape[0] != self.T + 1 or self.timesteps.shape[0] != self.T:
            raise ValueError(f"sigmas must have T+1 = {self.T + 1} entries and timesteps T = {self.T}")
        b = self.spec.branch_from
        if b is not None:  # a branch replays from its start k on the recorded schedule
            scheduler.start_at(b.step, self.sigmas, self.timesteps, dict(b.set_timesteps_kwargs))
            return
        # Condition the model on the recorded timesteps (the pipeline reads scheduler.timesteps next).
        scheduler.timesteps = self.timesteps.to(device=scheduler.timesteps.device, dtype=torch.float32)

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        if i in self.latents:
            self.velocities[i] = velocity.detach().to("cpu", torch.float32).clone()
        stochastic = i in self.sde_steps
        x_next = self.latents.get(i + 1)
        if x_next is not None:
            x_next = x_next.to(device=sample.device)
        else:  # a gap in the capture: the rollout's own step (same function, same noise)
            x_next = advance(scheduler, i, sample, velocity, self.sigmas, sampler=self.spec.sampler, seeds=self.seeds,
                             stochastic=stochastic)
        if self.grad:
            x_next = x_next.detach()  # x_{i+1} is data: gradients flow only through this step's velocity
        if stochastic and i in self.latents and (i + 1) in self.latents:
            self.log_probs[:, i] = step_log_prob(
                sample, x_next, velocity, self.sigmas, i, sampler=self.spec.sampler
            ).to("cpu")
        return x_next


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    log_probs: torch.Tensor
    """float32 [B, T]; NaN where the transition is deterministic or not both ends captured."""
    velocities: dict[int, torch.Tensor]
    """Absolute step i -> float32 [B, *latent_shape] (CPU): the CFG-combined velocity the replay
    computed at every captured step i < T (compare with the rollout's `StepCapture.velocity`)."""


class Replayer:
    """Re-runs `model` on captured trajectories; thread-safe like `run_rollout`."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model

    def log_probs(
        self,
        spec: RolloutSpec,
        *,
        latents: torch.Tensor,
        steps: Sequence[int],
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        seeds: Sequence[int],
        conditioning: Mapping[str, torch.Tensor] | None = None,
        per_sample_model_calls: bool = False,
        grad: bool = False,
    ) -> torch.Tensor:
        """float32 [B, T] log-probs: `replay(...).log_probs` with the same arguments."""
        return self.replay(spec, latents=latents, steps=steps, sigmas=sigmas, timesteps=timesteps, seeds=seeds,
                           conditioning=conditioning, per_sample_model_calls=per_sample_model_calls, grad=grad).log_probs

    def replay(
        self,
        spec: RolloutSpec,
        *,
        latents: torch.Tensor,
        steps: Sequence[int],
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        seeds: Sequence[int],
        conditioning: Mapping[str, torch.Tensor] | None = None,
        per_sample_model_calls: bool = False,
        grad: bool = False,
    ) -> ReplayResult:
        """Log-probs and velocities of a captured trajectory, recomputed with this model.

        latents: [B, K, *latent_shape], x_i for the absolute indices `steps` (K entries), in
        the dtype they were captured in (native for a bit-exact replay).
        sigmas [T+1], timesteps [T]: the trajectory's snapshot, as recorded.
        seeds: the per-sample seeds of the rollout (`RolloutResult.seeds` / the `seed` column).
        conditioning: the rollout's `RolloutResult.conditioning` (B rows): the prompts are not
        encoded, so the model needs no text encoders (they may be None).
        A branch rollout replays with its own spec (`branch_from` set; its `latents` may be
        any placeholder of the right shape: x_k comes from `latents`).
        Pass `per_sample_model_calls` as the rollout did.
        grad: run with autograd on (the pipeline's own `torch.no_grad` is bypassed), so the
        result carries a graph back to every model parameter with `requires_grad` (a trainer's
        policy loss). The values are the same bits as with `grad=False`; each x_{i+1} is
        treated as data (detached), so the graph of step i runs through its velocity only.
        """
        validate_spec(self.model, spec)
        if latents.shape[0] != spec.num_samples or latents.shape[1] != len(steps):
            raise ValueError(f"latents must be [B={spec.num_samples}, K={len(steps)}, ...], got {tuple(latents.shape)}")
        if conditioning is not None:
            check_conditioning(self.model.family, conditioning, spec.num_samples, field="conditioning")
        seeds_t = tuple(int(s) for s in seeds)
        by_step = {int(s): latents[:, k].to(self.model.device) for k, s in enumerate(steps)}
        driver = _ReplayDriver(spec, by_step, sigmas, timesteps, seeds_t, grad=grad)
        pipeline, _ = self.model.snapshot()
        scheduler = make_rollout_scheduler(pipeline.scheduler, driver)
        pipe = per_call_pipeline(pipeline, scheduler, call_overrides(self.model, pipeline, per_sample_model_calls))
        if conditioning is None and spec.branch_from is not None:
            with torch.inference_mode():
                conditioning = branch_conditioning(self.model, pipe, spec)
        if conditioning is not None and grad:  # inference tensors (a rollout's): autograd may not save them
            conditioning = {k: v.clone() for k, v in conditioning.items()}
        kwargs: dict[str, Any] = call_kwargs(self.model, spec, seeds_t, conditioning=conditioning)
        start = spec.start_step
        if start in by_step:
            kwargs["latents"] = by_step[start].to(self.model.dtype)
        elif start > 0:
            raise ValueError(f"a branch replay needs its first latent x_{start} among `steps`")
        if grad:
            # diffusers decorates __call__ with @torch.no_grad(); call the undecorated function.
            with torch.enable_grad():
                inspect.unwrap(type(pipe).__call__)(pipe, **kwargs)
        else:
            with torch.inference_mode():
                pipe(**kwargs)
        return ReplayResult(log_probs=driver.log_probs, velocities=driver.velocities)
