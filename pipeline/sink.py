"""What passes between the rollout engine (pipeline/rollout.py) and whoever queued the rollouts.

A rollout is whatever the caller queues (`Rollout`: a spec and a stop flag; the server's job
record, or `BatchMember` in process); the engine's view of it in a call is `Rows`. The engine
reports to one `Sink` per call: `schedule` once, `step` once per step with a `CallStep` (the
call's tensors, each member's rows as views), `end` per rollout. `Callbacks` adapts the sink to
one rollout's per-capture callbacks (`run_rollout`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch
from sigmaflight.pipeline.models import Policy
from sigmaflight.pipeline.spec import RolloutSpec, ScheduleSnapshot, StepCapture

__all__ = ["BatchMember", "CallStep", "Callbacks", "Failures", "each_member", "Quiet", "Rollout", "RolloutResult", "Rows", "Sink"]


@dataclass(frozen=True, kw_only=True)
class RolloutResult:
    snapshot: ScheduleSnapshot
    captures: tuple[StepCapture, ...]
    """The StepCaptures in ascending step order (empty with keep=False or capture=False)."""
    log_probs: torch.Tensor
    """float32 [B, T] on CPU; NaN on deterministic transitions or when not requested."""
    seeds: tuple[int, ...]
    final_latents: torch.Tensor
    """x_T [B, *latent_shape] in the model's dtype, on the model's device."""
    digest: str
    """Weights digest of the model that ran."""
    conditioning: Mapping[str, torch.Tensor] | None = None
    """With `return_conditioning`: the tensors the transformer consumed, keyed by the stock
    `__call__` keyword (`sigmaflight.pipeline.conditioning.CONDITIONING_NAMES`), B rows prompt-major, on CPU."""
    prompt_index: tuple[int, ...] = ()
    """Index into the prompts of each sample (the parent row's for a branch)."""
    parent_sample: tuple[int, ...] | None = None
    """Branch rollouts: the parent sample of each sample; None otherwise."""


class Rollout(Protocol):
    """What the engine needs of a queued rollout: its spec, and whether to stop it now."""

    @property
    def spec(self) -> RolloutSpec: ...

    def should_stop(self) -> bool: ...

    def last_stop_check(self) -> bool:
        """`should_stop` once the last step is done, the engine's last check: False means the
        rollout finishes, and a stop asked from then on must be refused (its answer would be wrong)."""
        ...


R = TypeVar("R", bound=Rollout)


@dataclass(eq=False)
class BatchMember:
    """A `Rollout` for in-process callers: a spec and, optionally, when to stop it."""

    spec: RolloutSpec
    stop: Callable[[], bool] | None = None

    def should_stop(self) -> bool:
        return self.stop is not None and self.stop()

    def last_stop_check(self) -> bool:
        return self.should_stop()


@dataclass(eq=False)
class Rows(Generic[R]):
    """The engine's view of one rollout of a call: its rows [first, end) and what is its own."""

    rollout: R
    first: int = 0
    end: int = 0
    seeds: tuple[int, ...] = ()
    steps: frozenset[int] = frozenset()
    """The latent indices it captures."""
    sde_steps: frozenset[int] = frozenset()
    snapshot: ScheduleSnapshot | None = None
    metadata: dict[str, Any] | None = None
    """The contract's `sigmaflight.rollout` object (without `id`), made with the snapshot."""
    conditioning: dict[str, torch.Tensor] | None = None
    captures: list[StepCapture] = field(default_factory=list)
    outcome: RolloutResult | BaseException | None = None

    @property
    def spec(self) -> RolloutSpec:
        return self.rollout.spec

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def own(self, call: torch.Tensor) -> torch.Tensor:
        """Its rows of a tensor of the call: the tensor itself when they are all of it, else a copy
        (a copy keeps only this rollout's bytes alive, not the whole call's)."""
        return call if self.first == 0 and self.end == call.shape[0] else call[self.first:self.end].clone()


@dataclass(frozen=True)
class CallStep(Generic[R]):
    """Step i of one call, reported once for every member: tensors of the whole call on the host,
    each copied once (None where no running member needs it)."""

    i: int
    total: int
    """T."""
    running: tuple[Rows[R], ...]
    """The members still running after transition i, in row order."""
    latent: torch.Tensor | None = None
    """x_i [B, ...] in the capture dtype."""
    velocity: torch.Tensor | None = None
    """float32 [B, ...]: the CFG-combined velocity of step i."""
    next_latent: torch.Tensor | None = None
    """x_T [B, ...] after the last transition."""
    log_prob: torch.Tensor | None = None
    """float32 [B] (CPU): log p(x_{i+1} | x_i) of every row, when a member asked for it."""

    def captures(self, rows: Rows[R], *, own: bool = False) -> list[StepCapture]:
        """What `rows` captures at this step: x_i (with its log-prob and velocity when asked for)
        and, after the last transition, x_T. Views of the call's tensors; with `own`, copies of
        its rows unless they are the whole call (`Rows.own`: whoever keeps them keeps only this
        rollout's bytes alive)."""
        i, spec, rs = self.i, rows.spec, slice(rows.first, rows.end)
        take = rows.own if own else (lambda t: t[rs])
        out = []
        if i in rows.steps:
            assert self.latent is not None
            lp = take(self.log_prob) if self.log_prob is not None and spec.return_log_probs and i in rows.sde_steps \
                else None
            v = take(self.velocity) if self.velocity is not None and spec.return_velocities else None
            out.append(StepCapture(step=i, latent=take(self.latent), log_prob=lp, velocity=v))
        if i == self.total - 1 and self.total in rows.steps:
            assert self.next_latent is not None
            out.append(StepCapture(step=self.total, latent=take(self.next_latent), log_prob=None))
        return out


Failures = list[tuple[Rows[R], BaseException]]
"""Members a sink could not take (e.g. a write failed): each ends with its error, alone."""


class Sink(Protocol[R]):
    """Where one call's rollouts go: `schedule` once and `step` once a step, each for all members;
    `end` once per member. Subclass it to take the defaults (nothing refused, nothing to report)."""

    def start(self, rollout: R, policy: Policy) -> None:
        """Before anything runs, with the weights the call will run on: raise to refuse them."""
        return None

    def schedule(self, running: Sequence[Rows[R]]) -> Failures[R]:
        """The schedule is known: each member's `snapshot` and `metadata` are set."""
        return []

    def step(self, step: CallStep[R]) -> Failures[R]:
        """Step `step.i` of every running member is done."""
        return []

    def end(self, rows: Rows[R], outcome: RolloutResult | BaseException) -> None:
        """`rows` ended (a result or its error), at once; the others may run on."""
        return None


class Quiet(Sink[Any]):
    """The sink of a caller that only wants the results."""


class Callbacks(Sink[BatchMember]):
    """`run_rollout`'s sink: per-capture and per-step callbacks of one rollout."""

    def __init__(self, on_schedule: Callable[[ScheduleSnapshot], None] | None,
                 on_step: Callable[[StepCapture], None] | None, on_progress: Callable[[int, int], None] | None) -> None:
        self.on_schedule, self.on_step, self.on_progress = on_schedule, on_step, on_progress

    def schedule(self, running: Sequence[Rows[BatchMember]]) -> Failures[BatchMember]:
        return each_member(running, lambda r: self.on_schedule(r.snapshot) if self.on_schedule and r.snapshot else None)

    def step(self, step: CallStep[BatchMember]) -> Failures[BatchMember]:
        def report(r: Rows[BatchMember]) -> None:
            for cap in step.captures(r) if self.on_step is not None else ():
                self.on_step(cap)  # type: ignore[misc]
            if self.on_progress is not None:
                self.on_progress(step.i + 1, step.total)

        return each_member(step.running, report)


def each_member(running: Sequence[Rows[R]], call: Callable[[Rows[R]], object]) -> Failures[R]:
    """`call(rows)` for every member; the members whose call raised, each with its error."""
    failures: Failures[R] = []
    for r in running:
        try:
            call(r)
        except Exception as exc:
            failures.append((r, exc))
    return failures


