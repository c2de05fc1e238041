"""Policy versions (contract, "Policy version"): a model's weights digest and weights_version.

The registry (pipeline/models.py) counts `weights_version`: 0 at load, +1 per accepted change
of weights (full push, LoRA put, LoRA delete); `LoadedModel.policy()` reads digest, version and
weights together, and each rollout records the pair it ran with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sigmaflight.pipeline.spec import RolloutSpec


class StalePolicy(RuntimeError):
    """The model's weights are not the ones the request expected (`expected_digest`)."""

    error_type = "stale_policy"


def policy(model: Any) -> tuple[str, int]:
    """(digest, weights_version) of the model now, read together."""
    p = model.policy()
    return str(p.digest), int(p.weights_version)


def check_started_with(spec: RolloutSpec, digest: str) -> None:
    """A rollout that starts on other weights than its request was accepted for fails: the
    `expected_digest` it asked for, or, for a branch, the weights its parent ran with (its x_k is a
    state of that policy; POST refuses such a branch with 409 stale_parent, and a push may land
    while it waits in the queue)."""
    expected = spec.expected_digest
    if expected is not None and digest != expected:
        raise StalePolicy(
            f"the model's weights changed between the request and the rollout's start: expected digest "
            f"{expected[:12]}..., the rollout would run with {digest[:12]}... (resubmit with the new digest)"
        )
    branch = spec.branch_from
    if branch is not None and branch.parent_digest and digest != branch.parent_digest:
        raise StalePolicy(
            f"the model's weights changed between the request and the rollout's start: the branch's parent "
            f"{branch.rollout} ran with {branch.parent_digest[:12]}..., the rollout would run with {digest[:12]}..., "
            f"so its x_{branch.step} is not a state of the current policy (branch from a rollout made on the "
            "current weights)"
        )
