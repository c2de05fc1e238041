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
from sigmaflight.pipeline.batch import batch_key
from sigmaflight.pipeline.calls import batch_call_kwargs, call_overrides
from sigmaflight.pipeline.conditioning import branch_conditioning, check_conditioning
from sigmaflight.pipeline.kernels import (
    gaussian_log_prob,
    kernel_mean_std,
    step_log_prob,
    stochastic_transitions,
)
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.schedules import RolloutScheduler, make_rollout_scheduler, per_call_pipeline
from sigmaflight.pipeline.spec import RolloutSpec
from sigmaflight.pipeline.stepping import advance
from sigmaflight.pipeline.validation import requested_sde_steps, validate_spec

__all__ = ["ReplayItem", "Replayer", "ReplayResult", "step_log_prob"]


class _NoGrad:
    """A text encoder called under `torch.no_grad()` in a replay with gradients: a trainer's own
    pipeline (`from_pretrained`) has every parameter requiring grad, and with autograd on, torch's
    CPU attention takes another kernel for them (CLIP's pooled output moved by ~1e-6), so the prompt
    embeddings would not be the rollout's bits. The policy's graph runs through the transformer."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self._module(*args, **kwargs)


class _ReplayMember:
    """One replayed trajectory inside the call: its rows [first, end) and what it replays from."""

    def __init__(self, item: ReplayItem, first: int, device: torch.device, grad: bool) -> None:
        spec = item.spec
        self.spec = spec
        self.first, self.end = first, first + spec.num_samples
        self.grad = grad
        self.T = spec.num_inference_steps
        # contiguous: a strided x_{i+1} fed back in is equal but not the same input to a low-precision
        # CPU matmul (FLUX's first Linear gave other bits for it in bf16/fp16)
        self.latents = {int(s): item.latents[:, k].to(device).contiguous() for k, s in enumerate(item.steps)}
        self.sigmas = item.sigmas
        self.timesteps = item.timesteps
        self.seeds = tuple(int(s) for s in item.seeds)
        self.sde_steps = stochastic_transitions(requested_sde_steps(spec), item.sigmas, sampler=spec.sampler)
        self.log_probs = torch.full((len(self.seeds), self.T), float("nan"), dtype=torch.float32)
        self.velocities: dict[int, torch.Tensor] = {}
        self.means: dict[int, torch.Tensor] = {}
        self.stds: dict[int, torch.Tensor] = {}

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        if i in self.latents:
            self.velocities[i] = velocity.detach().to("cpu", torch.float32).clone()
        stochastic = i in self.sde_steps
        x_next = self.latents.get(i + 1)
        if x_next is not None:
            x_next = x_next.to(device=sample.device, dtype=sample.dtype)  # a lossy capture (bf16) on a float32 model
        else:  # a gap in the capture: the rollout's own step (same function, same noise)
            x_next = advance(scheduler, i, sample, velocity, self.sigmas, sampler=self.spec.sampler, seeds=self.seeds,
                             stochastic=stochastic)
        if self.grad:
            x_next = x_next.detach()  # x_{i+1} is data: gradients flow only through this step's velocity
        if stochastic and i in self.latents and (i + 1) in self.latents:
            # step_log_prob's two halves, so the kernel's mean and std are kept too (same bits)
            mean, std = kernel_mean_std(sample, velocity, self.sigmas, i, sampler=self.spec.sampler)
            self.log_probs[:, i] = gaussian_log_prob(x_next, mean, std, self.spec.sampler.log_prob).to("cpu")
            self.means[i], self.stds[i] = mean, std
        return x_next


class _ReplayDriver:
    def __init__(self, members: list[_ReplayMember]) -> None:
        self.members = members
        first = members[0]
        self.spec, self.sigmas, self.timesteps, self.T = first.spec, first.sigmas, first.timesteps, first.T

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
        if len(self.members) == 1:
            return self.members[0].step(scheduler, i, sample, velocity)
        return torch.cat([m.step(scheduler, i, sample[m.first:m.end], velocity[m.first:m.end])
                          for m in self.members], dim=0)


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    log_probs: torch.Tensor
    """float32 [B, T]; NaN where the transition is deterministic or not both ends captured."""
    velocities: dict[int, torch.Tensor]
    """Absolute step i -> float32 [B, *latent_shape] (CPU): the CFG-combined velocity the replay
    computed at every captured step i < T (compare with the rollout's `StepCapture.velocity`)."""
    means: dict[int, torch.Tensor]
    """Scored transition i -> float32 [B, *latent_shape] on the model's device: the mean of the
    Gaussian kernel p(x_{i+1} | x_i) (with a graph to the model under `grad=True`)."""
    stds: dict[int, torch.Tensor]
    """Scored transition i -> float32 0-d: the kernel's std (it depends on the schedule only)."""


@dataclass(frozen=True, kw_only=True)
class ReplayItem:
    """One trajectory to replay (the arguments of `Replayer.replay`, as a record)."""

    spec: RolloutSpec
    latents: torch.Tensor
    steps: Sequence[int]
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    seeds: Sequence[int]
    conditioning: Mapping[str, torch.Tensor] | None = None


def _branch_rows(spec: RolloutSpec) -> torch.Tensor:
    """A branch's x_k per sample [B, *latent_shape]: its `branch_from.latents` repeated per branch, parent-major."""
    assert spec.branch_from is not None
    return spec.branch_from.latents.repeat_interleave(spec.num_outputs_per_prompt, dim=0)


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
        A branch rollout replays with its own spec (`branch_from` set) from x_k: the captured
        one when `steps` holds k, else the spec's `branch_from.latents` (the parent's x_k rows,
        which must then be the real ones: `sigmaflight.rollout_spec(traj, parent=...)`).
        Pass `per_sample_model_calls` as the rollout did.
        grad: run with autograd on (the pipeline's own `torch.no_grad` is bypassed), so the
        result carries a graph back to every model parameter with `requires_grad` (a trainer's
        policy loss). The values are the same bits as with `grad=False`; each x_{i+1} is
        treated as data (detached), so the graph of step i runs through its velocity only.
        A trajectory that ran co-batched (`sigmaflight.rollout.batch.requests` > 1) replays bit
        for bit in the same company: `replay_batch`.
        """
        item = ReplayItem(spec=spec, latents=latents, steps=steps, sigmas=sigmas, timesteps=timesteps, seeds=seeds,
                          conditioning=conditioning)
        return self.replay_batch([item], per_sample_model_calls=per_sample_model_calls, grad=grad)[0]

    def replay_batch(
        self, items: Sequence[ReplayItem], *, per_sample_model_calls: bool = False, grad: bool = False
    ) -> list[ReplayResult]:
        """`replay` of several trajectories in one model call, laid out as `run_batch` laid out the
        rollouts they came from (their rows one after another, in this order): the trajectories of
        one co-batched call, replayed together in their batch's order (`rows`), give their
        rollouts' log-probs bit for bit. They must share a batch key (pipeline/batch.py), and either
        all or none capture their first latent and carry conditioning."""
        if not items:
            return []
        for item in items:
            validate_spec(self.model, item.spec)
            if item.latents.shape[0] != item.spec.num_samples or item.latents.shape[1] != len(item.steps):
                raise ValueError(f"latents must be [B={item.spec.num_samples}, K={len(item.steps)}, ...], "
                                 f"got {tuple(item.latents.shape)}")
            if item.conditioning is not None:
                check_conditioning(self.model.family, item.conditioning, item.spec.num_samples, field="conditioning")
        if len({batch_key(self.model, item.spec) for item in items}) != 1:
            raise ValueError("trajectories replayed in one call must share one batch_key (pipeline/batch.py)")
        members, first = [], 0
        for item in items:
            members.append(_ReplayMember(item, first, self.model.device, grad))
            first = members[-1].end
        driver = _ReplayDriver(members)
        pipeline, _ = self.model.snapshot()
        scheduler = make_rollout_scheduler(pipeline.scheduler, driver)
        overrides = call_overrides(self.model, pipeline, per_sample_model_calls)
        if grad:  # the text encoders stay out of the graph and compute the rollout's bits (see _NoGrad)
            for name, comp in pipeline.components.items():
                if name.startswith("text_encoder") and isinstance(comp, torch.nn.Module):
                    overrides[name] = _NoGrad(overrides.get(name, comp))
        pipe = per_call_pipeline(pipeline, scheduler, overrides)
        conditioning: list[Mapping[str, torch.Tensor]] | None = None
        if all(item.conditioning is not None for item in items):
            conditioning = [item.conditioning for item in items if item.conditioning is not None]
        elif any(item.conditioning is not None for item in items):
            raise ValueError("give conditioning for every trajectory of a replay_batch, or for none")
        elif items[0].spec.branch_from is not None:
            with torch.inference_mode():
                conditioning = [branch_conditioning(self.model, pipe, item.spec) for item in items]
        if conditioning is not None and grad:  # inference tensors (a rollout's): autograd may not save them
            conditioning = [{k: v.clone() for k, v in c.items()} for c in conditioning]
        kwargs: dict[str, Any] = batch_call_kwargs(self.model, [item.spec for item in items],
                                                   [m.seeds for m in members], conditioning=conditioning)
        start = items[0].spec.start_step
        have = [start in m.latents for m in members]
        if all(have):
            # in their stored dtype: the pipeline's prepare_latents casts them to its loop's, as it
            # did the rollout's (a bf16 Wan keeps a float32 x_0; a rounded copy was off at step 0)
            kwargs["latents"] = torch.cat([m.latents[start] for m in members], dim=0)
        elif start > 0:  # a branch that did not capture x_k starts from its spec's, as the rollout did
            kwargs["latents"] = torch.cat([
                m.latents[start] if start in m.latents else _branch_rows(item.spec).to(self.model.device)
                for m, item in zip(members, items, strict=True)], dim=0)
        elif any(have):
            raise ValueError("replay_batch needs x_0 captured in every trajectory, or in none (drawn from the seeds)")
        if grad:
            # diffusers decorates __call__ with @torch.no_grad(); call the undecorated function.
            with torch.enable_grad():
                inspect.unwrap(type(pipe).__call__)(pipe, **kwargs)
        else:
            with torch.inference_mode():
                pipe(**kwargs)
        return [ReplayResult(log_probs=m.log_probs, velocities=m.velocities, means=m.means, stds=m.stds)
                for m in members]
