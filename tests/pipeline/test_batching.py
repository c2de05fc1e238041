"""Co-batched rollouts (`run_batch`) against references that are not sigmaflight's own code:
the stock pipeline's `prepare_latents`, the transformer's own inputs (a forward pre-hook), a
transcription of Flow-GRPO's step, and the same request run alone."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import torch
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.replay import Replayer, ReplayItem
from sigmaflight.pipeline.rollout import BatchMember, RolloutResult, run_batch, run_rollout
from sigmaflight.pipeline.spec import (
    BatchInfo,
    BranchStart,
    RolloutCancelled,
    RolloutNonFinite,
    RolloutSpec,
    SamplerSpec,
)

from tests.pipeline.test_kernels import flow_grpo_step

T = 4
SAMPLER = SamplerSpec(type="sde", noise_level=0.7)


def spec(**kw) -> RolloutSpec:
    base = dict(model="tiny-sd3", prompts=("a red cube",), num_inference_steps=T, seed=1, sampler=SAMPLER,
                guidance_scale=4.5)
    return RolloutSpec(**{**base, **kw})


def members_of(*specs: RolloutSpec) -> list[BatchMember]:
    return [BatchMember(spec=s) for s in specs]


def results(outcomes) -> list[RolloutResult]:
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    return list(outcomes)


# Three requests that differ in everything members keep their own: prompts, prompt count,
# outputs per prompt (so the call lays out one prompt per sample), negative prompt, seeds, sde window.
A = spec(prompts=("a red cube", "a blue ball"), seed=11, sampler=dataclasses.replace(SAMPLER, sde_steps=(0, 1)))
B = spec(prompts=("a dog",), num_outputs_per_prompt=2, seed=12)
C = spec(prompts=("a cat",), negative_prompt="blurry", seeds=(123456789,), return_velocities=True)


def batch_of(res: RolloutResult) -> BatchInfo:
    assert res.snapshot.batch is not None
    return res.snapshot.batch


def latent(res: RolloutResult, step: int) -> torch.Tensor:
    (cap,) = [c for c in res.captures if c.step == step]
    return cap.latent


@pytest.fixture(scope="module")
def batched(registry: ModelRegistry) -> list[RolloutResult]:
    specs = [dataclasses.replace(s, return_velocities=True) for s in (A, B, C)]
    return results(run_batch(registry.get("tiny-sd3"), members_of(*specs)))


def test_every_members_x0_is_the_stock_prepare_latents_draw_of_its_own_seeds(registry, batched):
    model = registry.get("tiny-sd3")
    pipe = model.pipeline
    d = model.defaults
    for res in batched:
        gens = [torch.Generator("cpu").manual_seed(int(s)) for s in res.seeds]
        want = pipe.prepare_latents(len(res.seeds), pipe.transformer.config.in_channels, d.height, d.width,
                                    torch.float32, torch.device("cpu"), gens)
        assert torch.equal(latent(res, 0), want)


def test_each_stored_latent_is_the_row_the_model_saw(registry):
    """A forward pre-hook on the transformer records its hidden_states ([uncond; cond] copies of the
    call's latents, CFG); member m's x_i is rows [first, end) of step i's call, bit for bit."""
    model = registry.get("tiny-sd3")
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        seen.append(kwargs["hidden_states"].detach().clone())

    handle = model.pipeline.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = results(run_batch(model, members_of(A, B, C)))
    finally:
        handle.remove()
    assert len(seen) == T
    total = sum(len(r.seeds) for r in out)
    for res in out:
        first, end = batch_of(res).rows
        assert batch_of(res).samples == total and batch_of(res).requests == 3
        for i in range(T):
            rows = seen[i][:total][first:end]
            assert torch.equal(latent(res, i), rows), (res.seeds, i)
            assert torch.equal(seen[i][total:][first:end], rows)  # the cond half sees the same latents


def test_rows_are_disjoint_and_cover_the_call(batched):
    rows = sorted(batch_of(r).rows for r in batched)
    assert rows[0][0] == 0 and all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[-1][1] == batch_of(batched[0]).samples == 5
    assert len({batch_of(r).id for r in batched}) == 1


def test_each_member_keeps_its_own_sde_window_and_flow_grpo_log_probs(batched):
    """Member A is stochastic at transitions 0 and 1 only, B and C at all; every recorded log-prob is
    Flow-GRPO's `sde_step_with_logprob` (the test's transcription) on the member's own stored x_i,
    x_{i+1} and velocity, within a few ULPs; the deterministic transitions record nothing."""
    a, b, c = batched
    assert a.snapshot.sde_steps == (0, 1) and b.snapshot.sde_steps == c.snapshot.sde_steps == (0, 1, 2, 3)
    for res in batched:
        sigmas = res.snapshot.sigmas
        for i in range(T):
            lp = res.log_probs[:, i]
            if i not in res.snapshot.sde_steps:
                assert torch.isnan(lp).all()
                continue
            (cap,) = [x for x in res.captures if x.step == i]
            _, ref, *_ = flow_grpo_step(sigmas, i, cap.latent, cap.velocity, 0.7, "sde", prev_sample=latent(res, i + 1))
            torch.testing.assert_close(lp, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * ref.abs().max().item())


def test_a_replay_in_the_same_company_gives_the_log_probs_bit_for_bit(registry, batched):
    model = registry.get("tiny-sd3")
    items = []
    for s, res in zip((A, B, C), batched, strict=True):
        steps = [c.step for c in res.captures]
        items.append(ReplayItem(spec=dataclasses.replace(s, return_velocities=True),
                                latents=torch.stack([c.latent for c in res.captures], dim=1), steps=steps,
                                sigmas=res.snapshot.sigmas, timesteps=res.snapshot.timesteps, seeds=res.seeds))
    replayed = Replayer(model).replay_batch(items)
    for res, rep in zip(batched, replayed, strict=True):
        assert torch.equal(rep.log_probs.nan_to_num(-7.0), res.log_probs.nan_to_num(-7.0))


def test_the_calls_shared_kernel_gives_each_member_what_its_own_rows_alone_give(registry, batched):
    """The driver computes a stochastic step's kernel once over the whole call and hands each member
    its rows. Whatever the company, a member's x_{i+1} must be `advance` on its own rows alone, and
    its log-prob the public `step_log_prob` of its stored x_i, x_{i+1} and velocity, bit for bit."""
    from sigmaflight.pipeline.kernels import step_log_prob
    from sigmaflight.pipeline.schedules import make_rollout_scheduler
    from sigmaflight.pipeline.stepping import advance

    model = registry.get("tiny-sd3")
    scheduler = make_rollout_scheduler(model.pipeline.scheduler, cast(Any, None))  # a stochastic step never asks it
    for res in batched:
        for i in res.snapshot.sde_steps:
            (cap,) = [c for c in res.captures if c.step == i]
            alone = advance(scheduler, i, cap.latent, cap.velocity, res.snapshot.sigmas, sampler=SAMPLER,
                            seeds=res.seeds, stochastic=True)
            assert torch.equal(latent(res, i + 1), alone), (res.seeds, i)
            scored = step_log_prob(cap.latent, latent(res, i + 1), cap.velocity, res.snapshot.sigmas, i, sampler=SAMPLER)
            assert torch.equal(res.log_probs[:, i], scored), (res.seeds, i)


def test_with_per_row_model_calls_a_member_is_bit_identical_to_the_request_alone(registry):
    """--batch-invariant: the model runs row by row, so a member's trajectory is its solo one."""
    model = registry.get("tiny-sd3")
    together = results(run_batch(model, members_of(A, B, C), per_sample_model_calls=True))
    for s, res in zip((A, B, C), together, strict=True):
        alone = run_rollout(model, s, per_sample_model_calls=True)
        assert [c.step for c in res.captures] == [c.step for c in alone.captures]
        for got, want in zip(res.captures, alone.captures, strict=True):
            assert torch.equal(got.latent, want.latent), (s.prompts, got.step)
        assert torch.equal(res.log_probs.nan_to_num(-7.0), alone.log_probs.nan_to_num(-7.0))
        assert torch.equal(res.final_latents, alone.final_latents)
        assert batch_of(res).requests == 3 and batch_of(alone).requests == 1


class Recorder:
    """A sink of the test's own: each member's steps done and its end, by name; `refuse` names a
    member whose weights check fails."""

    def __init__(self, names: dict[int, str], refuse: str | None = None) -> None:
        self.names, self.refuse = names, refuse
        self.done = dict.fromkeys(names.values(), 0)
        self.events: list[str] = []
        self.steps = 0

    def start(self, rollout, policy) -> None:
        if self.names[id(rollout)] == self.refuse:
            raise RuntimeError(f"stale: {policy.digest[:8]}")

    def schedule(self, running):
        return []

    def step(self, step):
        self.steps += 1
        for r in step.running:
            self.done[self.names[id(r.rollout)]] = step.i + 1
        return []

    def end(self, rows, outcome) -> None:
        name = self.names[id(rows.rollout)]
        self.events.append(f"{name} {type(outcome).__name__} while {self.done}")


def test_a_member_that_is_cancelled_ends_at_once_and_the_others_finish(registry):
    model = registry.get("tiny-sd3")
    cancelled = BatchMember(A)
    other = BatchMember(B)
    sink = Recorder({id(cancelled): "A", id(other): "B"})
    cancelled.stop = lambda: sink.done["A"] >= 1
    a, b = run_batch(model, [cancelled, other], sink)
    assert isinstance(a, RolloutCancelled) and "after step 1 of 4" in str(a)
    assert isinstance(b, RolloutResult) and [c.step for c in b.captures] == [0, 1, 2, 3, 4]
    assert sink.done == {"A": 1, "B": 4}
    assert sink.steps == 4  # one report a step for the whole call
    # A ended in step 0, not at the end
    assert sink.events == ["A RolloutCancelled while {'A': 1, 'B': 1}", "B RolloutResult while {'A': 1, 'B': 4}"]


def _branch(res: RolloutResult, step: int, scale: float = 1.0) -> BranchStart:
    return BranchStart(step=step, latents=latent(res, step) * scale, sigmas=res.snapshot.sigmas,
                       timesteps=res.snapshot.timesteps, set_timesteps_kwargs=res.snapshot.set_timesteps_kwargs,
                       samples=tuple(range(len(res.seeds))), prompt_index=res.snapshot.prompt_index,
                       rollout="parent")


def test_a_member_that_turns_non_finite_fails_alone_with_its_own_first_step(registry, batched):
    """Two branches of one parent at step 2: one starts from x_2 * 1e38 (overflows in its first
    step), the other from x_2 itself; only the first fails, naming transition 2."""
    model = registry.get("tiny-sd3")
    parent = batched[0]
    bad = spec(prompts=A.prompts, seed=5, branch_from=_branch(parent, 2, 1e38))
    good = spec(prompts=A.prompts, seed=6, branch_from=_branch(parent, 2))
    x, y = run_batch(model, members_of(bad, good))
    assert isinstance(x, RolloutNonFinite) and x.step == 2 and x.what == "log_prob"  # transition 2 overflows
    assert isinstance(y, RolloutResult) and bool(torch.isfinite(y.final_latents).all())
    assert batch_of(y).requests == 2 and batch_of(y).rows == (2, 4)
    assert torch.equal(latent(y, 2), latent(parent, 2))  # the branch starts at the parent's x_k


def test_a_member_past_float16_fails_alone_while_another_overflows_float32(registry):
    """return.latent_dtype float16, one step, a noise level so large that the step's mean term
    overflows float32 for some seeds and only float16 for others (numpy's own cast says which):
    every member fails at its own first non-finite value, as it does alone, whatever the others'
    rows hold; none succeeds with an Inf stored."""
    import numpy as np

    model = registry.get("tiny-sd3")
    specs = [spec(prompts=(f"m{k}",), seed=k, num_inference_steps=1, latent_dtype="float16",
                  sampler=SamplerSpec(type="sde", noise_level=1.37e19)) for k in range(8)]
    outcomes = run_batch(model, members_of(*specs))
    alone = [run_batch(model, members_of(s))[0] for s in specs]
    f32 = [k for k, o in enumerate(alone) if isinstance(o, RolloutNonFinite) and "float16" not in str(o)]
    # the others: x_1 finite in float32 but not as float16, by numpy's cast of the float32 run's x_1
    native = [run_rollout(model, dataclasses.replace(s, latent_dtype="native", return_log_probs=False))
              for k, s in enumerate(specs) if k not in f32]
    with np.errstate(over="ignore"):
        f16_only = [bool(torch.isfinite(r.final_latents).all()) and not np.isfinite(
            r.final_latents.numpy().astype(np.float16)).all() for r in native]
    assert f32 and any(f16_only), (f32, f16_only)  # both kinds are in the batch
    for k, (got, solo) in enumerate(zip(outcomes, alone, strict=True)):
        if isinstance(solo, RolloutResult):
            assert isinstance(got, RolloutResult) and bool(torch.isfinite(got.final_latents).all()), k
        else:
            assert isinstance(got, RolloutNonFinite) and isinstance(solo, RolloutNonFinite), (k, got, solo)
            assert (got.step, got.what) == (solo.step, solo.what), k


def test_a_member_that_refuses_the_weights_takes_no_rows(registry):
    model = registry.get("tiny-sd3")

    members = [BatchMember(A), BatchMember(B)]
    a, b = run_batch(model, members, Recorder({id(members[0]): "A", id(members[1]): "B"}, refuse="A"))
    assert isinstance(a, RuntimeError) and str(a).startswith("stale: ")
    assert isinstance(b, RolloutResult) and batch_of(b).rows == (0, 2) and batch_of(b).requests == 1


def test_rollouts_that_cannot_share_a_call_are_refused(registry):
    model = registry.get("tiny-sd3")
    for other in (spec(num_inference_steps=T + 1), spec(height=64), spec(guidance_scale=2.0),
                  spec(sampler=SamplerSpec(type="cps", noise_level=0.5)), spec(latent_dtype="bfloat16")):
        with pytest.raises(ValueError, match="batch_key"):
            run_batch(model, members_of(A, other))
