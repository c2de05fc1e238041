"""The extra streams of a rollout (contract, "More streams per rollout"): one table each.

Besides its "trajectory/v1" stream, a rollout may publish an "outputs/v1" stream (decoded
images or video frames) and a "conditioning/v1" stream (the tensors the transformer consumed).
Each is one Arrow table with its own schema: ``sigmaflight.format`` and ``sigmaflight.rollout``
metadata like the trajectory's, one row per sample in ascending order, columns ``sample``
int32, ``prompt_index`` int32, ``seed`` int64, then one ``arrow.fixed_shape_tensor`` column per
payload tensor (field metadata ``sigmaflight.dtype``; bfloat16 travels as uint16).

``stream_table(name, header, tensors)`` is the one builder: ``tensors`` maps column names to
``[B, ...]`` torch tensors or numpy arrays (B = the header's number of samples).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.schema import (
    KEY_DTYPE,
    KEY_FORMAT,
    KEY_ROLLOUT,
    rollout_metadata,
    schema_metadata,
    torch_dtype,
)

TRAJECTORY = "trajectory"
OUTPUTS = "outputs"
CONDITIONING = "conditioning"
FORMATS = {OUTPUTS: "outputs/v1", CONDITIONING: "conditioning/v1"}
"""Extra stream name -> its ``sigmaflight.format``."""
EXTRA_STREAMS = tuple(FORMATS)
KEY_COLUMNS = ("sample", "prompt_index", "seed")

# numpy dtype of the values -> (Arrow value type, sigmaflight.dtype name)
_NUMPY: dict[np.dtype[Any], tuple[pa.DataType, str]] = {
    np.dtype(np.uint8): (pa.uint8(), "uint8"),
    np.dtype(np.float32): (pa.float32(), "float32"),
    np.dtype(np.float16): (pa.float16(), "float16"),
    np.dtype(np.int64): (pa.int64(), "int64"),
    np.dtype(np.int32): (pa.int32(), "int32"),
}


class StreamNotFound(KeyError):
    """A rollout has no such extra stream (not requested, or not held any more)."""

    def __init__(self, rollout_id: str, stream: str, reason: str) -> None:
        super().__init__(stream)
        self.rollout_id = rollout_id
        self.stream = stream
        self.reason = reason

    def __str__(self) -> str:
        return f"stream {self.stream!r} of rollout {self.rollout_id} not found ({self.reason})"


def requested_streams(header: TrajectoryHeader) -> tuple[str, ...]:
    """The extra streams a rollout was asked for: ``sigmaflight.rollout.streams`` minus "trajectory"."""
    names = header.rollout.get("streams") or ()
    return tuple(n for n in EXTRA_STREAMS if n in names)


def _values(name: str, value: torch.Tensor | np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], pa.DataType, str]:
    """(contiguous numpy array [B, ...], Arrow value type, sigmaflight.dtype) of one payload tensor."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.uint16).numpy(), pa.uint16(), "bfloat16"
        arr = t.numpy()
    else:
        arr = np.ascontiguousarray(value)
    try:
        vt, dname = _NUMPY[arr.dtype]
    except KeyError:
        raise ValueError(f"column {name!r}: unsupported dtype {arr.dtype} (use uint8, float32, float16, bfloat16)") \
            from None
    return arr, vt, dname


def _tensor_column(arr: np.ndarray[Any, Any], value_type: pa.DataType) -> pa.Array:
    shape = [int(d) for d in arr.shape[1:]]
    size = int(np.prod(shape)) if shape else 1
    flat = pa.array(arr.reshape(-1), type=value_type)
    storage = pa.FixedSizeListArray.from_arrays(flat, size)
    return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(value_type, shape), storage)


def stream_table(
    name: str,
    header: TrajectoryHeader,
    tensors: Mapping[str, torch.Tensor | np.ndarray[Any, Any]],
    *,
    max_batch_bytes: int | None = None,
) -> pa.Table:
    """The "<name>/v1" table of one rollout: key columns, then one tensor column per entry of
    ``tensors`` (in the given order). Raises ValueError naming a bad column."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown stream {name!r}; known: {', '.join(EXTRA_STREAMS)}")
    if not tensors:
        raise ValueError(f"stream {name!r} needs at least one tensor column")
    b = header.num_samples
    samples = np.arange(b, dtype=np.int32)
    fields = [
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("prompt_index", pa.int32(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
    ]
    columns: list[pa.Array] = [
        pa.array(samples, type=pa.int32()),
        pa.array(np.asarray(header.prompt_indices(), dtype=np.int32), type=pa.int32()),
        pa.array(np.asarray(header.seeds, dtype=np.int64), type=pa.int64()),
    ]
    for col, value in tensors.items():
        if col in KEY_COLUMNS:
            raise ValueError(f"column {col!r} is a key column of every stream")
        arr, vt, dname = _values(col, value)
        if arr.ndim < 1 or arr.shape[0] != b:
            raise ValueError(f"column {col!r}: first dimension must be the {b} samples, got shape {list(arr.shape)}")
        column = _tensor_column(arr, vt)
        fields.append(pa.field(col, column.type, nullable=False, metadata={KEY_DTYPE: dname}))
        columns.append(column)
    metadata = {
        KEY_FORMAT: json.dumps(fmt).encode(),
        KEY_ROLLOUT: json.dumps(rollout_metadata(header), separators=(",", ":"), allow_nan=False).encode(),
    }
    table = pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=metadata))
    if max_batch_bytes is not None and b > 1:
        rows = max(1, int(max_batch_bytes // max(1, table.nbytes // b)))
        table = pa.Table.from_batches(table.to_batches(max_chunksize=rows), schema=table.schema)
    return table


def column_tensor(table: pa.Table, column: str) -> torch.Tensor:
    """A tensor column of a stream table as a torch tensor [B, ...] in its own dtype
    (bfloat16 back from uint16)."""
    field = table.schema.field(column)
    arr = table.column(column).combine_chunks()
    values = np.asarray(arr.to_numpy_ndarray())
    name = (field.metadata or {}).get(KEY_DTYPE.encode(), b"").decode(errors="replace")
    travels = np.dtype(np.uint16) if name == "bfloat16" else next((d for d, (_, n) in _NUMPY.items() if n == name), None)
    if travels is not None and values.dtype != travels:  # the bytes would be read as another type
        raise ValueError(f"column {column!r}: field metadata {KEY_DTYPE} is {name!r}, which travels as {travels} "
                         f"values, but the column holds {values.dtype} values")
    t = torch.from_numpy(values.copy())
    if name == "bfloat16":
        return t.view(torch.bfloat16)
    if name in ("float32", "float16"):
        return t.to(torch_dtype(name))
    return t


def stream_format(schema: pa.Schema) -> str | None:
    fmt = schema_metadata(schema).get(KEY_FORMAT)
    return fmt if isinstance(fmt, str) else None
