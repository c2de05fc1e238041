"""The Ray backend: rollout workers are Ray actors, each with its own device and Flight server.

The control plane (JobManager, REST) stays one small process. At submit time
`reserve` places a rollout on the least-loaded live worker and asks that worker for the
ticket, so the ticket's Flight locations name the worker that will hold the trajectory
and trainers pull straight from it. `run` starts the rollout on that worker and, while it
runs, polls the worker's progress (every call bounded by `call_timeout_s`: a worker that does
not answer is killed and its rollouts fail, never pinning a manager thread) and forwards a
cancel; a worker that dies fails its rollouts with the worker named and is replaced for new ones.

The workers themselves (starting, calling, replacing them) are ray_workers.py; changes of
weights, LoRA and tokens on every worker are ray_weights.py. Ray is imported lazily:
`pip install sigmaflight[ray]`; the local backend never needs it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

from sigmaflight.control.backends.ray_weights import WeightsFanout
from sigmaflight.control.backends.ray_workers import (
    ACTOR_PREFIX,
    NAMESPACE,
    NoWorkers,
    WorkerDied,
    _cause,
    _Slot,
    trajectory_ref,
)
from sigmaflight.control.backends.worker import WorkerConfig, outcome_from_json
from sigmaflight.control.jobs.backend import CallSize, Outcome, ParentTrajectory, RunContext, report_progress
from sigmaflight.control.node import NodeConfig
from sigmaflight.dataplane.schema import header_from_schema
from sigmaflight.dataplane.streams import CONDITIONING, requested_streams
from sigmaflight.dataplane.tickets import Gone
from sigmaflight.pipeline.spec import RolloutInputError

from sigmaflight.records import ResultInfo

log = logging.getLogger("sigmaflight.ray")

__all__ = ["ACTOR_PREFIX", "NAMESPACE", "NoWorkers", "RayBackend", "WorkerDied", "trajectory_ref"]


class RayBackend(WeightsFanout):
    """The `Backend` protocol (control/jobs/backend.py) over N `RolloutWorker` actors: placement
    (`reserve`), the run-and-poll loop, results, and the opt-in object-store path."""

    def __init__(self, config: WorkerConfig, **kwargs: Any) -> None:
        self._lost_callback: Callable[[str, str], None] | None = None
        self._released_callback: Callable[[str], None] | None = None
        super().__init__(config, **kwargs)
        threading.Thread(target=self._watch_events, name="sigmaflight-ray-events", daemon=True).start()

    @staticmethod
    def connect(address: str, **kwargs: Any) -> bool:
        """ray.init once per process: "auto" joins the running cluster, "local" starts one here.
        True when this call started the Ray instance (the backend then stops it on close)."""
        import ray

        if ray.is_initialized():
            return False
        target = None if address == "local" else address
        # ray.init replaces the main thread's SIGTERM handler with sys.exit; keep the server's
        # own (uvicorn's graceful shutdown: running rollouts end "server shutting down").
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(address=target, namespace=NAMESPACE, include_dashboard=False, **kwargs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        return address == "local"

    @classmethod
    def from_settings(cls, settings: Any, *, node: NodeConfig | None = None) -> RayBackend:
        """Join the cluster named by `settings.ray_address` and start `settings.workers` actors, each
        on the server's node config (`NodeConfig.from_settings`, or `node` when given)."""
        owns = cls.connect(settings.ray_address)
        config = WorkerConfig(index=0, model=settings.model, node=node or NodeConfig.from_settings(settings),
                              torch_threads=settings.torch_threads)
        if node is not None and node.device != settings.device:  # the service's own node runs on the CPU
            config = replace(config, node=replace(node, device=settings.device))
        return cls(config, workers=settings.workers, num_cpus=settings.ray_num_cpus,
                   call_timeout_s=settings.ray_call_timeout_s, start_timeout_s=settings.ray_start_timeout_s,
                   owns_cluster=owns)

    # ---- Backend protocol -------------------------------------------------------------------

    def reserve(self, job_id: str) -> str:
        for _ in range(len(self._slots) + 1):
            with self._lock:
                live = [s for s in self._slots if s.alive]
                if not live:
                    raise NoWorkers("no live ray worker to take the rollout")
                self._rr += 1
                best = min(live, key=lambda s: (s.load, (s.index - self._rr) % len(self._slots)))
                best.load += 1
                self._where[job_id] = best
            try:
                return str(self._call(best, "reserve", job_id))
            except WorkerDied:
                with self._lock:
                    best.load -= 1
                    self._where.pop(job_id, None)
            except BaseException:  # a timeout: the rollout is not placed (the manager says 503)
                with self._lock:
                    best.load -= 1
                    self._where.pop(job_id, None)
                raise
        raise NoWorkers("no live ray worker to take the rollout")

    def group(self, job_id: str) -> Hashable:
        """The worker (index and generation) the rollout was placed on: a batch stays on one worker."""
        slot = self._slot_of(job_id)
        return None if slot is None else (slot.index, slot.generation)

    def run(self, batch: Sequence[RunContext]) -> CallSize | None:
        """The batch on the worker it was placed on (the manager batches only within one `group`), as
        one model call there. While it runs: each member's progress, its cancel forwarded, and its
        outcome settled as soon as the worker reports it (a cancelled member ends at once, the
        others run on); every call to the worker bounded by call_timeout_s. Returns the call's size
        as the worker reports it (None when the worker died under it)."""
        if not batch:
            return None
        ray = self._ray
        slot = self._slot_of(batch[0].job_id)
        by_id = {ctx.job_id: ctx for ctx in batch}
        done = dict.fromkeys(by_id, 0)
        cancel_sent: set[str] = set()

        def report(states: dict[str, tuple[Any, Any]]) -> None:
            """(progress, outcome) by job: the steps each finished since the last poll, each step
            reported once for all the batch's jobs that reached it (as the local backend does),
            then the outcomes."""
            steps: dict[tuple[int, int], list[RunContext]] = {}
            for job_id, (progress, _) in states.items():
                if progress:
                    d, total = progress
                    for k in range(done[job_id] + 1, d + 1):
                        steps.setdefault((k, total), []).append(by_id[job_id])
                    done[job_id] = max(done[job_id], d)
            for (k, total), contexts in sorted(steps.items()):
                report_progress(contexts, k, total)
            for job_id, (_, outcome) in states.items():
                if outcome is not None:
                    by_id[job_id].settle(outcome_from_json(outcome))

        try:
            if slot is None or not slot.alive:
                raise WorkerDied(f"{slot.name if slot else 'its worker'} died before the rollout started")
            ref = slot.handle.run_batch.remote(list(by_id), [c.spec.to_json() for c in batch],
                                               [c.spec.branch_from for c in batch])
            while True:
                ready, _ = ray.wait([ref], timeout=self._poll_s)
                if ready:
                    out = ray.get(ref)
                    break
                for ctx in batch:
                    if ctx.should_stop() and ctx.job_id not in cancel_sent:
                        slot.handle.cancel.remote(ctx.job_id, ctx.stop_reason)
                        cancel_sent.add(ctx.job_id)
                live = [j for j, c in by_id.items() if c.outcome is None]
                report({j: (state["progress"], state["outcome"]) for j, state in self._call(slot, "poll", live).items()})
        except ray.exceptions.RayActorError as exc:
            assert slot is not None
            self._mark_dead(slot, exc)
            for ctx in batch:
                ctx.settle(Outcome.failure(WorkerDied.error_type, f"{slot.name} died: {_cause(exc)}"))
            return None
        except WorkerDied as exc:
            for ctx in batch:
                ctx.settle(Outcome.failure(WorkerDied.error_type, str(exc)))
            return None
        finally:
            if slot is not None:
                with self._lock:
                    slot.load -= len(batch)
        report({j: (state.get("progress"), state) for j, state in out["outcomes"].items()})
        return None if out["call"] is None else (int(out["call"][0]), int(out["call"][1]))

    def abandon(self, job_id: str, kind: str, message: str) -> None:
        with self._lock:
            slot = self._where.get(job_id)
            if slot is not None:
                slot.load -= 1  # never runs: it no longer counts against the worker
        if slot is not None and slot.alive:
            try:
                self._call(slot, "abandon", job_id, kind, message)
            except WorkerDied:
                pass  # its reservation died with it

    def release(self, job_id: str, *, aside: bool = False) -> None:
        with self._lock:
            slot = self._where.pop(job_id, None)
        if slot is not None and slot.alive:
            try:
                self._call(slot, "release", job_id, aside)
            except WorkerDied:
                pass  # its result died with it

    def result_info(self, job_id: str) -> ResultInfo | None:
        for s in self._holders(job_id):
            try:
                info = self._call(s, "result_info", job_id)
            except WorkerDied:
                log.warning("a ray worker died while asked for a result", extra={"rollout": job_id, "worker": s.index})
                continue
            if info is not None:
                with self._lock:
                    self._where[job_id] = s
                return ResultInfo.from_json(info)
        return None

    def stored_ids(self) -> list[str]:
        """What every live worker holds; each is remembered as its holder (a release goes there)."""
        held: list[str] = []
        for slot, ids in self._fan_out("stored_ids"):
            with self._lock:
                self._where.update(dict.fromkeys(ids, slot))
            held += ids
        return held

    def locations_for(self, job_id: str) -> list[str]:
        slot = self._slot_of(job_id)
        return list(slot.locations) if slot is not None else []

    def parent(self, rollout_id: str) -> ParentTrajectory | None:
        """The finished trajectory from the worker that holds it, through the Ray object store (x_k
        travels to the control plane, then with the branch's spec to whichever worker runs it)."""
        if self.result_info(rollout_id) is None:
            return None
        slot = self._slot_of(rollout_id)
        assert slot is not None
        try:
            table = self._ray.get(slot.handle.table.remote(rollout_id), timeout=self._call_timeout_s)
        except Exception as exc:  # the worker died or dropped it meanwhile: nothing to branch from
            raise RolloutInputError(
                "branch_from.rollout", f"rollout {rollout_id!r}: its Ray worker could not hand over the trajectory "
                f"({type(exc).__name__})"
            ) from None
        header = header_from_schema(table.schema)
        conditioning = None
        if CONDITIONING in requested_streams(header):
            try:
                conditioning = self._ray.get(slot.handle.stream.remote(rollout_id, CONDITIONING),
                                             timeout=self._call_timeout_s)
            except Exception:  # gone meanwhile: the branch encodes the prompts again (the same tensors)
                conditioning = None
        return ParentTrajectory(header=header, batches=table.to_batches(), conditioning=conditioning)

    def on_result_lost(self, callback: Callable[[str, str], None]) -> None:
        self._lost_callback = callback

    def on_result_released(self, callback: Callable[[str], None]) -> None:
        self._released_callback = callback

    def on_unknown_ticket(self, callback: Callable[[str], Gone | None]) -> None:
        """Not wired: each worker's Flight server answers for its own store, in its own process."""

    def _not_adopted(self, job_ids: list[str], dead: _Slot) -> None:
        lost_to = self._lost_callback
        if lost_to is None:
            return
        for job_id in job_ids:  # a running one failed worker_died already: the jobs layer ignores it
            lost_to(job_id, f"its Ray worker, {dead.name}, died and its replacement does not hold the trajectory "
                            "(kept across a worker's death only with --data-dir)")

    def _watch_events(self) -> None:
        """Every second, what happened to results on each worker that the control plane did not
        ask for: found lost (a file truncated or corrupted), or released by a Flight action there."""
        while not self._closed.wait(1.0):
            lost_to, released_to = self._lost_callback, self._released_callback
            if lost_to is None or released_to is None:
                continue
            with self._lock:
                slots = [s for s in self._slots if s.alive]
            for s in slots:
                try:
                    events = self._call(s, "take_events")
                except Exception:  # dead (replaced by _call) or closing: the next round asks again
                    continue
                for rollout_id, reason in events["lost"]:
                    lost_to(rollout_id, reason)
                for rollout_id in events["released"]:
                    released_to(rollout_id)

    # ---- extras -----------------------------------------------------------------------------

    def trajectory_ref(self, job_id: str) -> Any:
        """An ObjectRef to the finished trajectory as a pyarrow.Table, put in the Ray object
        store by the worker that holds it (opt-in; Flight stays the main path)."""
        slot = self._slot_of(job_id)
        if slot is None:
            raise KeyError(job_id)
        return slot.handle.table.remote(job_id)

    def worker_for(self, job_id: str) -> Any:
        """The actor handle holding a rollout (tests and tools)."""
        slot = self._slot_of(job_id)
        if slot is None:
            raise KeyError(job_id)
        return slot.handle
