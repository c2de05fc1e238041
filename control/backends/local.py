"""The local backend: runs rollouts in this process and keeps results in the result store.

This is where the planes meet: the engine reports each step of a model call once for all its
rollouts (`pipeline.rollout.CallStep`), and `_Writers`, the call's sink, writes each rollout's rows
into its own `TrajectoryWriter` (TrajectoryHeader, StepBatch) and reports the call's progress once.
It implements the `Backend` protocol (control/jobs/backend.py); each Ray worker runs its
rollouts through one of these too, so a trajectory is the same whichever backend ran it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from sigmaflight.control.jobs.backend import (
    CallSize,
    Outcome,
    ParentTrajectory,
    RunContext,
    outcome_of,
    report_progress,
)
from sigmaflight.control.policy import check_started_with
from sigmaflight.control.streams import outputs_table, stream_names
from sigmaflight.dataplane.cobatch import CallWriters
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.store import ResultStore
from sigmaflight.dataplane.streams import CONDITIONING, OUTPUTS, StreamNotFound, stream_table
from sigmaflight.dataplane.tickets import Gone
from sigmaflight.dataplane.writer import TrajectoryWriter
from sigmaflight.pipeline.models import LoadedModel, ModelRegistry, Policy
from sigmaflight.pipeline.rollout import CallStep, RolloutResult, Rows, parent_metadata, run_batch
from sigmaflight.pipeline.sink import Failures, each_member
from sigmaflight.pipeline.spec import RolloutCancelled, RolloutInputError, ScheduleSnapshot

from sigmaflight.records import ResultInfo

log = logging.getLogger("sigmaflight.backend")


def header_for(
    job_id: str, snapshot: ScheduleSnapshot, rollout: dict[str, Any], log_probs: bool,
    *, velocities: bool = False, parent: dict[str, Any] | None = None,
) -> TrajectoryHeader:
    return TrajectoryHeader(
        rollout_id=job_id,
        sigmas=snapshot.sigmas,
        timesteps=snapshot.timesteps,
        steps=snapshot.steps,
        sde_steps=snapshot.sde_steps,
        seeds=snapshot.seeds,
        num_outputs_per_prompt=snapshot.num_outputs_per_prompt,
        latent_shape=snapshot.latent_shape,
        latent_dtype=snapshot.latent_dtype,
        log_probs=log_probs,
        rollout=rollout,
        prompt_index=tuple(snapshot.prompt_index),
        parent_sample=None if snapshot.parent_sample is None else tuple(snapshot.parent_sample),
        parent=parent,
        velocities=velocities,
    )


class LocalBackend:
    """Runs rollouts on the calling worker thread; results live in `store`, served by the node's
    Flight server (whose tokens and weights are the service's own: the weights and token calls
    of the protocol have no other worker to reach here)."""

    def __init__(
        self,
        registry: ModelRegistry,
        store: ResultStore,
        *,
        locations: Callable[[], list[str]],
        batch_invariant: bool = False,
    ) -> None:
        self.registry = registry
        self.store = store
        self.locations = locations
        self.batch_invariant = batch_invariant

    def run(self, batch: Sequence[RunContext]) -> CallSize | None:
        """The rollouts of `batch` (sharing one batch key) as one model call (`run_batch`); each is
        settled as soon as it ends, the others running on. Returns the call's size (None when no
        member was left to run it)."""
        if not batch:
            return None
        try:
            model = self.registry.get(batch[0].spec.model)
        except Exception as exc:
            for ctx in batch:
                self._end(ctx, None, exc)
            return None
        writers = _Writers(self, model)
        run_batch(model, batch, writers, keep=False, per_sample_model_calls=self.batch_invariant,
                  batch_id=uuid.uuid4().hex)
        return writers.size

    def _end(self, ctx: RunContext, writer: TrajectoryWriter | None, exc: BaseException) -> None:
        """A rollout that did not succeed: end its streams, then settle it."""
        outcome = outcome_of(exc, ctx.stop_reason)
        if not isinstance(exc, (RolloutCancelled, RolloutInputError)) and not hasattr(exc, "error_type"):
            log.error("rollout raised", extra={"rollout": ctx.job_id}, exc_info=exc)
        # the data plane's message names the error's class (Flight consumers see it)
        message = outcome.message if ctx.stop_reason or outcome.error is None else f"{type(exc).__name__}: {exc}"
        if writer is not None:
            writer.fail(outcome.kind, message)
        else:
            self.abandon(ctx.job_id, outcome.kind, message)
        ctx.settle(outcome)

    def group(self, job_id: str) -> Hashable:
        return None  # one process, one model copy: any two compatible rollouts may share a call

    def reserve(self, job_id: str) -> str:
        return self.store.reserve(job_id)

    def abandon(self, job_id: str, kind: str, message: str) -> None:
        self.store.abandon(job_id, kind, message)

    def release(self, job_id: str, *, aside: bool = False) -> None:
        self.store.release(job_id, aside=aside)

    def result_info(self, job_id: str) -> ResultInfo | None:
        try:
            return self.store.result(job_id)
        except KeyError:
            return None

    def stored_ids(self) -> list[str]:
        return self.store.ids()

    def locations_for(self, job_id: str) -> list[str]:
        return self.locations()

    def can_place(self) -> bool:
        return True

    def parent(self, rollout_id: str) -> ParentTrajectory | None:
        """The store's succeeded trajectory `rollout_id`, with its conditioning stream when it
        published one and it is still held (no intact file after a restart: None, and the branch
        encodes the prompts again). RolloutInputError when it is held but did not succeed."""
        try:
            entry = self.store.get(rollout_id)
        except KeyError:
            return None
        state = entry.state
        batches = entry.snapshot()
        if state != "succeeded" or batches is None:
            raise RolloutInputError("branch_from.rollout", f"rollout {rollout_id!r} is {state}; a parent must have succeeded")
        conditioning = None
        if CONDITIONING in entry.streams_requested:
            try:
                conditioning = entry.stream_table(CONDITIONING)
            except StreamNotFound:
                conditioning = None
        return ParentTrajectory(header=entry.header, batches=batches, conditioning=conditioning)

    def load_weights(self, model_id: str, state: Mapping[str, torch.Tensor], *, expected_base: str | None = None,
                     expected_digest: str | None = None) -> list[str]:
        return []  # the service's registry is this backend's: it has the new weights already

    def load_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: dict[str, Any]) -> list[str]:
        return []

    def unload_lora(self, model_id: str) -> list[str]:
        return []

    def set_tokens(self, tokens: Sequence[str]) -> None:
        """Nothing to do: this backend's Flight server is the service node's, which the service updates."""

    def on_result_lost(self, callback: Callable[[str, str], None]) -> None:
        self.store.on_unavailable = callback

    def on_result_released(self, callback: Callable[[str], None]) -> None:
        """Not needed: this node's Flight `release` goes through the control plane itself."""

    def on_unknown_ticket(self, callback: Callable[[str], Gone | None]) -> None:
        self.store.on_unknown = callback

    def close(self) -> None:
        """Nothing to do: the node that built this backend stops its store and Flight server."""


class _Writers:
    """The sink of one local model call: each rollout's writer into the store. A step is encoded
    once for the call and each member given a copy of its rows (`CallWriters`), and its progress
    reported once for the call."""

    def __init__(self, backend: LocalBackend, model: LoadedModel) -> None:
        self.backend, self.model = backend, model
        self.writers: dict[str, TrajectoryWriter] = {}
        self.headers: dict[str, TrajectoryHeader] = {}
        self.rows: list[tuple[TrajectoryWriter, int, int]] = []
        self.call: CallWriters | None = None
        """Made at the first step, which gives the call's rows."""
        self.size: CallSize | None = None
        """The call's (samples, members), once its schedule is known: it runs."""

    def start(self, ctx: RunContext, policy: Policy) -> None:
        check_started_with(ctx.spec, policy.digest)

    def schedule(self, running: Sequence[Rows[RunContext]]) -> Failures[RunContext]:
        info = running[0].snapshot.batch if running and running[0].snapshot is not None else None
        if info is not None:
            self.size = (info.samples, info.requests)
        return each_member(running, self._create)

    def _create(self, rows: Rows[RunContext]) -> None:
        ctx, spec = rows.rollout, rows.spec
        assert rows.snapshot is not None and rows.metadata is not None
        rollout = {"id": ctx.job_id, **rows.metadata, "streams": stream_names(spec)}
        header = header_for(ctx.job_id, rows.snapshot, rollout, spec.return_log_probs,
                            velocities=spec.return_velocities, parent=parent_metadata(spec))
        writer = self.writers[ctx.job_id] = self.backend.store.create(header)
        self.headers[ctx.job_id] = header
        self.rows.append((writer, rows.first, rows.end))

    def step(self, step: CallStep[RunContext]) -> Failures[RunContext]:
        host = step.latent if step.latent is not None else step.next_latent
        if self.call is None and host is not None:
            self.call = CallWriters(self.rows, host.shape[0], max_batch_bytes=self.backend.store.max_batch_bytes)
        members = {id(w): r for r in step.running if (w := self.writers.get(r.rollout.job_id)) is not None}
        failures: Failures[RunContext] = [(r, RuntimeError(f"rollout {r.rollout.job_id} has no trajectory writer"))
                                          for r in step.running if r.rollout.job_id not in self.writers]
        # x_i (with its log-probs and velocities) to the members that capture i; after the last
        # transition, x_T to those that capture T
        batches = [StepBatch(step=step.i, latent=step.latent, log_prob=step.log_prob, velocity=step.velocity)] \
            if step.latent is not None else []
        if step.i == step.total - 1 and step.next_latent is not None:
            batches.append(StepBatch(step=step.total, latent=step.next_latent, log_prob=None))
        for batch in batches:
            writers = [self.writers[r.rollout.job_id] for r in step.running
                       if batch.step in r.steps and r.rollout.job_id in self.writers]
            if writers:
                assert self.call is not None
                failures += [(members[id(w)], exc) for w, exc in self.call.append(batch, writers)]
        report_progress([r.rollout for r in step.running], step.i + 1, step.total)
        return failures

    def end(self, rows: Rows[RunContext], outcome: RolloutResult | BaseException) -> None:
        ctx, store = rows.rollout, self.backend.store
        writer, header = self.writers.pop(ctx.job_id, None), self.headers.pop(ctx.job_id, None)
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            spec = ctx.spec
            assert writer is not None and header is not None
            if spec.return_outputs:  # after the last step, on the rollout's device; nothing otherwise
                writer.publish(OUTPUTS, outputs_table(self.model, spec, header, outcome.final_latents,
                                                      max_batch_bytes=store.max_batch_bytes))
            if spec.return_conditioning:
                if not outcome.conditioning:
                    raise RuntimeError("return.conditioning: the rollout captured no conditioning tensors")
                writer.publish(CONDITIONING, stream_table(CONDITIONING, header, outcome.conditioning,
                                                          max_batch_bytes=store.max_batch_bytes))
            result = writer.finish()
        except Exception as exc:
            self.backend._end(ctx, writer, exc)
            return
        ctx.settle(Outcome.success(result) if result is not None else
                   Outcome.failure("result_unavailable", "the trajectory was finished but the store does not hold it"))

