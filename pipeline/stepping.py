"""One transition x_i -> x_{i+1}: the single function the rollout and the replay both call.

`advance` is the kernel + noise + Euler fallback. The rollout produces every x_{i+1} with it;
the replay produces with it every x_{i+1} it was not given (a gap in the capture), so a
replayed chain equals the rollout's by construction, not by two copies of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from sigmaflight.pipeline.kernels import kernel_mean_std
from sigmaflight.pipeline.schedules import RolloutScheduler
from sigmaflight.pipeline.seeds import draw_noise
from sigmaflight.pipeline.spec import SamplerSpec

__all__ = ["advance"]


def advance(
    scheduler: RolloutScheduler,
    i: int,
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    sampler: SamplerSpec,
    seeds: Sequence[int],
    stochastic: bool,
    kernel: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x_{i+1} in the model's dtype, on `sample`'s device.

    stochastic: transition i is in the rollout's stochastic set (`stochastic_transitions`):
    x' = mean + std * eps (float32 kernel, eps from `draw_noise(seeds, i)`), cast back to the
    model dtype as the stock scheduler casts its result. Otherwise the stock scheduler's own
    Euler step (bit-identical to `FlowMatchEulerDiscreteScheduler.step`).
    sample, velocity: [B, ...] x_i and the CFG-combined velocity at step i.
    kernel: `kernel_mean_std` of exactly these arguments when the caller has it already (the
    rollout scores the transition with it too), so it is computed once.
    """
    if not stochastic:
        return scheduler.euler_step(i, sample, velocity)
    mean, std = kernel if kernel is not None else kernel_mean_std(sample, velocity, sigmas, i, sampler=sampler)
    eps = draw_noise(seeds, i, tuple(sample.shape[1:])).to(mean.device)  # [B, ...] float32
    return (mean + std * eps).to(velocity.dtype)
