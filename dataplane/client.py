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

The pieces live by concept: ``Trajectory`` / ``Transition`` in dataplane/trajectory.py, their
assembly from record batches in dataplane/assembly.py, a stream's reads under an idle timeout
in dataplane/idle.py, the same-host file read in dataplane/samehost.py; this module is the
Flight client and re-exports the public names.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import torch
from sigmaflight.dataplane.auth import bearer_header
from sigmaflight.dataplane.cancel import tracked
from sigmaflight.dataplane.codec import StepTensors, batch_to_tensors
from sigmaflight.dataplane.descriptors import DESCRIPTOR_ROOT
from sigmaflight.dataplane.errors import error_info, server_words
from sigmaflight.dataplane.idle import flight_batches
from sigmaflight.dataplane.samehost import (
    FileChanged,
    LocalFile,
    Offered,
    empty_hugepages,
    offered_file,
    open_local_file,
)
from sigmaflight.dataplane.schema import header_from_schema
from sigmaflight.dataplane.shm import host_id
from sigmaflight.dataplane.trajectory import Trajectory, Transition, iter_step_tensors, pull_file
from sigmaflight.dataplane.transport import Transport, check_transport

log = logging.getLogger(__name__)
_UNKNOWN = object()
DEFAULT_IDLE_TIMEOUT_S = 3600.0
"""A pull's default idle timeout: an hour without a record batch on a started stream."""
_OFFERED_MAX = 1024
"""Tickets whose offered file a client remembers (oldest forgotten first)."""


class TrajectoryClient:
    """One FlightClient (one connection) for many pulls.

    A refusal is the Flight error the server raised (its class, its `extra_info`), with the
    server's message alone: none of the debug context pyarrow appends (sigmaflight.dataplane.errors)."""

    def __init__(
        self,
        location: str | tuple[str, int] | flight.Location,
        *,
        token: str | None = None,
        tls_root_certs: bytes | None = None,
        generic_options: list[tuple[str, Any]] | None = None,
        transport: Transport = "auto",
        host: str | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        """``transport="flight"`` always streams over gRPC; ``"auto"`` reads a finished
        rollout's shared-memory file when its location names this host (``host``: this
        host's id, default ``sigmaflight.dataplane.shm.host_id()``) and the file can be opened.

        ``idle_timeout``: seconds a pull (``pull``, ``iter_steps``, ``iter_chunks``,
        ``iter_batches``, ``iter_steps_parallel``) waits for the next record batch once its
        stream has started; past it the stream is cancelled and ``TimeoutError`` raised. The
        wait of a queued rollout to start is not counted, nor the time your code spends between
        batches. A running rollout is silent while it computes the steps it does not return
        (a ``return.steps`` of only the last step: the whole rollout), hence the generous
        default (DEFAULT_IDLE_TIMEOUT_S, an hour); None waits as long as the stream is open.
        ``reader()`` is the raw pyarrow stream, never timed."""
        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds or None, got {idle_timeout!r}")
        self.idle_timeout = idle_timeout
        self.transport = check_transport(transport)
        self.host = host if host is not None else host_id()
        self._client = flight.FlightClient(
            location, tls_root_certs=tls_root_certs, generic_options=generic_options or None
        )
        headers = [(k.encode(), v.encode()) for k, v in bearer_header(token).items()]
        self._options = flight.FlightCallOptions(headers=headers)
        self._location = location
        self._offered: dict[str, Offered | None | object] = {}
        """ticket or id -> the file its finished rollout offers (None: none for this client)."""
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
        with server_words():
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
        with server_words():
            results = list(self._client.do_action(flight.Action(kind, body), self._options))
        return json.loads(results[0].body.to_pybytes()) if results else {}

    def cancel(self, rollout_id: str) -> bool:
        return bool(self._action("cancel", rollout_id).get("cancelled"))

    def release(self, rollout_id: str) -> bool:
        self._offered.pop(rollout_id, None)
        return bool(self._action("release", rollout_id).get("released"))

    # -- pulls -----------------------------------------------------------------------------
    def reader(self, ticket_or_id: str | bytes | flight.Ticket) -> flight.FlightStreamReader:
        """The raw Flight stream (pyarrow), e.g. for ``Trajectory.from_reader``."""
        return tracked(self._client.do_get(self._ticket(ticket_or_id), self._options))

    def iter_batches(self, ticket_or_id: str | bytes | flight.Ticket) -> Iterator[pa.RecordBatch]:
        return flight_batches(self.reader(ticket_or_id), self.idle_timeout)

    def schema(self, ticket_or_id: str | bytes | flight.Ticket) -> pa.Schema:
        with server_words():
            return self.reader(ticket_or_id).schema

    def local_file(self, ticket_or_id: str | bytes | flight.Ticket) -> LocalFile | None:
        """The rollout's shared-memory file (schema, memory-mapped batches, the open file) when
        this client may read it directly, else None (and the debug log says why).

        What a finished rollout's FlightInfo says of its file is kept per ticket (or id), so a
        later pull of it asks the server nothing; when the file is gone or holds something
        else, the next pull asks again."""
        if self.transport == "flight":
            return None
        name = _name(ticket_or_id)
        offered = self._offered.get(name, _UNKNOWN)
        if offered is _UNKNOWN:
            try:
                fi = self.flight_info(name)
            except flight.FlightError as e:
                log.debug("%s: no FlightInfo (%s); streaming over gRPC", name[:80], str(e).splitlines()[0][:200])
                return None
            offered = offered_file(fi)
            if offered is None:
                log.debug("%s: no file location (not finished, or the server has no --shm-dir)", name[:80])
            elif offered.host != self.host:
                log.debug("%s: file %s is on host %s, not this host %s; streaming over gRPC", name[:80],
                          offered.path, offered.host, self.host)
                offered = None
            if fi.total_records >= 0:  # finished: what it offers stays so until it is released
                self._offered[name] = offered
                while len(self._offered) > _OFFERED_MAX:
                    self._offered.pop(next(iter(self._offered)))
        if offered is None:
            return None
        assert isinstance(offered, Offered)
        local = open_local_file(offered, name)
        if local is None:
            self._offered.pop(name, None)
        return local

    def pull(
        self, ticket_or_id: str | bytes | flight.Ticket, *, out: torch.Tensor | None = None, verify: bool = False
    ) -> Trajectory:
        """The whole rollout; waits for a running (or queued) one to finish, streaming as it goes.

        ``out``: fill this contiguous CPU tensor [B, K, *latent_shape] (the rollout's dtype)
        instead of allocating one; ``traj.latents`` is then ``out``. Reusing one warm buffer
        across pulls avoids the page faults of fresh memory (what dominates a same-host pull).

        ``verify``: when the rollout is read from its same-host file, check every batch against
        the checksum the file carries, over the bytes read (CorruptTrajectoryFile naming the
        batch if one differs). Without it a same-host read trusts the file; over gRPC the
        server checks a file before it serves it."""
        local = self.local_file(ticket_or_id)
        if local is not None:
            with local.source:
                try:
                    return Trajectory.from_batches(local.schema, local.batches, source=local.source, out=out,
                                                   verify=verify)
                except FileChanged as e:
                    log.debug("%s; streaming over gRPC", e)
                    self._offered.pop(_name(ticket_or_id), None)
        with server_words():
            reader = self.reader(ticket_or_id)
            return Trajectory.from_batches(reader.schema, flight_batches(reader, self.idle_timeout), out=out)

    def _batches(self, ticket_or_id: str | bytes | flight.Ticket) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        local = self.local_file(ticket_or_id)
        if local is not None:
            local.source.close()  # views need only the mapping
            return local.schema, iter(local.batches)
        with server_words():
            reader = self.reader(ticket_or_id)
            return reader.schema, flight_batches(reader, self.idle_timeout)

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
        threads and closes the extra connections: no stream slot stays held. A rollout that has
        not started streaming yet (queued, or its batch still encoding prompts) is waited for, as
        ``iter_steps`` and do_get wait."""
        try:
            fi = self.flight_info(rollout_id, partitions=streams)
        except flight.FlightError as exc:
            if not str((error_info(exc) or {}).get("reason", "")).startswith("queued"):
                raise
            self._wait_started(rollout_id)
            fi = self.flight_info(rollout_id, partitions=streams)
        ordered = self._parallel(fi, prefetch)
        if merge_steps:
            return iter_step_tensors(fi.schema, ordered, copy=copy)
        dtype = header_from_schema(fi.schema).latent_dtype
        return (batch_to_tensors(b, copy=copy, dtype=dtype) for b in ordered)

    def _wait_started(self, rollout_id: str) -> None:
        """Return once the rollout streams: a do_get waits while it is queued, and its schema comes
        once it has started (or the error of one that ended without starting)."""
        with server_words():
            reader = self._client.do_get(flight.Ticket(rollout_id.encode()), self._options)
            try:
                _ = reader.schema
            finally:
                reader.cancel()

    def _parallel(self, fi: flight.FlightInfo, prefetch: int) -> Iterator[pa.RecordBatch]:
        """Every batch of ``fi``'s endpoints in stream order. A generator: nothing connects
        before the first next(); its finally stops the pumps and closes the extra clients."""
        extra: list[flight.FlightClient] = []
        try:
            extra = [flight.FlightClient(self._location, tls_root_certs=self._tls_root_certs) for _ in fi.endpoints[1:]]
            clients = [self._client, *extra]
            yield from _round_robin(
                [(c, ep.ticket) for c, ep in zip(clients, fi.endpoints, strict=True)], self._options, prefetch,
                self.idle_timeout,
            )
        finally:
            for c in extra:
                c.close()


def _name(ticket_or_id: str | bytes | flight.Ticket) -> str:
    """The ticket or rollout id as text (for the offered-file memory and the debug log)."""
    key = ticket_or_id.ticket if isinstance(ticket_or_id, flight.Ticket) else ticket_or_id
    return key.decode("utf-8", errors="replace") if isinstance(key, bytes) else key


def _round_robin(
    sources: list[tuple[flight.FlightClient, flight.Ticket]], options: flight.FlightCallOptions, prefetch: int,
    idle_timeout: float | None = None,
) -> Iterator[pa.RecordBatch]:
    """Pull every (client, ticket) concurrently, one thread each; yield batch j from source
    j % n (the partition tickets' order). On the way out (end, error or the consumer
    closing it) the streams are cancelled and the threads joined. TimeoutError when the next
    batch takes longer than ``idle_timeout`` seconds to come."""
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
            try:
                item = queues[k].get(timeout=idle_timeout)
            except queue.Empty:
                raise TimeoutError(f"no record batch for {idle_timeout:g} s (idle_timeout): the streams were "
                                   "cancelled") from None
            if item is _DONE:
                # batch j lives on source j % n: once one source ends, all later ones end
                for j in range(1, n):
                    if queues[(k + j) % n].get(timeout=idle_timeout) is not _DONE:
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
        for b in flight_batches(reader):
            if not _put(q, b, stop):
                return
        _put(q, _DONE, stop)
    except BaseException as e:  # handed to the consumer (unless it left)
        if not stop.is_set():
            _put(q, e, stop)


__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S", "StepTensors", "Trajectory", "TrajectoryClient", "Transition", "Transport", "check_transport", "empty_hugepages",
    "iter_step_tensors", "pull_file",
]
