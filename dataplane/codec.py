"""Zero-copy codec: StepBatch (torch) -> "trajectory/v1" record batches -> torch.

Out: the ``latent`` column's data buffer IS the tensor's memory (``pa.py_buffer`` over a
numpy view of the tensor); the record batch holds a reference, so the tensor stays alive
as long as any batch (or slice of it) does.

In: ``batch_to_tensors`` views Arrow's buffer with ``torch.from_numpy`` (read-only,
possibly misaligned as received from Flight); ``copy=True`` returns aligned, writable
tensors at the cost of one copy.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.schema import arrow_value_type, latent_dtype_of, numpy_dtype, trajectory_schema

DEFAULT_MAX_BATCH_BYTES = 8 << 20
"""Keep record batches within 1-8 MiB: the measured fast range for Flight here. A step
up to 8 MiB stays one batch (so per-step views need no concatenation)."""


@dataclass(frozen=True)
class StepTensors:
    """The rows of one record batch (one step, some or all samples) as torch tensors."""

    step: int
    sample: torch.Tensor
    """int64 [b]: sample indices (prompt-major)."""
    prompt_index: torch.Tensor
    """int64 [b]."""
    seed: torch.Tensor
    """int64 [b]."""
    latent: torch.Tensor
    """[b, *latent_shape] in the rollout's dtype: x_step for each sample."""
    log_prob: torch.Tensor
    """float32 [b], NaN where null (i = T, deterministic transitions, not requested)."""
    sigma: float
    sigma_next: float | None
    timestep: float | None
    sde: bool | None


def _tensor_to_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of ``t`` (no copy); bfloat16 bits as uint16."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def latent_array(latent: torch.Tensor, latent_shape: tuple[int, ...], dtype: torch.dtype) -> pa.Array:
    """[b, *latent_shape] tensor -> fixed_shape_tensor array over the same memory."""
    return _wrap_latent(_checked_latent(latent, latent_shape, dtype), latent_shape, dtype)[0]


def _checked_latent(latent: torch.Tensor, latent_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`latent` if it can be a latent column of this shape and dtype (contiguous: a copy if strided)."""
    if latent.device.type != "cpu":
        raise ValueError(f"latent must be on the CPU, got {latent.device}")
    if latent.dtype != dtype:
        raise ValueError(f"latent dtype {latent.dtype} != header latent_dtype {dtype}")
    if tuple(latent.shape[1:]) != tuple(latent_shape):
        raise ValueError(f"latent shape {list(latent.shape)} != [B, *{list(latent_shape)}]")
    return latent if latent.is_contiguous() else latent.contiguous()  # a strided tensor has no single buffer


def _wrap_latent(latent: torch.Tensor, latent_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[pa.Array, int]:
    """A checked, contiguous latent as a fixed_shape_tensor array over its memory, and the array's
    bytes (its one buffer: pyarrow's `nbytes` walks the array's layout for the same number)."""
    arr = _tensor_to_numpy(latent.detach())
    value_type, tensor_type = _tensor_types(dtype, tuple(latent_shape))
    values = pa.Array.from_buffers(value_type, arr.size, [None, pa.py_buffer(arr)])
    storage = pa.FixedSizeListArray.from_arrays(values, math.prod(latent_shape))
    return pa.ExtensionArray.from_storage(tensor_type, storage), arr.nbytes


@functools.lru_cache(maxsize=256)
def _tensor_types(dtype: torch.dtype, latent_shape: tuple[int, ...]) -> tuple[pa.DataType, pa.DataType]:
    """The value type and the fixed_shape_tensor type of a latent column (made once per shape)."""
    value_type = arrow_value_type(dtype)
    return value_type, pa.fixed_shape_tensor(value_type, list(latent_shape))


def velocity_array(velocity: torch.Tensor | None, rows: int, latent_shape: tuple[int, ...]) -> pa.Array:
    """The ``velocity`` column of ``rows`` rows: the float32 tensor's memory, or all null (i = T)."""
    if velocity is not None:
        return latent_array(velocity, latent_shape, torch.float32)
    return _null_velocity(rows, tuple(latent_shape))[0]


@functools.lru_cache(maxsize=256)
def _null_velocity(rows: int, latent_shape: tuple[int, ...]) -> tuple[pa.Array, int]:
    """An all-null velocity column of `rows` rows and its bytes (immutable: every last step shares it)."""
    ext = pa.fixed_shape_tensor(pa.float32(), list(latent_shape))
    arr = pa.ExtensionArray.from_storage(ext, pa.nulls(rows, ext.storage_type))
    return arr, arr.nbytes


@functools.lru_cache(maxsize=256)
def _null_log_probs(rows: int) -> tuple[pa.Array, int]:
    arr = pa.nulls(rows, pa.float32())
    return arr, arr.nbytes


class HeaderColumns:
    """What every step of one header shares, made once by the first step that needs it: the
    schedule as Python floats, and per row range the sample, prompt_index and seed columns (and
    parent_sample when the stream has it) with their bytes. A writer keeps one per trajectory."""

    def __init__(self, header: TrajectoryHeader) -> None:
        self.header = header
        self.sigmas: list[float] = header.sigmas.tolist()
        self.timesteps: list[float] = header.timesteps.tolist()
        self._ranges: dict[tuple[int, int], tuple[list[pa.Array], int]] = {}

    def rows(self, a: int, e: int) -> tuple[list[pa.Array], int]:
        hit = self._ranges.get((a, e))
        if hit is None:
            arrays = _row_columns(self.header, a, e)
            hit = self._ranges[(a, e)] = (arrays, sum(x.nbytes for x in arrays))
        return hit


def encode_step(
    header: TrajectoryHeader,
    batch: StepBatch,
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    schema: pa.Schema | None = None,
) -> list[pa.RecordBatch]:
    """One step -> record batches of ``trajectory_schema(header)``, split by samples
    so that each holds at most ``max_batch_bytes`` of latents (at least one sample)."""
    return [b for b, _ in encode_step_sized(header, batch, max_batch_bytes=max_batch_bytes, schema=schema)]


def encode_step_sized(
    header: TrajectoryHeader,
    batch: StepBatch,
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    schema: pa.Schema | None = None,
    columns: HeaderColumns | None = None,
) -> list[tuple[pa.RecordBatch, int]]:
    """`encode_step`, each batch with its bytes (equal to pyarrow's ``RecordBatch.nbytes``, which
    costs about 50 us a batch: more than encoding it). ``columns``: the header's `HeaderColumns`,
    kept by the caller from step to step.

    Each batch's columns are one list in schema order (step, sample, ..., latent, then the
    optional velocity and parent_sample), so the row layout reads in one place.
    """
    schema = schema if schema is not None else trajectory_schema(header)
    columns = columns if columns is not None else HeaderColumns(header)
    i = int(batch.step)
    t = len(columns.timesteps)
    b = header.num_samples
    if not 0 <= i <= t:
        raise ValueError(f"step {i} outside 0..{t}")
    if batch.latent.ndim < 1 or batch.latent.shape[0] != b:
        raise ValueError(f"latent must be [B={b}, ...], got {list(batch.latent.shape)}")
    shape = tuple(header.latent_shape)
    latent = _checked_latent(batch.latent, shape, header.latent_dtype)
    last = i == t
    sde = (i in header.sde_steps) if not last else None
    log_prob: np.ndarray[Any, Any] | None = None
    if header.log_probs and batch.log_prob is not None and not last and sde:
        log_prob = log_prob_values(batch.log_prob, b)
    velocity = None
    if header.velocities and not last and batch.velocity is not None:
        velocity = batch.velocity.detach().to("cpu", torch.float32).contiguous()
        if tuple(velocity.shape) != (b, *shape):
            raise ValueError(f"velocity must be [B={b}, *{list(shape)}], got {list(velocity.shape)}")
    per_sample = math.prod(shape) * (latent.element_size() + (4 if velocity is not None else 0))
    chunk = max(1, int(max_batch_bytes) // max(per_sample, 1))
    sigma = columns.sigmas[i]
    sigma_next = None if last else columns.sigmas[i + 1]
    timestep = None if last else columns.timesteps[i]
    out = []
    for a in range(0, b, chunk):
        e = min(b, a + chunk)
        n = e - a
        whole = a == 0 and e == b  # one batch: the tensors as they are, no slice
        same, nbytes = columns.rows(a, e)
        lp, lp_bytes = _null_log_probs(n)
        if log_prob is not None:
            part = log_prob[a:e]
            nan = np.isnan(part)
            if nan.any():  # NaN is null (a deterministic transition)
                lp = pa.array(part, pa.float32(), mask=nan)
                lp_bytes = lp.nbytes
            else:
                lp, lp_bytes = pa.array(part, pa.float32()), part.nbytes
        step_columns, step_bytes = _step_columns(i, n, timestep, sigma, sigma_next, sde)
        latent_col, latent_bytes = _wrap_latent(latent if whole else latent[a:e], shape, header.latent_dtype)
        arrays = [step_columns[0], *same[:3], *step_columns[1:], lp, latent_col]
        nbytes += lp_bytes + step_bytes + latent_bytes
        if header.velocities:
            if velocity is None:
                v, v_bytes = _null_velocity(n, shape)
            else:
                v, v_bytes = _wrap_latent(velocity if whole else velocity[a:e], shape, torch.float32)
            arrays.append(v)
            nbytes += v_bytes
        arrays += same[3:]
        out.append((pa.RecordBatch.from_arrays(arrays, schema=schema), nbytes))
    return out


def log_prob_values(log_prob: torch.Tensor, rows: int) -> np.ndarray[Any, Any]:
    """A step's log-probs as float32 numpy [rows] on the host (a view when they are already)."""
    lp = log_prob
    if lp.dtype != torch.float32 or lp.device.type != "cpu" or lp.requires_grad:
        lp = lp.detach().to("cpu", torch.float32)
    values = lp.numpy().reshape(-1)
    if values.shape[0] != rows:
        raise ValueError(f"log_prob must be [B={rows}], got {list(log_prob.shape)}")
    return values


@functools.lru_cache(maxsize=4096)
def _step_columns(i: int, n: int, timestep: float | None, sigma: float, sigma_next: float | None,
                  sde: bool | None) -> tuple[tuple[pa.Array, ...], int]:
    """The step, timestep, sigma, sigma_next and sde columns of n rows and their bytes: the same
    for every rollout of a co-batched call at one step, so made once for all of them (Arrow arrays
    are immutable: batches may share them)."""
    arrays = (
        pa.array(np.full(n, i, np.int32)),
        pa.array([timestep] * n, pa.float32()),
        pa.array(np.full(n, sigma, np.float32)),
        pa.array([sigma_next] * n, pa.float32()),
        pa.array([sde] * n, pa.bool_()),
    )
    return arrays, sum(x.nbytes for x in arrays)


def _row_columns(header: TrajectoryHeader, a: int, e: int) -> list[pa.Array]:
    """Rows [a, e)'s sample, prompt_index and seed columns, and parent_sample when the stream has it."""
    out = [
        pa.array(np.arange(a, e, dtype=np.int32)),
        pa.array(np.asarray(header.prompt_indices()[a:e], dtype=np.int32)),
        pa.array(np.asarray(header.seeds[a:e], dtype=np.int64)),
    ]
    if header.parent_sample is not None:
        out.append(pa.array(np.asarray(header.parent_sample[a:e], dtype=np.int32), pa.int32()))
    return out


def latent_view(column: pa.Array, dtype: torch.dtype, *, copy: bool = False) -> torch.Tensor:
    """fixed_shape_tensor column -> [rows, *shape] torch tensor (zero-copy unless ``copy``)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    ext_type = column.type
    shape = tuple(int(d) for d in ext_type.shape)
    storage = column.storage
    rows = len(storage)
    n = math.prod(shape)
    np_dtype = numpy_dtype(dtype)
    values = storage.values
    offset = (values.offset + storage.offset * n) * np_dtype.itemsize
    buf = values.buffers()[1]
    arr = np.frombuffer(buf, dtype=np_dtype, count=rows * n, offset=offset).reshape(rows, *shape)
    if copy:
        # one copy into torch-owned (64-byte aligned), writable memory
        out = torch.empty((rows, *shape), dtype=dtype)
        _tensor_to_numpy(out)[...] = arr
        return out
    with warnings.catch_warnings():
        # Arrow buffers are read-only by design: the view is read-only too.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        t = torch.from_numpy(arr.view(np.int16) if dtype == torch.bfloat16 else arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _int_column(batch: pa.RecordBatch, name: str) -> torch.Tensor:
    return torch.from_numpy(batch.column(name).to_numpy(zero_copy_only=False).astype(np.int64))


def batch_to_tensors(
    batch: pa.RecordBatch, *, copy: bool = False, dtype: torch.dtype | None = None
) -> StepTensors:
    """One "trajectory/v1" record batch -> StepTensors.

    ``copy=False``: ``latent`` is a read-only view of the batch's own buffer (possibly
    misaligned when received over Flight); it keeps the batch alive. ``copy=True``: an
    aligned, writable tensor (one copy). The dtype comes from the field metadata.
    """
    if batch.num_rows == 0:
        raise ValueError("empty record batch")
    dtype = dtype if dtype is not None else latent_dtype_of(batch.schema)
    steps = batch.column("step")
    step = int(steps[0].as_py())
    log_prob = batch.column("log_prob").to_numpy(zero_copy_only=False).astype(np.float32)  # nulls -> NaN
    sigma_next = batch.column("sigma_next")[0].as_py()
    timestep = batch.column("timestep")[0].as_py()
    sde = batch.column("sde")[0].as_py()
    return StepTensors(
        step=step,
        sample=_int_column(batch, "sample"),
        prompt_index=_int_column(batch, "prompt_index"),
        seed=_int_column(batch, "seed"),
        latent=latent_view(batch.column("latent"), dtype, copy=copy),
        log_prob=torch.from_numpy(log_prob),
        sigma=float(batch.column("sigma")[0].as_py()),
        sigma_next=None if sigma_next is None else float(sigma_next),
        timestep=None if timestep is None else float(timestep),
        sde=sde,
    )
