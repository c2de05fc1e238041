"""Trainer client: pull a rollout over Flight (or read a file) into torch tensors.

On the server's host, a finished rollout kept in ``--shm-dir`` is read straight from its
shared-memory file (the ``file://...?host=`` location of its FlightInfo endpoint):
``pull`` makes one copy into aligned tensors, ``iter_chunks`` / ``iter_steps`` give
zero-copy views over the mapped file. Anything else (another host, an unreadable file, a
running rollout, ``transport="flight"``) goes over gRPC; the debug log says why.

    from sigmaflight.dataplane.client import TrajectoryClient
    with TrajectoryClient("grpc+tcp://127.0.0.1:8815", token="...") as c:
        traj = c.pull(ticket_or_rollout_id)          # everything, one copy, aligned
        for i, x, x_next, s, s_next, lp in traj.transitions():
            ...
        for st in c.iter_steps(ticket):               # one step at a time, flat memory
            st.step, st.latent                        # [B, *latent_shape]
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch
from sigmaflight.dataplane.codec import StepTensors, batch_to_tensors
from sigmaflight.dataplane.durable import FOOTER_TICKET
from sigmaflight.dataplane.files import map_trajectory, read_trajectory
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.schema import header_from_schema, schema_metadata
from sigmaflight.dataplane.server import DESCRIPTOR_ROOT
from sigmaflight.dataplane.shm import host_id, parse_file_location

log = logging.getLogger(__name__)
Transport = Literal["auto", "flight"]


@dataclass(frozen=True)
class Transition:
    """Transition i: x_i -> x_{i+1} (aligned by absolute index)."""

    i: int
    x: torch.Tensor
    """[B, *latent_shape]: x_i."""
    x_next: torch.Tensor
    """[B, *latent_shape]: x_{i+1}."""
    sigma: float
    sigma_next: float
    log_prob: torch.Tensor
    """float32 [B], NaN where null."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.i, self.x, self.x_next, self.sigma, self.sigma_next, self.log_prob))


class Trajectory:
    """A whole rollout as torch tensors, aligned by ABSOLUTE step index.

    ``latents[:, k]`` is x_{steps[k]}; use ``latent(i)`` to look up by absolute index.
    sigmas / timesteps are the full schedule (never filtered by a step selection).
    """

    def __init__(
        self,
        header: TrajectoryHeader,
        latents: torch.Tensor,
        log_probs: torch.Tensor,
        metadata: dict[str, Any],
        schema: pa.Schema,
    ) -> None:
        self.header = header
        self.latents = latents  # [B, K, *latent_shape]
        self.log_probs = log_probs  # [B, T] float32, NaN where null
        self.steps = torch.tensor(header.steps, dtype=torch.int64)  # [K]
        self.sigmas = header.sigmas  # [T+1] float32
        self.timesteps = header.timesteps  # [T] float32
        self.seeds = torch.tensor(header.seeds, dtype=torch.int64)  # [B]
        self.prompt_index = torch.tensor(header.prompt_indices(), dtype=torch.int64)  # [B] (a branch: the parent's)
        self.parent_sample = (None if header.parent_sample is None  # [B]: branch rollouts only
                              else torch.tensor(header.parent_sample, dtype=torch.int64))
        self.sde_steps = tuple(header.sde_steps)
        self.metadata = metadata  # the sigmaflight.rollout object
        self.schema = schema
        self._pos = {s: k for k, s in enumerate(header.steps)}

    @property
    def rollout_id(self) -> str:
        return self.header.rollout_id

    @property
    def num_steps(self) -> int:
        """T."""
        return self.header.num_steps

    @property
    def num_samples(self) -> int:
        """B."""
        return self.header.num_samples

    def __repr__(self) -> str:
        return (
            f"Trajectory(id={self.rollout_id!r}, B={self.num_samples}, T={self.num_steps}, "
            f"steps={list(self.header.steps)}, latents={list(self.latents.shape)} {self.latents.dtype})"
        )

    def has_step(self, i: int) -> bool:
        return i in self._pos

    def latent(self, i: int) -> torch.Tensor:
        """x_i for every sample, [B, *latent_shape], by absolute step index."""
        if i not in self._pos:
            raise KeyError(f"step {i} is not in this trajectory (steps {list(self.header.steps)})")
        return self.latents[:, self._pos[i]]

    def transitions(self, steps: Iterable[int] | None = None) -> Iterator[Transition]:
        """Transitions i (x_i -> x_{i+1}) where both latents are present, ascending."""
        wanted = range(self.num_steps) if steps is None else sorted(set(steps))
        for i in wanted:
            if 0 <= i < self.num_steps and i in self._pos and i + 1 in self._pos:
                yield Transition(
                    i=i,
                    x=self.latent(i),
                    x_next=self.latent(i + 1),
                    sigma=float(self.sigmas[i]),
                    sigma_next=float(self.sigmas[i + 1]),
                    log_prob=self.log_probs[:, i],
                )

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_batches(
        cls,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        *,
        source: FileSource | None = None,
        out: torch.Tensor | None = None,
    ) -> Trajectory:
        """Assemble (one copy per latent into one aligned, writable tensor). With ``source``
        (the batches' memory-mapped file), latents are read from the file straight into the
        tensor (preadv: the kernel copies, no page faults on the mapping). ``out``: a
        contiguous CPU tensor [B, K, *latent_shape] of the rollout's dtype to fill instead of
        a fresh one (a warm buffer reused across pulls costs no page faults)."""
        header = header_from_schema(schema)
        b, t = header.num_samples, header.num_steps
        pos = {s: k for k, s in enumerate(header.steps)}
        shape = (b, len(header.steps), *header.latent_shape)
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != header.latent_dtype:
                raise ValueError(
                    f"out must be {header.latent_dtype} {list(shape)} for rollout {header.rollout_id}, "
                    f"got {out.dtype} {list(out.shape)}"
                )
            if out.device.type != "cpu" or not out.is_contiguous():
                raise ValueError("out must be a contiguous CPU tensor")
        latents = out if out is not None else empty_hugepages(shape, header.latent_dtype)
        log_probs = torch.full((b, t), float("nan"), dtype=torch.float32)
        seen = torch.zeros((b, len(header.steps)), dtype=torch.bool)
        with source.reads() if source is not None else contextlib.nullcontext() as reads:
            pending: list[tuple[Future[bool], torch.Tensor, torch.Tensor]] = []  # read, dest, fallback
            for batch in batches:
                st = batch_to_tensors(batch, dtype=header.latent_dtype)
                k = pos.get(st.step)
                if k is None:
                    raise ValueError(f"stream holds step {st.step}, not listed in sigmaflight.steps")
                idx = _rows(st.sample)
                if reads is not None and isinstance(idx, slice):  # the kernel copies, on the pool
                    dest = latents[idx, k]
                    pending.append((reads.submit(batch, dest), dest, st.latent))
                else:
                    latents[idx, k] = st.latent
                seen[idx, k] = True
                if st.step < t:
                    log_probs[idx, st.step] = st.log_prob
            for done, dest, fallback in pending:
                if not done.result():
                    dest.copy_(fallback)
        if not bool(seen.all()):
            missing = sorted({header.steps[int(k)] for k in torch.nonzero(~seen)[:, 1]})
            raise ValueError(f"trajectory {header.rollout_id} is incomplete: steps {missing} missing")
        return cls(header, latents, log_probs, dict(schema_metadata(schema).get("sigmaflight.rollout", {})), schema)

    @classmethod
    def from_reader(cls, reader: pa.RecordBatchReader | flight.FlightStreamReader) -> Trajectory:
        if isinstance(reader, flight.FlightStreamReader):
            return cls.from_batches(reader.schema, _flight_batches(reader))
        return cls.from_batches(reader.schema, reader)

    @classmethod
    def from_table(cls, table: pa.Table) -> Trajectory:
        return cls.from_batches(table.schema, table.to_batches())

    @classmethod
    def from_file(cls, path: str | Path) -> Trajectory:
        schema, batches, _ = read_trajectory(path)
        return cls.from_batches(schema, batches)


_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def empty_hugepages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, with the kernel asked for transparent huge pages before the first touch.

    A fresh multi-GiB tensor costs more in 4 KiB page faults than the copy into it (measured
    here: 0.9 GB/s into fresh memory against 3.3 GB/s with huge pages, 5 GB/s into warm
    memory); MADV_HUGEPAGE makes it one fault per 2 MiB. Linux only; elsewhere a no-op."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes >= 4 * _HUGE and _libc is not None:
        lo = -(-t.data_ptr() // _HUGE) * _HUGE
        hi = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        if hi > lo:
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
    return t


def _load_libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


class LocalFile(NamedTuple):
    schema: pa.Schema
    batches: list[pa.RecordBatch]
    """Memory-mapped: zero-copy views for iter_chunks / iter_steps."""
    source: FileSource
    """The same file, for pull's one copy (preadv)."""


class FileSource:
    """A memory-mapped trajectory file, read with preadv into tensors (one copy by the kernel).

    Reads run on a small thread pool (preadv releases the GIL): on this 2-core box one thread
    copies out of tmpfs at about 4.4 GB/s into a warm buffer and two at about 11 GB/s; into
    fresh (huge-page) memory, where the kernel also zeroes each page, 3.4 against 7.6 GB/s
    (/tmp micro-benchmarks, 1 GiB, 2026-12-01; the figures of record are ops/bench_transport.py's)."""

    _IOV_MAX = 1024

    def __init__(self, path: Path, base_address: int, size: int) -> None:
        self.path = path
        self._base = base_address
        self._size = size

    def read_latents(self, batch: pa.RecordBatch, dest: torch.Tensor) -> bool:
        """Copy the batch's latent rows into ``dest`` [rows, *shape] (each row contiguous).
        False (nothing trusted) if the batch is not in this file or a read comes up short."""
        with self.reads() as reads:
            return reads.submit(batch, dest).result()

    def reads(self) -> _Reads:
        """Parallel `read_latents` on one descriptor: ``with src.reads() as r: r.submit(b, d)``."""
        return _Reads(self)

    def read(self, fd: int, batch: pa.RecordBatch, dest: torch.Tensor) -> bool:
        storage = batch.column("latent").storage
        values = storage.values
        n = int(np.prod(dest.shape[1:]))
        row = n * dest.element_size()
        off = values.buffers()[1].address - self._base + (values.offset + storage.offset * n) * dest.element_size()
        if len(dest) != len(storage) or off < 0 or off + row * len(dest) > self._size:
            return False
        views = [dest[j].view(-1).view(torch.uint8).numpy().data for j in range(len(dest))]  # views, never copies
        for a in range(0, len(views), self._IOV_MAX):
            chunk = views[a : a + self._IOV_MAX]
            if os.preadv(fd, chunk, off + a * row) != row * len(chunk):
                return False
        return True


class _Reads:
    """An open descriptor and the reads submitted on it; leaving waits for every read (even on
    an error) before the descriptor is closed, so no read can land on a reused fd number."""

    def __init__(self, source: FileSource) -> None:
        self._source = source
        self._futures: list[Future[bool]] = []
        try:
            self._fd: int | None = os.open(source.path, os.O_RDONLY)
        except OSError as e:  # deleted or replaced since it was mapped: copy from the mapping
            log.debug("cannot reopen %s (%s); copying from the mapped file", source.path, e)
            self._fd = None

    def submit(self, batch: pa.RecordBatch, dest: torch.Tensor) -> Future[bool]:
        done: Future[bool]
        if self._fd is None:
            done = Future()
            done.set_result(False)
        else:
            done = _reader_pool().submit(self._read, self._fd, batch, dest)
        self._futures.append(done)
        return done

    def _read(self, fd: int, batch: pa.RecordBatch, dest: torch.Tensor) -> bool:
        try:
            return self._source.read(fd, batch, dest)
        except OSError as e:
            log.debug("reading %s failed (%s); copying from the mapped file", self._source.path, e)
            return False

    def __enter__(self) -> _Reads:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            wait(self._futures)
        finally:
            if self._fd is not None:
                os.close(self._fd)


def _read_threads() -> int:
    """Threads for pull's file reads: the CPUs this process may use, at most 8 (memory
    bandwidth, not CPU, is the limit past a few)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_read_threads(), thread_name_prefix="sigmaflight-read")
        return _pool


def _rows(sample: torch.Tensor) -> slice | torch.Tensor:
    """A slice when the batch holds a contiguous run of samples (always, as the server writes
    them): a strided copy instead of an index_put."""
    n = len(sample)
    if n and int(sample[-1]) - int(sample[0]) == n - 1 and bool((sample[1:] > sample[:-1]).all()):
        return slice(int(sample[0]), int(sample[0]) + n)
    return sample


def _flight_batches(reader: flight.FlightStreamReader) -> Iterator[pa.RecordBatch]:
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return
        yield chunk.data


def iter_step_tensors(
    schema: pa.Schema, batches: Iterable[pa.RecordBatch], *, copy: bool = False
) -> Iterator[StepTensors]:
    """Group batches by step: one StepTensors with all B samples per step. A step in one
    batch is a zero-copy view (unless ``copy``); a split step is concatenated (one copy)."""
    dtype = header_from_schema(schema).latent_dtype
    pending: list[StepTensors] = []
    for batch in batches:
        st = batch_to_tensors(batch, copy=copy, dtype=dtype)
        if pending and pending[0].step != st.step:
            yield _merge(pending)
            pending = []
        pending.append(st)
    if pending:
        yield _merge(pending)


def _merge(parts: Sequence[StepTensors]) -> StepTensors:
    if len(parts) == 1:
        return parts[0]
    p = parts[0]
    return StepTensors(
        step=p.step,
        sample=torch.cat([q.sample for q in parts]),
        prompt_index=torch.cat([q.prompt_index for q in parts]),
        seed=torch.cat([q.seed for q in parts]),
        latent=torch.cat([q.latent for q in parts]),
        log_prob=torch.cat([q.log_prob for q in parts]),
        sigma=p.sigma,
        sigma_next=p.sigma_next,
        timestep=p.timestep,
        sde=p.sde,
    )


class TrajectoryClient:
    """One FlightClient (one connection) for many pulls."""

    def __init__(
        self,
        location: str | tuple[str, int] | flight.Location,
        *,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
        generic_options: list[tuple[str, Any]] | None = None,
        transport: Transport = "auto",
        host: str | None = None,
    ) -> None:
        """``transport="flight"`` always streams over gRPC; ``"auto"`` reads a finished
        rollout's shared-memory file when its location names this host (``host``: this
        host's id, default ``sigmaflight.dataplane.shm.host_id()``) and the file can be opened."""
        if transport not in ("auto", "flight"):
            raise ValueError(f"transport must be 'auto' or 'flight', got {transport!r}")
        self.transport = transport
        self.host = host if host is not None else host_id()
        self._client = flight.FlightClient(
            location, tls_root_certs=tls_root_certs, generic_options=generic_options or None
        )
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers)
        self._location = location
        self._token = token
        self._tls_root_certs = tls_root_certs

    @property
    def flight_client(self) -> flight.FlightClient:
        return self._client

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TrajectoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookups ---------------------------------------------------------------------------
    def flight_info(self, rollout_id: str, *, partitions: int = 1) -> flight.FlightInfo:
        if partitions == 1:
            d = flight.FlightDescriptor.for_path(DESCRIPTOR_ROOT, rollout_id)
        else:
            d = flight.FlightDescriptor.for_path(DESCRIPTOR_ROOT, rollout_id, "partitions", str(partitions))
        return self._client.get_flight_info(d, self._options)

    def info(self, rollout_id: str) -> dict[str, Any]:
        fi = self.flight_info(rollout_id)
        return {
            "id": rollout_id,
            "ticket": fi.endpoints[0].ticket.ticket.decode(),
            "locations": [loc.uri.decode() for loc in fi.endpoints[0].locations],
            "total_records": fi.total_records,
            "total_bytes": fi.total_bytes,
            "schema": fi.schema,
        }

    def _ticket(self, ticket_or_id: str | bytes | flight.Ticket) -> flight.Ticket:
        if isinstance(ticket_or_id, flight.Ticket):
            return ticket_or_id
        if isinstance(ticket_or_id, bytes):
            return flight.Ticket(ticket_or_id)
        return flight.Ticket(ticket_or_id.encode())  # the server looks up a ticket or a rollout id

    def _action(self, kind: str, rollout_id: str) -> dict[str, Any]:
        body = json.dumps({"id": rollout_id}).encode()
        results = list(self._client.do_action(flight.Action(kind, body), self._options))
        return json.loads(results[0].body.to_pybytes()) if results else {}

    def cancel(self, rollout_id: str) -> bool:
        return bool(self._action("cancel", rollout_id).get("cancelled"))

    def release(self, rollout_id: str) -> bool:
        return bool(self._action("release", rollout_id).get("released"))

    # -- pulls -----------------------------------------------------------------------------
    def reader(self, ticket_or_id: str | bytes | flight.Ticket) -> flight.FlightStreamReader:
        """The raw Flight stream (pyarrow), e.g. for ``Trajectory.from_reader``."""
        return self._client.do_get(self._ticket(ticket_or_id), self._options)

    def iter_batches(self, ticket_or_id: str | bytes | flight.Ticket) -> Iterator[pa.RecordBatch]:
        return _flight_batches(self.reader(ticket_or_id))

    def schema(self, ticket_or_id: str | bytes | flight.Ticket) -> pa.Schema:
        return self.reader(ticket_or_id).schema

    def local_file(self, ticket_or_id: str | bytes | flight.Ticket) -> LocalFile | None:
        """The rollout's shared-memory file (schema, memory-mapped batches) when this client
        may read it directly, else None (and the debug log says why)."""
        if self.transport == "flight":
            return None
        key = ticket_or_id.ticket if isinstance(ticket_or_id, flight.Ticket) else ticket_or_id
        name = key.decode("utf-8", errors="replace") if isinstance(key, bytes) else key
        try:
            fi = self.flight_info(name)
        except flight.FlightError as e:
            log.debug("%s: no FlightInfo (%s); streaming over gRPC", name[:80], str(e).splitlines()[0][:200])
            return None
        ep = fi.endpoints[0]
        files = [f for f in (parse_file_location(loc.uri.decode()) for loc in ep.locations) if f is not None]
        if not files:
            log.debug("%s: no file location (not finished, or the server has no --shm-dir)", name[:80])
            return None
        path, host = files[0]
        if host != self.host:
            log.debug("%s: file %s is on host %s, not this host %s; streaming over gRPC", name[:80], path, host, self.host)
            return None
        try:
            m = map_trajectory(path, validate=False)
        except (OSError, ValueError) as e:
            log.debug("%s: cannot read %s (%s); streaming over gRPC", name[:80], path, e)
            return None
        if m.footer.get(FOOTER_TICKET, "").encode() != ep.ticket.ticket or not m.schema.equals(fi.schema):
            log.debug("%s: %s holds another trajectory; streaming over gRPC", name[:80], path)
            return None
        return LocalFile(m.schema, m.batches, FileSource(path, m.base_address, m.size))

    def pull(self, ticket_or_id: str | bytes | flight.Ticket, *, out: torch.Tensor | None = None) -> Trajectory:
        """The whole rollout; waits for a running (or queued) one to finish, streaming as it goes.

        ``out``: fill this contiguous CPU tensor [B, K, *latent_shape] (the rollout's dtype)
        instead of allocating one; ``traj.latents`` is then ``out``. Reusing one warm buffer
        across pulls avoids the page faults of fresh memory (what dominates a same-host pull)."""
        local = self.local_file(ticket_or_id)
        if local is not None:
            return Trajectory.from_batches(local.schema, local.batches, source=local.source, out=out)
        reader = self.reader(ticket_or_id)
        return Trajectory.from_batches(reader.schema, _flight_batches(reader), out=out)

    def _batches(self, ticket_or_id: str | bytes | flight.Ticket) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        local = self.local_file(ticket_or_id)
        if local is not None:
            return local.schema, iter(local.batches)
        reader = self.reader(ticket_or_id)
        return reader.schema, _flight_batches(reader)

    def iter_steps(self, ticket_or_id: str | bytes | flight.Ticket, *, copy: bool = False) -> Iterator[StepTensors]:
        """One StepTensors per step, as the stream delivers it (memory stays flat).

        ``copy=False``: latents are read-only views of the received buffers or the mapped
        file (valid as long as you hold them); ``copy=True``: aligned, writable tensors."""
        schema, batches = self._batches(ticket_or_id)
        return iter_step_tensors(schema, batches, copy=copy)

    def iter_chunks(self, ticket_or_id: str | bytes | flight.Ticket, *, copy: bool = False) -> Iterator[StepTensors]:
        """One StepTensors per record batch (one step, a run of samples; see ``.sample``):
        zero-copy views of the received buffers or the mapped file, never concatenated. The
        fastest way through a stream whose steps are larger than one batch."""
        schema, batches = self._batches(ticket_or_id)
        dtype = header_from_schema(schema).latent_dtype
        for batch in batches:
            yield batch_to_tensors(batch, copy=copy, dtype=dtype)

    def iter_steps_parallel(
        self, rollout_id: str, *, streams: int = 4, copy: bool = False, prefetch: int = 8, merge_steps: bool = True
    ) -> Iterator[StepTensors]:
        """Like ``iter_steps`` but pulls ``streams`` endpoints concurrently (one
        connection each) and yields in stream order (batch j comes from endpoint
        j % streams). ``merge_steps=False`` yields one StepTensors per record batch, like
        ``iter_chunks``.

        Nothing starts before the first step is asked for. A consumer that stops early
        (``break``, ``close()``, or drops the iterator) cancels the streams, ends the pump
        threads and closes the extra connections: no stream slot stays held."""
        fi = self.flight_info(rollout_id, partitions=streams)
        ordered = self._parallel(fi, prefetch)
        if merge_steps:
            return iter_step_tensors(fi.schema, ordered, copy=copy)
        dtype = header_from_schema(fi.schema).latent_dtype
        return (batch_to_tensors(b, copy=copy, dtype=dtype) for b in ordered)

    def _parallel(self, fi: flight.FlightInfo, prefetch: int) -> Iterator[pa.RecordBatch]:
        """Every batch of ``fi``'s endpoints in stream order. A generator: nothing connects
        before the first next(); its finally stops the pumps and closes the extra clients."""
        extra: list[flight.FlightClient] = []
        try:
            extra = [flight.FlightClient(self._location, tls_root_certs=self._tls_root_certs) for _ in fi.endpoints[1:]]
            clients = [self._client, *extra]
            yield from _round_robin(
                [(c, ep.ticket) for c, ep in zip(clients, fi.endpoints, strict=True)], self._options, prefetch
            )
        finally:
            for c in extra:
                c.close()


def _round_robin(
    sources: list[tuple[flight.FlightClient, flight.Ticket]], options: flight.FlightCallOptions, prefetch: int
) -> Iterator[pa.RecordBatch]:
    """Pull every (client, ticket) concurrently, one thread each; yield batch j from source
    j % n (the partition tickets' order). On the way out (end, error or the consumer
    closing it) the streams are cancelled and the threads joined."""
    n = len(sources)
    queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=prefetch) for _ in range(n)]
    stop = threading.Event()
    readers: list[flight.FlightStreamReader | None] = [None] * n
    threads = [
        threading.Thread(target=_pump, args=(client, ticket, options, queues[k], stop, readers, k), daemon=True)
        for k, (client, ticket) in enumerate(sources)
    ]
    for t in threads:
        t.start()
    k = 0
    try:
        while True:
            item = queues[k].get()
            if item is _DONE:
                # batch j lives on source j % n: once one source ends, all later ones end
                for j in range(1, n):
                    if queues[(k + j) % n].get() is not _DONE:
                        raise RuntimeError("partitioned stream ended out of order")
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            k = (k + 1) % n
    finally:
        stop.set()
        for r in readers:
            if r is not None:
                try:
                    r.cancel()
                except (flight.FlightError, OSError):
                    pass
        for t in threads:
            t.join(timeout=5)


_DONE = object()


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put unless the consumer left (``stop``); False then."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _pump(
    client: flight.FlightClient,
    ticket: flight.Ticket,
    options: flight.FlightCallOptions,
    q: queue.Queue[Any],
    stop: threading.Event,
    readers: list[flight.FlightStreamReader | None],
    k: int,
) -> None:
    try:
        if stop.is_set():
            return
        reader = client.do_get(ticket, options)
        readers[k] = reader
        if stop.is_set():
            reader.cancel()
            return
        for b in _flight_batches(reader):
            if not _put(q, b, stop):
                return
        _put(q, _DONE, stop)
    except BaseException as e:  # handed to the consumer (unless it left)
        if not stop.is_set():
            _put(q, e, stop)


def pull_file(path: str | Path) -> Trajectory:
    """A ``.arrow`` trajectory file as a Trajectory (memory-mapped read, one copy)."""
    return Trajectory.from_file(path)


__all__ = ["StepTensors", "Trajectory", "TrajectoryClient", "Transition", "Transport", "iter_step_tensors", "pull_file"]
