"""One process, both planes: model registry, result store, Flight server and job queue.

`Service` is built and started by the Starlette lifespan (control/app.py) and handed to
the routes as state; nothing here is a module-level global.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from control.backend import LocalBackend
from control.jobs import Backend, JobManager
from control.settings import Settings
from dataplane.server import FlightDataServer
from dataplane.store import ResultStore
from pipeline.models import ModelRegistry

log = logging.getLogger("sigmaflight.service")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        tokens = settings.tokens()
        self.auth_enabled = bool(tokens)
        dtype = DTYPES[settings.dtype]
        # With --backend ray the models run in the worker actors; here they only validate requests.
        device = settings.device if settings.backend == "local" else "cpu"
        self.registry = ModelRegistry(device=device, dtype=dtype)
        if settings.model_dir is not None:
            for sub in sorted(Path(settings.model_dir).iterdir()):
                if (sub / "model_index.json").is_file():
                    self.registry.register_local(sub.name, str(sub), device=device, dtype=dtype)
        self.store = ResultStore(
            memory_budget_bytes=settings.store_budget_bytes, data_dir=settings.data_dir, ttl_s=None,
            shm_dir=settings.shm_dir, shm_private=bool(tokens),
        )
        self.backend: Backend
        if settings.backend == "ray":
            from control.ray_backend import RayBackend

            self.backend = RayBackend.from_settings(settings)
        else:
            self.backend = LocalBackend(
                self.registry, self.store, locations=lambda: self.flight.locations,
                batch_invariant=settings.batch_invariant,
            )
        self.jobs = JobManager(
            self.backend,
            workers=settings.workers,
            queue_size=settings.queue_size,
            ttl_s=settings.ttl_s,
            data_dir=settings.data_dir,
        )
        tls = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            tls = [(Path(settings.tls_cert).read_bytes(), Path(settings.tls_key).read_bytes())]
        self.flight = FlightDataServer(
            self.store,
            host=settings.host,
            port=settings.flight_port,
            advertise_host=settings.advertise_host,
            tokens=tokens or None,
            tls_certificates=tls,
            on_cancel=self._cancel_from_flight,
            on_release=self._cancel_from_flight,
            max_concurrent_streams=settings.max_flight_streams,
        )
        self.ready = False

    def _cancel_from_flight(self, rollout_id: str) -> bool:
        return self.jobs.cancel(rollout_id) is not None

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
        self.flight.stop()
        self.store.close()
        log.info("stopped")
