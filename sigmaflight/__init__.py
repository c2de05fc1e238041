"""sigmaflight: the users' side in one import (client, wire models, typed errors, replay).

Nothing here loads server code: no Starlette, uvicorn, job journal or Ray (the server lives in
control/; `sigmaflight serve` imports it only when it runs).
"""

from sigmaflight.client import Client, replay_log_probs, rollout_spec
from sigmaflight.dataplane.client import Trajectory, Transition
from sigmaflight.errors import (
    ApiError,
    NotFound,
    RolloutCancelled,
    RolloutFailed,
    Unauthorized,
    WeightsMismatch,
)
from sigmaflight.pipeline.replay import Replayer, step_log_prob

__all__ = [
    "ApiError",
    "Client",
    "NotFound",
    "Replayer",
    "RolloutCancelled",
    "RolloutFailed",
    "Trajectory",
    "Transition",
    "Unauthorized",
    "WeightsMismatch",
    "replay_log_probs",
    "rollout_spec",
    "step_log_prob",
]
