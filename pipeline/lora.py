"""LoRA adapters for a model's transformer, with peft, unfused.

A trainer sends the tensors `peft.get_peft_model_state_dict` gives for its transformer
(keys like `transformer_blocks.0.attn.to_q.lora_A.weight`, with or without peft's
`base_model.model.` prefix) and its `LoraConfig` as a dict. `attach_adapter` checks both
against the model, then builds a transformer that shares every base tensor with the base
module (a structural copy, `share_tensors_copy`), injects the adapter with
`peft.inject_adapter_in_model` and loads the tensors with `peft.set_peft_model_state_dict`:
the same layers (`peft.tuners.lora.Linear`) and the same forward as a trainer's own
`get_peft_model` / `add_adapter` transformer, so the two compute the same bits.

Every refusal is a `RolloutInputError` whose `field` is the offending tensor key or
`lora_config` / `lora_config.<field>`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from sigmaflight.pipeline.spec import RolloutInputError

__all__ = ["LoraAdapter", "PEFT_PREFIX", "attach_adapter", "adapter_digest", "parse_lora_config", "share_tensors_copy"]

PEFT_PREFIX = "base_model.model."
"""The prefix `peft.get_peft_model` puts before the transformer's own module names."""

ADAPTER_NAME = "default"

_META_KEYS = frozenset({"peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                        "inference_mode"})
"""LoraConfig.to_dict() keys that describe the file, not the adapter: accepted and ignored."""

_SUPPORTED = frozenset({"r", "lora_alpha", "target_modules", "exclude_modules", "lora_dropout", "use_rslora",
                        "init_lora_weights", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern"})
"""LoraConfig fields that may differ from peft's default. Every other field must keep its default:
they change the forward (DoRA, LoRA bias, aLoRA, ...) or add tensors that are not LoRA factors
(modules_to_save, trainable tokens)."""

_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")


@dataclass(frozen=True, kw_only=True)
class LoraAdapter:
    """An accepted adapter, as it runs."""

    config: Any
    """The peft LoraConfig."""
    config_json: str
    """Canonical JSON of the config (sorted keys, target_modules sorted): part of the digest."""
    tensors: Mapping[str, torch.Tensor]
    """Normalised keys (no `base_model.model.` prefix) -> the values loaded, in the model's dtype, on CPU."""
    digest: str
    """adapter_digest(the base transformer's component digest, config_json, tensors): the
    transformer's entry in the model's per-component digests while the adapter is on."""

    @property
    def rank(self) -> int:
        return int(self.config.r)

    def describe(self) -> dict[str, Any]:
        targets = self.config.target_modules
        return {
            "r": self.rank,
            "lora_alpha": self.config.lora_alpha,
            "target_modules": sorted(targets) if isinstance(targets, (set, frozenset, list, tuple)) else targets,
            "tensors": len(self.tensors),
        }


def share_tensors_copy(module: torch.nn.Module) -> Any:
    """A copy of `module`'s module tree whose parameters and buffers are the original tensors.

    Costs the Python objects, not the weights. Assigning a parameter of the copy (for example
    `load_state_dict(..., assign=True)` or peft replacing a Linear) leaves the original as it is;
    neither side may change a shared tensor in place.
    """
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def parse_lora_config(raw: object) -> Any:
    """A peft LoraConfig from a dict (as `LoraConfig.to_dict()` gives it, JSON-decoded); refuses what does not fit."""
    from peft import LoraConfig

    if raw is None:
        raise RolloutInputError("lora_config", "missing: the adapter's peft LoraConfig (a JSON object) is required")
    if not isinstance(raw, Mapping):
        raise RolloutInputError("lora_config", f"must be a JSON object (a peft LoraConfig), not {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(LoraConfig)}
    defaults = LoraConfig()
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"lora_config.{key}"
        if key == "peft_type":
            if str(getattr(value, "value", value)) != "LORA":
                raise RolloutInputError(where, f"must be 'LORA', not {value!r}")
            continue
        if key in _META_KEYS:
            continue
        if key not in fields:
            raise RolloutInputError(where, "not a field of peft's LoraConfig")
        if key not in _SUPPORTED:
            if _jsonable(value) != _jsonable(getattr(defaults, key)):
                raise RolloutInputError(where, f"only plain LoRA is served: this field must keep peft's default "
                                               f"{_jsonable(getattr(defaults, key))!r}")
            continue
        kwargs[key] = value
    r = kwargs.get("r", None)
    if "r" not in kwargs or not _rank(r):
        raise RolloutInputError("lora_config.r", f"the rank must be an integer >= 1, got {r!r}")
    alpha = kwargs.get("lora_alpha", defaults.lora_alpha)
    if not _finite_number(alpha):
        raise RolloutInputError("lora_config.lora_alpha", f"must be a finite number, got {_shown(alpha)}")
    for name, check, want in (("rank_pattern", _rank, "an integer >= 1"), ("alpha_pattern", _finite_number,
                                                                           "a finite number")):
        if name in kwargs:
            kwargs[name] = _pattern(name, kwargs[name], check, want)
    targets = kwargs.get("target_modules")
    if isinstance(targets, str):
        if not targets:
            raise RolloutInputError("lora_config.target_modules", "must not be empty")
    elif not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise RolloutInputError("lora_config.target_modules",
                                f"required: a non-empty list of module names (or one regex), got {targets!r}")
    else:
        kwargs["target_modules"] = sorted(set(targets))
    dropout = kwargs.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise RolloutInputError("lora_config.lora_dropout", f"must be a number in [0, 1), got {dropout!r}")
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise RolloutInputError("lora_config", f"peft refuses it: {exc}") from None
    try:  # what the answers and GET /v1/models show of it must be JSON: checked before anything changes
        json.dumps(_jsonable({k: v for k, v in config.to_dict().items() if k not in _META_KEYS}), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RolloutInputError("lora_config", f"holds a value JSON cannot carry ({exc})") from None
    return config


def _finite_number(value: object) -> bool:
    """An int or float (not a bool) that float() holds as a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        return False


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _rank(value: object) -> bool:
    """An int (not a bool) >= 1: `r`, and each value of `rank_pattern`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _pattern(name: str, value: object, check: Any, want: str) -> dict[str, Any]:
    """`rank_pattern` / `alpha_pattern`: {module name or regex: value}, each value `check`ed."""
    where = f"lora_config.{name}"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RolloutInputError(where, f"must be a JSON object of module name (or regex) -> {want}, "
                                       f"not {type(value).__name__}")
    for key, v in value.items():
        if not isinstance(key, str) or not key:
            raise RolloutInputError(where, f"keys must be non-empty module names (or regexes), got {_shown(key)}")
        if not check(v):
            raise RolloutInputError(where, f"the value for {_shown(key)} must be {want}, got {_shown(v)}")
    return dict(value)


def config_json(config: Any) -> str:
    """The adapter's config as canonical JSON (sorted keys), part of its digest. Leaves out the
    file's own keys and `init_lora_weights`: how the factors would start does not change an
    adapter whose factors are given (the server places it with plain init and loads them)."""
    d = {k: v for k, v in config.to_dict().items() if k not in _META_KEYS and k != "init_lora_weights"}
    return json.dumps(_jsonable(d), sort_keys=True, separators=(",", ":"))


def adapter_digest(base_digest: str, cfg_json: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the base weights' digest, the adapter's canonical config and its tensors (keys, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    h.update(f"sigmaflight/lora/v1\n{base_digest}\n{cfg_json}\n".encode())
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _normalise(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise RolloutInputError("tensors", "no tensors: an adapter needs its lora_A and lora_B weights")
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise RolloutInputError(str(key), "tensor keys must be strings")
        name = key.removeprefix(PEFT_PREFIX)
        if not isinstance(value, torch.Tensor):
            raise RolloutInputError(key, f"not a tensor ({type(value).__name__})")
        if name in out:
            raise RolloutInputError(key, "given twice (with and without the base_model.model. prefix)")
        out[name] = value
    return out


def _check(name: str, key: str, got: torch.Tensor, expected: Mapping[str, torch.Tensor], modules: set[str],
           config: Any) -> None:
    m = _LORA_KEY.match(name)
    if m is None:
        raise RolloutInputError(key, "not a LoRA tensor: peft.get_peft_model_state_dict names them "
                                     "<module>.lora_A.weight and <module>.lora_B.weight")
    module = m["module"]
    if name not in expected:
        if module not in modules:
            raise RolloutInputError(key, f"unknown target module {module!r}: the transformer has no such module")
        raise RolloutInputError(key, f"module {module!r} is not a target of lora_config.target_modules "
                                     f"{_jsonable(config.target_modules)!r}")
    want = expected[name]
    if tuple(got.shape) != tuple(want.shape):
        axis = 0 if m["kind"] == "lora_A" else 1
        raise RolloutInputError(key, f"shape {list(got.shape)} does not fit: this module's {m['kind']} is "
                                     f"{list(want.shape)} (rank {want.shape[axis]} from lora_config)")
    if not got.is_floating_point():
        raise RolloutInputError(key, f"dtype {str(got.dtype).removeprefix('torch.')} is not a floating-point type")


def _check_patterns(config: Any, base: torch.nn.Module) -> None:
    """Each key of `rank_pattern` / `alpha_pattern` matches one of the modules the adapter goes on,
    as peft matches them: peft ignores one that matches none (a warning), so the rank or alpha
    meant is never used. With no module targeted at all, peft's own refusal follows."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    targets = [name for name, _ in base.named_modules() if name and check_target_module_exists(config, name)]
    if not targets:
        return
    for field in ("rank_pattern", "alpha_pattern"):
        for key in getattr(config, field) or {}:
            if not any(get_pattern_key([key], module) == key for module in targets):
                raise RolloutInputError(
                    f"lora_config.{field}", f"key {key!r} matches none of the modules the adapter is on "
                    f"(lora_config.target_modules; e.g. {targets[0]!r}): a module name, or a regex of its end")


def _check_finite(key: str, got: torch.Tensor, value: torch.Tensor) -> None:
    """`value` is `got` in the model's dtype, as the adapter will hold it: a float64 1e300 is finite
    as sent and infinite in float32, so the check is on the converted values."""
    if not bool(torch.isfinite(value).all()):
        where = "" if got.dtype == value.dtype else \
            f" once in the model's dtype {str(value.dtype).removeprefix('torch.')} (sent as {str(got.dtype).removeprefix('torch.')})"
        raise RolloutInputError(key, f"holds NaN or infinite values{where}")


def attach_adapter(
    base: torch.nn.Module,
    base_digest: str,
    tensors: Mapping[str, Any],
    lora_config: object,
    *,
    dtype: torch.dtype,
) -> tuple[Any, LoraAdapter]:
    """(transformer with the adapter, LoraAdapter): `base` is left as it is and shares its tensors."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict

    config = parse_lora_config(lora_config)
    given = _normalise(tensors)
    transformer = share_tensors_copy(base)
    # The factors are overwritten below; plain init keeps peft off the base weights (PiSSA, OLoRA, ... rewrite them).
    inject_config = dataclasses.replace(config, init_lora_weights=True)
    _check_patterns(config, base)
    try:
        with torch.random.fork_rng(devices=[]):
            # low_cpu_mem_usage: the factors start on the meta device (no init) and the values are assigned below
            inject_adapter_in_model(inject_config, transformer, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True)
    except ValueError as exc:
        raise RolloutInputError("lora_config.target_modules", f"peft cannot place the adapter: {exc}") from None
    expected = get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)
    modules = {name for name, _ in base.named_modules()}
    keys = {name: next(k for k in tensors if k.removeprefix(PEFT_PREFIX) == name) for name in given}
    for name in sorted(given):
        _check(name, keys[name], given[name], expected, modules, config)
    for name in sorted(set(expected) - set(given)):
        raise RolloutInputError(name, "missing from the adapter: lora_config targets this module")
    device = next(iter(base.parameters())).device
    values = {k: v.detach().to(device=device, dtype=dtype).contiguous() for k, v in given.items()}
    for name in sorted(values):
        _check_finite(keys[name], given[name], values[name])
    result = set_peft_model_state_dict(transformer, values, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=True)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:  # every key was checked against peft's own names above: this is a bug, not bad input
        raise RuntimeError(f"peft did not load {unexpected[:3]}")
    if any(p.is_meta for p in transformer.parameters()):  # peft left a factor unassigned: a bug, not bad input
        raise RuntimeError("an adapter factor was not loaded")
    transformer.eval()
    transformer.requires_grad_(False)
    cfg_json = config_json(config)
    cpu = {k: v.to("cpu") for k, v in values.items()}
    adapter = LoraAdapter(config=config, config_json=cfg_json, tensors=cpu,
                          digest=adapter_digest(base_digest, cfg_json, cpu))
    return transformer, adapter
