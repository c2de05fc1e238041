"""Read a safetensors body into tensors that are views of it (no copy), with the header's metadata.

`safetensors.torch.load(body)` copies every tensor out of the body, so a weights push held
the body and a copy of it at once (twice the pushed bytes). `read_safetensors` checks the
header (format: 8-byte little-endian header size, a JSON header of
`{name: {dtype, shape, data_offsets}}` plus an optional `__metadata__` of strings, then the
data) and returns tensors made with `torch.frombuffer` over the body: the push costs the body
alone, which the new weights keep alive. The tensors share the body's memory: nobody may
write to them (the registry never changes a weight in place).

Bad input raises `RolloutInputError` naming "body" or the tensor's key.
"""

from __future__ import annotations

import json
import math
import reprlib
import sys
import warnings
from typing import Any

import torch
from sigmaflight.pipeline.spec import RolloutInputError

__all__ = ["MAX_HEADER_BYTES", "lora_config_from_metadata", "parse_header", "read_safetensors"]

MAX_HEADER_BYTES = 100 << 20
"""The reference implementation's limit on the JSON header."""

MAX_TENSOR_BYTES = (1 << 63) - 1
"""Largest extent of one tensor (its dimensions, zeros counted as 1, times the item size): torch
keeps sizes and strides in int64."""

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _bad(reason: str, field: str = "body") -> RolloutInputError:
    return RolloutInputError(field, reason)


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxlong = 2, 8, 4, 60, 40


def _shown(value: object) -> str:
    """A short repr of a header value for an error message (the header is the client's input)."""
    return _SHOWN.repr(value)


def _extent_fits(shape: list[int], itemsize: int) -> bool:
    """Whether the dimensions (zeros counted as 1) times the item size stay within MAX_TENSOR_BYTES;
    stops at the first one past it (a long list of huge numbers is not multiplied out)."""
    extent = itemsize
    for d in shape:
        extent *= max(d, 1)
        if extent > MAX_TENSOR_BYTES:
            return False
    return True


def read_safetensors(body: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata): tensors are views of `body` (copied only where an offset is not aligned to the dtype)."""
    if sys.byteorder != "little":  # safetensors is little-endian
        raise RuntimeError("read_safetensors needs a little-endian host")
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise _bad(f"not a safetensors file: {len(view)} bytes, shorter than the 8-byte header size")
    n = int.from_bytes(view[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(view):
        raise _bad(f"not a safetensors file: header size {n} does not fit the body of {len(view)} bytes")
    data = view[8 + n:]
    entries, raw_meta = parse_header(bytes(view[8:8 + n]), len(data))
    out: dict[str, torch.Tensor] = {}
    for key, (dtype, shape, start, end) in entries.items():
        size = end - start
        if size == 0:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only bytes: torch warns that it cannot mark the tensor read-only
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=start)
        if start % dtype.itemsize:
            flat = flat.clone()  # an unaligned view would be slow or refused by some kernels
        out[key] = flat.view(dtype).view(shape)
    return out, raw_meta


def parse_header(raw: bytes, data_len: int | None) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], dict[str, str]]:
    """The JSON header of a safetensors file whose data section holds `data_len` bytes, checked:
    ({key: (dtype, shape, start, end)} with offsets into the data section, metadata). Used by
    `read_safetensors` and by the streamed PUT .../weights, which reads the header first.
    `data_len` None: not known yet (a chunked body); the caller checks where the data ends."""
    try:
        header = json.loads(raw, object_pairs_hook=_once_each)
    except _Twice as exc:  # json would keep the last: the format names each tensor once
        raise _bad("the header names it twice", exc.key) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"not a safetensors file: the header is not JSON ({exc})") from None
    except RecursionError:  # e.g. "[" * 100000: json's decoder recurses once a nesting level
        raise _bad("not a safetensors file: the header nests too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise _bad("not a safetensors file: the header is not a JSON object")
    raw_meta = header.pop("__metadata__", None) or {}
    if not isinstance(raw_meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw_meta.items()):
        raise _bad("the header's __metadata__ must map strings to strings", "__metadata__")
    spans: list[tuple[int, int, str]] = []
    out: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _bad("header entry must hold exactly dtype, shape and data_offsets", key)
        dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise _bad(f"unknown dtype {_shown(entry['dtype'])}", key)
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise _bad(f"shape must be a list of non-negative integers, got {_shown(shape)}", key)
        if not _extent_fits(shape, dtype.itemsize):  # a zero-size entry goes to torch.empty unchecked
            raise _bad(f"shape {_shown(shape)} is too large: its sizes and strides do not fit in 64 bits", key)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] or (data_len is not None and offsets[1] > data_len)):
            raise _bad(f"data_offsets {_shown(offsets)} do not fit the {data_len} data bytes", key)
        start, end = offsets
        size = math.prod(shape) * dtype.itemsize
        if end - start != size:
            raise _bad(f"data_offsets span {end - start} bytes, shape {shape} of {entry['dtype']} needs {size}", key)
        spans.append((start, end, key))
        out[key] = (dtype, shape, start, end)
    spans.sort()
    for (_, a_end, a_key), (b_start, _, b_key) in zip(spans, spans[1:], strict=False):
        if b_start < a_end:
            raise _bad(f"data overlaps {a_key!r}", b_key)
    # the data section is indexed entirely (as the format requires and its own reader checks)
    ends = [0, *(end for _, end, _ in spans)]
    for (start, _, key), before in zip(spans, ends, strict=False):
        if start > before:
            raise _bad(f"data bytes {before}..{start} belong to no tensor (a safetensors file has no holes)", key)
    if data_len is not None and ends[-1] != data_len:
        raise _bad(trailing_bytes(data_len - ends[-1]))
    return out, dict(raw_meta)


def trailing_bytes(n: int) -> str:
    return f"the {n} data bytes after the last tensor's belong to no tensor"


class _Twice(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of the header, refusing a key given twice (json.loads keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(key)
        out[key] = value
    return out


def lora_config_from_metadata(metadata: dict[str, str]) -> dict[str, Any]:
    """The adapter's LoraConfig dict from the header metadata key `lora_config` (the contract's place for it)."""
    raw = metadata.get("lora_config")
    if raw is None:
        raise RolloutInputError("lora_config", "missing: put the peft LoraConfig as JSON under the safetensors "
                                               "header metadata key 'lora_config'")
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise RolloutInputError("lora_config", f"not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise RolloutInputError("lora_config", f"must be a JSON object, not {type(config).__name__}")
    return config
