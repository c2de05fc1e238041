"""The "trajectory/v1" Arrow schema (contract, section Flight) and its inverse.

Rows are (step, sample) pairs, step-major. Schedule metadata (sigmas, timesteps) rides
in the schema metadata as JSON numbers chosen so that ``float32(value)`` gives back the
exact bits of the snapshot.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.record import TrajectoryHeader

FORMAT = "trajectory/v1"

KEY_FORMAT = "sigmaflight.format"
KEY_SIGMAS = "sigmaflight.sigmas"
KEY_TIMESTEPS = "sigmaflight.timesteps"
KEY_STEPS = "sigmaflight.steps"
KEY_SDE_STEPS = "sigmaflight.sde_steps"
KEY_ROLLOUT = "sigmaflight.rollout"
KEY_LOG_PROBS = "sigmaflight.log_probs"
"""Added key (v1 readers ignore unknown keys): whether log-probs were requested."""
KEY_DTYPE = "sigmaflight.dtype"
"""Field metadata of ``latent``: the torch dtype the values stand for."""
KEY_PARENT = "sigmaflight.parent"
"""Branch rollouts: {"rollout", "step", "samples"} of the parent (contract, "Branch rollouts")."""

COLUMNS = ("step", "sample", "prompt_index", "seed", "timestep", "sigma", "sigma_next", "sde", "log_prob", "latent")
OPTIONAL_COLUMNS = ("velocity", "parent_sample")
"""Added after ``latent`` when the rollout has them (v1 readers select columns by name):
``velocity`` with ``return.velocities``, ``parent_sample`` for branch rollouts."""

# torch dtype <-> (Arrow value type, numpy dtype, name in field metadata)
_DTYPES: dict[torch.dtype, tuple[pa.DataType, np.dtype[Any], str]] = {
    torch.float32: (pa.float32(), np.dtype(np.float32), "float32"),
    torch.float16: (pa.float16(), np.dtype(np.float16), "float16"),
    torch.bfloat16: (pa.uint16(), np.dtype(np.uint16), "bfloat16"),
}
_BY_NAME = {name: dt for dt, (_, _, name) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype][2]
    except KeyError:
        raise ValueError(f"unsupported latent dtype {dtype}; use float32, float16 or bfloat16") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown sigmaflight.dtype {name!r}") from None


def arrow_value_type(dtype: torch.dtype) -> pa.DataType:
    dtype_name(dtype)
    return _DTYPES[dtype][0]


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype whose bytes carry ``dtype`` (uint16 for bfloat16)."""
    dtype_name(dtype)
    return _DTYPES[dtype][1]


def exact_float32(value: float | np.floating[Any]) -> float:
    """The shortest decimal whose float32 rounding is ``value``'s float32 bits.

    numpy's float32 repr is the shortest round-tripping decimal for float32; it is
    parsed as a Python float (float64) and checked, because decimal -> float64 ->
    float32 rounds twice. Should the check ever fail, the float64 that equals the
    float32 exactly is returned (always round-trips, just longer).
    """
    f = np.float32(value)
    if not math.isfinite(float(f)):
        raise ValueError(f"schedule value {float(f)!r} is not finite")
    short = float(str(f))  # numpy 2: shortest float32 repr, e.g. '0.1'
    if np.float32(short).view(np.uint32) == f.view(np.uint32):
        return short
    return float(f)


def float32_list(values: torch.Tensor | Sequence[float] | np.ndarray[Any, Any]) -> list[float]:
    arr = values.detach().cpu().to(torch.float32).numpy() if isinstance(values, torch.Tensor) else values
    return [exact_float32(v) for v in np.asarray(arr, dtype=np.float32).reshape(-1)]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


_FORMAT_JSON = _dumps(FORMAT)


def rollout_metadata(header: TrajectoryHeader) -> dict[str, Any]:
    """``header.rollout`` with the keys the contract names filled from the header."""
    rollout = dict(header.rollout)
    rollout["id"] = header.rollout_id
    rollout["seeds"] = [int(s) for s in header.seeds]
    rollout["num_samples"] = header.num_samples
    rollout["num_outputs_per_prompt"] = header.num_outputs_per_prompt
    n = max(1, header.num_outputs_per_prompt)
    if header.prompt_index and tuple(header.prompt_index) != tuple(s // n for s in range(header.num_samples)):
        rollout["prompt_index"] = [int(p) for p in header.prompt_index]  # a branch: the parent rows'
    return rollout


def validate_header(header: TrajectoryHeader) -> None:
    """Invariants the codec relies on; raises ValueError naming the bad field."""
    t = header.num_steps
    if header.sigmas.ndim != 1 or header.sigmas.shape[0] != t + 1:
        raise ValueError(f"sigmas must be [T+1] = [{t + 1}], got {list(header.sigmas.shape)}")
    if header.timesteps.ndim != 1:
        raise ValueError("timesteps must be 1-D [T]")
    steps = list(header.steps)
    if steps != sorted(set(steps)) or any(not 0 <= s <= t for s in steps):
        raise ValueError(f"steps must be unique, ascending and in 0..{t}, got {steps}")
    if any(not 0 <= s < t for s in header.sde_steps):
        raise ValueError(f"sde_steps must be in 0..{t - 1}, got {list(header.sde_steps)}")
    if header.num_outputs_per_prompt < 1 or header.num_samples % header.num_outputs_per_prompt:
        raise ValueError(
            f"num_samples {header.num_samples} is not a multiple of num_outputs_per_prompt "
            f"{header.num_outputs_per_prompt}"
        )
    if header.num_samples < 1:
        raise ValueError("a rollout needs at least one sample (seeds is empty)")
    dtype_name(header.latent_dtype)
    if any(d < 1 for d in header.latent_shape) or not header.latent_shape:
        raise ValueError(f"latent_shape must be non-empty and positive, got {header.latent_shape}")
    for name, values in (("prompt_index", header.prompt_index), ("parent_sample", header.parent_sample or ())):
        if values and len(values) != header.num_samples:
            raise ValueError(f"{name} must have one entry per sample ({header.num_samples}), got {len(values)}")


def trajectory_schema(header: TrajectoryHeader) -> pa.Schema:
    """The exact "trajectory/v1" schema (column order, types, nullability, metadata)."""
    validate_header(header)
    metadata = {
        KEY_FORMAT: _FORMAT_JSON,
        KEY_SIGMAS: schedule_json(header.sigmas),
        KEY_TIMESTEPS: schedule_json(header.timesteps),
        KEY_STEPS: _dumps([int(s) for s in header.steps]),
        KEY_SDE_STEPS: _dumps(sorted(int(s) for s in header.sde_steps)),
        KEY_ROLLOUT: _dumps(rollout_metadata(header)),
        KEY_LOG_PROBS: _dumps(bool(header.log_probs)),
    }
    if header.parent is not None:
        metadata[KEY_PARENT] = _dumps(dict(header.parent))
    fields = _fields(header.latent_dtype, tuple(header.latent_shape), header.velocities, header.parent_sample is not None)
    return pa.schema(fields, metadata=metadata)


@functools.lru_cache(maxsize=64)
def _fields(dtype: torch.dtype, latent_shape: tuple[int, ...], velocities: bool, parent: bool) -> tuple[pa.Field, ...]:
    """The columns of a trajectory: the same for every rollout of one model call (Arrow fields
    are immutable), so made once per kind."""
    value_type, _, name = _DTYPES[dtype]
    fields = [
        pa.field("step", pa.int32(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("prompt_index", pa.int32(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("timestep", pa.float32(), nullable=True),
        pa.field("sigma", pa.float32(), nullable=False),
        pa.field("sigma_next", pa.float32(), nullable=True),
        pa.field("sde", pa.bool_(), nullable=True),
        pa.field("log_prob", pa.float32(), nullable=True),
        pa.field("latent", pa.fixed_shape_tensor(value_type, list(latent_shape)), nullable=False,
                 metadata={KEY_DTYPE: name}),
    ]
    if velocities:
        velocity_type = pa.fixed_shape_tensor(pa.float32(), list(latent_shape))
        fields.append(pa.field("velocity", velocity_type, nullable=True, metadata={KEY_DTYPE: "float32"}))
    if parent:
        fields.append(pa.field("parent_sample", pa.int32(), nullable=False))
    return tuple(fields)


def schedule_json(values: torch.Tensor) -> bytes:
    """`float32_list(values)` as JSON: made once per schedule, which every rollout of a
    co-batched call shares (keyed by its float32 bytes, so equal schedules share it too)."""
    raw = values.detach().cpu().to(torch.float32).contiguous().numpy().tobytes()
    return _exact_float32_json(raw)


@functools.lru_cache(maxsize=256)
def _exact_float32_json(raw: bytes) -> bytes:
    return _dumps(float32_list(np.frombuffer(raw, dtype=np.float32)))


def schema_metadata(schema: pa.Schema) -> dict[str, Any]:
    """The schema metadata with JSON values decoded (unknown keys kept, v1 evolution)."""
    out: dict[str, Any] = {}
    for k, v in (schema.metadata or {}).items():
        key = k.decode()
        try:
            out[key] = json.loads(v)
        except ValueError:
            out[key] = v.decode(errors="replace")
    return out


def latent_dtype_of(schema: pa.Schema) -> torch.dtype:
    field = schema.field("latent")
    meta = field.metadata or {}
    name = meta.get(KEY_DTYPE.encode())
    storage = getattr(field.type.storage_type, "value_type", None) if isinstance(field.type, pa.BaseExtensionType) else None
    if name is not None:
        dtype = torch_dtype(name.decode(errors="replace"))
        if storage is not None and storage != _DTYPES[dtype][0]:  # the bytes would be read as another type
            raise ValueError(f"latent: field metadata {KEY_DTYPE} is {name.decode()!r}, which travels as "
                             f"{_DTYPES[dtype][0]} values, but the column holds {storage} values")
        return dtype
    for dt, (vt, _, _) in _DTYPES.items():
        if storage == vt and dt is not torch.bfloat16:
            return dt
    raise ValueError(f"cannot tell the latent dtype of {field.type} (no {KEY_DTYPE} field metadata)")


def header_from_schema(schema: pa.Schema) -> TrajectoryHeader:
    """Rebuild the TrajectoryHeader a "trajectory/v1" schema was made from."""
    meta = schema_metadata(schema)
    fmt = meta.get(KEY_FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"not a {FORMAT} schema ({KEY_FORMAT} = {fmt!r})")
    missing = [c for c in COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"{FORMAT} schema lacks columns {missing}")
    latent_type = schema.field("latent").type
    if not isinstance(latent_type, pa.FixedShapeTensorType):
        raise ValueError(f"latent column is {latent_type}, expected arrow.fixed_shape_tensor")
    rollout = dict(meta.get(KEY_ROLLOUT) or {})
    seeds = tuple(int(s) for s in rollout.get("seeds", ()))
    n = int(rollout.get("num_outputs_per_prompt", 1))
    parent = meta.get(KEY_PARENT)
    parent_sample = None
    if isinstance(parent, dict) and "parent_sample" in schema.names:
        parent_sample = tuple(int(j) for j in parent.get("samples", ()) for _ in range(n))
    sigmas, timesteps = _schedule(meta)
    return TrajectoryHeader(
        rollout_id=str(rollout.get("id", "")),
        sigmas=torch.from_numpy(sigmas),
        timesteps=torch.from_numpy(timesteps),
        steps=_steps(meta, len(timesteps)),
        sde_steps=tuple(int(s) for s in meta.get(KEY_SDE_STEPS, ())),
        seeds=seeds,
        num_outputs_per_prompt=n,
        latent_shape=tuple(int(d) for d in latent_type.shape),
        latent_dtype=latent_dtype_of(schema),
        log_probs=bool(meta.get(KEY_LOG_PROBS, True)),
        rollout=rollout,
        prompt_index=tuple(int(p) for p in rollout.get("prompt_index", ())),
        parent_sample=parent_sample,
        parent=parent if isinstance(parent, dict) else None,
        velocities="velocity" in schema.names,
    )


def _schedule(meta: dict[str, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """float32 sigmas [T+1] and timesteps [T] from the metadata, as the contract states them:
    T+1 finite sigmas ending in 0 (ValueError naming the key otherwise)."""
    for key in (KEY_SIGMAS, KEY_TIMESTEPS):
        if not isinstance(meta.get(key), list):
            raise ValueError(f"{key} must be a JSON list of numbers, got {type(meta.get(key)).__name__}")
    try:
        sigmas = np.asarray(meta[KEY_SIGMAS], dtype=np.float32).reshape(-1)
        timesteps = np.asarray(meta[KEY_TIMESTEPS], dtype=np.float32).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"{KEY_SIGMAS} and {KEY_TIMESTEPS} must be lists of numbers") from None
    t = len(timesteps)
    if len(sigmas) != t + 1:
        raise ValueError(f"{KEY_SIGMAS} has {len(sigmas)} values, expected T+1 = {t + 1} ({KEY_TIMESTEPS} has T = {t})")
    bad = ~np.isfinite(sigmas)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{KEY_SIGMAS}[{i}] is {str(sigmas[i])}, not a finite number")
    if sigmas[-1] != 0:
        raise ValueError(f"{KEY_SIGMAS} ends in {str(sigmas[-1])}, not 0 (the terminal sigma)")
    return sigmas, timesteps


def _steps(meta: dict[str, Any], t: int) -> tuple[int, ...]:
    """``sigmaflight.steps``: absolute indices in 0..T, each once, ascending (ValueError naming
    the step that is not)."""
    raw = meta.get(KEY_STEPS)
    if not isinstance(raw, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in raw):
        raise ValueError(f"{KEY_STEPS} must be a JSON list of integers")
    seen: set[int] = set()
    for s in raw:
        if s in seen:
            raise ValueError(f"{KEY_STEPS} lists step {s} more than once")
        if not 0 <= s <= t:
            raise ValueError(f"{KEY_STEPS} lists step {s}, outside 0..T = 0..{t}")
        seen.add(s)
    if raw != sorted(raw):
        raise ValueError(f"{KEY_STEPS} is not ascending: {raw[:20]}")
    return tuple(raw)
