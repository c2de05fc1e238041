"""A FlowMatchEulerDiscreteScheduler that hands each step to a rollout driver.

The pipeline keeps doing what it does (text encoding, CFG, latent preparation, calling
`set_timesteps` and `step`); this scheduler only

1. snapshots `sigmas` / `timesteps` (float32, cloned, on CPU) after every `set_timesteps`
   call and records the keyword arguments it was called with (the last call wins);
2. in `step`, finds the step index exactly as the stock scheduler does (exact float lookup
   on the first call, then counting) and asks its driver for x_{i+1}.

Each rollout gets its own scheduler and its own shallow copy of the pipeline
(`per_call_pipeline`), so concurrent rollouts never share scheduler state.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteSchedulerOutput,
)
from sigmaflight.pipeline.spec import RolloutInputError

__all__ = ["StepDriver", "RolloutScheduler", "make_rollout_scheduler", "per_call_pipeline"]


class StepDriver(Protocol):
    def on_set_timesteps(self, scheduler: RolloutScheduler) -> None: ...

    def step(
        self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor
    ) -> torch.Tensor: ...


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").tolist()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# diffusers' lazy module confuses type checkers; the base is a plain FlowMatchEulerDiscreteScheduler.
_FlowMatchBase: Any = FlowMatchEulerDiscreteScheduler


class RolloutScheduler(_FlowMatchBase):
    """FlowMatchEulerDiscreteScheduler whose `step` is delegated to a `StepDriver`."""

    driver: StepDriver | None = None
    sigmas_snapshot: torch.Tensor | None = None
    timesteps_snapshot: torch.Tensor | None = None
    set_timesteps_kwargs: dict[str, Any] | None = None
    index_offset: int = 0
    size: tuple[int, int] | None = None
    """The call's (height, width), named when the schedule for them is not finite; None: not known."""
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    """k after `start_at(k)`: the pipeline loops over timesteps[k:], step indices stay absolute."""

    def set_timesteps(  # type: ignore[override]
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        sigmas: list[float] | None = None,
        mu: float | None = None,
        timesteps: list[float] | None = None,
    ) -> None:
        # 1. Run the stock schedule computation (numpy's overflow warnings held: a schedule that
        #    overflowed is refused below, by name; errstate is thread-local, unlike warnings filters).
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                super().set_timesteps(num_inference_steps, device, sigmas=sigmas, mu=mu, timesteps=timesteps)
        except OverflowError:  # math.exp(mu) past float64: a shift larger still than the one below
            raise self._not_finite(mu) from None
        # 2. Record how it was called (JSON-able, device dropped, None omitted).
        given = {"num_inference_steps": num_inference_steps, "sigmas": sigmas, "mu": mu, "timesteps": timesteps}
        self.set_timesteps_kwargs = {k: _jsonable(v) for k, v in given.items() if v is not None}
        # 3. Snapshot the schedule that will run: float32, CPU, cloned (`.to` may return the same object).
        self.sigmas_snapshot = self.sigmas.detach().to("cpu", torch.float32).clone()  # [T+1]
        self.timesteps_snapshot = self.timesteps.detach().to("cpu", torch.float32).clone()  # [T]
        if not (torch.isfinite(self.sigmas_snapshot).all() and torch.isfinite(self.timesteps_snapshot).all()):
            raise self._not_finite(mu)
        if self.driver is not None:
            self.driver.on_set_timesteps(self)

    def _not_finite(self, mu: float | None) -> RolloutInputError:
        """FLUX's shift (mu) grows with the image's tokens; past what the scheduler's config was
        made for, exp(mu) overflows float32 (the schedule is NaN) or float64 (OverflowError): the
        size is what to change, the larger side named."""
        if self.size is None:
            field, size = "height", "this height x width"
        else:
            h, w = self.size
            field, size = "width" if w > h else "height", f"height x width {h} x {w}"
        return RolloutInputError(field, f"the scheduler's schedule for {size} is not finite (set_timesteps "
                                 f"mu={mu!r}: the shift grows with the image's size); ask a smaller size")

    def step(  # type: ignore[override]
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: torch.Generator | None = None,
        per_token_timesteps: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> Any:
        if self.driver is None or per_token_timesteps is not None:
            if per_token_timesteps is not None:
                raise NotImplementedError("per-token timesteps are not supported by sigmaflight rollouts")
            return super().step(model_output, timestep, sample, generator=generator, return_dict=return_dict)
        if self.step_index is None:
            self._init_step_index(timestep)  # exact float lookup, as the stock scheduler
            found: Any = self.step_index
            self._step_index = int(found) + self.index_offset  # absolute (0 unless start_at)
        i = int(self.step_index)
        prev_sample = self.driver.step(self, i, sample, model_output)
        self._step_index = i + 1
        if not return_dict:
            return (prev_sample,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev_sample)  # type: ignore[arg-type]

    def euler_step(self, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        """The stock deterministic step at index i (bit-identical to FlowMatchEulerDiscreteScheduler.step)."""
        saved = self._step_index
        self._step_index = i
        try:
            t = self.timesteps[i - self.index_offset]  # unused by the stock step once _step_index is set
            out = FlowMatchEulerDiscreteScheduler.step(self, velocity, t, sample, return_dict=False)
        finally:
            self._step_index = saved
        return out[0]


    def start_at(self, step: int, sigmas: torch.Tensor, timesteps: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """Run a recorded schedule from absolute step k: call from `StepDriver.on_set_timesteps`.

        The scheduler takes `sigmas` [T+1] and `timesteps` [T] as they are (float32, bit for
        bit); the pipeline, which reads `scheduler.timesteps` right after `set_timesteps`, then
        loops over timesteps[k:] only, and `step` numbers its steps k, k+1, ... The snapshot
        is the full recorded schedule with `kwargs` as its set_timesteps arguments.
        """
        device = self.timesteps.device
        self.sigmas = sigmas.to(device=device, dtype=torch.float32)
        self.timesteps = timesteps[step:].to(device=device, dtype=torch.float32)
        self.index_offset = step
        self.sigmas_snapshot = sigmas.detach().to("cpu", torch.float32).clone()
        self.timesteps_snapshot = timesteps.detach().to("cpu", torch.float32).clone()
        self.set_timesteps_kwargs = dict(kwargs)


def make_rollout_scheduler(original: Any, driver: StepDriver) -> RolloutScheduler:
    """A fresh RolloutScheduler with `original`'s config; refuses non-flow-match schedulers."""
    if not isinstance(original, _FlowMatchBase):
        raise RolloutInputError(
            "model",
            f"scheduler {type(original).__name__} is not a flow-match scheduler "
            "(FlowMatchEulerDiscreteScheduler or a subclass); sigmaflight rollouts need one",
        )
    config = {k: v for k, v in original.config.items() if not k.startswith("_")}
    scheduler = RolloutScheduler(**config)
    scheduler.driver = driver
    return scheduler


def per_call_pipeline(pipeline: Any, scheduler: RolloutScheduler, overrides: dict[str, Any] | None = None) -> Any:
    """A shallow copy of `pipeline` (same modules) with its own scheduler.

    `overrides` replace attributes after construction without registering them (used for
    the per-row model wrappers, which are not nn.Modules).
    """
    pipe = type(pipeline)(**{**pipeline.components, "scheduler": scheduler})
    pipe.set_progress_bar_config(disable=True)
    for name, value in (overrides or {}).items():
        object.__setattr__(pipe, name, value)
    return pipe
