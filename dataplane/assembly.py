"""Assembly of "trajectory/v1" record batches into one Trajectory's tensors, and its checks.

Where every row goes is known from the metadata (steps, B): a step-major stream's row r is
x_{steps[r // B]} of sample r % B, so each batch's latents are copied straight to their place
(or, from a same-host file, read there by preadv). The order, the seeds and the nulls are
checked afterwards with arithmetic over whole columns: a missing, repeated or unknown step or
sample is a ValueError naming it, and rows in another order are moved into place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.samehost import FileSource, empty_hugepages, verify_read
from sigmaflight.dataplane.schema import header_from_schema

if TYPE_CHECKING:
    from sigmaflight.dataplane.trajectory import Trajectory


class Assembly:
    """One pull's tensors, and where each row of a step-major stream lands, worked out once from
    the metadata: row r is x_{steps[r // B]} of sample r % B, i.e. latents[r % B, r // B]."""

    def __init__(self, schema: pa.Schema, out: torch.Tensor | None) -> None:
        h = header_from_schema(schema)
        self.schema, self.header = schema, h
        self.b, self.k = h.num_samples, len(h.steps)
        shape = (self.b, self.k, *h.latent_shape)
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != h.latent_dtype:
                raise ValueError(
                    f"out must be {h.latent_dtype} {list(shape)} for rollout {h.rollout_id}, "
                    f"got {out.dtype} {list(out.shape)}"
                )
            if out.device.type != "cpu" or not out.is_contiguous():
                raise ValueError("out must be a contiguous CPU tensor")
        self.latents = out if out is not None else empty_hugepages(shape, h.latent_dtype)
        self.elems = int(np.prod(h.latent_shape))
        self.itemsize = self.latents.element_size()
        self.row_bytes = self.elems * self.itemsize
        self.rows_total = self.b * self.k
        flat = self.latents.view(-1).view(torch.uint8).numpy()
        self.dest = flat.reshape(self.b, self.k, self.row_bytes)  # [B, K, row bytes]: the latents' bytes
        self.steps = np.asarray(h.steps, dtype=np.int64)
        names = schema.names
        self.i_step, self.i_sample = names.index("step"), names.index("sample")
        self.i_lp, self.i_lat = names.index("log_prob"), names.index("latent")
        self.i_seed = names.index("seed")
        self.i_vel = names.index("velocity") if "velocity" in names else None
        self.velocities = torch.empty(shape, dtype=torch.float32) if self.i_vel is not None else None
        self.vdest = (None if self.velocities is None  # [B, K, elements]: the velocities, float32
                      else self.velocities.view(self.b, self.k, -1).numpy())
        self.step = np.empty(self.rows_total, np.int32)  # each row's step, sample and seed, in stream order
        self.sample = np.empty(self.rows_total, np.int32)
        self.seed = np.empty(self.rows_total, np.int64)
        self.lp = np.full(self.rows_total, np.nan, np.float32)
        self.rows = 0

    def _latent_offset(self, batch: pa.RecordBatch) -> tuple[pa.Buffer, int]:
        """The buffer holding the batch's latent rows and the byte offset of its first row."""
        storage = batch.column(self.i_lat).storage
        values = storage.values
        return values.buffers()[1], (values.offset + storage.offset * self.elems) * self.itemsize

    def _check_nulls(self, part: pa.RecordBatch | pa.Table) -> None:
        """ValueError naming a non-nullable column that holds a null (the schema says none may)."""
        for i in (self.i_step, self.i_sample, self.i_seed, self.i_lat):
            col = part.column(i)
            if col.null_count:
                raise ValueError(f"trajectory {self.header.rollout_id}: column {self.schema.names[i]!r} holds "
                                 f"{col.null_count} null(s); it is not nullable")
        chunks = part.column(self.i_lat).chunks if isinstance(part, pa.Table) else [part.column(self.i_lat)]
        for chunk in chunks:
            if chunk.storage.values.null_count:
                raise ValueError(f"trajectory {self.header.rollout_id}: column 'latent' holds null values "
                                 "inside a latent; it is not nullable")

    def _take_columns(self, r0: int, part: pa.RecordBatch | pa.Table) -> None:
        self._check_nulls(part)
        self._take(r0, part.num_rows, *(part.column(i) for i in (self.i_step, self.i_sample, self.i_seed, self.i_lp)))

    def _take(self, r0: int, n: int, step_col: Any, sample_col: Any, seed_col: Any, lp: Any) -> None:
        """Rows r0..r0+n's step, sample, seed and log_prob columns (arrays or chunked arrays)."""
        step = step_col.to_numpy(zero_copy_only=False)
        sample = sample_col.to_numpy(zero_copy_only=False)
        if r0 + n > self.rows_total:  # a row twice, or a step not listed: say which
            self._destinations(np.concatenate([self.step[:r0], step]), np.concatenate([self.sample[:r0], sample]))
            raise ValueError(f"trajectory {self.header.rollout_id}: more rows than B x steps = {self.rows_total}")
        self.step[r0 : r0 + n] = step
        self.sample[r0 : r0 + n] = sample
        self.seed[r0 : r0 + n] = seed_col.to_numpy(zero_copy_only=False)
        if lp.null_count != n:
            self.lp[r0 : r0 + n] = lp.to_numpy(zero_copy_only=False)  # nulls -> NaN

    def put(self, batch: pa.RecordBatch) -> None:
        """The next batch of a stream: its latents copied to their rows, its columns noted."""
        n, r0 = batch.num_rows, self.rows
        if n == 0:
            return
        self._take_columns(r0, batch)
        buf, off = self._latent_offset(batch)
        src = np.frombuffer(buf, np.uint8, count=n * self.row_bytes, offset=off).reshape(n, self.row_bytes)
        b, k, i = r0 % self.b, r0 // self.b, 0
        while i < n:  # once, unless the batch runs past the end of a step
            take = min(n - i, self.b - b)
            self.dest[b : b + take, k] = src[i : i + take]
            i, b, k = i + take, 0, k + 1
        self._take_velocities(r0, batch)
        self.rows = r0 + n

    def _take_velocities(self, r0: int, batch: pa.RecordBatch) -> None:
        """The batch's velocity rows copied to their places (rows r0...), NaN where null (i = T)."""
        if self.vdest is None or self.i_vel is None:
            return
        n = batch.num_rows
        storage = batch.column(self.i_vel).storage
        if storage.null_count == n:
            src = np.full((n, self.elems), np.nan, np.float32)
        else:
            values = storage.values
            offset = (values.offset + storage.offset * self.elems) * 4
            src = np.frombuffer(values.buffers()[1], np.float32, count=n * self.elems, offset=offset)
            src = src.reshape(n, self.elems)
            if storage.null_count:
                src = np.where(storage.is_valid().to_numpy(zero_copy_only=False)[:, None], src, np.float32(np.nan))
        b, k, i = r0 % self.b, r0 // self.b, 0
        while i < n:
            take = min(n - i, self.b - b)
            self.vdest[b : b + take, k] = src[i : i + take]
            i, b, k = i + take, 0, k + 1

    def read_file(self, batches: list[pa.RecordBatch], source: FileSource, verify: bool) -> None:
        """Every batch of a mapped file at once: the columns in one pass each, the latents by
        preadv from ``source`` (file offset of each row -> address of its destination row)."""
        source.check_size()
        self._check_nulls(pa.Table.from_batches(batches, schema=self.schema))  # null counts: batch metadata
        n = sum(b.num_rows for b in batches)
        if n > self.rows_total:
            raise ValueError(f"trajectory {self.header.rollout_id}: more rows than B x steps = {self.rows_total}")
        cols = [np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.float32)]
        source.read_columns(batches, [self.i_step, self.i_sample, self.i_seed, self.i_lp], cols)  # not the mapping
        self._take(0, n, *(pa.array(c) for c in cols))
        counts = np.fromiter((b.num_rows for b in batches), np.int64, len(batches))
        offsets = np.zeros(len(batches), np.int64)
        for j, batch in enumerate(batches):  # the one step per batch: where its latents lie in the file
            if len(batch):
                buf, off = self._latent_offset(batch)
                offsets[j] = buf.address - source.base_address + off
        n = int(counts.sum())
        r = np.arange(n, dtype=np.int64)
        src = np.repeat(offsets - (np.cumsum(counts) - counts) * self.row_bytes, counts) + r * self.row_bytes
        dst_row = (r % self.b) * self.k + r // self.b
        source.read_rows(src, dst_row.astype(np.uint64) * np.uint64(self.row_bytes) + np.uint64(self.dest.ctypes.data),
                         self.row_bytes)
        self.rows = n
        first = 0
        for batch in batches:  # velocities (a rollout that asked for them): copied from the mapping
            self._take_velocities(first, batch)
            first += batch.num_rows
        if verify:
            flat = self.dest.reshape(self.rows_total, self.row_bytes)
            ends = np.cumsum(counts)
            rows = [[memoryview(flat[j]) for j in dst_row[e - c : e]] for c, e in zip(counts, ends, strict=True)]
            verify_read(source, batches, rows)

    def _destinations(self, step: np.ndarray[Any, Any], sample: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Each row's index in [B x K] (sample * K + position of its step); ValueError naming an
        unknown step or sample, a row present twice, or the steps missing."""
        h, t = self.header, self.header.num_steps
        pos = np.full(t + 1, -1, np.int64)  # absolute step -> its position k in sigmaflight.steps
        pos[self.steps] = np.arange(self.k)
        k = np.where((step >= 0) & (step <= t), pos[np.clip(step, 0, t)], -1)
        if (k < 0).any():
            raise ValueError(f"stream holds step {int(step[np.argmax(k < 0)])}, not listed in sigmaflight.steps")
        bad = (sample < 0) | (sample >= self.b)
        if bad.any():
            raise ValueError(f"stream holds sample {int(sample[np.argmax(bad)])}, outside 0..{self.b - 1}")
        where = sample.astype(np.int64) * self.k + k
        seen = np.bincount(where, minlength=self.rows_total)
        if (seen > 1).any():
            j = int(np.argmax(seen > 1))
            raise ValueError(f"trajectory {h.rollout_id}: step {h.steps[j % self.k]} of sample {j // self.k} "
                             "appears more than once")
        if (seen == 0).any():
            missing = sorted({h.steps[int(j) % self.k] for j in np.flatnonzero(seen == 0)})
            raise ValueError(f"trajectory {h.rollout_id} is incomplete: steps {missing} missing")
        return where

    def finish(self, cls: type[Trajectory]) -> Trajectory:
        """Check the order with arithmetic (rows moved into place when a stream had another
        order) and fill the log-probs from the column, all in one pass each."""
        st, sa = self.step.reshape(self.k, self.b), self.sample.reshape(self.k, self.b)
        if not (self.rows == self.rows_total and (st == self.steps[:, None]).all()
                and (sa == np.arange(self.b)[None, :]).all()):
            self._reorder()
        h = self.header
        self._check_seeds()
        log_probs = np.full((self.b, h.num_steps), np.nan, np.float32)  # [B, T]
        has = self.steps < h.num_steps  # no transition leaves x_T
        log_probs[:, self.steps[has]] = self.lp.reshape(self.k, self.b)[has].T
        return cls(h, self.latents, torch.from_numpy(log_probs), dict(h.rollout), self.schema, self.velocities)

    def _check_seeds(self) -> None:
        """The seed column against ``sigmaflight.rollout.seeds`` (samples are known to be in
        range here): ValueError naming the first row that disagrees."""
        seeds = np.asarray(self.header.seeds, dtype=np.int64)
        bad = self.seed[: self.rows] != seeds[self.sample[: self.rows]]
        if bad.any():
            r = int(np.argmax(bad))
            j = int(self.sample[r])
            raise ValueError(f"trajectory {self.header.rollout_id}: column 'seed' holds {int(self.seed[r])} for "
                             f"sample {j} at step {int(self.step[r])}, but sigmaflight.rollout.seeds[{j}] is "
                             f"{int(seeds[j])}")

    def _reorder(self) -> None:
        """Rows that came in another order than step-major: each moved from the place its
        position in the stream gave it to the one its step and sample name."""
        n = self.rows
        where = self._destinations(self.step[:n], self.sample[:n])
        r = np.arange(n)
        flat = self.dest.reshape(self.rows_total, self.row_bytes)
        flat[where] = flat[(r % self.b) * self.k + r // self.b]  # fancy indexing reads a copy first
        if self.vdest is not None:
            vflat = self.vdest.reshape(self.rows_total, self.elems)
            vflat[where] = vflat[(r % self.b) * self.k + r // self.b]
        lp = np.empty(self.rows_total, np.float32)
        lp[(where % self.k) * self.b + where // self.k] = self.lp[:n]
        self.lp = lp

