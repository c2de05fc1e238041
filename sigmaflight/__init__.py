"""sigmaflight: the users' side in one import (client, wire models, typed errors, replay).

Nothing here loads server code: no Starlette, uvicorn, job journal or Ray (the server lives in
control/; `sigmaflight serve` imports it only when it runs). Nor does `import sigmaflight` load
the model stack: each name below is imported on first use (PEP 562), so `Client` costs httpx,
pydantic and pyarrow, `group_advantages` numpy only, `Trajectory` and `step_log_prob` add torch,
and only `Replayer` and `replay_log_probs` (running a model) need diffusers, the `replay` extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sigmaflight.errors import (
    ApiError,
    NotFound,
    RolloutCancelled,
    RolloutFailed,
    ServerUnreachable,
    Unauthorized,
    WeightsMismatch,
)

if TYPE_CHECKING:
    from sigmaflight.aclient import AsyncClient
    from sigmaflight.advantages import group_advantages
    from sigmaflight.client import Client
    from sigmaflight.dataplane.client import Trajectory, Transition
    from sigmaflight.pipeline.kernels import step_log_prob
    from sigmaflight.pipeline.replay import Replayer
    from sigmaflight.replay import replay_log_probs, rollout_spec

_LAZY = {
    "AsyncClient": "sigmaflight.aclient",
    "group_advantages": "sigmaflight.advantages",  # numpy only
    "Client": "sigmaflight.client",
    "replay_log_probs": "sigmaflight.replay",
    "rollout_spec": "sigmaflight.replay",
    "Trajectory": "sigmaflight.dataplane.client",
    "Transition": "sigmaflight.dataplane.client",
    "step_log_prob": "sigmaflight.pipeline.kernels",  # torch only: scoring needs no diffusers
    "Replayer": "sigmaflight.pipeline.replay",
}

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "NotFound",
    "Replayer",
    "RolloutCancelled",
    "RolloutFailed",
    "ServerUnreachable",
    "Trajectory",
    "Transition",
    "Unauthorized",
    "WeightsMismatch",
    "__version__",
    "group_advantages",
    "replay_log_probs",
    "rollout_spec",
    "step_log_prob",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("sigmaflight")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sigmaflight' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
