"""The Ray backend's workers: actors, their slots and generations, calls bounded in time, replacements.

Each worker is a `RolloutWorker` (worker.py) turned into a Ray actor. `RayWorkers` owns the slots
under one lock: it starts the actors, calls them with a time bound (a worker that dies or does
not answer is marked dead, killed and replaced), and starts a replacement for a dead one, which
catches up with the cluster's weights before it takes rollouts. Ray is imported lazily.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from sigmaflight.control.backends.worker import RolloutWorker, WorkerConfig

log = logging.getLogger("sigmaflight.ray")

__all__ = ["ACTOR_PREFIX", "NAMESPACE", "NoWorkers", "RayWorkers", "WorkerDied", "trajectory_ref"]

NAMESPACE = "sigmaflight"
ACTOR_PREFIX = "sigmaflight-worker-"


class WorkerDied(RuntimeError):
    """The worker actor that held a rollout died (process crash, node lost, ray.kill) or stopped
    answering; the `error.type` of the rollouts it held."""

    error_type = "worker_died"


class NoWorkers(RuntimeError):
    """No live worker can take a rollout (all died and none could be replaced yet)."""


class _ActorWorker(RolloutWorker):
    """The actor-side wrapper (its name is what `ray list actors` shows)."""

    def __init__(self, config: WorkerConfig) -> None:
        import ray

        super().__init__(config, node_ip=ray.util.get_node_ip_address())

    def actor_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_actor_id() or ""


_REMOTE: Any = None


def _remote_worker_class() -> Any:
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(_ActorWorker)
    return _REMOTE


@dataclass
class _Slot:
    index: int
    handle: Any
    generation: int
    actor_id: str = ""
    locations: list[str] = field(default_factory=list)
    alive: bool = True
    load: int = 0
    """Rollouts reserved on this worker and not finished."""

    @property
    def name(self) -> str:
        return f"worker {self.index} (actor {self.actor_id or '?'})"


class RayWorkers:
    """N `RolloutWorker` actors in slots; `RayBackend` (ray.py) places and runs rollouts on them."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        workers: int,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        poll_s: float = 0.1,
        call_timeout_s: float = 30.0,
        start_timeout_s: float = 600.0,
        max_concurrency: int = 16,
        owns_cluster: bool = False,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayBackend needs ray.init(...) first (see RayBackend.connect)")
        self._ray = ray
        self._config = config
        self._num_cpus = num_cpus
        self._num_gpus = (1.0 if config.node.device.startswith("cuda") else 0.0) if num_gpus is None else num_gpus
        self._poll_s = poll_s
        self._call_timeout_s = call_timeout_s
        self._start_timeout_s = start_timeout_s
        self._max_concurrency = max_concurrency
        self._owns_cluster = owns_cluster
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._where: dict[str, _Slot] = {}  # job id -> the worker holding it; read and written under _lock
        self._rr = 0
        self._generation = 0
        self._closed = threading.Event()
        self._change_lock = threading.Lock()
        """Held by a change every worker must see (weights, LoRA, tokens) and by a replacement
        worker from its catch-up to joining: a worker joins either before a change (and gets it)
        or after (and catches up with it)."""
        slots = [self._spawn(i) for i in range(workers)]
        for s in slots:
            self._await_ready(s)
        self._slots = slots

    def _spawn(self, index: int) -> _Slot:
        with self._lock:
            self._generation += 1
            generation = self._generation
            cfg = replace(self._config, index=index)
        actor_cls = _remote_worker_class().options(
            name=f"{ACTOR_PREFIX}{index}-{generation}",
            num_cpus=self._num_cpus,
            num_gpus=self._num_gpus,
            max_concurrency=self._max_concurrency,
            max_restarts=0,
        )
        return _Slot(index=index, handle=actor_cls.remote(cfg), generation=generation)

    def _await_ready(self, slot: _Slot) -> None:
        desc, actor_id = self._ray.get(
            [slot.handle.describe.remote(), slot.handle.actor_id.remote()], timeout=self._start_timeout_s
        )
        slot.locations, slot.actor_id = list(desc["locations"]), actor_id
        log.info("ray worker ready", extra={"worker": slot.index, "actor": actor_id, "flight_url": slot.locations[0]})

    def _replace(self, dead: _Slot) -> None:
        """Start a new actor for a dead one's index; it joins placement once ready and caught up."""
        def start() -> None:
            try:
                slot = self._spawn(dead.index)
                self._await_ready(slot)
                with self._change_lock:  # no change of weights between its catch-up and joining
                    self._catch_up(slot)
                    # with --data-dir it adopted the dead one's finished trajectories: served here now
                    adopted = self._ray.get(slot.handle.stored_ids.remote(), timeout=self._start_timeout_s)
                    with self._lock:
                        if self._closed.is_set():
                            self._ray.kill(slot.handle)
                            return
                        self._slots = [slot if s is dead else s for s in self._slots]
                        self._where.update(dict.fromkeys(adopted, slot))
                        gone = [j for j, s in self._where.items() if s is dead]  # kept: a queued one fails naming it
                self._not_adopted(gone, dead)
            except Exception:
                log.exception("could not replace ray worker", extra={"worker": dead.index})
                return
            log.info("ray worker replaced", extra={"worker": dead.index, "actor": slot.actor_id})

        threading.Thread(target=start, name=f"sigmaflight-replace-{dead.index}", daemon=True).start()

    def _catch_up(self, slot: _Slot) -> None:
        """Bring a replacement worker to the cluster's state before it takes rollouts (_change_lock held)."""

    def _not_adopted(self, job_ids: list[str], dead: _Slot) -> None:
        """Rollouts the dead worker held that its replacement does not (no --data-dir, or a file it
        could not adopt): a finished one's trajectory is gone (RayBackend reports it lost)."""

    def _mark_dead(self, slot: _Slot, cause: BaseException | str, *, kill: bool = False) -> None:
        with self._lock:
            if not slot.alive:
                return
            slot.alive = False
        log.error("ray worker died", extra={"worker": slot.index, "actor": slot.actor_id, "cause": str(cause)})
        if kill:  # it stopped answering: make sure it is gone before its index is reused
            try:
                self._ray.kill(slot.handle)
            except Exception:
                log.warning("could not kill an unresponsive ray worker", extra={"worker": slot.index})
        if not self._closed.is_set():
            self._replace(slot)

    def workers(self) -> list[dict[str, Any]]:
        """Live workers: index, actor id, Flight locations, rollouts placed on it."""
        with self._lock:
            return [
                {"index": s.index, "actor": s.actor_id, "locations": s.locations, "load": s.load}
                for s in self._slots
                if s.alive
            ]

    def _call(self, slot: _Slot, method: str, *args: Any) -> Any:
        """`method(*args)` on one worker, bounded by call_timeout_s. A worker that died or does not
        answer is marked dead (and replaced) and WorkerDied raised: dead, not absent."""
        try:
            return self._ray.get(getattr(slot.handle, method).remote(*args), timeout=self._call_timeout_s)
        except self._ray.exceptions.RayActorError as exc:
            self._mark_dead(slot, exc)
            raise WorkerDied(f"{slot.name} died: {_cause(exc)}") from None
        except self._ray.exceptions.GetTimeoutError:
            why = f"{slot.name} did not answer {method} within {self._call_timeout_s:g} s"
            self._mark_dead(slot, why, kill=True)
            raise WorkerDied(why) from None

    def can_place(self) -> bool:
        """A live worker can take a rollout (none while every worker is dead and not replaced yet)."""
        with self._lock:
            return any(s.alive for s in self._slots)

    def _slot_of(self, job_id: str) -> _Slot | None:
        with self._lock:
            return self._where.get(job_id)

    def _holders(self, job_id: str) -> list[_Slot]:
        """The live worker known to hold `job_id`, else every live worker (after a restart the
        control plane does not know where a finished rollout's file was adopted)."""
        with self._lock:
            slot = self._where.get(job_id)
            return [slot] if slot is not None and slot.alive else [s for s in self._slots if s.alive]

    def _fan_out(self, method: str, *args: Any) -> list[tuple[_Slot, Any]]:
        """`method(*args)` on every live worker at once; (worker, answer) of each that answered. One
        that died or did not answer within start_timeout_s is marked dead (killed) and replaced."""
        with self._lock:
            slots = [s for s in self._slots if s.alive]
        pending = [(s, getattr(s.handle, method).remote(*args)) for s in slots]
        answers = []
        for slot, call in pending:
            try:
                answers.append((slot, self._ray.get(call, timeout=self._start_timeout_s)))
            except self._ray.exceptions.RayActorError as exc:
                self._mark_dead(slot, exc)
            except self._ray.exceptions.GetTimeoutError:
                self._mark_dead(slot, f"{slot.name} did not answer {method} within {self._start_timeout_s:g} s",
                                kill=True)
        return answers

    def _call_all(self, method: str, *args: Any) -> list[str]:
        """`method(*args)` on every live worker at once; their answers (a dead one is replaced)."""
        return [str(answer) for _, answer in self._fan_out(method, *args)]

    def close(self) -> None:
        """Stop every worker; when this backend's `connect` started the Ray instance ("local"),
        shut that down too, so no Ray process outlives the server."""
        self._closed.set()
        with self._lock:
            slots = list(self._slots)
        for s in slots:
            if s.alive:
                try:
                    self._ray.get(s.handle.stop.remote(), timeout=10)
                except Exception:  # dying anyway
                    pass
                self._ray.kill(s.handle)
        if self._owns_cluster:
            self._ray.shutdown()


def trajectory_ref(rollout_id: str, *, namespace: str = NAMESPACE) -> Any:
    """From any process in the cluster (`ray.init(address="auto")`): an ObjectRef to the
    finished trajectory as a pyarrow.Table, asked of the sigmaflight worker that holds it."""
    import ray

    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["namespace"] != namespace or not info["name"].startswith(ACTOR_PREFIX):
            continue
        try:
            handle = ray.get_actor(info["name"], namespace=namespace)
            if ray.get(handle.result_info.remote(rollout_id), timeout=30) is not None:
                return handle.table.remote(rollout_id)
        except (ValueError, ray.exceptions.RayActorError):
            continue  # gone meanwhile
    raise KeyError(f"no sigmaflight worker holds a finished rollout {rollout_id!r}")


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
