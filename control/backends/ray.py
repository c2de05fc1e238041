"""The Ray backend: rollout workers are Ray actors, each with its own device and Flight server.

The control plane (JobManager, REST) stays one small process. At submit time
`reserve` places a rollout on the least-loaded live worker and asks that worker for the
ticket, so the ticket's Flight locations name the worker that will hold the trajectory
and trainers pull straight from it. `run` starts the rollout on that worker and, while it
runs, polls the worker's progress (every call bounded by `call_timeout_s`: a worker that does
not answer is killed and its rollouts fail, never pinning a manager thread) and forwards a
cancel; a worker that dies fails its rollouts with the worker named and is replaced for new ones.

Ray is imported lazily: `pip install sigmaflight[ray]`; the local backend never needs it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from sigmaflight.control.backends.worker import RolloutWorker, WorkerConfig, outcome_from_json
from sigmaflight.control.jobs.backend import Outcome, ParentTrajectory, RunContext
from sigmaflight.control.node import NodeConfig
from sigmaflight.dataplane.schema import header_from_schema
from sigmaflight.dataplane.streams import CONDITIONING, requested_streams
from sigmaflight.pipeline.spec import RolloutInputError

from sigmaflight.records import ResultInfo

log = logging.getLogger("sigmaflight.ray")

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


class RayBackend:
    """The `Backend` protocol (control/jobs/backend.py) over N `RolloutWorker` actors.

    Long (~400 lines) for a reason: it owns the worker slots and their generations under one
    lock; placement (`reserve`), the run-and-poll loop, replacing a dead worker and fanning
    weights, LoRA and token changes out to every worker (a replacement gets the latest) all
    read and change those slots together. The worker itself (worker.py) and its node
    (control/node.py) live outside."""

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
        self._weights: dict[str, Any] = {}
        """model id -> ObjectRef of the latest pushed state dict (a replacement worker loads it)."""
        self._lora: dict[str, tuple[Any, dict[str, Any]]] = {}
        """model id -> (ObjectRef of the adapter's tensors, its LoraConfig dict) of the adapter on now."""
        self._weights_version = 0
        self._lost_callback: Callable[[str, str], None] | None = None
        slots = [self._spawn(i) for i in range(workers)]
        for s in slots:
            self._await_ready(s)
        self._slots = slots
        threading.Thread(target=self._watch_lost, name="sigmaflight-ray-lost", daemon=True).start()

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
        config = WorkerConfig(index=0, model=settings.model, node=node or NodeConfig.from_settings(settings))
        if node is not None and node.device != settings.device:  # the service's own node runs on the CPU
            config = replace(config, node=replace(node, device=settings.device))
        return cls(config, workers=settings.workers, num_cpus=settings.ray_num_cpus,
                   call_timeout_s=settings.ray_call_timeout_s, start_timeout_s=settings.ray_start_timeout_s,
                   owns_cluster=owns)

    # ---- workers ----------------------------------------------------------------------------

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
        """Start a new actor for a dead one's index; it joins placement once ready."""
        def start() -> None:
            try:
                slot = self._spawn(dead.index)
                self._await_ready(slot)
                while True:  # the latest pushed weights, before it takes any rollout
                    with self._lock:
                        weights, lora, version = dict(self._weights), dict(self._lora), self._weights_version
                    for model_id, ref in weights.items():
                        self._ray.get(slot.handle.load_weights.remote(model_id, ref), timeout=self._start_timeout_s)
                    for model_id, (ref, config) in lora.items():  # after the full push: it drops adapters
                        self._ray.get(slot.handle.load_lora.remote(model_id, ref, config),
                                      timeout=self._start_timeout_s)
                    with self._lock:
                        if self._weights_version != version:
                            continue  # a push came meanwhile: load that too
                        if self._closed.is_set():
                            self._ray.kill(slot.handle)
                            return
                        self._slots = [slot if s is dead else s for s in self._slots]
                        break
            except Exception:
                log.exception("could not replace ray worker", extra={"worker": dead.index})
                return
            log.info("ray worker replaced", extra={"worker": dead.index, "actor": slot.actor_id})

        threading.Thread(target=start, name=f"sigmaflight-replace-{dead.index}", daemon=True).start()

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

    def _slot_of(self, job_id: str) -> _Slot | None:
        with self._lock:
            return self._where.get(job_id)

    def _holders(self, job_id: str) -> list[_Slot]:
        """The live worker known to hold `job_id`, else every live worker (after a restart the
        control plane does not know where a finished rollout's file was adopted)."""
        with self._lock:
            slot = self._where.get(job_id)
            return [slot] if slot is not None and slot.alive else [s for s in self._slots if s.alive]

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

    def run(self, batch: Sequence[RunContext]) -> None:
        """The batch on the worker it was placed on (the manager batches only within one `group`), as
        one model call there. While it runs: each member's progress, its cancel forwarded, and its
        outcome settled as soon as the worker reports it (a cancelled member ends at once, the
        others run on); every call to the worker bounded by call_timeout_s."""
        if not batch:
            return
        ray = self._ray
        slot = self._slot_of(batch[0].job_id)
        by_id = {ctx.job_id: ctx for ctx in batch}
        done = dict.fromkeys(by_id, 0)
        cancel_sent: set[str] = set()

        def report(job_id: str, progress: Any, outcome: Any) -> None:
            ctx = by_id[job_id]
            if progress:
                d, total = progress
                for k in range(done[job_id] + 1, d + 1):  # one call per step, as the local backend makes
                    ctx.progress(k, total)
                done[job_id] = max(done[job_id], d)
            if outcome is not None:
                ctx.settle(outcome_from_json(outcome))

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
                for job_id, state in self._call(slot, "poll", live).items():
                    report(job_id, state["progress"], state["outcome"])
        except ray.exceptions.RayActorError as exc:
            assert slot is not None
            self._mark_dead(slot, exc)
            for ctx in batch:
                ctx.settle(Outcome.failure(WorkerDied.error_type, f"{slot.name} died: {_cause(exc)}"))
            return
        except WorkerDied as exc:
            for ctx in batch:
                ctx.settle(Outcome.failure(WorkerDied.error_type, str(exc)))
            return
        finally:
            if slot is not None:
                with self._lock:
                    slot.load -= len(batch)
        for job_id, state in out.items():
            report(job_id, state.get("progress"), state)

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

    def release(self, job_id: str) -> None:
        with self._lock:
            slot = self._where.pop(job_id, None)
        if slot is not None and slot.alive:
            try:
                self._call(slot, "release", job_id)
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

    def load_weights(self, model_id: str, state: Mapping[str, torch.Tensor]) -> list[str]:
        """Push new transformer weights to every live worker; returns once each has loaded them
        (their digests), so every rollout that starts afterwards runs on them. The state dict
        is put in the object store once; a worker started later (a replacement) loads the latest
        before it takes rollouts. A worker that dies meanwhile is replaced as usual."""
        ref = self._ray.put(dict(state))
        with self._lock:
            self._weights[model_id] = ref
            self._lora.pop(model_id, None)  # a full push drops the adapter
            self._weights_version += 1
        return self._broadcast("load_weights", model_id, ref)

    def load_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: dict[str, Any]) -> list[str]:
        """Put a LoRA adapter on every live worker (replacing any); a replacement worker gets the
        adapter on now before it takes rollouts. Returns the workers' digests."""
        ref = self._ray.put(dict(tensors))
        with self._lock:
            self._lora[model_id] = (ref, dict(lora_config))
            self._weights_version += 1
        return self._broadcast("load_lora", model_id, ref, dict(lora_config))

    def unload_lora(self, model_id: str) -> list[str]:
        """Remove the adapter on every live worker; returns their digests (the base digest)."""
        with self._lock:
            self._lora.pop(model_id, None)
            self._weights_version += 1
        return self._broadcast("unload_lora", model_id)

    def set_tokens(self, tokens: Sequence[str]) -> None:
        """The accepted bearer tokens of every live worker's Flight server (a reload), once each
        has them; a worker started later (a replacement) gets them too."""
        with self._lock:
            self._config = replace(self._config, node=replace(self._config.node, tokens=tuple(tokens)))
        n = len(self._call_all("set_tokens", list(tokens)))
        log.info("tokens pushed to ray workers", extra={"workers": n})

    def on_result_lost(self, callback: Callable[[str, str], None]) -> None:
        self._lost_callback = callback

    def _watch_lost(self) -> None:
        """Every second, the results each worker's store found lost (a file truncated or corrupted)."""
        while not self._closed.wait(1.0):
            callback = self._lost_callback
            if callback is None:
                continue
            with self._lock:
                slots = [s for s in self._slots if s.alive]
            for s in slots:
                try:
                    lost = self._call(s, "take_lost")
                except Exception:  # dead (replaced by _call) or closing: the next round asks again
                    continue
                for rollout_id, reason in lost:
                    callback(rollout_id, reason)

    def _broadcast(self, method: str, model_id: str, *args: Any) -> list[str]:
        digests = self._call_all(method, model_id, *args)
        log.info("change of weights pushed to ray workers", extra={"model": model_id, "change": method,
                                                                    "workers": len(digests)})
        return digests

    def _call_all(self, method: str, *args: Any) -> list[str]:
        """`method(*args)` on every live worker at once; their answers (a dead one is replaced)."""
        with self._lock:
            slots = [s for s in self._slots if s.alive]
        pending = [(s, getattr(s.handle, method).remote(*args)) for s in slots]
        digests = []
        for slot, call in pending:
            try:
                digests.append(str(self._ray.get(call, timeout=self._start_timeout_s)))
            except self._ray.exceptions.RayActorError as exc:
                self._mark_dead(slot, exc)
        return digests

    # ---- extras -----------------------------------------------------------------------------

    def trajectory_ref(self, job_id: str) -> Any:
        """An ObjectRef to the finished trajectory as a pyarrow.Table, put in the Ray object
        store by the worker that holds it (opt-in; Flight stays the main path)."""
        slot = self._slot_of(job_id)
        if slot is None:
            raise KeyError(job_id)
        return slot.handle.table.remote(job_id)

    def stream_ref(self, job_id: str, name: str) -> Any:
        """An ObjectRef to a finished rollout's extra stream as a pyarrow.Table (None when it
        was not asked for or is not held), put in the object store by the worker that holds it."""
        slot = self._slot_of(job_id)
        if slot is None:
            raise KeyError(job_id)
        return slot.handle.stream.remote(job_id, name)

    def worker_for(self, job_id: str) -> Any:
        """The actor handle holding a rollout (tests and tools)."""
        slot = self._slot_of(job_id)
        if slot is None:
            raise KeyError(job_id)
        return slot.handle

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
