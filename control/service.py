"""One process, both planes: a node (models, store, Flight server) and the job queue.

`Service` is built and started by the Starlette lifespan (control/http/app.py) and handed to
the routes as state; nothing here is a module-level global. The node is built by
control/node.py, the same wiring each Ray worker uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import pyarrow.flight as flight
import torch
from sigmaflight.control.jobs.manager import Backend, JobManager, NotFinished
from sigmaflight.control.node import Node, NodeConfig
from sigmaflight.control.settings import Settings
from sigmaflight.dataplane.auth import TokenSet
from sigmaflight.pipeline.models import Policy, parse_hub_id

log = logging.getLogger("sigmaflight.service")


def node_config(settings: Settings) -> NodeConfig:
    """The service's own node. With --backend ray the models run in the worker actors; here
    they only validate requests, so they stay on the CPU."""
    return NodeConfig(
        device=settings.device if settings.backend == "local" else "cpu",
        dtype=settings.dtype,
        model_dir=str(settings.model_dir) if settings.model_dir is not None else None,
        data_dir=str(settings.data_dir) if settings.data_dir is not None else None,
        shm_dir=str(settings.shm_dir) if settings.shm_dir is not None else None,
        store_budget_bytes=settings.store_budget_bytes,
        host=settings.host,
        port=settings.flight_port,
        advertise_host=settings.advertise_host,
        tokens=tuple(settings.tokens()),
        tls_certificates=settings.tls_certificates(),
        max_flight_streams=settings.max_flight_streams,
        batch_invariant=settings.batch_invariant,
        hub_models=(settings.model,) if parse_hub_id(settings.model) is not None else (),
    )


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.auth_enabled = bool(settings.tokens())
        self.node = Node(node_config(settings), on_cancel=self._cancel_from_flight, on_release=self._release_from_flight)
        self.registry, self.store, self.flight = self.node.registry, self.node.store, self.node.flight
        self.backend: Backend
        if settings.backend == "ray":
            from sigmaflight.control.backends.ray import RayBackend

            self.backend = RayBackend.from_settings(settings)
        else:
            self.backend = self.node.backend
        self.jobs = JobManager(
            self.backend,
            workers=settings.workers,
            queue_size=settings.queue_size,
            ttl_s=settings.ttl_s,
            data_dir=settings.data_dir,
        )
        self.store.on_unavailable = self._result_unavailable
        self.ready = False
        self._change_lock = threading.Lock()
        """One change of weights (or of tokens) at a time, registry and workers together (workers
        see the same order)."""

    def _result_unavailable(self, rollout_id: str, reason: str) -> None:
        """The store lost a finished trajectory (its file truncated or corrupted): REST stops
        saying succeeded. (Only this node's store: Ray workers' stores are not wired yet.)"""
        self.jobs.result_lost(rollout_id, reason)

    def _cancel_from_flight(self, rollout_id: str) -> bool:
        """Flight `cancel`: only stops a queued or running rollout (a finished one is kept)."""
        return self.jobs.cancel_active(rollout_id)

    def _release_from_flight(self, rollout_id: str) -> bool:
        """Flight `release`: frees a finished rollout; a queued or running one is refused."""
        try:
            return self.jobs.release(rollout_id)
        except NotFinished as exc:
            raise flight.FlightServerError(str(exc)) from None

    def push_weights(self, model_id: str, state: Mapping[str, torch.Tensor]) -> Policy:
        """New transformer weights: the service's registry (`replace_weights`, which checks them
        and raises RolloutInputError naming the key), then every remote worker's (Ray), before
        this returns. Returns the new Policy (digest, weights_version)."""
        with self._change_lock:
            new = self.registry.replace_weights(model_id, state)
            self._fan_out("load_weights", model_id, new.digest, dict(state))
            return new

    def push_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: dict[str, Any]) -> Policy:
        """A LoRA adapter (replacing any): the service's registry (`load_lora`, which checks it and
        raises RolloutInputError naming the key), then every remote worker's, before this returns."""
        with self._change_lock:
            new = self.registry.load_lora(model_id, tensors, lora_config)
            self._fan_out("load_lora", model_id, new.digest, dict(tensors), lora_config)
            return new

    def remove_lora(self, model_id: str) -> Policy:
        """Drop the adapter (raises LoraNotLoaded when there is none) here, then on every worker."""
        with self._change_lock:
            new = self.registry.unload_lora(model_id)
            self._fan_out("unload_lora", model_id, new.digest)
            return new

    def _fan_out(self, method: str, model_id: str, digest: str, *args: Any) -> None:
        push: Any = getattr(self.backend, method, None)
        if push is None:  # the local backend shares `self.registry`
            return
        for got in push(model_id, *args):
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
            push: Any = getattr(self.backend, "set_tokens", None)
            if push is not None:
                push(tokens)
        return len(rest)

    def start(self) -> None:
        model = self.registry.get(self.settings.model)
        log.info("model loaded", extra={"model": model.id, "digest": model.digest, "device": str(model.device)})
        self.flight.start()
        self.jobs.start()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self.jobs.stop("server shutting down")
        if hasattr(self.backend, "close"):
            self.backend.close()
        self.node.stop()
        log.info("stopped")
