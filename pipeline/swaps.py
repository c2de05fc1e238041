"""Changes of a model's weights: a new transformer (all or some tensors), a LoRA adapter on, off.

A change never touches a pipeline in use: it builds a new pipeline object around a new
transformer whose unchanged tensors are the old ones (shared, not copied) and swaps it in under
the model's lock, so a rollout that read `LoadedModel.policy()` keeps its weights to the end and
the next one sees the new. A change of the transformer is two steps: `stage_weights` /
`stage_tensors` build and check it (nothing served changes; a refusal leaves the model as it
was), `install` swaps it in. Between the two a Ray backend asks every worker to stage the same
change, and installs on all or on none (control/backends/ray.py). The caller holds
`LoadedModel.push_lock` around both steps; `install` refuses a staged change made against another
`weights_version` than the model's (StaleWeights).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from sigmaflight.pipeline.hashing import combine_digests, state_digest
from sigmaflight.pipeline.loaded import LoadedModel, LoraNotLoaded, Policy, StaleWeights
from sigmaflight.pipeline.lora import attach_adapter, share_tensors_copy
from sigmaflight.pipeline.spec import RolloutInputError

__all__ = ["StagedWeights", "check_state_dict", "drop_lora", "install", "put_lora", "stage_tensors",
           "stage_weights"]


def with_transformer(pipeline: Any, transformer: Any) -> Any:
    new = type(pipeline)(**{**pipeline.components, "transformer": transformer})
    new.set_progress_bar_config(disable=True)
    return new


def check_state_dict(current: Mapping[str, torch.Tensor], new: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, why) of the first tensor that cannot replace `current`; None when all fit."""
    for key in sorted(set(current) - set(new)):
        return key, "missing from the upload (the whole transformer state dict is required)"
    for key in sorted(set(new) - set(current)):
        return key, "not a parameter or buffer of this model's transformer"
    for key in sorted(new):
        have, got = current[key], new[key]
        if not isinstance(got, torch.Tensor):
            return key, f"not a tensor ({type(got).__name__})"
        if tuple(got.shape) != tuple(have.shape):
            return key, f"shape {list(got.shape)} does not match the model's {list(have.shape)}"
        if got.dtype != have.dtype:
            return key, f"dtype {str(got.dtype).removeprefix('torch.')} does not match the model's " \
                        f"{str(have.dtype).removeprefix('torch.')}"
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            return key, "holds NaN or infinite values"
    return None


@dataclass(frozen=True, kw_only=True)
class StagedWeights:
    """A new transformer for `model`, built and checked, not served yet (`install` serves it)."""

    model: LoadedModel
    pipeline: Any
    components: dict[str, str]
    digest: str
    from_version: int
    """The model's weights_version it was built against: `install` refuses it once that moved."""
    from_base: str
    """The model's base digest then."""


def stage_weights(model: LoadedModel, state_dict: Mapping[str, torch.Tensor]) -> StagedWeights:
    """The whole transformer state dict, checked (RolloutInputError(key, why) for a missing or
    unknown key, another shape or dtype, NaN/Inf values) and built; nothing served changes."""
    base = model.base_transformer()
    bad = check_state_dict(base.state_dict(), state_dict)
    if bad is not None:
        raise RolloutInputError(*bad)
    return _build(model, base, state_dict)


def stage_tensors(model: LoadedModel, tensors: Mapping[str, torch.Tensor], *, expected_base: str | None = None,
                  known_crcs: tuple[str, Mapping[str, str]] | None = None) -> StagedWeights:
    """Some of the transformer's tensors (the others kept as served), already checked by the caller
    as they arrived, built into a new transformer; nothing served changes. `expected_base`: the base
    digest the kept tensors must come from (StaleWeights otherwise). `known_crcs`: (a base digest,
    the tensor_crc of its tensors), used for the kept tensors when that digest is still the served
    one, so only the new tensors are checksummed."""
    policy = model.policy()
    if expected_base is not None and policy.base_digest != expected_base:
        raise StaleWeights(expected_base, policy.base_digest)
    base = model.base_transformer()
    current = base.state_dict()
    bad = next(((k, "not a parameter or buffer of this model's transformer") for k in sorted(tensors)
                if k not in current), None)
    if bad is not None:
        raise RolloutInputError(*bad)
    kept = None
    if known_crcs is not None and known_crcs[0] == policy.base_digest:
        kept = {k: c for k, c in known_crcs[1].items() if k not in tensors}
    return _build(model, base, {**current, **tensors}, kept)


def _build(model: LoadedModel, base: Any, state_dict: Mapping[str, torch.Tensor],
           known_crcs: Mapping[str, str] | None = None) -> StagedWeights:
    """A copy of `base` sharing its modules takes `state_dict` (assigned, no copy on the model's
    device) inside a new pipeline; its digest from the per-tensor checksums."""
    with model.lock:
        version, from_base = model.weights_version, model.base_digest
        current = model.base_pipeline if model.base_pipeline is not None else model.pipeline
        base_components = dict(model.base_components)
    new = {k: v.detach().to(model.device) for k, v in state_dict.items()}
    transformer = share_tensors_copy(base)
    transformer.load_state_dict(new, strict=True, assign=True)
    transformer.eval()
    transformer.requires_grad_(False)
    del new
    components = {**base_components, "transformer": state_digest("transformer", transformer.state_dict(), known_crcs)}
    return StagedWeights(model=model, pipeline=with_transformer(current, transformer), components=components,
                         digest=combine_digests(components), from_version=version,
                         from_base=from_base)


def install(staged: StagedWeights) -> Policy:
    """Serve a staged transformer: pipeline, digest and version change together under the model's
    lock; any LoRA is dropped. StaleWeights when another change came since it was staged."""
    model = staged.model
    with model.lock:
        if model.weights_version != staged.from_version:
            raise StaleWeights(staged.from_base, model.base_digest)
        model.pipeline, model.base_pipeline, model.lora = staged.pipeline, None, None
        model.digest = model.base_digest = staged.digest
        model.components, model.base_components = dict(staged.components), dict(staged.components)
        model.weights_version += 1
    return model.policy()


def put_lora(model: LoadedModel, tensors: Mapping[str, torch.Tensor], lora_config: object) -> Policy:
    """A peft LoRA adapter on the base transformer, unfused, replacing any (see
    ModelRegistry.load_lora); the transformer's component digest becomes the adapter digest."""
    with model.lock:
        base_pipeline = model.base_pipeline if model.base_pipeline is not None else model.pipeline
        base_components = dict(model.base_components)
    transformer, adapter = attach_adapter(base_pipeline.transformer, base_components["transformer"],
                                          tensors, lora_config, dtype=model.dtype)
    pipeline = with_transformer(base_pipeline, transformer)
    components = {**base_components, "transformer": adapter.digest}
    with model.lock:
        model.pipeline, model.base_pipeline, model.lora = pipeline, base_pipeline, adapter
        model.components, model.digest = components, combine_digests(components)
        model.weights_version += 1
    return model.policy()


def drop_lora(model: LoadedModel) -> Policy:
    """The base pipeline runs again (LoraNotLoaded when no adapter is on)."""
    with model.lock:
        if model.base_pipeline is None:
            raise LoraNotLoaded(f"model {model.id!r} has no LoRA adapter")
        model.pipeline, model.base_pipeline, model.lora = model.base_pipeline, None, None
        model.digest, model.components = model.base_digest, dict(model.base_components)
        model.weights_version += 1
    return model.policy()
