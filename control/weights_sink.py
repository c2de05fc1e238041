"""The control plane's side of a streamed weights push: the sink the Flight server stages into
(dataplane/weights.py) over this service's models, and the per-tensor manifest.

The manifest (`GET /v1/models/{id}/weights/manifest`) gives one CRC32C per tensor of the served
base transformer (`sigmaflight.pipeline.models.tensor_crc`): a trainer compares its own tensors'
and pushes only those that differ. The transformer's component digest is made from these same
per-tensor values (`state_digest`). It is made once per served base digest and, after a streamed
commit, from the previous one with only the pushed tensors checksummed again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from sigmaflight.dataplane.weights import PushRefused, PushStats, TensorSpec, dtype_name
from sigmaflight.pipeline.models import StaleWeights, tensor_crc
from sigmaflight.pipeline.spec import RolloutInputError

if TYPE_CHECKING:
    from sigmaflight.control.service import Service

log = logging.getLogger("sigmaflight.weights")

__all__ = ["ManifestCache", "ServiceWeightsSink"]


class ManifestCache:
    """{model id: (base digest, {key: crc})}, made when asked for a digest it does not hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: dict[str, tuple[str, dict[str, str]]] = {}

    def get(self, model_id: str, base_digest: str, transformer: Any) -> dict[str, str]:
        with self._lock:
            hit = self._by_model.get(model_id)
        if hit is not None and hit[0] == base_digest:
            return dict(hit[1])
        manifest = {k: tensor_crc(v) for k, v in sorted(transformer.state_dict().items())}
        with self._lock:
            self._by_model[model_id] = (base_digest, manifest)
        return dict(manifest)

    def peek(self, model_id: str) -> tuple[str, dict[str, str]] | None:
        """(base digest, manifest) as last made, or None."""
        with self._lock:
            return self._by_model.get(model_id)

    def forget(self, model_id: str) -> None:
        """Drop the model's manifest (its tensors changed in place): the next one is made afresh."""
        with self._lock:
            self._by_model.pop(model_id, None)

    def update(self, model_id: str, old_digest: str, new_digest: str, changed: Mapping[str, torch.Tensor]) -> None:
        """After a commit from `old_digest`: the old manifest with the pushed tensors' CRCs."""
        with self._lock:
            hit = self._by_model.get(model_id)
        if hit is None or hit[0] != old_digest:
            return
        manifest = {**hit[1], **{k: tensor_crc(v) for k, v in changed.items()}}
        with self._lock:
            self._by_model[model_id] = (new_digest, manifest)


class ServiceWeightsSink:
    """The Flight server's WeightsSink over a Service: tensors are the base transformer's, a
    commit goes through `Service.push_tensors` (the same swap as PUT .../weights).

    `--weights-swap in-place`: a push holds the model (`LoadedModel.hold`: the running model call
    ends, new ones wait) and its chunks land in the served tensors themselves; the commit then
    swaps in those same tensors (new digest and version). A push that ends otherwise after some
    bytes landed leaves the weights half written: the model is failed closed (`LoadedModel.failed`,
    rollouts refused with WeightsFailed) until a full push commits or the server restarts."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self.in_place = service.settings.weights_swap == "in-place"
        self.manifests = ManifestCache()
        self.skipped_bytes = 0

    def tensor_specs(self, model_id: str) -> Mapping[str, TensorSpec]:
        try:
            model = self._service.registry.get(model_id)
        except RolloutInputError:
            raise PushRefused("unknown_model", f"no model {model_id[:200]!r}; known: "
                              f"{self._service.registry.ids()}") from None
        return {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in model.base_transformer().state_dict().items()}

    def open_push(self, model_id: str, *, full: bool, base_digest: str | None) -> Mapping[str, torch.Tensor] | None:
        if not self.in_place:
            return None
        model = self._service.registry.get(model_id)
        if model.failed is not None and not full:
            raise PushRefused("model_failed", f"model {model_id!r} is failed closed (an in-place push failed: "
                              f"{model.failed}); only a push of every tensor (only_changed=False, not partial) "
                              "reopens it")
        model.hold()
        if base_digest is not None and not full and model.policy().base_digest != base_digest:
            model.unhold(model.failed)
            raise PushRefused("stale_base", str(StaleWeights(base_digest, model.policy().base_digest)))
        log.info("in-place weights push holds the model", extra={"model": model_id})
        return model.base_transformer().state_dict()

    def close_push(self, model_id: str, *, wrote: bool, failed: str | None) -> None:
        if not self.in_place:
            return
        model = self._service.registry.get(model_id)
        if failed is None:
            model.unhold(None)
        elif wrote:
            self.manifests.forget(model_id)
            model.unhold(failed)
            log.error("in-place weights push failed after writing into the served weights: the model refuses "
                      "rollouts until a full push commits", extra={"model": model_id, "reason": failed})
        else:
            model.unhold(model.failed)

    def manifest(self, model_id: str) -> dict[str, Any]:
        """{"id", "digest", "weights_version", "base_digest", "algorithm", "tensors": {key: crc},
        "specs": {key: {"dtype", "shape"}}, "failed": why an in-place push failed the model closed, or
        None}: a client answers a push where nothing differs without a stream only when the model is
        not failed closed, and skips a tensor as unchanged only when its dtype and shape match too."""
        model = self._service.registry.get(model_id)
        with model.push_lock:  # the base and its digest read together, no swap in between
            policy = model.policy()
            transformer = model.base_transformer()
            tensors = self.manifests.get(model_id, policy.base_digest, transformer)
            specs = {k: {"dtype": dtype_name(v.dtype), "shape": list(v.shape)}
                     for k, v in transformer.state_dict().items()}
            failed = model.failed
        return {"id": model_id, "digest": policy.digest, "weights_version": policy.weights_version,
                "base_digest": policy.base_digest, "algorithm": "crc32c", "tensors": tensors, "specs": specs,
                "failed": failed}

    def commit(self, model_id: str, staged: dict[str, torch.Tensor], *, partial: bool, base_digest: str | None,
               stats: PushStats) -> dict[str, Any]:
        t0 = time.monotonic()
        before = self._service.registry.get(model_id).policy()
        try:
            old, policy = self._service.push_tensors(model_id, staged, expected_base=base_digest,
                                                     known_crcs=self.manifests.peek(model_id))
        except StaleWeights as exc:
            raise PushRefused("stale_base", str(exc)) from None
        except RolloutInputError as exc:
            raise PushRefused("commit_failed", f"{exc.field}: {exc.reason}", tensor=exc.field) from None
        self.manifests.update(model_id, old, policy.base_digest, staged)
        # a commit serves a new base and drops any LoRA adapter (pipeline/swaps.py install): say so
        # (as the model stood when the commit began: a LoRA put racing this push from another
        # client, between that read and the swap, is not seen)
        lora_dropped = before.lora is not None
        now = time.monotonic()
        seconds, commit_seconds = now - stats.started, now - t0
        self.skipped_bytes += stats.skipped_bytes
        log.info("weights push committed", extra={
            "model": model_id, "digest": policy.digest, "weights_version": policy.weights_version,
            "tensors": len(staged), "bytes_sent": stats.received_bytes, "bytes_skipped": stats.skipped_bytes,
            "seconds": round(seconds, 3), "commit_seconds": round(commit_seconds, 3)})
        return {"id": model_id, "digest": policy.digest, "weights_version": policy.weights_version,
                "tensors": len(staged), "bytes_sent": stats.received_bytes, "bytes_skipped": stats.skipped_bytes,
                "seconds": seconds, "commit_seconds": commit_seconds, "lora_dropped": lora_dropped}
