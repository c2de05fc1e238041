"""What the data plane takes in: plain tensors plus schedule metadata (no diffusers).

control/ fills these from the pipeline's records; the codec turns them into
"trajectory/v1" record batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class TrajectoryHeader:
    rollout_id: str
    sigmas: torch.Tensor
    """float32 [T+1], the exact snapshot (post-shift, terminal 0)."""
    timesteps: torch.Tensor
    """float32 [T]."""
    steps: tuple[int, ...]
    """Absolute step indices present in the stream, ascending."""
    sde_steps: tuple[int, ...]
    """Absolute indices of stochastic transitions."""
    seeds: tuple[int, ...]
    """One per sample, prompt-major."""
    num_outputs_per_prompt: int
    """prompt_index of sample s = s // num_outputs_per_prompt."""
    latent_shape: tuple[int, ...]
    """Per-sample latent shape."""
    latent_dtype: torch.dtype
    """float32, float16 or bfloat16 (bf16 travels as uint16 with field metadata)."""
    log_probs: bool
    """Whether log-probs were requested (False: the column is all null)."""
    rollout: Mapping[str, Any]
    """The JSON object stored under sigmaflight.rollout."""
    prompt_index: tuple[int, ...] = ()
    """Index into the request's prompts of each sample (B entries); empty = s // num_outputs_per_prompt.
    A branch rollout's samples carry their parent row's prompt index, which breaks that rule."""
    parent_sample: tuple[int, ...] | None = None
    """Branch rollouts: the parent sample of each sample (column ``parent_sample``); None otherwise."""
    parent: Mapping[str, Any] | None = None
    """Branch rollouts: the ``sigmaflight.parent`` object {"rollout", "step", "samples"}."""
    velocities: bool = False
    """Whether the stream has the ``velocity`` column (``return.velocities``)."""

    @property
    def num_steps(self) -> int:
        """T."""
        return int(self.timesteps.shape[0])

    @property
    def num_samples(self) -> int:
        """B."""
        return len(self.seeds)

    def prompt_indices(self) -> tuple[int, ...]:
        """prompt_index of each sample: the recorded one, else s // num_outputs_per_prompt."""
        if self.prompt_index:
            return tuple(self.prompt_index)
        n = max(1, self.num_outputs_per_prompt)
        return tuple(s // n for s in range(self.num_samples))


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One absolute step i for all samples."""

    step: int
    latent: torch.Tensor
    """[B, *latent_shape], CPU, contiguous."""
    log_prob: torch.Tensor | None
    """float32 [B] (NaN = null) or None (all null)."""
    velocity: torch.Tensor | None = None
    """float32 [B, *latent_shape] or None (null: i = T, or the header has no velocity column)."""
