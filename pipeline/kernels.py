"""Step kernels of the Flow-GRPO family and their Gaussian log-probs.

Notation (one transition i, x_i -> x_{i+1}; all math in float32):

    sigma  = sigmas[i]          (code: `sigma`)
    sigma' = sigmas[i + 1]      (code: `sigma_next`)
    dt     = sigma' - sigma     (negative while denoising)
    v      = CFG-combined velocity the model predicted at (x_i, t_i)   (code: `velocity`)
    a      = SamplerSpec.noise_level                                   (code: `a`)

"sde" -- Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via
Online RL", arXiv:2505.05470: the reverse-time SDE of the rectified flow discretised with
Euler-Maruyama). Follows the "sde" branch of Flow-GRPO's `sde_step_with_logprob`
(yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py) and of SGLang's
`flow_sde_sampling` (sgl-project/sglang, .../post_training/scheduler_rl_mixin.py):

    d       = sigmas[1] if sigma == 1 else sigma        (the denominator only)
    std_t   = sqrt(sigma / (1 - d)) * a
    mean    = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
    std     = std_t * sqrt(-dt)
    x'      = mean + std * eps,   eps ~ N(0, I)

sigma == 1 is compared exactly, as Flow-GRPO does (SGLang uses `torch.isclose`); the two
agree on every schedule whose first sigma is exactly 1.0 (stock static and dynamic shift,
a custom list starting at 1.0) and differ only for a sigma within 1e-5 of 1 but not 1.

"cps" -- coefficients-preserving sampling (Wang & Yu 2025, "Coefficients-Preserving
Sampling for Reinforcement Learning with Flow Matching"); the "cps"
branch of the same two functions. a in [0, 1] (validation refuses more):

    std     = sigma' * sin(a * pi / 2)
    mean    = (x - sigma v) (1 - sigma') + (x + (1 - sigma) v) * sqrt(sigma'^2 - std^2)
    x'      = mean + std * eps

"ode" -- the deterministic Euler step of diffusers' FlowMatchEulerDiscreteScheduler,
x' = x + dt * v (computed by the stock scheduler itself, cast to the model dtype); no log-prob.
Deterministic transitions of "sde"/"cps" (those not in `sde_steps`) take the same Euler step
(it is the a = 0 limit of both kernels).

Log-prob of x' under N(mean, std^2 I), averaged (not summed) over the non-batch elements:

    "density":  -(x' - mean)^2 / (2 std^2) - log(std) - log(sqrt(2 pi))   (Flow-GRPO "sde")
    "no_const": -(x' - mean)^2            (SGLang `rollout_log_prob_no_const`; Flow-GRPO "cps")

`step_log_prob` is the one function that scores a transition; the rollout calls it on the
stored x_i and x_{i+1}, so a trainer that calls it with the same tensors gets the same bits.
A transition whose std is exactly 0 (noise_level 0, or cps into sigma' = 0, i.e. the last
step) has no density: `stochastic_transitions` drops it from the stochastic set, so the
rollout takes the Euler step there (the kernels' own mean at std = 0) and records no
log-prob (a null; SGLang writes 0 there, on purpose not followed); called directly on such a
transition, `step_log_prob` gives NaN or -inf for "density".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from sigmaflight.pipeline.spec import SamplerSpec

__all__ = ["kernel_mean_std", "step_log_prob", "gaussian_log_prob", "transition_std", "stochastic_transitions"]

_LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


def _sde_std_t(sig: torch.Tensor, sigma: torch.Tensor, a: float) -> torch.Tensor:
    """std_t = sqrt(sigma / (1 - d)) * a, d = sigmas[1] at sigma == 1 (exact compare), else sigma.

    Only the denominator is substituted: Flow-GRPO `sde_step_with_logprob`
    (`torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))`) and SGLang
    `flow_sde_sampling` (the same with `torch.isclose`).
    """
    d = sig[1].to(sigma.device) if bool(sigma == 1) else sigma
    return torch.sqrt(sigma / (1 - d)) * a


def transition_std(sigmas: torch.Tensor, step_index: int, *, sampler: SamplerSpec) -> torch.Tensor:
    """std (float32 0-d) of transition i under the "sde" or "cps" kernel; it depends on the schedule only."""
    sig = sigmas.to(dtype=torch.float32)
    i = int(step_index)
    sigma, sigma_next = sig[i], sig[i + 1]
    a = float(sampler.noise_level)
    if sampler.type == "sde":
        return _sde_std_t(sig, sigma, a) * torch.sqrt(-(sigma_next - sigma))
    if sampler.type == "cps":
        return sigma_next * math.sin(a * math.pi / 2)
    raise ValueError(f"kernel {sampler.type!r} has no Gaussian transition")


def stochastic_transitions(requested: Iterable[int], sigmas: torch.Tensor, *, sampler: SamplerSpec) -> frozenset[int]:
    """The requested transitions that really are stochastic (std > 0) under this schedule."""
    if sampler.type == "ode":
        return frozenset()
    steps = [int(i) for i in requested]
    if not steps:
        return frozenset()
    # `transition_std` of every requested step in one pass of tensor ops (element by element the
    # same float32 arithmetic): one scalar call per step cost ~30 us, seconds for a long rollout.
    sig = sigmas.to(dtype=torch.float32)
    at = torch.tensor(steps, dtype=torch.long, device=sig.device)
    sigma, sigma_next = sig[at], sig[at + 1]
    a = float(sampler.noise_level)
    if sampler.type == "sde":
        d = torch.where(sigma == 1, sig[1], sigma)  # as `_sde_std_t`
        std = torch.sqrt(sigma / (1 - d)) * a * torch.sqrt(-(sigma_next - sigma))
    elif sampler.type == "cps":
        std = sigma_next * math.sin(a * math.pi / 2)
    else:
        raise ValueError(f"kernel {sampler.type!r} has no Gaussian transition")
    return frozenset(i for i, keep in zip(steps, (std > 0).tolist(), strict=True) if keep)


def kernel_mean_std(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int,
    *,
    sampler: SamplerSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (float32, shape of x) and std (float32 0-d) of p(x_{i+1} | x_i) for "sde" / "cps"."""
    sig = sigmas.to(dtype=torch.float32)  # [T+1]; a no-op for the float32 snapshot
    i = int(step_index)
    if not 0 <= i < sig.shape[0] - 1:
        raise IndexError(f"step_index {i} outside 0..{sig.shape[0] - 2}")
    x = x.to(torch.float32)  # [B, ...]
    v = velocity.to(torch.float32)  # [B, ...]
    sigma = sig[i].to(x.device)  # 0-d
    sigma_next = sig[i + 1].to(x.device)  # 0-d
    a = float(sampler.noise_level)
    if sampler.type == "sde":
        dt = sigma_next - sigma
        std_t = _sde_std_t(sig, sigma, a)
        mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_t * torch.sqrt(-dt)
    elif sampler.type == "cps":
        std = sigma_next * math.sin(a * math.pi / 2)
        x0 = x - sigma * v
        eps_hat = x + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + eps_hat * torch.sqrt(sigma_next**2 - std**2)
    else:
        raise ValueError(f"kernel {sampler.type!r} has no Gaussian transition")
    return mean, std


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, kind: str) -> torch.Tensor:
    """log N(x_next; mean, std^2), mean over non-batch elements -> float32 [B]."""
    x_next = x_next.to(torch.float32)
    sq = (x_next - mean) ** 2
    if kind == "density":
        lp = -sq / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    elif kind == "no_const":
        lp = -sq  # SGLang `rollout_log_prob_no_const`, Flow-GRPO's cps log-prob: no 1 / (2 std^2)
    else:
        raise ValueError(f"unknown log_prob kind {kind!r}")
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def step_log_prob(
    x_i: torch.Tensor,
    x_next: torch.Tensor,
    velocity: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int,
    *,
    sampler: SamplerSpec | Mapping[str, Any],
) -> torch.Tensor:
    """log p(x_{i+1} | x_i) of one transition: float32 [B].

    x_i, x_next: [B, ...] latents as stored (any float dtype; upcast to float32 here).
    velocity: [B, ...] CFG-combined model output at step i.
    sigmas: the trajectory's [T+1] float32 snapshot (pass it as recorded; a sigma recomputed
    from timesteps, or stored in bf16, gives other numbers).
    step_index: absolute transition index i (0 <= i < T).
    sampler: a SamplerSpec, or the trajectory's own sampler metadata (`traj.metadata["sampler"]`).
    """
    spec = SamplerSpec.of(sampler)
    mean, std = kernel_mean_std(x_i, velocity, sigmas, step_index, sampler=spec)
    return gaussian_log_prob(x_next, mean, std, spec.log_prob)
