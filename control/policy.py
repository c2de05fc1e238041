"""Policy versions (contract, "Policy version"): a model's weights digest and weights_version.

`weights_version` is 0 at load and +1 per accepted change of weights. It is read in one place,
`weights_version(model)`, as `getattr(model, "weights_version", 0)`: pipeline/models.py's
`LoadedModel` is gaining the field (and counting it in `load_weights`); until it does,
`note_weights_change` counts here after each accepted push.
"""

from __future__ import annotations

from typing import Any


class StalePolicy(RuntimeError):
    """The model's weights are not the ones the request expected (`expected_digest`)."""

    error_type = "stale_policy"


def weights_version(model: Any) -> int:
    """The model's weights_version (0 at load, +1 per accepted weights change)."""
    return int(getattr(model, "weights_version", 0))


def note_weights_change(model: Any, before: int) -> None:
    """After an accepted weights push: count it, unless the registry counted it already."""
    with model.lock:
        if weights_version(model) == before:
            model.weights_version = before + 1


def policy(model: Any) -> tuple[str, int]:
    """(digest, weights_version) of the model now, read together."""
    with model.lock:
        return str(model.digest), weights_version(model)


def check_started_with(expected_digest: str | None, digest: str) -> None:
    """A rollout that asked for `expected_digest` but took other weights at its start fails."""
    if expected_digest is not None and digest != expected_digest:
        raise StalePolicy(
            f"the model's weights changed between the request and the rollout's start: expected digest "
            f"{expected_digest[:12]}..., the rollout would run with {digest[:12]}... (resubmit with the new digest)"
        )
