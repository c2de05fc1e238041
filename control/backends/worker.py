"""One rollout worker: a model on one device, its own result store and Flight server.

`RolloutWorker` is a plain class; control/backends/ray.py turns it into a Ray actor
(`ray.remote(...)`, threaded with `max_concurrency`) so rollouts run on one thread while the
control plane polls `progress` and calls `cancel` on others. Rollouts run through the
node's `LocalBackend`, the same pipeline -> data-plane path as the local backend, so a
trajectory is bit-identical whichever backend ran it; the worker gives each its own
`RunContext` and hands the outcome back as plain data (never a pickled exception).

Nothing here imports Ray: the class is testable (and usable) in-process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import torch
from sigmaflight.control.jobs.backend import Outcome, RunContext
from sigmaflight.control.jobs.job import NotFinished
from sigmaflight.control.node import Node, NodeConfig
from sigmaflight.dataplane.errors import flight_error
from sigmaflight.dataplane.streams import StreamNotFound
from sigmaflight.pipeline.loaded import StaleWeights
from sigmaflight.pipeline.spec import BranchStart, RolloutInputError, RolloutSpec
from sigmaflight.pipeline.swaps import StagedWeights

from sigmaflight.records import ErrorInfo, ResultInfo, RolloutState

log = logging.getLogger("sigmaflight.worker")

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What a worker needs to know; plain data so it pickles across the Ray boundary."""

    index: int
    """Worker number shown in logs and errors ("worker 1 (actor ...)")."""
    model: str = "tiny-sd3"
    """Model loaded at start-up (others load on first use)."""
    node: NodeConfig = field(default_factory=NodeConfig)
    """The server's node config (`NodeConfig.from_settings`); `worker_node` makes this worker's own."""
    torch_threads: int | None = None
    """torch intra-op threads; None keeps torch's default (Ray sets OMP_NUM_THREADS from num_cpus)."""


def worker_node(config: WorkerConfig, node_ip: str | None) -> NodeConfig:
    """This worker's node: the server's, with its own directories (DIR/worker-<index>: one live store
    a directory, and a replacement worker takes over its files), its own Flight port, and an address
    trainers on other nodes can reach (loopback stays loopback on one node; anything else binds
    0.0.0.0 and advertises the node's IP)."""
    node = config.node
    loopback = node.host in LOOPBACK
    return replace(
        node,
        data_dir=None if node.data_dir is None else f"{node.data_dir}/worker-{config.index}",
        shm_dir=None if node.shm_dir is None else f"{node.shm_dir}/worker-{config.index}",
        host=node.host if loopback else "0.0.0.0",
        port=0,
        advertise_host=None if loopback else (node_ip or node.host),
    )


def outcome_to_json(outcome: Outcome) -> dict[str, Any]:
    """An outcome as plain data, to cross the Ray boundary (`outcome_from_json` reads it)."""
    return {
        "state": str(outcome.state),
        "result": outcome.result.to_json() if outcome.result is not None else None,
        "error": [outcome.error.type, outcome.error.message] if outcome.error is not None else None,
    }


def outcome_from_json(data: dict[str, Any]) -> Outcome:
    return Outcome(
        state=RolloutState(data["state"]),
        result=ResultInfo.from_json(data["result"]) if data["result"] is not None else None,
        error=ErrorInfo(type=data["error"][0], message=data["error"][1]) if data["error"] is not None else None,
    )


class RolloutWorker:
    """Runs rollouts on one device and serves their trajectories from its own Flight server."""

    def __init__(self, config: WorkerConfig, node_ip: str | None = None) -> None:
        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.node = Node(worker_node(config, node_ip), on_cancel=self.cancel, on_release=self._release_from_flight)
        self.registry, self.store, self.backend = self.node.registry, self.node.store, self.node.backend
        self.registry.get(config.model)  # load once, before the first rollout
        self.flight = self.node.flight.start()
        self._lock = threading.Lock()
        self._running: dict[str, RunContext] = {}
        self._progress: dict[str, tuple[int, int]] = {}
        self._cancelled: dict[str, str | None] = {}  # cancelled before it ran: id -> stop reason
        self._outcomes: dict[str, dict[str, Any]] = {}  # ended, not yet polled: id -> outcome JSON
        self._lost: list[tuple[str, str]] = []
        self._released: list[str] = []  # released by a Flight action here, not yet reported
        self._queued: set[str] = set()  # reserved here, not yet run
        self._prepared: dict[str, StagedWeights] = {}  # push id -> weights staged, not yet committed
        self.backend.on_result_lost(self._result_lost)
        log.info("worker %d ready at %s (pid %d)", config.index, self.flight.locations[0], os.getpid())

    # ---- what the control plane calls -------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"index": self.config.index, "locations": self.flight.locations, "pid": os.getpid()}

    def reserve(self, job_id: str) -> str:
        ticket = self.backend.reserve(job_id)
        with self._lock:
            self._queued.add(job_id)
        return ticket

    def run_batch(self, job_ids: Sequence[str], spec_jsons: Sequence[dict[str, Any]],
                  branches: Sequence[BranchStart | None]) -> dict[str, Any]:
        """Run the rollouts `job_ids` as one batch (the node's LocalBackend: one model call) to their
        ends: {"outcomes": each one's outcome as plain data (`outcome_from_json`) by id, "call": the
        call's (samples, members) or None}. `poll` sees each outcome as soon as that rollout ends,
        while the others run on.

        The specs cross the Ray boundary in their JSON form; a branch's BranchStart (its parent's
        x_k and schedule: tensors) travels beside it."""
        contexts, run = [], []
        for job_id, spec_json, branch in zip(job_ids, spec_jsons, branches, strict=True):
            spec = RolloutSpec.from_json(spec_json, branch_from=branch)
            ctx = RunContext(job_id, spec, on_progress=self._set_progress, on_settle=self._set_outcome)
            with self._lock:
                self._running[job_id] = ctx
                self._queued.discard(job_id)
                self._progress[job_id] = (0, spec.num_inference_steps)
                cancelled = job_id in self._cancelled
                reason = self._cancelled.pop(job_id, None)
            contexts.append(ctx)
            if cancelled:  # cancelled through this worker's Flight server while queued
                ctx.stop(reason)
                outcome = Outcome.failure("shutdown", reason) if reason else Outcome.cancel()
                self.backend.abandon(job_id, outcome.kind, outcome.message)
                ctx.settle(outcome)
            else:
                run.append(ctx)
        size = None
        try:
            size = self.backend.run(run)
        finally:
            with self._lock:
                for job_id in job_ids:
                    self._running.pop(job_id, None)
        missing = Outcome.failure("internal_error", "the worker's backend returned without an outcome")
        with self._lock:  # handed over here: what `poll` has not taken yet is not kept
            for ctx in contexts:
                self._outcomes.pop(ctx.job_id, None)
            outcomes = {ctx.job_id: {**outcome_to_json(ctx.outcome or missing),
                                     "progress": self._progress.pop(ctx.job_id, None)} for ctx in contexts}
        return {"outcomes": outcomes, "call": size}

    def _set_progress(self, contexts: Sequence[RunContext], done: int, total: int) -> None:
        for ctx in contexts:
            self._progress[ctx.job_id] = (done, total)

    def _set_outcome(self, ctx: RunContext, outcome: Outcome) -> None:
        self._outcomes[ctx.job_id] = outcome_to_json(outcome)

    def poll(self, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Of each running or just-finished rollout of `job_ids`: (steps_done, steps_total) and its
        outcome once it has ended (None before)."""
        return {j: {"progress": self._progress.get(j), "outcome": self._outcomes.pop(j, None)}
                for j in job_ids if j in self._progress}

    def cancel(self, job_id: str, stop_reason: str | None = None) -> bool:
        """Stop a running rollout at its next step (or mark a reserved one); True if known here."""
        with self._lock:
            ctx = self._running.get(job_id)
            if ctx is not None:
                ctx.stop(stop_reason)
                return True
            try:
                self.store.ticket_for(job_id)
            except KeyError:
                return False
            if job_id in self.store.ids():  # finished already: nothing to stop
                return False
            self._cancelled[job_id] = stop_reason  # reserved, not started: refuse it when it comes
        self.backend.abandon(job_id, "failed" if stop_reason else "cancelled", stop_reason or "cancelled by client")
        return True

    def abandon(self, job_id: str, kind: str, message: str) -> None:
        with self._lock:
            self._cancelled.pop(job_id, None)
            self._queued.discard(job_id)
        self.backend.abandon(job_id, kind, message)

    def release(self, job_id: str, aside: bool = False) -> None:
        self.backend.release(job_id, aside=aside)

    def result_info(self, job_id: str) -> dict[str, Any] | None:
        info = self.backend.result_info(job_id)
        return None if info is None else info.to_json()

    def stored_ids(self) -> list[str]:
        return self.backend.stored_ids()

    def _result_lost(self, job_id: str, reason: str) -> None:
        with self._lock:
            self._lost.append((job_id, reason))

    def _release_from_flight(self, job_id: str) -> bool:
        """Flight `release` sent here, where the rollout's ticket points: refused for a queued or
        running rollout as the control plane's Flight refuses it, unless its trajectory is already
        whole (a trainer releasing as its pull returns); a finished one is freed and reported
        (`take_events`), so REST and the metrics follow (the control plane releases it as it
        records its end when that report comes first)."""
        with self._lock:  # running here, or ended and not yet handed to the control plane (its `poll`)
            running = job_id in self._running or job_id in self._progress
            active = "running" if running else "queued" if job_id in self._queued else None
        if active == "running" and self.backend.result_info(job_id) is not None:
            active = None  # its stream has ended: nothing of it runs any more
        if active is not None:
            raise flight_error("conflict", str(NotFinished(job_id, active)), rollout=job_id, status=active)
        released = self.store.release(job_id)
        if released:
            with self._lock:
                self._released.append(job_id)
        return released

    def take_events(self) -> dict[str, list[Any]]:
        """Since the last call: the finished rollouts this worker's store found lost (`lost`: id,
        reason) and those a Flight action released here (`released`: ids)."""
        with self._lock:
            events: dict[str, list[Any]] = {"lost": self._lost, "released": self._released}
            self._lost, self._released = [], []
        return events

    def set_tokens(self, tokens: list[str]) -> str:
        """Replace this worker's Flight bearer tokens (a reload on the control plane)."""
        self.node.flight.set_tokens(tokens)
        return "ok"

    def prepare_weights(self, push_id: str, model_id: str, state: dict[str, torch.Tensor],
                        expected_base: str | None = None) -> dict[str, Any]:
        """Stage new transformer weights for `model_id` (checked and built; nothing served changes)
        under `push_id`, for `commit_weights` or `abort_weights`. Answers plain data: {"digest"} it
        would serve, or the refusal: {"field", "reason"} (a tensor that does not fit) or {"stale":
        [expected, served]} (this worker serves another base than `expected_base`)."""
        try:
            served = self.registry.get(model_id).policy().base_digest
            if expected_base is not None and served != expected_base:
                raise StaleWeights(expected_base, served)
            staged = self.registry.stage_weights(model_id, state)
        except StaleWeights as exc:
            return {"stale": [exc.expected, exc.digest]}
        except RolloutInputError as exc:
            return {"field": exc.field, "reason": exc.reason}
        with self._lock:
            self._prepared[push_id] = staged
        return {"digest": staged.digest}

    def commit_weights(self, push_id: str) -> str:
        """Serve the weights `prepare_weights` staged under `push_id`; rollouts that start after this
        returns run on them. Returns the model's new digest."""
        with self._lock:
            staged = self._prepared.pop(push_id)
        return self.registry.install(staged).digest

    def abort_weights(self, push_id: str) -> bool:
        """Drop what `prepare_weights` staged under `push_id` (True if it held some)."""
        with self._lock:
            return self._prepared.pop(push_id, None) is not None

    def weights_of(self, model_id: str) -> dict[str, Any]:
        """What this worker serves for `model_id` (digest, base_digest, weights_version) and how many
        pushes it holds staged, not committed."""
        policy = self.registry.get(model_id).policy()
        with self._lock:
            staged = len(self._prepared)
        return {"digest": policy.digest, "base_digest": policy.base_digest,
                "weights_version": policy.weights_version, "staged": staged}

    def load_weights(self, model_id: str, state: dict[str, torch.Tensor]) -> str:
        """The cluster's committed weights for `model_id`, at once (a replacement worker catching
        up before it takes rollouts). Returns the model's new digest."""
        return self.registry.replace_weights(model_id, state).digest

    def set_weights_version(self, model_id: str, version: int) -> None:
        """Take the cluster's weights_version for `model_id` (a replacement that just loaded the
        committed weights and adapter counted only its own changes)."""
        model = self.registry.get(model_id)
        with model.push_lock, model.lock:  # as `install` changes it: between pushes, with the policy read
            model.weights_version = int(version)

    def load_lora(self, model_id: str, tensors: dict[str, torch.Tensor], lora_config: dict[str, Any]) -> str:
        """A LoRA adapter for `model_id` (checked by the control plane), replacing any; returns the digest."""
        return self.registry.load_lora(model_id, tensors, lora_config).digest

    def unload_lora(self, model_id: str) -> str:
        """Drop the adapter, if any (a replacement worker may never have had it); returns the digest."""
        from sigmaflight.pipeline.models import LoraNotLoaded

        try:
            return self.registry.unload_lora(model_id).digest
        except LoraNotLoaded:
            return self.registry.get(model_id).policy().digest

    def table(self, job_id: str) -> pa.Table:
        """The finished trajectory as one Arrow table (same schema and batches as the Flight stream).

        Returned through Ray, it lands in the object store: the opt-in path for trainers that
        already pass data through Ray. Raises KeyError if unknown, RuntimeError if not finished.
        """
        entry = self.store.get(job_id)
        if entry.state != "succeeded":
            raise RuntimeError(f"rollout {job_id} is {entry.state}, not succeeded")
        return pa.Table.from_batches(list(entry.iter_batches()), schema=entry.schema)

    def stream(self, job_id: str, name: str) -> pa.Table | None:
        """A succeeded rollout's extra stream ("outputs", "conditioning") as one Arrow table; None
        when the rollout did not ask for it or it is not held any more. Raises KeyError if unknown,
        RuntimeError if not succeeded. Through Ray it lands in the object store, as `table` does
        (a branch's control plane reads its parent's conditioning this way)."""
        entry = self.store.get(job_id)
        if entry.state != "succeeded":
            raise RuntimeError(f"rollout {job_id} is {entry.state}, not succeeded")
        try:
            return entry.stream_table(name)
        except StreamNotFound:
            return None

    def stop(self) -> None:
        with self._lock:
            for ctx in self._running.values():
                ctx.stop(ctx.stop_reason or "server shutting down")
        self.node.stop()
