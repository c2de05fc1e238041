"""Changes every Ray worker must see: new transformer weights (all workers or none), a LoRA, tokens.

A weights push is two-phase. Prepare: every live worker stages the new transformer and checks it
(`RolloutWorker.prepare_weights`: the state dict's keys, shapes, dtypes and values, the base it
expects, the digest it would serve); nothing a worker serves changes. Commit: when every worker
prepared the same digest, every worker swaps its staged transformer in (`commit_weights`: a swap
under the model's lock, nothing left to fail but the worker itself). When one refuses, every
worker drops what it staged (`abort_weights`) and the push raises the refusal: the cluster
serves the old weights everywhere. A worker that dies during a push is replaced as usual; the
committed weights are recorded only after every commit, and a replacement catches up with the
recorded ones before it joins, under the same lock a push holds, so it joins with the weights
the others serve.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from sigmaflight.control.backends.ray_workers import RayWorkers, _Slot
from sigmaflight.pipeline.loaded import StaleWeights
from sigmaflight.pipeline.spec import RolloutInputError

log = logging.getLogger("sigmaflight.ray")

__all__ = ["WeightsFanout"]


class WeightsFanout(RayWorkers):
    """The changes of weights and tokens of `RayBackend`, on every worker, recorded for replacements."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._weights: dict[str, Any] = {}
        """model id -> ObjectRef of the committed state dict (a replacement worker loads it)."""
        self._lora: dict[str, tuple[Any, dict[str, Any]]] = {}
        """model id -> (ObjectRef of the adapter's tensors, its LoraConfig dict) of the adapter on now."""
        self._versions: dict[str, int] = {}
        """model id -> changes of weights every worker took since it loaded (a push, a LoRA on or off:
        each +1 there and on the control plane): the weights_version a replacement takes, which
        loads the committed weights and adapter at once (two changes at most)."""
        super().__init__(*args, **kwargs)

    def load_weights(self, model_id: str, state: Mapping[str, torch.Tensor], *, expected_base: str | None = None,
                     expected_digest: str | None = None) -> list[str]:
        """New transformer weights on every live worker, or on none: returns once each serves them
        (their digests), so every rollout that starts afterwards runs on them. `expected_base`: the
        base digest each worker must serve now (StaleWeights otherwise); `expected_digest`: the
        digest each must end with (the control plane's). A worker's refusal (RolloutInputError or
        StaleWeights, naming it) leaves every worker on its old weights."""
        with self._change_lock:
            ref = self._ray.put(dict(state))
            push_id = uuid.uuid4().hex
            prepared = self._fan_out("prepare_weights", push_id, model_id, ref, expected_base)
            refusal = _refusal(prepared, expected_digest)
            if refusal is not None:
                aborted = self._fan_out("abort_weights", push_id)
                log.error("a ray worker refused a weights push: no worker changed", extra={
                    "model": model_id, "workers": len(prepared), "aborted": sum(1 for _, a in aborted if a),
                    "error": str(refusal)})
                raise refusal
            digests = [str(d) for _, d in self._fan_out("commit_weights", push_id)]
            self._weights[model_id] = ref
            self._lora.pop(model_id, None)  # a full push drops the adapter
            self._versions[model_id] = self._versions.get(model_id, 0) + 1
        log.info("weights pushed to every ray worker", extra={"model": model_id, "workers": len(digests)})
        return digests

    def load_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: dict[str, Any]) -> list[str]:
        """Put a LoRA adapter on every live worker (replacing any); a replacement worker gets the
        adapter on now before it takes rollouts. Returns the workers' digests."""
        with self._change_lock:
            ref = self._ray.put(dict(tensors))
            digests = self._call_all("load_lora", model_id, ref, dict(lora_config))
            self._lora[model_id] = (ref, dict(lora_config))
            self._versions[model_id] = self._versions.get(model_id, 0) + 1
        return self._logged("load_lora", model_id, digests)

    def unload_lora(self, model_id: str) -> list[str]:
        """Remove the adapter on every live worker; returns their digests (the base digest)."""
        with self._change_lock:
            digests = self._call_all("unload_lora", model_id)
            self._lora.pop(model_id, None)
            self._versions[model_id] = self._versions.get(model_id, 0) + 1
        return self._logged("unload_lora", model_id, digests)

    def set_tokens(self, tokens: Sequence[str]) -> None:
        """The accepted bearer tokens of every live worker's Flight server (a reload), once each
        has them; a worker started later (a replacement) gets them too."""
        with self._change_lock:
            with self._lock:
                self._config = replace(self._config, node=replace(self._config.node, tokens=tuple(tokens)))
            n = len(self._call_all("set_tokens", list(tokens)))
        log.info("tokens pushed to ray workers", extra={"workers": n})

    def _catch_up(self, slot: _Slot) -> None:
        """The committed weights, then the adapters on now (a full push drops adapters), the
        weights_version the other workers serve, and the tokens of now (the worker may have
        started with older ones)."""
        for model_id, ref in self._weights.items():
            self._ray.get(slot.handle.load_weights.remote(model_id, ref), timeout=self._start_timeout_s)
        for model_id, (ref, config) in self._lora.items():
            self._ray.get(slot.handle.load_lora.remote(model_id, ref, config), timeout=self._start_timeout_s)
        for model_id, version in self._versions.items():  # the version the others serve, not its own count
            self._ray.get(slot.handle.set_weights_version.remote(model_id, version), timeout=self._start_timeout_s)
        with self._lock:
            tokens = list(self._config.node.tokens)
        if tokens:
            self._ray.get(slot.handle.set_tokens.remote(tokens), timeout=self._start_timeout_s)

    @staticmethod
    def _logged(change: str, model_id: str, digests: list[str]) -> list[str]:
        log.info("change of weights pushed to ray workers", extra={"model": model_id, "change": change,
                                                                    "workers": len(digests)})
        return digests


def _refusal(prepared: list[tuple[_Slot, Any]], expected_digest: str | None) -> Exception | None:
    """The first worker's refusal among the prepare answers, as the error the control plane types
    (RolloutInputError, StaleWeights); a digest other than the expected one is a refusal too."""
    for slot, answer in prepared:
        if "stale" in answer:
            expected, digest = answer["stale"]
            return StaleWeights(expected, digest)
        if "field" in answer:
            return RolloutInputError(answer["field"], f"{slot.name} refused the weights: {answer['reason']}")
        if expected_digest is not None and answer["digest"] != expected_digest:
            return RolloutInputError("weights", f"{slot.name} would serve digest {answer['digest'][:12]}..., the "
                                     f"control plane {expected_digest[:12]}...: its model differs")
    return None
