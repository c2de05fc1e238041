"""Co-batched writes: the steps of one model call's rollouts, encoded once for the whole call.

A co-batched call runs many rollouts' rows as one tensor [B, ...]. Encoding each member's step on
its own costs a dozen Arrow arrays and a record batch per member per step: most of what 16 one-
prompt requests cost a worker beyond one 16-prompt request. `CallWriters` instead makes each step
one record batch of every row of the call (the columns `encode_step_sized` makes for one
trajectory, over the call's tensors, without copying them) and gives each member a copy of its
own rows: `pa.concat_batches` of a slice, new buffers for every column in one C++ call, with the
member's own schema. A stored trajectory keeps only its own bytes alive, as a copy made member by
member did. A call of one rollout writes as before (`TrajectoryWriter.append`: its tensors
wrapped, no copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.codec import (
    _checked_latent,
    _null_log_probs,
    _null_velocity,
    _step_columns,
    _wrap_latent,
    log_prob_values,
)
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.writer import TrajectoryWriter

__all__ = ["CallColumns", "CallWriters", "encode_call_step"]


class CallColumns:
    """What every step of one call shares: its members' headers, schemas and rows, and the
    call-wide sample, prompt_index, seed (and parent_sample) columns, made once. The members share
    the schedule, the latent shape and dtype, and whether they are branches (their batch key)."""

    def __init__(self, members: Sequence[tuple[TrajectoryHeader, pa.Schema, int, int]], rows: int) -> None:
        """members: each one's header, stream schema and rows [first, end) of the call's `rows`
        (rows no member has, e.g. of a rollout that ended before its first step, are never written)."""
        if not members:
            raise ValueError("a call has at least one member")
        self.headers = [h for h, _, _, _ in members]
        self.schemas = [s for _, s, _, _ in members]
        self.ranges = [(a, e) for _, _, a, e in members]
        self.rows = rows
        for h, (a, e) in zip(self.headers, self.ranges, strict=True):
            if not 0 <= a < e <= rows or h.num_samples != e - a:
                raise ValueError(f"rollout {h.rollout_id}: {h.num_samples} samples in rows [{a}, {e}) of {rows}")
        first = self.headers[0]
        self.shape = tuple(first.latent_shape)
        self.sigmas: list[float] = first.sigmas.tolist()
        self.timesteps: list[float] = first.timesteps.tolist()
        self.sde = [frozenset(h.sde_steps) for h in self.headers]
        self._row_columns: list[pa.Array] | None = None

    def spread(self, values: Sequence[Any], dtype: type) -> np.ndarray[Any, Any]:
        """A [rows] array of each member's values in its rows: a sequence of its rows' values, or
        one value for all of them (zero where no member is)."""
        out: np.ndarray[Any, Any] = np.zeros(self.rows, dtype=dtype)
        for (a, e), v in zip(self.ranges, values, strict=True):
            out[a:e] = v
        return out

    def row_columns(self) -> list[pa.Array]:
        """sample (each member's from 0), prompt_index, seed and, for branches, parent_sample of every row."""
        if self._row_columns is None:
            hs = self.headers
            cols = [
                pa.array(self.spread([range(h.num_samples) for h in hs], np.int32)),
                pa.array(self.spread([h.prompt_indices() for h in hs], np.int32)),
                pa.array(self.spread([h.seeds for h in hs], np.int64)),
            ]
            if any(h.parent_sample is not None for h in hs):  # branches (all of a call's are: their batch key)
                cols.append(pa.array(self.spread([h.parent_sample or 0 for h in hs], np.int32)))
            self._row_columns = cols
        return self._row_columns


def encode_call_step(
    call: CallColumns, batch: StepBatch, members: Sequence[int], *, max_batch_bytes: int
) -> list[list[tuple[pa.RecordBatch, int]]]:
    """Step `batch.step` of the call (`batch`: the call's tensors, [B, ...]) as each member's record
    batches and their bytes, for the members at these indices of `call`: copies of its rows, at
    most `max_batch_bytes` of latents a batch (at least one sample), as `encode_step_sized` splits
    them. Raises ValueError for tensors that do not fit the call (then no member has the step)."""
    i, t, b, shape = int(batch.step), len(call.timesteps), call.rows, call.shape
    if not 0 <= i <= t:
        raise ValueError(f"step {i} outside 0..{t}")
    if batch.latent.ndim < 1 or batch.latent.shape[0] != b:
        raise ValueError(f"latent must be [B={b}, ...], got {list(batch.latent.shape)}")
    dtype = call.headers[0].latent_dtype
    latent, _ = _wrap_latent(_checked_latent(batch.latent, shape, dtype), shape, dtype)
    last = i == t
    sde = [None if last else i in s for s in call.sde]
    shared, _ = _step_columns(i, b, None if last else call.timesteps[i], call.sigmas[i],
                              None if last else call.sigmas[i + 1], sde[0])
    step_cols = list(shared)
    if len(set(sde)) > 1:  # members with different sde windows: the column row by row
        step_cols[4] = pa.array(call.spread(sde, bool), pa.bool_())
    arrays = [step_cols[0], *call.row_columns()[:3], *step_cols[1:], _log_probs(call, batch, sde, last), latent]
    velocity = None
    if not last and batch.velocity is not None and any(call.headers[k].velocities for k in members):
        v = batch.velocity.detach().to("cpu", torch.float32).contiguous()
        if tuple(v.shape) != (b, *shape):
            raise ValueError(f"velocity must be [B={b}, *{list(shape)}], got {list(v.shape)}")
        velocity = _wrap_latent(v, shape, torch.float32)[0]
    calls: dict[tuple[bool, bool], pa.RecordBatch] = {}  # by the stream's optional columns: velocity, parent_sample
    out = []
    for k in members:
        h, schema, (first, end) = call.headers[k], call.schemas[k], call.ranges[k]
        layout = (h.velocities, h.parent_sample is not None)
        whole = calls.get(layout)
        if whole is None:
            cols = list(arrays)
            if h.velocities:
                cols.append(velocity if velocity is not None else _null_velocity(b, shape)[0])
            if h.parent_sample is not None:
                cols.append(call.row_columns()[3])
            whole = calls[layout] = pa.RecordBatch.from_arrays(cols, schema=schema)
        per_sample = math.prod(shape) * (batch.latent.element_size() + (4 if h.velocities and velocity is not None else 0))
        chunk = max(1, int(max_batch_bytes) // max(per_sample, 1))
        own = []
        for a in range(first, end, chunk):
            copy = pa.concat_batches([whole.slice(a, min(chunk, end - a))]).replace_schema_metadata(schema.metadata)
            own.append((copy, copy.get_total_buffer_size()))  # its own buffers: pyarrow's nbytes
        out.append(own)
    return out


def _log_probs(call: CallColumns, batch: StepBatch, sde: list[bool | None], last: bool) -> pa.Array:
    """The log_prob column of every row: a member's value where its stream has log-probs and
    transition i is stochastic for it, null elsewhere and where the value is NaN."""
    b = call.rows
    keep = [h.log_probs and bool(s) for h, s in zip(call.headers, sde, strict=True)]
    if last or batch.log_prob is None or not any(keep):
        return _null_log_probs(b)[0]
    values = log_prob_values(batch.log_prob, b)
    null = np.isnan(values)
    if not all(keep):
        null |= ~call.spread(keep, bool)
    return pa.array(values, pa.float32(), mask=null) if null.any() else pa.array(values, pa.float32())


class CallWriters:
    """The writers of one call's rollouts, each with its rows: `append` writes a step of the call
    to the members that capture it."""

    def __init__(self, members: Sequence[tuple[TrajectoryWriter, int, int]], rows: int, *, max_batch_bytes: int) -> None:
        """members: each writer with its rows [first, end) of the call's `rows`."""
        self.index = {id(w): k for k, (w, _, _) in enumerate(members)}
        self.call = CallColumns([(w.header, w.schema, a, e) for w, a, e in members], rows)
        self.alone = len(members) == 1 and self.call.ranges[0] == (0, rows)
        """The call is this one rollout: its tensors are written as they are, no copy."""
        self.max_batch_bytes = max_batch_bytes

    def append(self, batch: StepBatch, writers: Sequence[TrajectoryWriter]) -> list[tuple[TrajectoryWriter, Exception]]:
        """Step `batch.step` (the call's tensors) to these writers; those that could not take it,
        each with its error (all of them when the step could not be encoded)."""
        if not writers:
            return []
        sized: list[list[tuple[pa.RecordBatch, int]]] | None = None
        if not self.alone:  # co-batched: the step encoded once for the call (alone: as it is, no copy)
            try:
                sized = encode_call_step(self.call, batch, [self.index[id(w)] for w in writers],
                                         max_batch_bytes=self.max_batch_bytes)
            except Exception as exc:
                return [(w, exc) for w in writers]
        failures = []
        for k, w in enumerate(writers):
            try:
                if sized is None:
                    w.append(batch)
                else:
                    w.append_encoded(batch.step, sized[k])
            except Exception as exc:
                failures.append((w, exc))
        return failures
