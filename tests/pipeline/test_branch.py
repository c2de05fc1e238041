"""Branch rollouts: start at a parent's x_k on the parent's schedule (TempFlow-GRPO / BranchGRPO).

References: the parent rollout's own captured latents (an "ode" branch must continue it bit
for bit), Flow-GRPO's `sde_step_with_logprob` (transcribed in test_kernels) for the log-prob
at the branching transition, and the stock pipeline's step count.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
import torch
from sigmaflight.pipeline.kernels import step_log_prob
from sigmaflight.pipeline.replay import Replayer
from sigmaflight.pipeline.rollout import parent_metadata, rollout_metadata, run_rollout
from sigmaflight.pipeline.spec import BranchStart, RolloutInputError, RolloutSpec, SamplerSpec

from tests.pipeline.test_kernels import flow_grpo_step

T = 4
PARENT: dict[str, Any] = dict(prompts=("a cat", "the dog"), num_outputs_per_prompt=2, guidance_scale=4.5, negative_prompt="blurry")


def _parent(model, *, per_row=False, conditioning=False):
    spec = RolloutSpec(model=model.id, num_inference_steps=T, seed=17, sampler=SamplerSpec(type="ode"),
                       return_conditioning=conditioning, **PARENT)
    return spec, run_rollout(model, spec, per_sample_model_calls=per_row)


def _branch_from(parent_spec, parent, k, samples, *, with_conditioning=False):
    snap = parent.snapshot
    cond = None
    if with_conditioning:
        cond = {name: t[list(samples)] for name, t in parent.conditioning.items()}
    return BranchStart(step=k, latents=parent.captures[k].latent[list(samples)], sigmas=snap.sigmas,
                       timesteps=snap.timesteps, set_timesteps_kwargs=snap.set_timesteps_kwargs, samples=tuple(samples),
                       prompt_index=tuple(snap.prompt_index[j] for j in samples), rollout="parent-1", conditioning=cond)


def _branch_spec(parent_spec, branch, n, sampler, **kw):
    own = {"seed": None, "return_conditioning": False, **kw}
    return dataclasses.replace(parent_spec, branch_from=branch, num_outputs_per_prompt=n, sampler=sampler, **own)


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux", "tiny-wan"])
@pytest.mark.parametrize("k", [0, 2])
def test_ode_branch_continues_the_parent_bit_for_bit(registry, model_id, k):
    model = registry.get(model_id)
    spec, parent = _parent(model, conditioning=True)
    samples = tuple(range(spec.num_samples))  # the parent's batch layout: the same model calls
    # Re-encoding the prompts and reusing the parent's conditioning both continue the parent.
    for with_cond in (False, True):
        branch = _branch_from(spec, parent, k, samples, with_conditioning=with_cond)
        res = run_rollout(model, _branch_spec(spec, branch, 1, SamplerSpec(type="ode")))
        assert res.snapshot.steps == tuple(range(k, T + 1)) and [c.step for c in res.captures] == list(range(k, T + 1))
        assert torch.equal(res.snapshot.sigmas, parent.snapshot.sigmas)
        assert torch.equal(res.snapshot.timesteps, parent.snapshot.timesteps)
        for c in res.captures:
            assert torch.equal(c.latent, parent.captures[c.step].latent), f"x_{c.step} differs from the parent's"
        assert res.log_probs.isnan().all()


def test_ode_branches_of_chosen_samples_continue_their_parents(registry):
    # Per-row model calls make every row independent of the batch: 2 of 4 parents, 2 branches each.
    model = registry.get("tiny-sd3")
    spec, parent = _parent(model, per_row=True, conditioning=True)
    k, samples, n = 1, (3, 0), 2
    branch = _branch_from(spec, parent, k, samples)
    bspec = dataclasses.replace(_branch_spec(spec, branch, n, SamplerSpec(type="ode")), return_conditioning=True)
    res = run_rollout(model, bspec, per_sample_model_calls=True)
    assert res.parent_sample == (3, 3, 0, 0) and res.prompt_index == (1, 1, 0, 0)
    assert res.conditioning is not None
    for name, t in res.conditioning.items():  # the prompts encoded again: the parent rows' bits
        assert torch.equal(t, parent.conditioning[name][[3, 3, 0, 0]]), name
    for c in res.captures:
        expect = parent.captures[c.step].latent[[3, 3, 0, 0]]
        assert c.latent.shape[0] == len(samples) * n and torch.equal(c.latent, expect), f"x_{c.step}"


def test_sde_only_at_the_branching_transition(registry):
    model = registry.get("tiny-sd3")
    spec, parent = _parent(model)
    k, samples, n = 2, (0, 3), 3
    sampler = SamplerSpec(type="sde", noise_level=0.7, sde_steps=(k,))
    branch = _branch_from(spec, parent, k, samples)
    bspec = _branch_spec(spec, branch, n, sampler, seed=5, return_velocities=True)
    res = run_rollout(model, bspec)
    b = len(samples) * n
    x = {c.step: c for c in res.captures}
    assert sorted(x) == [2, 3, 4] and all(c.latent.shape[0] == b for c in res.captures)
    assert torch.equal(x[k].latent, parent.captures[k].latent[[0, 0, 0, 3, 3, 3]])  # x_k is the parent's
    assert res.snapshot.sde_steps == (k,) and res.parent_sample == (0, 0, 0, 3, 3, 3)
    for step in (3, 4):  # after k the branches of one parent differ: fresh noise from their own seeds
        for p in range(len(samples)):
            rows = x[step].latent[p * n:(p + 1) * n]
            assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[1], rows[2])
    assert torch.isfinite(res.log_probs[:, k]).all()
    assert res.log_probs[:, [0, 1, 3]].isnan().all()  # before k, and the ode transition after it
    v = x[k].velocity
    assert v is not None
    assert torch.equal(res.log_probs[:, k], step_log_prob(x[k].latent, x[k + 1].latent, v, res.snapshot.sigmas, k,
                                                           sampler=sampler))
    _, ref, *_ = flow_grpo_step(res.snapshot.sigmas, k, x[k].latent, v, 0.7, "sde", prev_sample=x[k + 1].latent)
    assert torch.allclose(res.log_probs[:, k].double(), ref.double(), rtol=0, atol=1e-5)
    # The branch's seeds are its own: another seed gives other branches from the same x_k.
    other = run_rollout(model, dataclasses.replace(bspec, seed=6))
    assert torch.equal(other.captures[0].latent, x[k].latent) and not torch.equal(other.captures[1].latent, x[k + 1].latent)
    # The replay scores the branch from its own spec, bit for bit.
    latents = torch.stack([c.latent for c in res.captures], dim=1)
    rep = Replayer(model).replay(bspec, latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                 timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.equal(rep.log_probs[:, k], res.log_probs[:, k]) and torch.equal(rep.velocities[k], v)
    trainer = dataclasses.replace(model, pipeline=type(model.pipeline)(**{
        **model.pipeline.components, "transformer": copy.deepcopy(model.pipeline.transformer).requires_grad_(True)}))
    with_grad = Replayer(trainer).log_probs(bspec, latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                            timesteps=res.snapshot.timesteps, seeds=res.seeds, grad=True)
    assert with_grad.requires_grad and torch.equal(with_grad.detach()[:, k], res.log_probs[:, k])
    with_grad[:, k].sum().backward()


def test_branch_metadata_names_the_parent(registry):
    model = registry.get("tiny-sd3")
    spec, parent = _parent(model)
    branch = _branch_from(spec, parent, 1, (2,))
    bspec = _branch_spec(spec, branch, 2, SamplerSpec(type="sde"))
    res = run_rollout(model, bspec)
    assert parent_metadata(bspec) == {"rollout": "parent-1", "step": 1, "samples": [2]}
    assert parent_metadata(spec) is None
    meta = json.loads(json.dumps(rollout_metadata(model, bspec, res.snapshot)))
    assert meta["request"]["branch_from"] == {"rollout": "parent-1", "step": 1, "samples": [2]}
    assert meta["num_samples"] == 2 and meta["scheduler"]["set_timesteps"] == dict(parent.snapshot.set_timesteps_kwargs)
    assert res.snapshot.start_step == 1 and res.snapshot.sde_steps == (1, 2, 3)  # default: all of k..T-1


def _error(model, spec):
    with pytest.raises(RolloutInputError) as e:
        run_rollout(model, spec)
    return e.value.field


def test_branch_validation_names_the_field(registry):
    model = registry.get("tiny-sd3")
    spec, parent = _parent(model)
    ok = _branch_from(spec, parent, 2, (0, 1))
    ode = SamplerSpec(type="ode")
    for k in (T, -1):
        assert _error(model, _branch_spec(spec, dataclasses.replace(ok, step=k), 1, ode)) == "branch_from.step"
    assert _error(model, _branch_spec(spec, ok, 1, SamplerSpec(sde_steps=(1,)))) == "sampler.sde_steps"
    assert _error(model, _branch_spec(spec, ok, 1, ode, return_steps=(1, 4))) == "return.steps"
    assert _error(model, _branch_spec(spec, ok, 1, ode, seeds=(1, 2, 3))) == "seeds"  # B = 2 x 1
    bad_rows = dataclasses.replace(ok, latents=ok.latents[:1])
    assert _error(model, _branch_spec(spec, bad_rows, 1, ode)) == "branch_from.latents"
    bad_prompt = dataclasses.replace(ok, prompt_index=(0, 2))
    assert _error(model, _branch_spec(spec, bad_prompt, 1, ode)) == "branch_from.prompt_index"
    bad_sched = dataclasses.replace(ok, sigmas=ok.sigmas[:-1])
    assert _error(model, _branch_spec(spec, bad_sched, 1, ode)) == "branch_from.sigmas"
    # In range they run: sde_steps at k, return.steps from k.
    res = run_rollout(model, _branch_spec(spec, ok, 1, SamplerSpec(sde_steps=(2,)), return_steps=(2, 4)))
    assert [c.step for c in res.captures] == [2, 4]
