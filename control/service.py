"""One process, both planes: a node (models, store, Flight server) and the job queue.

`Service` is built and started by the Starlette lifespan (control/http/app.py) and handed to
the routes as state; nothing here is a module-level global. The node is built by
control/node.py, the same wiring each Ray worker uses.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from sigmaflight.control.jobs import JobManager, NotFinished
from sigmaflight.control.jobs.backend import Backend
from sigmaflight.control.node import Node, NodeConfig
from sigmaflight.control.settings import Settings
from sigmaflight.control.weights_sink import ServiceWeightsSink
from sigmaflight.dataplane.auth import TokenSet
from sigmaflight.dataplane.errors import flight_error
from sigmaflight.dataplane.tickets import Gone
from sigmaflight.dataplane.weights import WeightsPushes
from sigmaflight.pipeline.models import Policy, StagedWeights

from sigmaflight.records import RolloutState

log = logging.getLogger("sigmaflight.service")
STEP_WAIT_S = 15.0
"""How long a shutdown waits for the running steps to end (docs/operations.md, Fault behaviour)."""


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.auth_enabled = bool(settings.tokens())
        config = NodeConfig.from_settings(settings)
        if settings.backend == "ray":  # the models run in the worker actors; here they only validate requests
            config = dataclasses.replace(config, device="cpu")
        if settings.torch_threads is not None and settings.backend == "local":  # Ray workers set their own
            torch.set_num_threads(settings.torch_threads)  # the default of every thread started from now: the workers
        self.node = Node(config, on_cancel=self._cancel_from_flight, on_release=self._release_from_flight)
        self.registry, self.store, self.flight = self.node.registry, self.node.store, self.node.flight
        self.backend: Backend
        if settings.backend == "ray":
            from sigmaflight.control.backends.ray import RayBackend

            self.backend = RayBackend.from_settings(settings, node=config)
        else:
            self.backend = self.node.backend
        self.jobs = JobManager(
            self.backend,
            workers=settings.workers,
            queue_size=settings.queue_size,
            ttl_s=settings.ttl_s,
            keep_records=settings.max_records,
            data_dir=settings.data_dir,
            max_batch_samples=settings.max_batch_samples,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
        )
        self.backend.on_result_lost(self._result_unavailable)
        self.backend.on_result_released(self.jobs.released_elsewhere)
        self.backend.on_unknown_ticket(self._ended_before)
        self.ready = False
        self._rollouts_ended = self._stopped = False
        self._change_lock = threading.Lock()
        """One change of weights (or of tokens) at a time, registry and workers together (workers
        see the same order)."""
        self.weights_sink = ServiceWeightsSink(self)
        self.weights_pushes = WeightsPushes(self.weights_sink, expire_s=settings.weights_push_timeout_s)
        """Streamed weights pushes over this node's Flight do_put (taken once the service starts)."""

    def _result_unavailable(self, rollout_id: str, reason: str) -> None:
        """The backend lost a finished trajectory (its file truncated or corrupted): REST stops
        saying succeeded."""
        self.jobs.result_lost(rollout_id, reason)

    def _ended_before(self, key: str) -> Gone | None:
        """How the rollout a ticket or id names ended, when the store no longer knows it (it ended
        before a restart, or the store forgot it): Flight then names the reason REST gives."""
        view = self.jobs.get(key)
        if view is None:
            view = next(iter(self.jobs.list(ticket=key, limit=1)[0]), None)
        if view is None or view.status.active or view.status is RolloutState.SUCCEEDED:
            return None
        reason = f"{view.status}: {view.error.message}" if view.error is not None else str(view.status)
        return Gone(view.status, reason)

    def _cancel_from_flight(self, rollout_id: str) -> bool:
        """Flight `cancel`: only stops a queued or running rollout (a finished one is kept)."""
        return self.jobs.cancel_active(rollout_id)

    def _release_from_flight(self, rollout_id: str) -> bool:
        """Flight `release`: frees a finished rollout; a queued or running one is refused, unless its
        trajectory is already whole (a trainer releasing as its pull returns): then it is freed as
        the control plane records its end."""
        try:
            return self.jobs.release(rollout_id)
        except NotFinished as exc:
            if exc.status == RolloutState.RUNNING and self.backend.result_info(rollout_id) is not None:
                return self.jobs.release_when_finished(rollout_id)
            raise flight_error("conflict", str(exc), rollout=rollout_id, status=exc.status) from None

    def push_weights(self, model_id: str, state: Mapping[str, torch.Tensor]) -> Policy:
        """New transformer weights: checked and built in the service's registry (RolloutInputError
        naming the key), then on every remote worker (Ray: all workers or none, a refusal raised),
        then served here. Returns the new Policy (digest, weights_version)."""
        with self._change_lock:
            staged = self.registry.stage_weights(model_id, state)
            self._to_workers(model_id, state, staged, expected_base=None)
            return self.registry.install(staged)

    def push_tensors(self, model_id: str, tensors: Mapping[str, torch.Tensor], *, expected_base: str | None = None,
                     known_crcs: tuple[str, Mapping[str, str]] | None = None) -> tuple[str, Policy]:
        """Some of the transformer's tensors, already checked as they streamed in (the others kept):
        built by the registry's `stage_tensors`, then every remote worker gets the whole new state
        dict (all or none, each on the same base when the push named one), then served here.
        Returns (the base digest before, the new Policy), read under this change's lock."""
        with self._change_lock:
            before = self.registry.get(model_id).policy().base_digest
            staged = self.registry.stage_tensors(model_id, tensors, expected_base=expected_base,
                                                 known_crcs=known_crcs)
            self._to_workers(model_id, staged.pipeline.transformer.state_dict(), staged, expected_base=expected_base)
            return before, self.registry.install(staged)

    def _to_workers(self, model_id: str, state: Mapping[str, torch.Tensor], staged: StagedWeights, *,
                    expected_base: str | None) -> None:
        """The staged weights on every remote worker before they are served here: the Ray backend
        commits on every worker or raises the refusal of one (nothing changed anywhere); the local
        backend has none."""
        digests = self.backend.load_weights(model_id, state, expected_base=expected_base, expected_digest=staged.digest)
        self._check_workers("load_weights", model_id, staged.digest, digests)

    def push_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: dict[str, Any]) -> Policy:
        """A LoRA adapter (replacing any): the service's registry (`load_lora`, which checks it and
        raises RolloutInputError naming the key), then every remote worker's, before this returns."""
        with self._change_lock:
            new = self.registry.load_lora(model_id, tensors, lora_config)
            self._check_workers("load_lora", model_id, new.digest,
                                self.backend.load_lora(model_id, tensors, lora_config))
            return new

    def remove_lora(self, model_id: str) -> Policy:
        """Drop the adapter (raises LoraNotLoaded when there is none) here, then on every worker."""
        with self._change_lock:
            new = self.registry.unload_lora(model_id)
            self._check_workers("unload_lora", model_id, new.digest, self.backend.unload_lora(model_id))
            return new

    @staticmethod
    def _check_workers(method: str, model_id: str, digest: str, workers: list[str]) -> None:
        """Every worker's digest after a change of weights must be the service's."""
        for got in workers:
            if got != digest:
                log.error("a worker's digest differs after a change of weights",
                          extra={"model": model_id, "digest": digest, "worker_digest": got, "change": method})

    def reload_tokens(self, rest: TokenSet) -> int:
        """Re-read --token-file (SIGHUP) and swap the accepted tokens on both planes: `rest` (the
        REST middleware's), this node's Flight server, and every Ray worker's (a replacement
        worker starts with them). Fail closed: a file that is now missing, unreadable or empty
        raises TokenFileError and nothing changes; so does a server started without auth
        (ValueError). Returns the number of tokens now accepted."""
        if self.settings.token_file is None:
            raise ValueError("no --token-file to reload (tokens from SIGMAFLIGHT_TOKEN only change with a restart)")
        tokens = self.settings.tokens()  # TokenFileError: the file is unusable now; keep the old tokens
        if not rest:
            raise ValueError("auth is off on this server; restart it with --token-file to turn it on")
        with self._change_lock:
            self.flight.set_tokens(tokens)
            rest.replace(tokens)
            self.backend.set_tokens(tokens)
        return len(rest)

    def start(self) -> None:
        model = self.registry.get(self.settings.model)
        log.info("model loaded", extra={"model": model.id, "digest": model.digest, "device": str(model.device)})
        self.flight.accept_weights(self.weights_pushes)
        self.flight.start()
        self.jobs.start()
        self.ready = True

    def draining(self) -> None:
        """The signal came: refuse new rollouts (503) and answer /readyz 503 from now on, while uvicorn
        finishes the requests it has. No lock: this runs in the signal handler, on the thread that
        may hold one."""
        self.ready = False
        self.jobs.refuse_new()

    def end_rollouts(self, step_wait_s: float = STEP_WAIT_S) -> None:
        """The shutdown's first step: queued and running rollouts fail "server shutting down", so the
        clients still connected (a held status read, a Flight stream) are answered with that end.
        Waits up to `step_wait_s` for the workers' running steps."""
        self.ready = False
        self.weights_pushes.drop_idle("shutdown")  # a cut in-place push no longer holds its model's rollouts
        self.jobs.end_all("server shutting down", step_wait_s)
        self._rollouts_ended = True

    def stop(self) -> None:
        if self._stopped:  # a forced exit stops it from serve.py, and the lifespan may still try
            return
        self._stopped = True
        if not self._rollouts_ended:  # uvicorn's shutdown ends them first (serve.py)
            self.end_rollouts()
        # no second wait for a step that outlasted the first: the exit stays within its 30 s
        self.jobs.stop("server shutting down", timeout=0.0)
        self.backend.close()
        self.node.stop()
        log.info("stopped")
