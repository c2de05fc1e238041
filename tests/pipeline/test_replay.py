import pytest
import torch
from sigmaflight.pipeline.replay import Replayer, step_log_prob
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec


def _run(registry, kind, steps=None, return_steps=None, num_steps=3):
    if kind == "cps" and steps is None:
        steps = tuple(range(num_steps - 1))  # cps has std = 0 at the last transition (sigma' = 0): no density
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat", "the dog"), num_outputs_per_prompt=2, num_inference_steps=num_steps,
                       guidance_scale=4.5, negative_prompt="blurry", seed=21,
                       sampler=SamplerSpec(type=kind, noise_level=0.7, sde_steps=steps), return_steps=return_steps)
    res = run_rollout(model, spec)
    latents = torch.stack([c.latent for c in res.captures], dim=1)  # [B, K, ...]
    return model, spec, res, latents


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_replay_equals_rollout_bit_for_bit_with_cfg(registry, kind):
    model, spec, res, latents = _run(registry, kind)
    # CFG is really on: the same request without guidance takes another path.
    no_cfg = run_rollout(model, RolloutSpec(**{**spec.__dict__, "guidance_scale": 1.0}))
    assert not torch.equal(no_cfg.captures[1].latent, res.captures[1].latent)
    replayed = Replayer(model).log_probs(spec, latents=latents, steps=res.snapshot.steps,
                                         sigmas=res.snapshot.sigmas, timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(res.log_probs[:, list(spec.sampler.sde_steps or range(3))]).all()
    assert _same(replayed, res.log_probs)


def test_replay_with_a_gap_in_the_capture(registry):
    model, spec, res, latents = _run(registry, "sde", steps=(2,), return_steps=(2, 3))
    replayed = Replayer(model).log_probs(spec, latents=latents, steps=(2, 3), sigmas=res.snapshot.sigmas,
                                         timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(replayed[:, 2]).all() and _same(replayed, res.log_probs)


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


def test_step_log_prob_is_the_public_scoring_function(registry):
    model, spec, res, latents = _run(registry, "sde")
    v = torch.zeros_like(latents[:, 0])
    a = step_log_prob(latents[:, 1], latents[:, 2], v, res.snapshot.sigmas, 1, sampler=spec.sampler)
    b = step_log_prob(latents[:, 1], latents[:, 2] + 1e-3, v, res.snapshot.sigmas, 1, sampler=spec.sampler)
    assert a.shape == (4,) and a.dtype == torch.float32 and not torch.equal(a, b)
