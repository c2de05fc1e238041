"""Replaying a branch rollout whose `return.steps` leave out its start step k, through the real
server: its x_k is the parent's (the server started it from the parent's stored rows), so the
trainer passes the parent's pulled trajectory; without it the replay says what is missing
instead of starting from anything else. The reference is the branch's own recorded log-probs
(`torch.equal`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight import Client, replay_log_probs, rollout_spec
from tests.servers import InProcessServer

T = 5
K = 1
SDE = {"type": "sde", "noise_level": 0.7}


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--workers", "1") as s:
        yield s


@pytest.fixture(scope="module")
def rollouts(server) -> dict[str, Any]:
    """An "ode" parent (2 prompts x 2, every step streamed), a branch of its samples [3, 0] from K
    that streams only [3, 4, 5], and an unrelated rollout; each pulled."""
    with Client(server.rest_url) as client:
        parent = client.submit(model="tiny-sd3", prompts=["a red cube", "a blue ball"], num_outputs_per_prompt=2,
                               num_inference_steps=T, seed=1, sampler={"type": "ode"})
        other = client.submit(model="tiny-sd3", prompts=["a cat"], num_inference_steps=T, seed=2)
        client.wait(parent, timeout=120)
        branch = client.branch(parent.id, K, [3, 0], branches=2, seed=3, sampler=SDE,
                               return_={"log_probs": True, "steps": [3, 4, 5]})
        assert client.wait(branch, timeout=120).status == "succeeded"
        client.wait(other, timeout=120)
        return {"parent": client.pull(parent), "branch": client.pull(branch), "other": client.pull(other)}


def test_a_branch_that_did_not_stream_its_start_replays_bit_for_bit_from_its_parents_trajectory(rollouts):
    parent, branch = rollouts["parent"], rollouts["branch"]
    assert not branch.has_step(K) and [t.i for t in branch.transitions()] == [3, 4]
    replayed = replay_log_probs(ModelRegistry().get("tiny-sd3"), branch, parent=parent)
    scored = [3, 4]
    assert torch.isfinite(branch.log_probs[:, scored]).all()
    assert torch.equal(replayed[:, scored], branch.log_probs[:, scored])
    assert replayed[:, :3].isnan().all() and branch.log_probs[:, :3].isnan().all()
    start = rollout_spec(branch, parent=parent).branch_from
    assert start is not None and torch.equal(start.latents, parent.latent(K)[[3, 0]])  # the parent's rows, not zeros


def test_a_branch_that_streamed_its_start_needs_no_parent(server, rollouts):
    with Client(server.rest_url) as client:
        branch = client.branch(rollouts["parent"].rollout_id, K, [1], branches=2, seed=4, sampler=SDE)
        client.wait(branch, timeout=120)
        traj = client.pull(branch)
    replayed = replay_log_probs(ModelRegistry().get("tiny-sd3"), traj)
    assert torch.isfinite(traj.log_probs[:, K:]).all() and torch.equal(replayed[:, K:], traj.log_probs[:, K:])


def test_replaying_such_a_branch_without_its_parent_says_what_is_missing_and_how_to_give_it(rollouts):
    branch, parent_id = rollouts["branch"], rollouts["parent"].rollout_id
    for replay in (lambda: rollout_spec(branch), lambda: replay_log_probs(ModelRegistry().get("tiny-sd3"), branch)):
        with pytest.raises(ValueError, match=rf"did not stream its start step {K} .*x_{K} must come from its parent "
                           rf"{parent_id}: pass the parent's trajectory as parent= .*{K} among return.steps"):
            replay()


def test_a_parent_that_is_not_the_branchs_parent_is_refused(rollouts):
    branch, other = rollouts["branch"], rollouts["other"]
    with pytest.raises(ValueError, match=rf"but parent= is rollout {other.rollout_id}"):
        rollout_spec(branch, parent=other)
