"""sigmaflight: the user-facing API in one import (the code lives in control/, dataplane/, pipeline/)."""

from control.client import ApiError, Client, RolloutFailed, replay_log_probs, rollout_spec
from dataplane.client import Trajectory, Transition
from pipeline.replay import Replayer, step_log_prob

__all__ = [
    "ApiError",
    "Client",
    "Replayer",
    "RolloutFailed",
    "Trajectory",
    "Transition",
    "replay_log_probs",
    "rollout_spec",
    "step_log_prob",
]
