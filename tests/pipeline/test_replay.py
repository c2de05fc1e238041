"""Replay and the public scoring function, against references that share no code with pipeline/.

References: the stock diffusers pipeline `__call__` (its own CFG, its own stock
FlowMatchEulerDiscreteScheduler and schedule) made to step onto the rollout's stored latents,
which gives the velocity at every x_i; and Flow-GRPO's `sde_step_with_logprob`, transcribed in
test_kernels, which scores each transition from that velocity.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput
from sigmaflight.pipeline.replay import Replayer, step_log_prob
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

from tests.pipeline.test_kernels import flow_grpo_step

PROMPTS: dict[str, Any] = dict(prompts=("a cat", "the dog"), num_outputs_per_prompt=2, guidance_scale=4.5,
                               negative_prompt="blurry")


def _run(registry, kind, steps=None, return_steps=None, num_steps=3, log_prob="density", velocities=False):
    if kind == "cps" and steps is None:
        steps = tuple(range(num_steps - 1))  # cps has std = 0 at the last transition (sigma' = 0): no density
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", num_inference_steps=num_steps, seed=21, return_steps=return_steps,
                       sampler=SamplerSpec(type=kind, noise_level=0.7, sde_steps=steps, log_prob=log_prob),
                       return_velocities=velocities, **PROMPTS)
    res = run_rollout(model, spec)
    latents = torch.stack([c.latent for c in res.captures], dim=1)  # [B, K, ...]
    return model, spec, res, latents


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


class _SteppedOntoStoredLatents(FlowMatchEulerDiscreteScheduler):
    """The stock scheduler, made to follow a stored trajectory: `step` keeps the model output the
    pipeline hands it (the CFG-combined velocity at x_i) and returns the stored x_{i+1}."""

    stored: torch.Tensor  # [B, T+1, ...]
    seen: list[torch.Tensor]

    def step(self, model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
        i = len(self.seen)
        assert torch.equal(sample.cpu(), self.stored[:, i]), f"the pipeline did not feed x_{i} back in"
        self.seen.append(model_output.detach().float().cpu().clone())
        super().step(model_output, timestep, sample, *args, **kwargs)  # type: ignore[misc]  # the stock bookkeeping
        x_next = self.stored[:, i + 1].to(sample.device, sample.dtype)
        if kwargs.get("return_dict", True) is False:
            return (x_next,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=x_next)  # type: ignore[arg-type]  # a FloatTensor


def _stock_velocities(model, spec, latents):
    """The stock pipeline on the rollout's modules and prompts, every x_i taken from `latents`
    (all T+1 of them): its velocity at each step and the schedule its stock scheduler set."""
    pipe, d = model.pipeline, model.defaults
    scheduler = _SteppedOntoStoredLatents.from_config(pipe.scheduler.config)
    scheduler.stored, scheduler.seen = latents, []
    stock = type(pipe)(**{**pipe.components, "scheduler": scheduler})
    stock.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        stock(prompt=list(spec.prompts), negative_prompt=spec.negative_prompt, guidance_scale=spec.guidance_scale,
              num_images_per_prompt=spec.num_outputs_per_prompt, height=d.height, width=d.width,
              num_inference_steps=spec.num_inference_steps, latents=latents[:, 0].to(model.device, model.dtype),
              output_type="latent", **d.call_kwargs)
    assert len(scheduler.seen) == spec.num_inference_steps
    return scheduler.seen, scheduler.sigmas.to(torch.float32)


def _flow_grpo_log_prob(sigmas, i, x, v, x_next, sampler):
    """Flow-GRPO's kernel for the mean and std; its "sde" density, or its "cps" -(x' - mean)^2."""
    _, lp, mean, std_dev_t, sqrt_dt = flow_grpo_step(sigmas, i, x, v, sampler.noise_level, sampler.type, prev_sample=x_next)
    if sampler.type == "sde" or sampler.log_prob == "no_const":
        assert (sampler.type, sampler.log_prob) in (("sde", "density"), ("cps", "no_const"))
        return lp
    # cps scored as a density (Flow-GRPO scores cps without constants): its sde density expression, cps std.
    std = std_dev_t
    lp = -((x_next.float() - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


@pytest.mark.parametrize(("kind", "log_prob"), [("sde", "density"), ("cps", "no_const"), ("cps", "density")])
def test_replay_equals_rollout_bit_for_bit_with_cfg(registry, kind, log_prob):
    model, spec, res, latents = _run(registry, kind, log_prob=log_prob)
    # CFG is really on: the same request without guidance takes another path.
    no_cfg = run_rollout(model, RolloutSpec(**{**spec.__dict__, "guidance_scale": 1.0}))
    assert not torch.equal(no_cfg.captures[1].latent, res.captures[1].latent)
    rep = Replayer(model).replay(spec, latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                 timesteps=res.snapshot.timesteps, seeds=res.seeds)
    velocities, stock_sigmas = _stock_velocities(model, spec, latents)
    assert torch.equal(stock_sigmas, res.snapshot.sigmas)
    stochastic = spec.sampler.sde_steps or range(3)
    assert torch.isfinite(res.log_probs[:, list(stochastic)]).all()
    for i in range(spec.num_inference_steps):
        assert torch.equal(rep.velocities[i], velocities[i]), f"the replay's velocity at step {i} is not the stock pipeline's"
        if i in stochastic:
            ref = _flow_grpo_log_prob(stock_sigmas, i, latents[:, i], velocities[i], latents[:, i + 1], spec.sampler)
            assert torch.equal(rep.log_probs[:, i], ref), f"step {i}: {rep.log_probs[:, i]} != Flow-GRPO's {ref}"
    assert _same(rep.log_probs, res.log_probs)


def test_replay_with_a_gap_in_the_capture(registry):
    model, spec, res, latents = _run(registry, "sde", steps=(2,), return_steps=(2, 3))
    replayed = Replayer(model).log_probs(spec, latents=latents, steps=(2, 3), sigmas=res.snapshot.sigmas,
                                         timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(replayed[:, 2]).all() and _same(replayed, res.log_probs)


def test_a_lossy_bf16_capture_replays_on_a_float32_model(registry):
    """The stored x_{i+1} went into the step in its stored dtype: a bfloat16 capture replayed on a
    float32 model raised torch's "Input type and bias type should be the same". It is cast to the
    model's dtype as x_0 is; the log-probs are those of the rounded latents (Flow-GRPO's kernel on
    them), not the rollout's own, as docs/pipeline.md says of lossy captures."""
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", num_inference_steps=3, seed=21, latent_dtype="bfloat16",
                       sampler=SamplerSpec(type="sde", noise_level=0.7), **PROMPTS)
    res = run_rollout(model, spec)
    latents = torch.stack([c.latent for c in res.captures], dim=1)
    assert latents.dtype == torch.bfloat16
    rep = Replayer(model).replay(spec, latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                 timesteps=res.snapshot.timesteps, seeds=res.seeds)
    for i in range(spec.num_inference_steps):
        x, x_next = latents[:, i].float(), latents[:, i + 1].float()
        ref = _flow_grpo_log_prob(res.snapshot.sigmas, i, x, rep.velocities[i], x_next, spec.sampler)
        assert torch.isfinite(rep.log_probs[:, i]).all() and torch.equal(rep.log_probs[:, i], ref)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_replay_with_drifted_sigmas_does_not_match(registry, kind):
    # T = 14: a schedule where timesteps / 1000 differs from the snapshot by an ULP (see test_schedules).
    model, spec, res, latents = _run(registry, kind, num_steps=14)
    snap = res.snapshot
    replayer = Replayer(model)
    from_t = torch.cat([snap.timesteps / 1000, torch.zeros(1)])
    bf16 = snap.sigmas.to(torch.bfloat16)
    assert not torch.equal(from_t, snap.sigmas) and not torch.equal(bf16.float(), snap.sigmas)
    # cps at T = 14 happens to absorb the one-ULP t/1000 drift in rounding; bf16 sigmas break both.
    for sigmas in ((from_t, bf16) if kind == "sde" else (bf16,)):
        got = replayer.log_probs(spec, latents=latents, steps=snap.steps, sigmas=sigmas,
                                 timesteps=snap.timesteps, seeds=res.seeds)
        assert not _same(got, res.log_probs)
    exact = replayer.log_probs(spec, latents=latents, steps=snap.steps, sigmas=snap.sigmas,
                               timesteps=snap.timesteps, seeds=res.seeds)
    assert _same(exact, res.log_probs)


@pytest.mark.parametrize(("kind", "log_prob"), [("sde", "density"), ("cps", "no_const")])
def test_step_log_prob_is_the_public_scoring_function(registry, kind, log_prob):
    """What a trainer does with a trajectory: `step_log_prob` on the stored x_i, x_{i+1} and the
    rollout's velocity gives the recorded log-prob bit for bit, and that is Flow-GRPO's."""
    _, spec, res, latents = _run(registry, kind, log_prob=log_prob, velocities=True)
    sigmas = res.snapshot.sigmas
    scored = 0
    for i in sorted(res.snapshot.sde_steps):
        v = res.captures[i].velocity
        assert v is not None
        got = step_log_prob(latents[:, i], latents[:, i + 1], v, sigmas, i, sampler=spec.sampler)
        assert got.shape == (spec.num_samples,) and got.dtype == torch.float32
        assert torch.equal(got, res.log_probs[:, i]), f"step {i}: not the log-prob the rollout recorded"
        ref = _flow_grpo_log_prob(sigmas, i, latents[:, i], v, latents[:, i + 1], spec.sampler)
        assert torch.equal(got, ref), f"step {i}: {got} != Flow-GRPO's {ref}"
        moved = step_log_prob(latents[:, i], latents[:, i + 1] + 1e-3, v, sigmas, i, sampler=spec.sampler)
        assert not torch.equal(moved, got)
        scored += 1
    assert scored == (3 if kind == "sde" else 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_flux_replays_bit_for_bit_with_several_samples(dtype):
    """Each stored x_{i+1} went back into the pipeline as a strided view of the trajectory's
    [B, K, ...] latents; FLUX feeds it straight to a Linear, and on CPU a bf16/fp16 matmul of a
    strided input gives other bits than of the contiguous x_{i+1} the rollout made: the replay was
    1e-4 off from step 1 on (B > 1; x_0 is concatenated, so step 0 was exact)."""
    from sigmaflight.pipeline.models import ModelRegistry

    model = ModelRegistry(dtype=dtype).get("tiny-flux")
    spec = RolloutSpec(model="tiny-flux", prompts=("a cat", "b"), num_outputs_per_prompt=2, num_inference_steps=4,
                       seed=3, sampler=SamplerSpec(type="sde", noise_level=0.7))
    res = run_rollout(model, spec)
    latents = torch.stack([c.latent for c in res.captures], dim=1)  # [B, K, ...], as Trajectory.latents holds them
    assert latents.dtype == dtype and not latents[:, 1].is_contiguous()
    replayed = Replayer(model).log_probs(spec, latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                         timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(res.log_probs).all() and torch.equal(replayed, res.log_probs)
