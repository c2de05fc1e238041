"""The trainer's side of the replay weights check: the digests of the modules a trainer holds,
made the way the server makes a trajectory's `model.components` (pipeline/models.py), cached
per module so a replay loop pays the hash only after the weights changed.

The cache is keyed on the tensors' identities (weak references), their storage addresses and
their in-place version counters (`Tensor._version`, which every in-place op and optimizer step
bumps; torch has no public equivalent): a tensor replaced (`load_state_dict(assign=True)`), given
new storage (`p.data = ...`, as `torch.nn.utils.vector_to_parameters` does) or edited in place is
a miss, a tensor freed and another at its address is a miss too. An in-place write through `.data`
(`p.data.add_(...)`) moves no version counter (that is what `.data` is for): it is not seen.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from sigmaflight.pipeline.lora import PEFT_PREFIX, adapter_digest, config_json, parse_lora_config
from sigmaflight.pipeline.models import combine_digests, component_digest, state_digest

__all__ = ["cached_digest", "current_components", "current_digest"]

_digest_cache: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[list[tuple[Any, tuple[int, int]]], str]]] = (
    weakref.WeakKeyDictionary())


def cached_digest(module: torch.nn.Module, what: str, tensors: list[torch.Tensor], make: Callable[[], str]) -> str:
    """make(), remembered for `module` while `tensors` are the same objects on the same storage with
    the same in-place version counters (weak references: a tensor freed and another at its address
    is a miss)."""
    slot = _digest_cache.setdefault(module, {})
    hit = slot.get(what)
    if hit is not None and len(hit[0]) == len(tensors) and all(
        ref() is t and key == (t.data_ptr(), t._version) for (ref, key), t in zip(hit[0], tensors, strict=True)
    ):
        return hit[1]
    digest = make()
    slot[what] = ([(weakref.ref(t), (t.data_ptr(), t._version)) for t in tensors], digest)
    return digest


def current_components(model: Any) -> dict[str, str]:
    """{component: digest} of `model.pipeline`'s torch modules as they are now, the way the server
    makes a trajectory's `model.components` (sigmaflight.pipeline.models.component_digests). A peft-wrapped
    transformer with one adapter (`get_peft_model` or `add_adapter`) gets the digest the server
    gives it once that adapter is pushed: the adapter digest over its base weights, config and factors.

    Cached per module on the identities and in-place version counters of its tensors, so a
    replay loop pays the hash only after the weights changed (an optimizer step, a load); under
    a LoRA only the factors are hashed again, the frozen base once."""
    out: dict[str, str] = {}
    for name, module in sorted(model.pipeline.components.items()):
        if not isinstance(module, torch.nn.Module):
            continue
        tensors = list(module.state_dict(keep_vars=True).values())
        peft_config = getattr(module, "peft_config", None)
        if isinstance(peft_config, Mapping) and len(peft_config) == 1:
            out[name] = cached_digest(module, "adapter:" + name, tensors, functools.partial(_adapter_digest, name, module))
        else:
            out[name] = cached_digest(module, name, tensors, functools.partial(component_digest, name, module))
    return out


def current_digest(model: Any) -> str:
    """The weights digest of `model.pipeline` as it is now (sigmaflight.pipeline.models.weights_digest)."""
    return combine_digests(current_components(model))


def _adapter_digest(name: str, module: Any) -> str:
    from peft import get_peft_model_state_dict  # only a peft-wrapped module gets here

    ((adapter_name, config),) = module.peft_config.items()
    # get_peft_model's PeftModel prefixes every key with `base_model.model.`; add_adapter does not
    base = {k.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): v
            for k, v in module.state_dict(keep_vars=True).items() if ".lora_" not in k}
    base_digest = cached_digest(module, "base:" + name, list(base.values()), lambda: state_digest(name, base))
    dtype = next(iter(base.values())).dtype  # the server holds the factors in the model's dtype
    factors = {k.removeprefix(PEFT_PREFIX): v.detach().to("cpu", dtype)
               for k, v in get_peft_model_state_dict(module, adapter_name=adapter_name).items()}
    cfg = parse_lora_config(json.loads(json.dumps(config.to_dict(), default=sorted)))  # as push_lora sends it
    return adapter_digest(base_digest, config_json(cfg), factors)
