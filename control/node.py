"""One node: model registry, result store, Flight server and local backend, wired in one place.

The single-process service (control/service.py) builds one `Node`; with the Ray backend each
worker actor (control/backends/worker.py) builds its own. Both get the same registry loading
(built-ins lazily, every pipeline under --model-dir at start-up), the same store and Flight
server options, and the same `LocalBackend` that runs rollouts from the pipeline into the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from sigmaflight.control.backends.local import LocalBackend
from sigmaflight.control.settings import Settings
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore
from sigmaflight.pipeline.models import ModelRegistry, parse_hub_id
from sigmaflight.pipeline.sources import local_model_dirs

log = logging.getLogger("sigmaflight.node")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The --dtype names and their torch dtypes (the one table)."""


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything a node needs; plain data (it crosses the Ray boundary inside WorkerConfig).

    Made from the server's Settings in one place, `from_settings`; the service's own node and
    every Ray worker's are that same object with what differs per process replaced."""

    device: str = "cpu"
    dtype: str = "float32"
    model_dir: str | None = None
    """Directory of local diffusers pipelines, one per subdirectory (loaded at start-up)."""
    data_dir: str | None = None
    shm_dir: str | None = None
    """Keep finished trajectories as memory-mapped IPC files here (same-host trainers read them)."""
    store_budget_bytes: int = 4 << 30
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    tokens: Sequence[str] = ()
    tls_certificates: Sequence[tuple[bytes, bytes]] = ()
    max_flight_streams: int = 64
    batch_invariant: bool = False
    hub_models: Sequence[str] = ()
    """Hugging Face hub ids (org/name[@revision]) loaded at start-up, from the HF cache or the hub."""

    @classmethod
    def from_settings(cls, settings: Settings) -> NodeConfig:
        """The node that `sigmaflight serve` runs (the token file and TLS files are read here)."""
        return cls(
            device=settings.device,
            dtype=settings.dtype,
            model_dir=_str_or_none(settings.model_dir),
            data_dir=_str_or_none(settings.data_dir),
            shm_dir=_str_or_none(settings.shm_dir),
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


def _str_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)


def quiet_library_output() -> None:
    """Turn off diffusers' and transformers' own loading bars, and send their log records (e.g. a
    tokenizer's "input was truncated" warning, on every prompt longer than a text encoder keeps)
    to the root logger instead of their own stderr handlers: every log line stays one of ours
    (JSON by default)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.disable_progress_bar()
        library.disable_default_handler()
        library.enable_propagation()


def load_registry(config: NodeConfig) -> ModelRegistry:
    """A registry on the node's device and dtype, with every hub model and every pipeline under
    `model_dir` loaded.

    Loading local pipelines can take long: a tqdm bar shows it on a terminal (off when stderr is
    not one, so a JSON log stays JSON), diffusers' and transformers' own bars are off, and each
    model logs one "model loaded" line."""
    dtype = DTYPES[config.dtype]
    registry = ModelRegistry(device=config.device, dtype=dtype)
    quiet_library_output()
    for model_id in config.hub_models:
        model = registry.register_hub(model_id, device=config.device, dtype=dtype)
        log.info("model loaded", extra={"model": model.id, "source": "hub", "family": model.family,
                                        "digest": model.digest, "device": str(model.device)})
    if config.model_dir is None:
        return registry
    from tqdm import tqdm

    for sub in tqdm(local_model_dirs(config.model_dir), desc="loading models", unit="model", disable=None):
        model = registry.register_local(sub.name, str(sub), device=config.device, dtype=dtype)
        log.info("model loaded", extra={"model": model.id, "path": str(sub), "family": model.family,
                                        "digest": model.digest, "device": str(model.device)})
    return registry


class Node:
    """Registry, store, Flight server and local backend of one process (service or Ray worker)."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        on_cancel: Callable[[str], bool] | None = None,
        on_release: Callable[[str], bool] | None = None,
    ) -> None:
        self.config = config
        self.registry = load_registry(config)
        self.store = ResultStore(
            memory_budget_bytes=config.store_budget_bytes,
            data_dir=Path(config.data_dir) if config.data_dir is not None else None,
            shm_dir=Path(config.shm_dir) if config.shm_dir is not None else None,
            shm_private=bool(config.tokens),
        )
        self.flight = FlightDataServer(
            self.store,
            host=config.host,
            port=config.port,
            advertise_host=config.advertise_host,
            tokens=list(config.tokens) or None,
            tls_certificates=list(config.tls_certificates) or None,
            on_cancel=on_cancel,
            on_release=on_release,
            max_concurrent_streams=config.max_flight_streams,
        )
        self.backend = LocalBackend(
            self.registry, self.store, locations=lambda: self.flight.locations,
            batch_invariant=config.batch_invariant,
        )

    def stop(self) -> None:
        """Stop the Flight server and close the store (spilled files stay for the restart scan)."""
        self.flight.stop()
        self.store.close()
