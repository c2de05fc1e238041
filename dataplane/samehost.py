"""Same-host reads: a trajectory file in the server's ``--shm-dir``, read straight into tensors.

A finished rollout kept in ``--shm-dir`` is one Arrow IPC file; its FlightInfo endpoint lists
``file://<path>?host=<host id>`` after the grpc location. A client on the same host (same host
id) maps the file (zero-copy views for ``iter_chunks`` / ``iter_steps``) and ``pull`` copies the
latents out of it with ``preadv`` (the kernel copies; no page faults on the mapping) into a
tensor whose pages were asked to be huge (``empty_hugepages``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch
from sigmaflight.dataplane.durable import FOOTER_TICKET
from sigmaflight.dataplane.files import map_trajectory
from sigmaflight.dataplane.shm import parse_file_location

log = logging.getLogger("sigmaflight.dataplane.client")  # one logger for the client's "why not the file" lines
Transport = Literal["auto", "flight"]


def check_transport(transport: str) -> Transport:
    """``transport`` itself when it is "auto" or "flight"; ValueError naming it otherwise. The
    one check for every client (TrajectoryClient, sigmaflight.Client)."""
    if transport not in ("auto", "flight"):
        raise ValueError(f"transport must be 'auto' or 'flight', got {transport!r}")
    return transport  # type: ignore[return-value]


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


def open_local_file(fi: flight.FlightInfo, host: str, name: str) -> LocalFile | None:
    """The file of ``fi``'s first endpoint when it names this ``host`` and holds that endpoint's
    trajectory (its ticket in the footer, the same schema); else None, the debug log saying why.
    ``name``: what the caller asked for (for the log)."""
    ep = fi.endpoints[0]
    files = [f for f in (parse_file_location(loc.uri.decode()) for loc in ep.locations) if f is not None]
    if not files:
        log.debug("%s: no file location (not finished, or the server has no --shm-dir)", name[:80])
        return None
    path, file_host = files[0]
    if file_host != host:
        log.debug("%s: file %s is on host %s, not this host %s; streaming over gRPC", name[:80], path, file_host, host)
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
