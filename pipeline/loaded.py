"""A served model and what one rollout runs with: `LoadedModel`, `Policy`, and the errors of a change of weights.

Policy version (contract, "Policy version"): each model has a `digest` of the weights a rollout
runs with and a `weights_version`, 0 at load and +1 per accepted change of weights. A rollout reads
them once with `LoadedModel.policy()` and keeps that pipeline to its end; pipeline/swaps.py makes
the changes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from sigmaflight.pipeline.builtins import ModelDefaults
from sigmaflight.pipeline.lora import LoraAdapter
from sigmaflight.pipeline.spec import RolloutCancelled

__all__ = ["LoadedModel", "LoraNotLoaded", "Policy", "StaleWeights", "WeightsFailed"]


class StaleWeights(ValueError):
    """A change made against other base weights than the model serves now."""

    def __init__(self, expected: str, digest: str) -> None:
        super().__init__(f"the push was made against weights {expected[:12]}..., the model serves {digest[:12]}... "
                         "now; fetch the manifest again and push what differs from it")
        self.expected, self.digest = expected, digest


class WeightsFailed(RuntimeError):
    """A rollout of a model whose weights an in-place push left half written (`--weights-swap
    in-place`): refused until a full push commits or the server restarts. control/ reports it as
    `error.type` "weights_failed"; `reason` is why the push failed (checksum, non_finite, expired, ...)."""

    error_type = "weights_failed"

    def __init__(self, model_id: str, reason: str) -> None:
        super().__init__(f"model {model_id!r} is closed: an in-place weights push failed ({reason}) after writing "
                         "into the served weights; push every tensor again (a full push) or restart the server")
        self.model_id, self.reason = model_id, reason


class LoraNotLoaded(LookupError):
    """`unload_lora` on a model that has no adapter: nothing changed, the version did not move."""


@dataclass(frozen=True, kw_only=True)
class Policy:
    """What one rollout runs with, read at once: the pipeline and the (digest, version) of its weights."""

    pipeline: Any
    digest: str
    """weights_digest of the base weights, or the adapter digest (base + adapter) while a LoRA is loaded."""
    weights_version: int
    """0 at load, +1 per accepted change of weights (full push, LoRA put, LoRA delete)."""
    base_digest: str
    """The digest of the weights without the adapter (== digest when no LoRA is loaded)."""
    lora: LoraAdapter | None = None
    components: Mapping[str, str] = field(default_factory=dict)
    """component name -> its digest (`digest` == combine_digests(components)); with a LoRA the
    transformer's is the adapter digest over the base transformer's."""


@dataclass(kw_only=True)
class LoadedModel:
    """A ready pipeline plus what a rollout needs to know about it.

    `pipeline`, `digest`, `weights_version` (and the base and adapter behind them) change together
    under `lock` when the registry changes the weights; a rollout reads them once with `policy()`
    (or `snapshot()`, the older (pipeline, digest) pair).
    """

    id: str
    family: str
    """The name of its row in `sigmaflight.pipeline.families` ("sd3", "flux", "wan", or "other")."""
    pipeline: Any
    device: torch.device
    dtype: torch.dtype
    digest: str
    defaults: ModelDefaults
    weights_version: int = 0
    base_pipeline: Any = None
    """The pipeline without the adapter while a LoRA is loaded; None otherwise (then `pipeline` is the base)."""
    base_digest: str = ""
    """Digest of the base weights ("" until set: then `digest`)."""
    lora: LoraAdapter | None = None
    components: dict[str, str] = field(default_factory=dict)
    """Per-component digests of the weights a rollout runs with (see Policy.components)."""
    base_components: dict[str, str] = field(default_factory=dict)
    """Per-component digests of the base weights (without the adapter)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    push_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held for the whole of a change of weights: changes of one model run one at a time."""
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    """Fast tokenizers mutate their padding/truncation state per call: one call at a time."""

    failed: str | None = None
    """Why an in-place push left the weights half written (the model refuses rollouts); None when sound."""
    _gate: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _running: int = 0
    _held: bool = False

    @contextmanager
    def in_use(self, should_stop: Callable[[], bool] | None = None) -> Iterator[None]:
        """Held around one model call: waits while an in-place push holds the model, raises
        WeightsFailed while the model is failed closed. `should_stop`: asked while it waits (every
        50 ms); True ends the wait with RolloutCancelled, so a cancel need not outlast the push."""
        with self._gate:
            while self._held:
                if should_stop is not None and should_stop():
                    raise RolloutCancelled("cancelled while an in-place weights push held the model")
                self._gate.wait(timeout=None if should_stop is None else 0.05)
            if self.failed is not None:
                raise WeightsFailed(self.id, self.failed)
            self._running += 1
        try:
            yield
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()

    def hold(self) -> None:
        """For an in-place push: hold new model calls and wait for the running ones to end."""
        with self._gate:
            self._gate.wait_for(lambda: not self._held)
            self._held = True
            self._gate.wait_for(lambda: self._running == 0)

    def unhold(self, failed: str | None) -> None:
        """End an in-place push: `failed` None (committed, or nothing was written) reopens the
        model, a reason fails it closed."""
        with self._gate:
            self._held, self.failed = False, failed
            self._gate.notify_all()

    def __post_init__(self) -> None:
        if not self.base_digest:
            self.base_digest = self.digest
        if not self.base_components:
            self.base_components = dict(self.components)

    def policy(self) -> Policy:
        with self.lock:
            return Policy(pipeline=self.pipeline, digest=self.digest, weights_version=self.weights_version,
                          base_digest=self.base_digest, lora=self.lora, components=dict(self.components))

    def snapshot(self) -> tuple[Any, str]:
        with self.lock:
            return self.pipeline, self.digest

    def base_transformer(self) -> Any:
        """The transformer without the adapter (what a full weights push replaces)."""
        with self.lock:
            return (self.base_pipeline if self.base_pipeline is not None else self.pipeline).transformer
