"""One rollout worker: a model on one device, its own result store and Flight server.

`RolloutWorker` is a plain class; control/backends/ray.py turns it into a Ray actor
(`ray.remote(...)`, threaded with `max_concurrency`) so the rollout runs on one thread
while the control plane polls `progress` and calls `cancel` on others. The rollout itself
runs through `LocalBackend.run`, the same pipeline -> data-plane path as the local backend,
so a trajectory is bit-identical whichever backend ran it.

Nothing here imports Ray: the class is testable (and usable) in-process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
from sigmaflight.control.jobs.manager import Job
from sigmaflight.control.node import Node, NodeConfig
from sigmaflight.dataplane.streams import StreamNotFound
from sigmaflight.pipeline.spec import RolloutCancelled, RolloutSpec

log = logging.getLogger("sigmaflight.worker")

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What a worker needs to know; plain data so it pickles across the Ray boundary."""

    index: int
    """Worker number shown in logs and errors ("worker 1 (actor ...)")."""
    model: str = "tiny-sd3"
    """Model loaded at start-up (others load on first use)."""
    model_dir: str | None = None
    """Directory of local diffusers pipelines, as Settings.model_dir (must exist on the worker's node)."""
    device: str = "cpu"
    dtype: str = "float32"
    batch_invariant: bool = False
    torch_threads: int | None = None
    """torch intra-op threads; None keeps torch's default (Ray sets OMP_NUM_THREADS from num_cpus)."""
    host: str = "127.0.0.1"
    """Flight bind address: loopback stays loopback (single node); anything else binds 0.0.0.0
    and advertises the node's IP, so trainers on other nodes can reach it."""
    data_dir: str | None = None
    """This worker's own durable directory (node-local), or None for memory only."""
    shm_dir: str | None = None
    """This worker's own --shm-dir (node-local): its finished trajectories as shared-memory files
    that trainers on the worker's host read directly (others stream over gRPC)."""
    store_budget_bytes: int = 4 << 30
    tokens: tuple[str, ...] = ()
    tls_certificates: tuple[tuple[bytes, bytes], ...] = ()
    max_flight_streams: int = 64


class RolloutWorker:
    """Runs rollouts on one device and serves their trajectories from its own Flight server."""

    def __init__(self, config: WorkerConfig, node_ip: str | None = None) -> None:
        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        loopback = config.host in LOOPBACK
        self.node = Node(
            NodeConfig(
                device=config.device,
                dtype=config.dtype,
                model_dir=config.model_dir,
                data_dir=config.data_dir,
                shm_dir=config.shm_dir,
                store_budget_bytes=config.store_budget_bytes,
                host=config.host if loopback else "0.0.0.0",
                port=0,
                advertise_host=None if loopback else (node_ip or config.host),
                tokens=config.tokens,
                tls_certificates=config.tls_certificates,
                max_flight_streams=config.max_flight_streams,
                batch_invariant=config.batch_invariant,
            ),
            on_cancel=self.cancel,
        )
        self.registry, self.store, self.backend = self.node.registry, self.node.store, self.node.backend
        self.registry.get(config.model)  # load once, before the first rollout
        self.flight = self.node.flight.start()
        self._lock = threading.Lock()
        self._running: dict[str, Job] = {}
        self._progress: dict[str, tuple[int, int]] = {}
        self._cancelled: dict[str, str | None] = {}  # cancelled before it ran: id -> stop reason
        log.info("worker %d ready at %s (pid %d)", config.index, self.flight.locations[0], os.getpid())

    # ---- what the control plane calls -------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"index": self.config.index, "locations": self.flight.locations, "pid": os.getpid()}

    def reserve(self, job_id: str) -> str:
        return self.backend.reserve(job_id)

    def run(self, job_id: str, spec: RolloutSpec) -> dict[str, Any]:
        """Run one rollout to the end; raises RolloutCancelled when cancelled, anything else on failure."""
        job = Job(id=job_id, model=spec.model, spec=spec, request={}, steps_total=spec.num_inference_steps,
                  created_at=time.time())
        with self._lock:
            if job_id in self._cancelled:
                job.stop_reason = self._cancelled.pop(job_id)
                job.cancel.set()
            self._running[job_id] = job
            self._progress[job_id] = (0, spec.num_inference_steps)

        def on_progress(done: int, total: int) -> None:
            self._progress[job_id] = (done, total)

        try:
            if job.cancel.is_set():  # cancelled through this worker's Flight server while queued
                message = job.stop_reason or "cancelled by client"
                self.backend.abandon(job_id, "failed" if job.stop_reason else "cancelled", message)
                raise RolloutCancelled(message)
            return self.backend.run(job, on_progress=on_progress, should_stop=job.cancel.is_set)
        finally:
            with self._lock:
                self._running.pop(job_id, None)

    def progress(self, job_id: str) -> tuple[int, int] | None:
        """(steps_done, steps_total) of a running or just-finished rollout."""
        return self._progress.get(job_id)

    def forget(self, job_id: str) -> None:
        self._progress.pop(job_id, None)

    def cancel(self, job_id: str, stop_reason: str | None = None) -> bool:
        """Stop a running rollout at its next step (or mark a reserved one); True if known here."""
        with self._lock:
            job = self._running.get(job_id)
            if job is not None:
                job.stop_reason = stop_reason
                job.cancel.set()
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
        self.backend.abandon(job_id, kind, message)

    def release(self, job_id: str) -> None:
        self._progress.pop(job_id, None)
        self.backend.release(job_id)

    def has_result(self, job_id: str) -> bool:
        return self.backend.has_result(job_id)

    def result_info(self, job_id: str) -> dict[str, Any] | None:
        return self.backend.result_info(job_id)

    def set_tokens(self, tokens: list[str]) -> str:
        """Replace this worker's Flight bearer tokens (a reload on the control plane)."""
        self.node.flight.set_tokens(tokens)
        return "ok"

    def load_weights(self, model_id: str, state: dict[str, torch.Tensor]) -> str:
        """New transformer weights for `model_id` (checked by the control plane); rollouts that
        start after this returns run on them. Returns the model's new digest."""
        return self.registry.load_weights(model_id, state)

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

    def ping(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        with self._lock:
            for job in self._running.values():
                job.stop_reason = job.stop_reason or "server shutting down"
                job.cancel.set()
        self.node.stop()
