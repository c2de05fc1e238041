"""Same-host reads: a trajectory file in the server's ``--shm-dir``, read straight into tensors.

A finished rollout kept in ``--shm-dir`` is one Arrow IPC file; its FlightInfo endpoint lists
``file://<path>?host=<host id>`` after the grpc location. A client on the same host (same host
id) opens the file once (``files.open_regular``: O_NONBLOCK | O_NOFOLLOW, S_ISREG checked on the
descriptor), maps that descriptor (zero-copy views for ``iter_chunks`` / ``iter_steps``) and
checks that it holds the endpoint's trajectory (its ticket in the footer, the same schema);
``pull`` then reads the latents from the same descriptor with a few ``preadv`` calls straight
into the ``[B, K, ...]`` tensor (the kernel copies; no page faults on the mapping).

``pull`` never reads the mapping itself: the columns it needs come with ``pread``, the latents
with ``preadv``, so a file truncated after the map is a short read there (``FileChanged``: the
pull streams over gRPC instead), never a SIGBUS. What a same-host read does not detect
(docs/dataplane.md): bytes changed in place after the server wrote them (unless
``verify=True``); the zero-copy views of ``iter_chunks`` / ``iter_steps`` ARE the mapping, and
a file truncated under them faults (SIGBUS) as for any memory-mapped reader.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import torch
from sigmaflight.dataplane.durable import FOOTER_TICKET
from sigmaflight.dataplane.files import KEY_CRC, CorruptTrajectoryFile, map_ipc, open_regular
from sigmaflight.dataplane.shm import parse_file_location

log = logging.getLogger("sigmaflight.dataplane.client")  # one logger for the client's "why not the file" lines
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def _load_libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
        lib.preadv.restype = ctypes.c_ssize_t
        return lib
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


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


class FileChanged(OSError):
    """A read of a checked file came up short (it was truncated meanwhile): read it over gRPC."""


class Offered(NamedTuple):
    """The file a finished rollout's FlightInfo endpoint offers, and what it must hold."""

    path: Path
    host: str
    ticket: bytes
    """The endpoint's ticket: the file's footer must carry it."""
    schema: pa.Schema


def offered_file(fi: flight.FlightInfo) -> Offered | None:
    """The ``file://`` location of ``fi``'s first endpoint, or None when it lists none."""
    ep = fi.endpoints[0]
    for loc in ep.locations:
        found = parse_file_location(loc.uri.decode())
        if found is not None:
            return Offered(found[0], found[1], ep.ticket.ticket, fi.schema)
    return None


_IOV_MAX = 1024
"""Most iovecs one preadv takes (Linux UIO_MAXIOV)."""
GAP_READ_MAX = 16 << 10
"""File bytes between two latent runs that one preadv reads into a scratch buffer rather than
starting another call: the other columns of the next batch and its message header (a few KiB
per batch); a ``velocity`` column in between starts a new call."""
THREADS_MIN_BYTES = 8 << 20
"""From this many bytes a read is split over threads (the CPUs this process may use, at most
8), below it one thread reads: see ``ops/bench_transport.py --paths read-threads``."""


class FileSource:
    """A checked trajectory file, open on one descriptor, that ``read_rows`` reads with preadv.

    The descriptor is the one ``open_regular`` checked and the mapping was made from: it stays
    the same file whatever is renamed onto the name. Closed by ``close()`` (or when dropped)."""

    def __init__(self, fd: int, path: Path, base_address: int, size: int, crcs: tuple[int, ...] | None) -> None:
        self.fd = fd
        self.path = path
        self.base_address = base_address
        self.size = size
        self.crcs = crcs
        self._closed = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._closed()

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_size(self) -> None:
        """FileChanged when the file is now shorter than what was mapped (truncated since)."""
        now = os.fstat(self.fd).st_size
        if now < self.size:
            raise FileChanged(f"{self.path}: {now} bytes now, {self.size} when mapped (truncated since it was checked)")

    def pread(self, offset: int, n: int) -> bytes:
        """``n`` bytes at file ``offset``, read from the descriptor (never through the mapping: a
        truncated file is a FileChanged here, where the mapping would fault with SIGBUS)."""
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{self.path}: bytes {offset}..{offset + n} outside the file ({self.size} bytes)")
        parts, got = [], 0
        while got < n:
            part = os.pread(self.fd, n - got, offset + got)
            if not part:
                raise FileChanged(f"{self.path}: ends before offset {offset + got} (truncated since it was checked)")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_columns(self, batches: list[pa.RecordBatch], columns: list[int], out: list[np.ndarray[Any, Any]]) -> None:
        """Columns ``columns`` (fixed-width numbers: int32, int64, float32) of the mapped
        ``batches``, concatenated into ``out`` (one numpy array per column, as many rows as the
        batches hold; a null is NaN), read with ``pread``: one call per batch, as those columns'
        buffers lie together in its body (a few KiB). Nothing of a pull reads the mapping itself."""
        base, r0 = self.base_address, 0
        for batch in batches:
            n = batch.num_rows
            if n == 0:
                continue
            cols = [batch.column(i) for i in columns]
            bufs = [c.buffers() for c in cols]
            lo = min(b.address for bs in bufs for b in bs if b is not None and b.size) - base
            hi = max(b.address + b.size for bs in bufs for b in bs if b is not None and b.size) - base
            region = np.frombuffer(self.pread(lo, hi - lo), np.uint8)
            for col, (validity, data), dst in zip(cols, bufs, out, strict=True):
                if col.null_count == n:
                    dst[r0 : r0 + n] = np.nan
                    continue
                start = data.address - base - lo + col.offset * dst.itemsize
                dst[r0 : r0 + n] = region[start : start + n * dst.itemsize].view(dst.dtype)
                if col.null_count:  # the validity bitmap, bit (offset + row), LSB first
                    at = validity.address - base - lo
                    bits = np.unpackbits(region[at : at + validity.size], bitorder="little")
                    dst[r0 : r0 + n][bits[col.offset : col.offset + n] == 0] = np.nan
            r0 += n

    def read_rows(self, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], row_bytes: int) -> None:
        """Copy ``row_bytes`` from file offset ``src[r]`` to address ``dst[r]``, for every r.

        Rows adjacent in the file and in memory merge into one iovec; small gaps between them
        are read into a scratch buffer, so a whole trajectory file is one preadv (or a handful:
        IOV_MAX, a wide gap); from THREADS_MIN_BYTES the calls are spread over threads.
        Raises FileChanged when the file no longer holds those bytes (a short read)."""
        if len(src) == 0:
            return
        order = np.argsort(src, kind="stable")
        src, dst = src[order], dst[order]
        if int(src[0]) < 0 or int(src[-1]) + row_bytes > self.size or bool((np.diff(src) < row_bytes).any()):
            raise ValueError(f"{self.path}: latent rows outside the file or overlapping")
        scratch = np.empty(GAP_READ_MAX, np.uint8)
        iov, offsets, pieces = _plan(src, dst, row_bytes, scratch.ctypes.data)
        total = int(iov[:, 1].sum())
        groups = _spread(pieces, iov, total)
        if len(groups) == 1:
            _read_pieces(self, iov, offsets, groups[0])
            return
        futures = [_reader_pool().submit(_read_pieces, self, iov, offsets, g) for g in groups[1:]]
        try:
            _read_pieces(self, iov, offsets, groups[0])
        finally:
            errors = [f.exception() for f in futures]  # every read has returned before the caller closes fd
        for e in errors:
            if e is not None:
                raise e


def _plan(
    src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], row_bytes: int, scratch: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], list[tuple[int, int]]]:
    """The iovecs ([n, 2] uint64: address, length), each one's file offset, and the pieces
    (iovec ranges [a, b), each one preadv: contiguous in the file, at most IOV_MAX long)."""
    n = len(src)
    new = np.ones(n, dtype=bool)
    new[1:] = (src[1:] != src[:-1] + row_bytes) | (dst[1:] != dst[:-1] + row_bytes)
    starts = np.flatnonzero(new)
    lens = np.diff(np.append(starts, n)).astype(np.int64) * row_bytes
    seg_off, seg_dst = src[starts].astype(np.int64), dst[starts].astype(np.uint64)
    gap = seg_off[1:] - (seg_off[:-1] + lens[:-1])
    fill = (gap > 0) & (gap <= GAP_READ_MAX)
    at = np.arange(len(starts)) + np.concatenate([[0], np.cumsum(fill)])  # each segment's iovec
    iov = np.empty((len(starts) + int(fill.sum()), 2), dtype=np.uint64)
    offsets = np.empty(len(iov), dtype=np.int64)
    iov[at, 0], iov[at, 1], offsets[at] = seg_dst, lens, seg_off
    after = np.flatnonzero(fill)
    iov[at[after] + 1, 0], iov[at[after] + 1, 1] = scratch, gap[after]
    offsets[at[after] + 1] = seg_off[after] + lens[after]
    cuts = [0, *(int(at[j + 1]) for j in np.flatnonzero(gap > GAP_READ_MAX)), len(iov)]
    pieces = [(a, min(a + _IOV_MAX, b)) for lo, b in zip(cuts, cuts[1:], strict=False) for a in range(lo, b, _IOV_MAX)]
    return iov, offsets, pieces


def _spread(pieces: list[tuple[int, int]], iov: np.ndarray[Any, Any], total: int) -> list[list[tuple[int, int]]]:
    """Pieces in groups of about equal bytes, one group per thread (one group below
    THREADS_MIN_BYTES); a long piece is cut at iovec boundaries to balance them."""
    threads = _read_threads() if total >= THREADS_MIN_BYTES else 1
    if threads == 1:
        return [pieces]
    ends = np.cumsum(iov[:, 1].astype(np.int64))
    cuts = sorted(set(np.searchsorted(ends, [total * k // threads for k in range(1, threads)], side="right").tolist()))
    groups: list[list[tuple[int, int]]] = [[] for _ in range(len(cuts) + 1)]
    for a, b in pieces:
        inner = [c for c in cuts if a < c < b]
        for lo, hi in zip([a, *inner], [*inner, b], strict=True):
            groups[bisect.bisect_right(cuts, lo)].append((lo, hi))  # the group of the cut it starts at
    return [g for g in groups if g]


def _read_pieces(
    source: FileSource, iov: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any], pieces: list[tuple[int, int]]
) -> None:
    """One preadv per piece (ctypes drops the GIL); a short read resumes where it stopped."""
    if _libc is None:
        raise FileChanged(f"{source.path}: no preadv on this platform")
    base = iov.ctypes.data
    for a, b in pieces:
        off = int(offsets[a])
        while a < b:
            want = int(iov[a:b, 1].sum())
            got = _libc.preadv(source.fd, ctypes.c_void_p(base + a * 16), b - a, off)
            if got < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"preadv of {source.path}: {os.strerror(err)}")
            if got == want:
                break
            if got == 0:
                raise FileChanged(f"{source.path}: ends before offset {off} (truncated since it was checked)")
            off += got
            done = np.cumsum(iov[a:b, 1].astype(np.int64))
            k = int(np.searchsorted(done, got, side="right"))  # first iovec not read whole
            used = got - (int(done[k - 1]) if k else 0)
            a += k
            iov[a, 0] += np.uint64(used)
            iov[a, 1] -= np.uint64(used)


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


class LocalFile(NamedTuple):
    schema: pa.Schema
    batches: list[pa.RecordBatch]
    """Memory-mapped: zero-copy views for iter_chunks / iter_steps."""
    source: FileSource
    """The same file on its checked descriptor, for pull's one copy (preadv); close it when done."""


def open_local_file(offered: Offered, name: str) -> LocalFile | None:
    """The offered file when it opens as a regular file and holds the endpoint's trajectory
    (its ticket in the footer, the same schema and metadata); else None, the debug log saying
    why. The host id is the caller's check. ``name``: what the caller asked for (for the log)."""
    try:
        fd, _ = open_regular(offered.path)
    except (OSError, ValueError) as e:
        log.debug("%s: cannot read %s (%s); streaming over gRPC", name[:80], offered.path, e)
        return None
    try:
        m = map_ipc(offered.path, fd=fd)
    except (OSError, ValueError) as e:
        os.close(fd)
        log.debug("%s: cannot read %s (%s); streaming over gRPC", name[:80], offered.path, e)
        return None
    if m.footer.get(FOOTER_TICKET, "").encode() != offered.ticket or not m.schema.equals(
        offered.schema, check_metadata=True
    ):
        os.close(fd)
        log.debug("%s: %s holds another trajectory; streaming over gRPC", name[:80], offered.path)
        return None
    return LocalFile(m.schema, m.batches, FileSource(fd, offered.path, m.base_address, m.size, m.crcs))


def verify_read(source: FileSource, batches: list[pa.RecordBatch], latent_rows: list[list[memoryview]]) -> None:
    """Check each batch against the checksum the file carries for it, over the bytes a pull
    delivered: the latent rows as read into the tensor (``latent_rows[i]``: batch i's rows in
    order), every other buffer as mapped. Raises CorruptTrajectoryFile naming the batch."""
    if source.crcs is None or len(source.crcs) != len(batches):
        raise CorruptTrajectoryFile(f"{source.path}: the file carries no {KEY_CRC} checksums to verify against")
    for i, (batch, want) in enumerate(zip(batches, source.crcs, strict=True)):
        crc = 0
        latent = batch.column("latent").storage.values.buffers()[1]
        for col in batch.columns:
            for buf in col.buffers():
                if buf is None or not buf.size:
                    continue
                if buf.address == latent.address and buf.size == sum(r.nbytes for r in latent_rows[i]):
                    for row in latent_rows[i]:
                        crc = crc32c.crc32c(row, value=crc)
                else:  # read from the descriptor, never through the mapping (see FileSource.pread)
                    crc = crc32c.crc32c(source.pread(buf.address - source.base_address, buf.size), value=crc)
        if crc != want:
            raise CorruptTrajectoryFile(
                f"{source.path}: checksum mismatch in batch {i} (crc32c {crc:08x}, written {want:08x}): "
                "the file changed after the server wrote it (pull(verify=True))"
            )
