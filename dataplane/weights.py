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

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
from sigmaflight.dataplane.errors import clip, flight_error
from sigmaflight.dataplane.weights_staging import Staging
from sigmaflight.dataplane.weights_wire import (
    HEADER_KEY,
    SCHEMA,
    WEIGHTS_STATUS_ACTION,
    PushRefused,
    PushStats,
    TensorSpec,
    WeightsSink,
    chunk_batch,
    declared_tensors,
    dtype_name,
    parse_dtype,
    parse_header,
)

log = logging.getLogger("sigmaflight.weights")

__all__ = [
    "HEADER_KEY", "SCHEMA", "WEIGHTS_STATUS_ACTION", "PushRefused", "PushStats", "TensorSpec", "WeightsPushes",
    "WeightsSink", "chunk_batch", "dtype_name", "parse_dtype",
]


class WeightsPushes:
    """The pushes under way on one Flight server, by push id; at most one per model.

    A second push to a model while one is under way (streaming, or cut and waiting to be resumed)
    is refused at once with reason "push_in_progress"; it can go once the first commits, fails or
    expires. A push that no stream has fed for `expire_s` seconds is dropped (`sweep`)."""

    def __init__(self, sink: WeightsSink, *, expire_s: float = 300.0) -> None:
        self.sink = sink
        self.expire_s = float(expire_s)
        self._lock = threading.Lock()
        self._pushes: dict[str, Staging] = {}
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

    def _drop(self, staging: Staging, reason: str | None) -> None:
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
        """Drop the pushes that received nothing for longer than expire_s, whether their stream is
        gone or still open and silent (it is refused "expired" if it sends again); how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [s for s in self._pushes.values() if now - s.touched > self.expire_s]
        dropped = [s for s in old if self._mark_dropped(s, f"weights push {s.push_id!r} expired: nothing arrived for "
                                                           f"{self.expire_s:g} s (--weights-push-timeout-s); its "
                                                           "staging was freed, start the push again",
                                                        idle_s=self.expire_s)]
        for s in dropped:
            log.warning("weights push expired", extra={"model": s.model_id, "push_id": s.push_id,
                                                       "received_bytes": s.stats.received_bytes})
            self._drop(s, "expired")
        return len(dropped)

    def drop_idle(self, reason: str) -> int:
        """Drop every push not opening, writing a chunk or committing now (at shutdown: an in-place
        one stops holding its model); how many."""
        with self._lock:
            pushes = list(self._pushes.values())
        idle = [s for s in pushes if self._mark_dropped(s, f"weights push {s.push_id!r} dropped: {reason}")]
        for s in idle:
            self._drop(s, reason)
        return len(idle)

    @staticmethod
    def _mark_dropped(staging: Staging, why: str, idle_s: float | None = None) -> bool:
        """Mark a push dropped unless it is busy (opening, a chunk landing, committing) or, with
        `idle_s`, received something within idle_s seconds; a stream that still holds it is refused
        from its next chunk on."""
        if not staging.busy.acquire(blocking=False):
            return False
        try:
            if staging.dropped is not None or (idle_s is not None and time.monotonic() - staging.touched <= idle_s):
                return False
            staging.dropped = why
            return True
        finally:
            staging.busy.release()

    def status(self, push_id: str) -> dict[str, Any]:
        with self._lock:
            staging = self._pushes.get(push_id)
        if staging is None:
            raise PushRefused("expired", f"no weights push {clip(push_id, 200)!r} under way (committed, failed or "
                              "expired)")
        return staging.status()

    def _open(self, header: dict[str, Any]) -> Staging:
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
        declared = declared_tensors(header, specs)
        fresh = Staging(push_id, model_id, header, declared, sum(s.nbytes for s in specs.values()))
        fresh.busy.acquire()  # not swept while the sink opens it (an in-place one waits for the running batch)
        with self._lock:
            other = self._by_model.get(model_id)
            if other is None:
                self._pushes[push_id] = fresh
                self._by_model[model_id] = push_id
        if other is not None:
            fresh.busy.release()
            raise PushRefused("push_in_progress", f"another weights push ({clip(other, 100)!r}) to model "
                              f"{model_id!r} is under way; retry once it commits, fails or expires "
                              f"(after {self.expire_s:g} s without data)", in_progress=other)
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
            fresh.busy.release()
        return fresh

    # -- one body, not resumable (PUT .../weights): begin, write..., commit, or abort ------------
    def begin(self, header: dict[str, Any]) -> Staging:
        """A push from a header (as do_put's); PushRefused (counted) when it cannot start."""
        try:
            return self._open(header)
        except PushRefused as exc:
            self._count(exc.reason)
            raise

    def write(self, staging: Staging, name: str, offset: int, data: memoryview) -> None:
        """Stage one piece (whole elements); PushRefused as for a chunk (the caller aborts)."""
        staging.write(name, offset, data, None)
        with self._lock:
            self.pushed_bytes += data.nbytes

    def commit(self, staging: Staging) -> dict[str, Any]:
        """Swap the staged tensors in (every declared one whole) and drop the push; PushRefused
        ("incomplete", or the sink's) drops it too."""
        try:
            missing = staging.missing()
            if missing:
                raise PushRefused("incomplete", f"the body ended with {len(missing)} tensor(s) not received whole, "
                                  f"first {missing[0]!r}", tensor=missing[0])
            answer = self._commit(staging)
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

    def abort(self, staging: Staging, reason: str) -> None:
        self._drop(staging, reason)

    # -- the stream --------------------------------------------------------------------------
    def receive(self, descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
                writer: flight.FlightMetadataWriter) -> None:
        """The do_put body: stage every chunk, commit at the end, answer the commit as metadata."""
        try:
            if descriptor.descriptor_type != flight.DescriptorType.CMD:
                raise PushRefused("bad_header", "a weights push needs a CMD descriptor holding its JSON header")
            header = parse_header(descriptor.command)
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
            with staging.busy:
                staging.check_live()  # the stream ended after the push expired
            missing = staging.missing()
            if missing:  # an early end: keep what arrived for a resume
                staging.touched = time.monotonic()
                raise PushRefused("incomplete", f"the stream ended with {len(missing)} tensor(s) not received whole, "
                                  f"first {missing[0]!r}; resume push {staging.push_id!r} with the rest",
                                  tensor=missing[0])
            answer = self._commit(staging)
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

    def _commit(self, staging: Staging) -> dict[str, Any]:
        """The sink's commit of a push that has not expired (not swept while it commits)."""
        with staging.busy:
            staging.check_live()
            return self.sink.commit(staging.model_id, staging.staged(), partial=staging.partial,
                                    base_digest=staging.base_digest, stats=staging.stats)

    def _feed(self, staging: Staging, reader: flight.MetadataRecordBatchReader) -> None:
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
        "not_found" for an unknown model, "bad_weights" for everything wrong with the push itself
        (a stream that sends again after its push expired too)."""
        log.warning("weights push refused", extra={"reason": exc.reason, "tensor": exc.tensor, "push_id": push_id,
                                                   "error": exc.message})
        type_ = {"push_in_progress": "conflict", "stale_base": "conflict", "model_failed": "conflict",
                 "unknown_model": "not_found"}.get(exc.reason, "bad_weights")
        extra = {"in_progress": exc.in_progress} if exc.in_progress is not None else {}
        return flight_error(type_, exc.message, reason=exc.reason, tensor=exc.tensor, push_id=push_id, **extra)


def _batches(reader: flight.MetadataRecordBatchReader) -> Iterator[pa.RecordBatch]:
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return
        if chunk.data is None:
            continue
        yield chunk.data
