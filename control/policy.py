"""Policy versions (contract, "Policy version"): a model's weights digest and weights_version.

The registry (pipeline/models.py) counts `weights_version`: 0 at load, +1 per accepted change
of weights (full push, LoRA put, LoRA delete); `LoadedModel.policy()` reads digest, version and
weights together, and each rollout records the pair it ran with.
"""

from __future__ import annotations

from typing import Any


class StalePolicy(RuntimeError):
    """The model's weights are not the ones the request expected (`expected_digest`)."""

    error_type = "stale_policy"


def policy(model: Any) -> tuple[str, int]:
    """(digest, weights_version) of the model now, read together."""
    p = model.policy()
    return str(p.digest), int(p.weights_version)


def check_started_with(expected_digest: str | None, digest: str) -> None:
    """A rollout that asked for `expected_digest` but took other weights at its start fails."""
    if expected_digest is not None and digest != expected_digest:
        raise StalePolicy(
            f"the model's weights changed between the request and the rollout's start: expected digest "
            f"{expected_digest[:12]}..., the rollout would run with {digest[:12]}... (resubmit with the new digest)"
        )
