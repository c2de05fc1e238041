"""The weights stream: a trainer's new transformer weights pushed over Flight `do_put`, chunk by
chunk, into a staging copy of each tensor, committed whole or not at all.

One push is one `do_put` stream (or several, when a cut stream is resumed under the same push id).
Its descriptor is a CMD descriptor whose command is the push header, JSON:

    {"sigmaflight.weights": 1, "model": "<model id>", "push_id": "<client-chosen id>",
     "partial": false, "base_digest": "<digest the unsent tensors must come from>" | null,
     "tensors": {"<key>": {"dtype": "float32", "shape": [64, 32]}, ...}}

and every record batch follows `SCHEMA`, one row per chunk: the tensor's key, the chunk's byte
offset in that tensor's raw (C-order) bytes, the bytes, and their CRC32C. As each chunk lands it
is checked (a declared key, a whole number of elements inside the tensor, no byte received twice,
the checksum, finite values for a floating tensor) and written straight into that tensor's staging
copy; no buffer holds the whole push. When the stream ends and every declared tensor has arrived
whole, the sink commits the staged tensors as one swap and the server answers the commit (JSON:
digest, weights_version, bytes) on the stream's metadata. A bad chunk or header ends the push with
a typed Flight error (`extra_info` {"type": "bad_weights", "reason", "tensor", "push_id"}), frees
its staging and changes nothing. A stream that ends early (a cut connection) keeps what arrived
for `expire_s` seconds: the client asks `weights_push_status` which byte ranges arrived and
resumes the same push id with the rest.

dataplane/ knows no models: a `WeightsSink` (control/ implements it over the model registry)
names the tensors a model accepts and commits staged ones.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch
from sigmaflight.dataplane.errors import clip, flight_error

log = logging.getLogger("sigmaflight.weights")

__all__ = [
    "HEADER_KEY", "SCHEMA", "WEIGHTS_STATUS_ACTION", "PushRefused", "PushStats", "TensorSpec", "WeightsPushes", "WeightsSink",
    "chunk_batch", "dtype_name", "parse_dtype",
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
    """A push that cannot go on; `reason` is one of REASONS, `tensor` the key it is about."""

    REASONS = ("unknown_model", "unknown_tensor", "missing_tensor", "shape", "dtype", "offset", "overlap",
               "checksum", "non_finite", "incomplete", "bad_header", "bad_chunk", "push_in_progress",
               "stale_base", "expired", "commit_failed", "model_failed")

    def __init__(self, reason: str, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.tensor = reason, message, tensor


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


class _Staging:
    """One push's staging: a tensor per declared key (allocated at its first chunk) and the byte
    ranges received so far, merged. `lock` is held by the stream feeding it (one at a time)."""

    def __init__(self, push_id: str, model_id: str, header: dict[str, Any], declared: dict[str, TensorSpec],
                 model_bytes: int, live: Mapping[str, torch.Tensor] | None = None) -> None:
        self.push_id, self.model_id, self.header, self.declared = push_id, model_id, header, declared
        self.partial = bool(header.get("partial", False))
        self.base_digest: str | None = header.get("base_digest")
        self.tensors: dict[str, torch.Tensor] = {}
        self.flat: dict[str, np.ndarray] = {}
        self.ranges: dict[str, list[tuple[int, int]]] = {k: [] for k in declared}
        self.stats = PushStats(declared_bytes=sum(s.nbytes for s in declared.values()), model_bytes=model_bytes)
        self.lock = threading.Lock()
        self.touched = time.monotonic()
        self.live = live
        self.wrote = False
        """Some bytes were written into their target (checked or not: in-place, the served weights changed)."""
        """The served tensors the chunks are written into (in-place), or None: fresh staging copies."""

    @property
    def staged_bytes(self) -> int:
        return 0 if self.live is not None else sum(t.nbytes for t in self.tensors.values())

    def write(self, name: str, offset: int, data: pa.Buffer | memoryview, crc: int | None) -> None:
        """Check and stage one chunk (crc None: a body without checksums, PUT .../weights)."""
        spec = self.declared.get(name)
        if spec is None:
            raise PushRefused("unknown_tensor", f"tensor {clip(name, 200)!r} was not declared in this push's header",
                              tensor=clip(name, 200))
        size, item = (data.size if isinstance(data, pa.Buffer) else data.nbytes), spec.dtype.itemsize
        if offset < 0 or offset % item or size % item or offset + size > spec.nbytes:
            raise PushRefused("offset", f"tensor {name!r}: chunk at byte {offset} of {size} bytes is not a whole "
                              f"number of {dtype_name(spec.dtype)} elements inside its {spec.nbytes} bytes",
                              tensor=name)
        if crc is not None and (got := crc32c.crc32c(data)) != crc:
            raise PushRefused("checksum", f"tensor {name!r}: chunk at byte {offset} has crc32c {got:08x}, "
                              f"the chunk says {crc:08x}", tensor=name)
        ranges = self.ranges[name]
        i = bisect.bisect_right(ranges, (offset, offset + size))
        if size and ((i > 0 and ranges[i - 1][1] > offset) or (i < len(ranges) and ranges[i][0] < offset + size)):
            raise PushRefused("overlap", f"tensor {name!r}: chunk at byte {offset} of {size} bytes overlaps bytes "
                              "this push has already received", tensor=name)
        if name not in self.tensors:  # the staging allocation: a fresh copy, or (in-place) the served tensor
            t = torch.empty(spec.shape, dtype=spec.dtype) if self.live is None else self.live[name]
            self.tensors[name] = t
            on_cpu = t.device.type == "cpu"
            self.flat[name] = t.view(-1).view(torch.uint8).numpy() if t.numel() and on_cpu else np.empty(0, np.uint8)
        target = self.tensors[name]
        self.wrote = self.wrote or size > 0
        if target.device.type == "cpu":
            self.flat[name][offset:offset + size] = np.frombuffer(data, dtype=np.uint8)
            values = target.view(-1)[offset // item:(offset + size) // item]
        else:  # an in-place push into an accelerator's tensor: through one chunk-sized host buffer
            bounce = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
            target.view(-1).view(torch.uint8)[offset:offset + size].copy_(bounce)
            values = bounce.view(spec.dtype)
        if spec.dtype.is_floating_point and size:
            if not _all_finite(values):
                raise PushRefused("non_finite", f"tensor {name!r}: chunk at byte {offset} holds NaN or infinite "
                                  "values", tensor=name)
        ranges.insert(i, (offset, offset + size))
        if i + 1 < len(ranges) and ranges[i][1] == ranges[i + 1][0]:
            ranges[i:i + 2] = [(ranges[i][0], ranges[i + 1][1])]
        if i > 0 and ranges[i - 1][1] == ranges[i][0]:
            ranges[i - 1:i + 1] = [(ranges[i - 1][0], ranges[i][1])]
        self.stats.received_bytes += size
        self.touched = time.monotonic()

    def missing(self) -> list[str]:
        """Declared keys not yet received whole."""
        out = []
        for name, spec in self.declared.items():
            r = self.ranges[name]
            if spec.nbytes and r != [(0, spec.nbytes)]:
                out.append(name)
        return out

    def staged(self) -> dict[str, torch.Tensor]:
        return {name: self.tensors.get(name, torch.empty(spec.shape, dtype=spec.dtype))
                for name, spec in self.declared.items()}

    def status(self) -> dict[str, Any]:
        return {"push_id": self.push_id, "model": self.model_id,
                "received": {k: [list(r) for r in v] for k, v in self.ranges.items() if v},
                "received_bytes": self.stats.received_bytes, "declared_bytes": self.stats.declared_bytes}


def _all_finite(values: torch.Tensor) -> bool:
    """No NaN or infinity among `values` (a CPU tensor). numpy's isfinite is SIMD and one thread
    (torch.isfinite is far slower here); bfloat16 and float8, which numpy lacks, by min and max
    (both NaN when any value is)."""
    if values.dtype in (torch.float32, torch.float64, torch.float16):
        return bool(np.isfinite(values.numpy()).all())
    lo, hi = torch.aminmax(values if values.dtype.itemsize > 1 else values.float())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
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
    return header


def _declared(header: dict[str, Any], specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
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


class WeightsPushes:
    """The pushes under way on one Flight server, by push id; at most one per model.

    A second push to a model while one is under way (streaming, or cut and waiting to be resumed)
    is refused at once with reason "push_in_progress"; it can go once the first commits, fails or
    expires. A push that no stream has fed for `expire_s` seconds is dropped (`sweep`)."""

    def __init__(self, sink: WeightsSink, *, expire_s: float = 300.0) -> None:
        self.sink = sink
        self.expire_s = float(expire_s)
        self._lock = threading.Lock()
        self._pushes: dict[str, _Staging] = {}
        self._by_model: dict[str, str] = {}
        self.pushed_bytes = 0
        self.push_seconds = 0.0
        self.commits = 0
        self.failures: dict[str, int] = {}
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None

    def start(self) -> WeightsPushes:
        """Drop expired pushes in the background (a thread waking every expire_s / 4, at most 5 s)."""
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="weights-push-sweeper", daemon=True)
            self._sweeper.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
            self._sweeper = None

    def _sweep_loop(self) -> None:
        while not self._closed.wait(min(self.expire_s / 4, 5.0)):
            self.sweep()

    # -- bookkeeping -------------------------------------------------------------------------
    def staged_bytes(self) -> int:
        with self._lock:
            return sum(s.staged_bytes for s in self._pushes.values())

    def active(self) -> int:
        with self._lock:
            return len(self._pushes)

    def _drop(self, staging: _Staging, reason: str | None) -> None:
        """Forget the push and free its staging; a failure's reason is counted once."""
        with self._lock:
            held = self._pushes.get(staging.push_id) is staging
            if held:
                del self._pushes[staging.push_id]
                self._by_model.pop(staging.model_id, None)
        if reason is not None and held:
            self._count(reason)
        staging.tensors.clear()
        staging.flat.clear()
        if held:
            self.sink.close_push(staging.model_id, wrote=staging.wrote, failed=reason)

    def sweep(self, now: float | None = None) -> int:
        """Drop the pushes idle for longer than expire_s (their stream is gone); how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [s for s in self._pushes.values() if now - s.touched > self.expire_s and not s.lock.locked()]
        for s in old:
            log.warning("weights push expired", extra={"model": s.model_id, "push_id": s.push_id,
                                                       "received_bytes": s.stats.received_bytes})
            self._drop(s, "expired")
        return len(old)

    def drop_idle(self, reason: str) -> int:
        """Drop every push no stream is feeding now (at shutdown: an in-place one stops holding its
        model); how many."""
        with self._lock:
            idle = [s for s in self._pushes.values() if not s.lock.locked()]
        for s in idle:
            self._drop(s, reason)
        return len(idle)

    def status(self, push_id: str) -> dict[str, Any]:
        with self._lock:
            staging = self._pushes.get(push_id)
        if staging is None:
            raise PushRefused("expired", f"no weights push {clip(push_id, 200)!r} under way (committed, failed or "
                              "expired)")
        return staging.status()

    def _open(self, header: dict[str, Any]) -> _Staging:
        self.sweep()
        model_id, push_id = header["model"], header["push_id"]
        with self._lock:
            staging = self._pushes.get(push_id)
            other = self._by_model.get(model_id)
        if staging is not None:
            if staging.model_id != model_id or staging.header != header:
                raise PushRefused("bad_header", f"push {push_id!r} is under way with another header; resume it "
                                  "with the same header or start a new push id")
            return staging
        specs = self.sink.tensor_specs(model_id)
        declared = _declared(header, specs)
        fresh = _Staging(push_id, model_id, header, declared, sum(s.nbytes for s in specs.values()))
        fresh.lock.acquire()  # not swept while the sink opens it (an in-place one waits for the running batch)
        with self._lock:
            other = self._by_model.get(model_id)
            if other is None:
                self._pushes[push_id] = fresh
                self._by_model[model_id] = push_id
        if other is not None:
            fresh.lock.release()
            raise PushRefused("push_in_progress", f"another weights push ({clip(other, 100)!r}) to model "
                              f"{model_id!r} is under way; retry once it commits, fails or expires "
                              f"(after {self.expire_s:g} s without data)")
        try:
            fresh.live = self.sink.open_push(model_id, full=len(declared) == len(specs),
                                             base_digest=fresh.base_digest)
        except BaseException:
            with self._lock:
                del self._pushes[push_id]
                self._by_model.pop(model_id, None)
            raise
        finally:
            fresh.touched = time.monotonic()
            fresh.lock.release()
        return fresh

    # -- one body, not resumable (PUT .../weights): begin, write..., commit, or abort ------------
    def begin(self, header: dict[str, Any]) -> _Staging:
        """A push from a header (as do_put's); PushRefused (counted) when it cannot start."""
        try:
            return self._open(header)
        except PushRefused as exc:
            self._count(exc.reason)
            raise

    def write(self, staging: _Staging, name: str, offset: int, data: memoryview) -> None:
        """Stage one piece (whole elements); PushRefused as for a chunk (the caller aborts)."""
        staging.write(name, offset, data, None)
        with self._lock:
            self.pushed_bytes += data.nbytes

    def commit(self, staging: _Staging) -> dict[str, Any]:
        """Swap the staged tensors in (every declared one whole) and drop the push; PushRefused
        ("incomplete", or the sink's) drops it too."""
        try:
            missing = staging.missing()
            if missing:
                raise PushRefused("incomplete", f"the body ended with {len(missing)} tensor(s) not received whole, "
                                  f"first {missing[0]!r}", tensor=missing[0])
            answer = self.sink.commit(staging.model_id, staging.staged(), partial=staging.partial,
                                      base_digest=staging.base_digest, stats=staging.stats)
        except PushRefused as exc:
            self._drop(staging, exc.reason)
            raise
        except BaseException:
            self._drop(staging, "commit_failed")
            raise
        with self._lock:
            self.commits += 1
            self.push_seconds += time.monotonic() - staging.stats.started
        self._drop(staging, None)
        return answer

    def abort(self, staging: _Staging, reason: str) -> None:
        self._drop(staging, reason)

    # -- the stream --------------------------------------------------------------------------
    def receive(self, descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
                writer: flight.FlightMetadataWriter) -> None:
        """The do_put body: stage every chunk, commit at the end, answer the commit as metadata."""
        try:
            if descriptor.descriptor_type != flight.DescriptorType.CMD:
                raise PushRefused("bad_header", "a weights push needs a CMD descriptor holding its JSON header")
            header = _parse_header(descriptor.command)
            staging = self._open(header)
        except PushRefused as exc:
            self._count(exc.reason)
            raise self._error(exc) from None
        if not staging.lock.acquire(timeout=30):
            self._count("push_in_progress")
            raise self._error(PushRefused("push_in_progress", f"push {staging.push_id!r} is being fed by another "
                                          "stream"), staging.push_id)
        try:
            self._feed(staging, reader)
            missing = staging.missing()
            if missing:  # an early end: keep what arrived for a resume
                staging.touched = time.monotonic()
                raise PushRefused("incomplete", f"the stream ended with {len(missing)} tensor(s) not received whole, "
                                  f"first {missing[0]!r}; resume push {staging.push_id!r} with the rest",
                                  tensor=missing[0])
            answer = self.sink.commit(staging.model_id, staging.staged(), partial=staging.partial,
                                      base_digest=staging.base_digest, stats=staging.stats)
        except PushRefused as exc:
            if exc.reason == "incomplete":
                self._count(exc.reason)
            else:
                self._drop(staging, exc.reason)
            raise self._error(exc, staging.push_id) from None
        except pa.ArrowException:  # the stream broke (client gone): keep what arrived for a resume
            self._count("cut")
            raise
        except BaseException:
            self._drop(staging, "commit_failed")
            raise
        finally:
            staging.touched = time.monotonic()
            staging.lock.release()
        seconds = time.monotonic() - staging.stats.started
        with self._lock:
            self.commits += 1
            self.push_seconds += seconds
        self._drop(staging, None)
        writer.write(pa.py_buffer(json.dumps({**answer, "push_id": staging.push_id}).encode()))

    def _feed(self, staging: _Staging, reader: flight.MetadataRecordBatchReader) -> None:
        got = [(f.name, f.type) for f in reader.schema]
        if got != [(f.name, f.type) for f in SCHEMA]:
            raise PushRefused("bad_chunk", "the stream's schema is not the weights chunk schema "
                              f"{[(f.name, str(f.type)) for f in SCHEMA]}")
        for batch in _batches(reader):
            names, offsets, data, crcs = batch.columns
            for i in range(batch.num_rows):
                buf = data[i].as_buffer()
                if buf is None:
                    raise PushRefused("bad_chunk", "a chunk with null data")
                staging.write(names[i].as_py(), offsets[i].as_py(), buf, crcs[i].as_py())
                with self._lock:
                    self.pushed_bytes += buf.size

    def _count(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1

    @staticmethod
    def _error(exc: PushRefused, push_id: str | None = None) -> flight.FlightError:
        """The typed Flight error: "conflict" for a push that must wait its turn or a stale base,
        "not_found" for an unknown model, "bad_weights" for everything wrong with the push itself."""
        log.warning("weights push refused", extra={"reason": exc.reason, "tensor": exc.tensor, "push_id": push_id,
                                                   "error": exc.message})
        type_ = {"push_in_progress": "conflict", "stale_base": "conflict", "model_failed": "conflict",
                 "unknown_model": "not_found",
                 "expired": "not_found"}.get(exc.reason, "bad_weights")
        return flight_error(type_, exc.message, reason=exc.reason, tensor=exc.tensor, push_id=push_id)


def _batches(reader: flight.MetadataRecordBatchReader) -> Iterator[pa.RecordBatch]:
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return
        if chunk.data is None:
            continue
        yield chunk.data
