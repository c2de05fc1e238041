"""The step kernels against independent transcriptions of the field's reference code.

`flow_grpo_step` transcribes Flow-GRPO's `sde_step_with_logprob` (yifan123/flow_grpo,
flow_grpo/diffusers_patch/sd3_sde_with_logprob.py; "sde" and "cps" branches) and
`sglang_step` transcribes SGLang's `flow_sde_sampling` with its `rollout_log_prob_no_const`
switch (sgl-project/sglang, python/sglang/multimodal_gen/runtime/post_training/
scheduler_rl_mixin.py). Both are written here from the references' formulas, in the
references' own order of operations, and share no code with pipeline/kernels.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from sigmaflight.pipeline.kernels import kernel_mean_std, step_log_prob, stochastic_transitions
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

EPS32 = torch.finfo(torch.float32).eps
ULPS = 4  # "within a few float32 ULPs"
# SGLang scores its own draw (x' - mean = noise * std, never rounded) while sigmaflight and
# Flow-GRPO score the stored float32 x'. Rounding x' moves each residual by up to ulp(|x'|) / 2,
# which near sigma' = 0 (std ~ 2e-3) is ~1e-4 of the residual: a few more ULPs on the mean.
ULPS_SGLANG_LOG_PROB = 8


def _col(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape(-1, *([1] * (ndim - 1)))


def flow_grpo_step(sigmas, i, sample, model_output, noise_level, sde_type, prev_sample=None, noise=None):
    """Flow-GRPO `sde_step_with_logprob` for one step index i (the whole batch at the same i).

    Returns (prev_sample, log_prob [B], prev_sample_mean, std_dev_t, sqrt(-dt)).
    Flow-GRPO scores "sde" with the full density and "cps" with -(x' - mean)^2 only.
    """
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    b = sample.shape[0]
    sigma = _col(sigmas[[i] * b], sample.ndim)
    sigma_prev = _col(sigmas[[i + 1] * b], sample.ndim)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
            1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
        ) * dt
        if prev_sample is None:
            prev_sample = mean + std_dev_t * torch.sqrt(-1 * dt) * noise
        log_prob = (
            -((prev_sample - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
            - torch.log(std_dev_t * torch.sqrt(-1 * dt))
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        )
    elif sde_type == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0 = sample - sigma * model_output
        x1 = sample + model_output * (1 - sigma)
        mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        if prev_sample is None:
            prev_sample = mean + std_dev_t * noise
        log_prob = -((prev_sample - mean) ** 2)
    else:
        raise ValueError(sde_type)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, mean, std_dev_t, torch.sqrt(-1 * dt)


def sglang_step(sigmas, i, sample, model_output, noise_level, sde_type, no_const, noise):
    """SGLang `flow_sde_sampling` for one step (sigma_max = sigmas[min(1, len - 1)]).

    Returns (prev_sample, log_prob [B], prev_sample_mean, noise_std_dev). SGLang scores the
    drawn noise (x' - mean = noise * std) and averages as sum / element count.
    """
    current_sigma, next_sigma = sigmas[i], sigmas[i + 1]
    sigma_max = sigmas[min(1, len(sigmas) - 1)].item()
    dt = next_sigma - current_sigma
    model_output = model_output.float()
    sample = sample.float()
    if sde_type == "sde":
        std_dev_t = (
            torch.sqrt(
                current_sigma
                / (1 - torch.where(torch.isclose(current_sigma, current_sigma.new_tensor(1.0)), sigma_max, current_sigma))
            )
            * noise_level
        )
        noise_std_dev = std_dev_t * torch.sqrt(-1 * dt)
        mean = sample * (1 + std_dev_t**2 / (2 * current_sigma) * dt) + model_output * (
            1 + std_dev_t**2 * (1 - current_sigma) / (2 * current_sigma)
        ) * dt
    elif sde_type == "cps":
        std_dev_t = next_sigma * math.sin(noise_level * math.pi / 2)
        noise_std_dev = std_dev_t
        x0 = sample - current_sigma * model_output
        x1 = sample + model_output * (1 - current_sigma)
        mean = x0 * (1 - next_sigma) + x1 * torch.sqrt(next_sigma**2 - std_dev_t**2)
    else:
        raise ValueError(sde_type)
    prev_sample = mean + noise * noise_std_dev
    val = -((noise * noise_std_dev) ** 2)
    dims = list(range(1, val.ndim))
    count = val.new_full((val.shape[0],), float(math.prod(val.shape[1:])))
    if no_const:
        total = val.sum(dim=dims)
    else:
        total = (val / (2 * (noise_std_dev**2)) - torch.log(noise_std_dev) - math.log(math.sqrt(2 * math.pi))).sum(dim=dims)
    return prev_sample, total / count, mean, noise_std_dev


# --------------------------------------------------------------------------- schedules


def _stock_sigmas(config: dict, **set_kwargs) -> torch.Tensor:
    sched: Any = FlowMatchEulerDiscreteScheduler(**config)
    sched.set_timesteps(**set_kwargs)
    return sched.sigmas.to(torch.float32)


SCHEDULES = {
    "toy": torch.tensor([1.0, 0.9, 0.6, 0.25, 0.0], dtype=torch.float32),
    "static_shift": _stock_sigmas({"shift": 3.0}, num_inference_steps=5),
    "dynamic_shift": _stock_sigmas({"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}, num_inference_steps=5, mu=0.8),
    "custom_list": _stock_sigmas({"shift": 1.0}, sigmas=[1.0, 0.83, 0.55, 0.31, 0.07]),
}


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux", "tiny-wan"])
def test_real_schedules_start_exactly_at_one(registry, model_id):
    """The sigma == 1 branch is what the references special-case: a real rollout's schedule (static
    shift, dynamic shift with mu, video) hits it, and its first transition is scored as Flow-GRPO
    scores it there, with std = a exactly in closed form (sqrt(1 / (1 - s1)) a sqrt(1 - s1))."""
    a = 0.7
    spec = RolloutSpec(model=model_id, prompts=("a cat",), num_outputs_per_prompt=2, num_inference_steps=3, seed=4,
                       sampler=SamplerSpec(type="sde", noise_level=a), return_velocities=True)
    res = run_rollout(registry.get(model_id), spec)
    sig = res.snapshot.sigmas
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0, sig
    x0, x1, v = res.captures[0].latent, res.captures[1].latent, res.captures[0].velocity
    assert v is not None and 0 in res.snapshot.sde_steps
    _, ref, _, std_dev_t, sqrt_dt = flow_grpo_step(sig, 0, x0, v, a, "sde", prev_sample=x1)
    _close_ulps((std_dev_t * sqrt_dt).reshape(-1)[0], torch.tensor(a))
    assert torch.equal(res.log_probs[:, 0], ref), (res.log_probs[:, 0], ref)


def _inputs(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    eps = torch.randn(shape, generator=g)
    return x, v, eps


def _close_ulps(got: torch.Tensor, ref: torch.Tensor, ulps: int = ULPS) -> None:
    """|got - ref| <= ulps * eps32 * max(|ref|, 1): a few float32 ULPs of the value's scale."""
    got, ref = got.double(), ref.double()
    scale = ref.abs().clamp(min=1.0)
    err = ((got - ref).abs() / scale).max().item() / EPS32
    assert err <= ulps, f"differs by {err:.2f} ULPs (allowed {ulps})"


def _check_against_flow_grpo(mean, std, lp_density, lp_no_const, sig, i, x, v, a, kind, x_next):
    _, ref_lp, ref_mean, std_dev_t, sqrt_dt = flow_grpo_step(sig, i, x, v, a, kind, prev_sample=x_next)
    ref_std = (std_dev_t * sqrt_dt if kind == "sde" else std_dev_t).reshape(-1)[0]
    _close_ulps(mean, ref_mean)
    _close_ulps(std, ref_std)
    if kind == "sde":
        _close_ulps(lp_density, ref_lp)  # Flow-GRPO's sde log-prob is the full density
    else:
        _close_ulps(lp_no_const, ref_lp)  # Flow-GRPO's cps log-prob is -(x' - mean)^2, no constants


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kind", ["sde", "cps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_flow_grpo_and_sglang(schedule, kind, dtype):
    sig = SCHEDULES[schedule]
    a = 0.7
    last = sig.shape[0] - 2 if kind == "sde" else sig.shape[0] - 3  # cps into sigma' = 0 has std 0
    for i in range(last + 1):
        x, v, eps = _inputs((3, 4, 5, 6), seed=i)
        x, v = x.to(dtype), v.to(dtype)
        x_next, sg_nc, sg_mean, sg_std = sglang_step(sig, i, x, v, a, kind, no_const=True, noise=eps)
        _, sg_density, _, _ = sglang_step(sig, i, x, v, a, kind, no_const=False, noise=eps)
        density = SamplerSpec(type=kind, noise_level=a, log_prob="density")
        no_const = SamplerSpec(type=kind, noise_level=a, log_prob="no_const")
        mean, std = kernel_mean_std(x, v, sig, i, sampler=density)
        lp_d = step_log_prob(x, x_next, v, sig, i, sampler=density)
        lp_nc = step_log_prob(x, x_next, v, sig, i, sampler=no_const)
        assert lp_d.dtype == torch.float32 and lp_d.shape == (3,)
        # SGLang: all four (kernel, kind) pairs.
        _close_ulps(mean, sg_mean)
        _close_ulps(std, sg_std)
        _close_ulps(lp_d, sg_density, ULPS_SGLANG_LOG_PROB)
        _close_ulps(lp_nc, sg_nc, ULPS_SGLANG_LOG_PROB)
        # Flow-GRPO: (sde, density) and (cps, no_const), scoring the same x'.
        _check_against_flow_grpo(mean, std, lp_d, lp_nc, sig, i, x, v, a, kind, x_next)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_random_schedules(kind):
    g = torch.Generator().manual_seed(123)
    for trial in range(20):
        inner = torch.sort(torch.rand(4, generator=g), descending=True).values
        sig = torch.cat([torch.ones(1), inner, torch.zeros(1)]).to(torch.float32)
        a = float(torch.rand(1, generator=g)) * (1.0 if kind == "cps" else 1.5)
        for i in range(sig.shape[0] - 2):
            x, v, eps = _inputs((2, 3, 7), seed=100 * trial + i)
            x_next, sg_nc, sg_mean, _ = sglang_step(sig, i, x, v, a, kind, no_const=True, noise=eps)
            _, sg_d, _, _ = sglang_step(sig, i, x, v, a, kind, no_const=False, noise=eps)
            sampler = SamplerSpec(type=kind, noise_level=a)
            mean, _ = kernel_mean_std(x, v, sig, i, sampler=sampler)
            _close_ulps(mean, sg_mean)
            _close_ulps(step_log_prob(x, x_next, v, sig, i, sampler=sampler), sg_d, ULPS_SGLANG_LOG_PROB)
            nc = step_log_prob(x, x_next, v, sig, i, sampler=SamplerSpec(type=kind, noise_level=a, log_prob="no_const"))
            _close_ulps(nc, sg_nc, ULPS_SGLANG_LOG_PROB)


EDGE_SCHEDULES = {
    **SCHEDULES,
    "flat_steps": torch.tensor([1.0, 0.8, 0.8, 0.3, 0.3, 0.0], dtype=torch.float32),  # sigma' == sigma: sde's std 0
    "long": _stock_sigmas({"shift": 3.0}, num_inference_steps=400),
}


@pytest.mark.parametrize("schedule", list(EDGE_SCHEDULES))
@pytest.mark.parametrize("kind", ["sde", "cps"])
@pytest.mark.parametrize("a", [0.0, 0.7])
def test_stochastic_transitions_are_the_steps_whose_flow_grpo_std_is_positive(schedule, kind, a):
    """The steps that draw noise (and get a log-prob) are those whose transition std, as Flow-GRPO's
    step computes it, is > 0; every step of the schedule is asked at once, shuffled, as a rollout's
    `return` list may be."""
    sig = EDGE_SCHEDULES[schedule]
    steps = list(range(sig.shape[0] - 1))
    x, v, eps = _inputs((1, 2), seed=5)
    expected = set()
    for i in steps:
        _, _, _, std_t, sqrt_dt = flow_grpo_step(sig, i, x, v, a, kind, noise=eps)
        std = std_t * sqrt_dt if kind == "sde" else std_t
        if bool((std > 0).all()):
            expected.add(i)
    shuffled = steps[1::2] + steps[::2]
    got = stochastic_transitions(shuffled, sig, sampler=SamplerSpec(type=kind, noise_level=a))
    assert got == expected
    assert stochastic_transitions([], sig, sampler=SamplerSpec(type=kind, noise_level=a)) == frozenset()
    if a > 0:  # the terminal step into sigma = 0 draws no noise under cps
        assert (sig.shape[0] - 2 in got) == (kind == "sde")
        assert len(got) > 0
    if schedule == "flat_steps":  # sde's std has sqrt(sigma - sigma'); cps's is sigma' sin(a pi / 2) alone
        assert (got & {1, 3}) == (set() if kind == "sde" or a == 0 else {1, 3})


@pytest.mark.parametrize("schedule", ["static_shift", "dynamic_shift", "custom_list"])
def test_the_old_numerator_substitution_is_detected(schedule):
    """sigmaflight's first transition (sigma == 1) against its closed form in float64: only the
    denominator takes s1 = sigmas[1], so std_t = a sqrt(1 / (1 - s1)) and std = std_t sqrt(1 - s1) = a.
    The formula sigmaflight used before (s1 in the numerator too) gives std = a sqrt(s1)."""
    sig = SCHEDULES[schedule]
    assert sig[0].item() == 1.0
    a = 0.7
    s1 = sig[1].item()
    x, v, eps = _inputs((2, 4, 8, 8), seed=7)
    dt = s1 - 1.0
    std_t = a * math.sqrt(1.0 / (1.0 - s1))
    ref_std = std_t * math.sqrt(-dt)
    # sigma = 1: mean = x (1 + std_t^2 dt / 2) + v (1 + std_t^2 (1 - 1) / 2) dt
    ref_mean = x.double() * (1 + std_t**2 * dt / 2) + v.double() * dt
    x_next = (ref_mean + ref_std * eps.double()).float()
    ref_lp = (-((x_next.double() - ref_mean) ** 2) / (2 * ref_std**2) - math.log(ref_std)
              - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    sampler = SamplerSpec(type="sde", noise_level=a)
    mean, std = kernel_mean_std(x, v, sig, 0, sampler=sampler)
    _close_ulps(std, torch.tensor(ref_std, dtype=torch.float64))
    _close_ulps(mean, ref_mean)
    _close_ulps(step_log_prob(x, x_next, v, sig, 0, sampler=sampler), ref_lp, ULPS_SGLANG_LOG_PROB)
    # The check tells the old formula apart: its std is off by far more ULPs than allowed.
    assert abs(a * math.sqrt(s1) - ref_std) / (EPS32 * max(ref_std, 1.0)) > 1000 * ULPS


def test_no_const_is_not_divided_by_two_std_squared():
    sig = SCHEDULES["toy"]  # transition 1: std 1.15 (sde) and 0.54 (cps), so 2 std^2 is far from 1
    zeros = torch.zeros(1, 2, 8, 8)
    x, v, eps = _inputs((3, 2, 8, 8), seed=11)
    x_next = x + 0.3 * eps
    for kind in ("sde", "cps"):
        sampler = SamplerSpec(type=kind, noise_level=0.7, log_prob="no_const")
        # x = v = 0: the mean of both kernels is 0 whatever their coefficients, so x' = 1 scores -(1 - 0)^2.
        got = step_log_prob(zeros, torch.ones(1, 2, 8, 8), zeros, sig, 1, sampler=sampler)
        assert torch.equal(got, torch.tensor([-1.0])), (kind, got)
        # Any x and v: -(x' - mean)^2 with Flow-GRPO's mean (its cps log-prob is exactly this).
        _, cps_lp, ref_mean, _, _ = flow_grpo_step(sig, 1, x, v, 0.7, kind, prev_sample=x_next)
        ref = -((x_next - ref_mean) ** 2).mean(dim=(1, 2, 3))
        if kind == "cps":
            assert torch.equal(ref, cps_lp)
        _close_ulps(step_log_prob(x, x_next, v, sig, 1, sampler=sampler), ref)


def test_log_prob_is_a_mean_not_a_sum():
    sig = SCHEDULES["toy"]
    sampler = SamplerSpec(type="sde", noise_level=0.7, log_prob="no_const")
    small = step_log_prob(torch.zeros(1, 2, 8, 8), torch.ones(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), sig, 1, sampler=sampler)
    big = step_log_prob(torch.zeros(1, 2, 16, 16), torch.ones(1, 2, 16, 16), torch.zeros(1, 2, 16, 16), sig, 1, sampler=sampler)
    torch.testing.assert_close(small, big)


def test_noise_level_zero_sde_mean_is_euler():
    sig = SCHEDULES["toy"]
    x, v, _ = _inputs((2, 3, 4), seed=0)
    mean, std = kernel_mean_std(x, v, sig, 2, sampler=SamplerSpec(type="sde", noise_level=0.0))
    assert float(std) == 0.0
    torch.testing.assert_close(mean, x + (sig[3] - sig[2]) * v)
