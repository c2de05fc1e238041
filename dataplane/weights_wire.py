"""The weights stream's wire format: the chunk schema, the push header and its checks, and the
`WeightsSink` a Flight server hands a push to (dataplane/weights.py has the stream itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import crc32c
import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.errors import clip

__all__ = [
    "HEADER_KEY", "SCHEMA", "WEIGHTS_STATUS_ACTION", "PushRefused", "PushStats", "TensorSpec", "WeightsSink",
    "chunk_batch", "declared_tensors", "dtype_name", "parse_dtype", "parse_header",
]


WEIGHTS_STATUS_ACTION = "weights_push_status"
"""The do_action that answers what a push has received (to resume it)."""

HEADER_KEY = "sigmaflight.weights"
"""The key (with version 1) that marks a do_put command as a weights push header."""

SCHEMA = pa.schema([
    pa.field("tensor", pa.utf8(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("data", pa.binary(), nullable=False),
    pa.field("crc32c", pa.uint32(), nullable=False),
], metadata={HEADER_KEY: "1"})
"""One row per chunk: tensor key, byte offset, the bytes, CRC32C of the bytes (Castagnoli)."""

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object) -> torch.dtype | None:
    return _DTYPES.get(name) if isinstance(name, str) else None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the model holds: what a pushed one must match."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class PushRefused(Exception):
    """A push that cannot go on; `reason` is one of REASONS, `tensor` the key it is about,
    `in_progress` (push_in_progress) the id of the push that holds the model: resume it with that id."""

    REASONS = ("unknown_model", "unknown_tensor", "missing_tensor", "shape", "dtype", "offset", "overlap",
               "checksum", "non_finite", "incomplete", "bad_header", "bad_chunk", "push_in_progress",
               "stale_base", "expired", "commit_failed", "model_failed")

    def __init__(self, reason: str, message: str, *, tensor: str | None = None, in_progress: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.tensor, self.in_progress = reason, message, tensor, in_progress


@dataclass
class PushStats:
    """What a push moved: declared and received bytes, the model's bytes, seconds since it began."""

    declared_bytes: int = 0
    model_bytes: int = 0
    received_bytes: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def skipped_bytes(self) -> int:
        return self.model_bytes - self.declared_bytes


class WeightsSink(Protocol):
    """What the Flight server hands a push to (control/ implements it over the model registry)."""

    def tensor_specs(self, model_id: str) -> Mapping[str, TensorSpec]:
        """Every tensor of the model's transformer; PushRefused("unknown_model") for an unknown id."""
        ...

    def commit(self, model_id: str, staged: dict[str, torch.Tensor], *, partial: bool, base_digest: str | None,
               stats: PushStats) -> dict[str, Any]:
        """Swap the staged tensors in (the others kept as served); the answer (JSON-able: digest,
        weights_version, ...). PushRefused("stale_base") when base_digest is not the served one."""
        ...

    def open_push(self, model_id: str, *, full: bool, base_digest: str | None) -> Mapping[str, torch.Tensor] | None:
        """A push to `model_id` starts (before its first chunk lands). None: stage it into fresh
        copies (`--weights-swap staged`); or the served tensors themselves, which the chunks are
        written straight into (`in-place`: the sink holds the model until `close_push`).
        `full`: the push declares every tensor. PushRefused when it cannot start."""
        ...

    def close_push(self, model_id: str, *, wrote: bool, failed: str | None) -> None:
        """The push opened by `open_push` is over: committed (failed None) or dropped for `failed`;
        `wrote`: some of its bytes had landed."""
        ...


def chunk_batch(name: str, offset: int, data: memoryview | np.ndarray) -> pa.RecordBatch:
    """One chunk as a record batch of SCHEMA, without copying `data` (a C-contiguous byte view)."""
    buf = pa.py_buffer(data)
    offsets = pa.py_buffer(np.array([0, buf.size], dtype=np.int32))
    values = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, buf])
    return pa.RecordBatch.from_arrays(
        [pa.array([name], pa.utf8()), pa.array([offset], pa.int64()), values,
         pa.array([crc32c.crc32c(buf)], pa.uint32())], schema=SCHEMA)



def parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; nesting past the stack too
        raise PushRefused("bad_header", "the do_put command is not a JSON weights push header") from None
    if not isinstance(header, dict) or header.get(HEADER_KEY) != 1:
        raise PushRefused("bad_header", f"the do_put command is not a weights push header ({HEADER_KEY!r}: 1)")
    for key, kind in (("model", str), ("push_id", str), ("tensors", dict)):
        if not isinstance(header.get(key), kind) or not header[key]:
            raise PushRefused("bad_header", f"header field {key!r} must be a non-empty {kind.__name__}")
    if len(header["push_id"]) > 200:
        raise PushRefused("bad_header", "header field 'push_id' is longer than 200 characters")
    if header.get("base_digest") is not None and not isinstance(header["base_digest"], str):
        raise PushRefused("bad_header", "header field 'base_digest' must be a string or null")
    if not isinstance(header.get("partial", False), bool):  # bool("no") would run a partial push
        raise PushRefused("bad_header", "header field 'partial' must be true or false")
    return header


def declared_tensors(header: dict[str, Any], specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """The header's tensors checked against the model's: known keys, same shapes and dtypes, and
    every key unless the push is partial or names the base its unsent tensors come from."""
    out: dict[str, TensorSpec] = {}
    for name, want in sorted(header["tensors"].items()):
        spec = specs.get(name)
        if spec is None:
            raise PushRefused("unknown_tensor", f"tensor {clip(name, 200)!r} is not a parameter or buffer of this "
                              "model's transformer", tensor=clip(name, 200))
        if not isinstance(want, dict):
            raise PushRefused("bad_header", f"tensor {name!r}: expected {{'dtype', 'shape'}}", tensor=name)
        shape = want.get("shape")
        if not isinstance(shape, list) or tuple(shape) != spec.shape:
            raise PushRefused("shape", f"tensor {name!r}: shape {clip(str(shape), 100)} does not match the "
                              f"model's {list(spec.shape)}", tensor=name)
        if parse_dtype(want.get("dtype")) != spec.dtype:
            raise PushRefused("dtype", f"tensor {name!r}: dtype {clip(str(want.get('dtype')), 40)} does not match "
                              f"the model's {dtype_name(spec.dtype)}", tensor=name)
        out[name] = spec
    if not header.get("partial") and header.get("base_digest") is None:
        for name in sorted(set(specs) - set(out)):
            raise PushRefused("missing_tensor", f"tensor {name!r} is missing from a full push (send every tensor, "
                              "or partial=true, or the base_digest the others come from)", tensor=name)
    return out
