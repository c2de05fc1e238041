"""FlightDataServer: the "trajectory/v1" streams of a ResultStore over Arrow Flight.

Errors (all FlightError subclasses made by dataplane/errors.py: a message naming what was
wrong, and `extra_info` JSON {"type", "rollout", ...} that clients branch on):
- unknown / released / expired ticket or rollout id: type "not_found" (FlightServerError
  "ticket '...' not found (unknown|released|expired)"), answered at once, never a hang;
- an extra stream ("outputs", "conditioning") the rollout was not asked for: "not_found"
  ("stream 'outputs' of rollout <id> not found (not requested: ...)");
- malformed descriptor (CMD, wrong path shape, non-UTF-8), unknown action: "bad_request";
- rollout failed: "failed" (FlightInternalError "rollout <id> failed: <reason>");
- rollout cancelled, released or expired while a stream waits: "cancelled", "released",
  "expired" (FlightServerError "rollout <id> cancelled: <reason>");
- missing / wrong bearer token: "unauthenticated" (FlightUnauthenticatedError);
- more than ``max_concurrent_streams`` streams: "too_many_streams" (FlightUnavailableError).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Collection, Iterator

import pyarrow as pa
import pyarrow.flight as flight
from sigmaflight.dataplane.auth import TokenSet
from sigmaflight.dataplane.descriptors import (
    DESCRIPTOR_ROOT,
    action_rollout,
    path_partitions,
    path_rollout,
    path_stream,
)
from sigmaflight.dataplane.errors import flight_error, not_found, rollout_ended
from sigmaflight.dataplane.slots import CallSlot, CallSlotFactory, StreamSlot, StreamSlots
from sigmaflight.dataplane.store import Entry, ResultStore, RolloutEnded, StreamNotFound, TicketNotFound
from sigmaflight.dataplane.tickets import is_minted, stream_ticket
from sigmaflight.dataplane.weights import WEIGHTS_STATUS_ACTION, PushRefused, WeightsPushes

from sigmaflight.records import RolloutState

log = logging.getLogger(__name__)

ACTIONS = {
    "cancel": 'Cancel a queued or running rollout. Body: the rollout id or ticket (UTF-8) or JSON {"id": ...}. '
    'Answers JSON {"id", "cancelled": bool}.',
    "release": 'Release a finished rollout (memory and file). Body: the rollout id or ticket (UTF-8) or JSON '
    '{"id": ...}. Answers JSON {"id", "released": bool}.',
    WEIGHTS_STATUS_ACTION: "The byte ranges a weights push (do_put) has received so far, to resume it. Body: the push "
    'id (UTF-8). Answers JSON {"push_id", "model", "received": {tensor: [[start, end], ...]}, ...}.',
}


class BearerTokenMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Every call needs ``authorization: Bearer <token>`` matching one of ``tokens``.

    Compared with hmac.compare_digest against every token (no early exit), never logged.
    """

    def __init__(self, tokens: Collection[str]) -> None:
        super().__init__()
        self.tokens = TokenSet(tokens)
        if not self.tokens:
            raise ValueError("tokens must hold at least one non-empty token")

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> None:
        values = headers.get("authorization") or headers.get("Authorization") or []
        ok = self.tokens.matches(values[0] if values else None)
        if not ok:
            raise flight_error(
                "unauthenticated", "missing or wrong bearer token (send the header 'authorization: Bearer <token>')"
            )
        return None


_IPC_OPTIONS = pa.ipc.IpcWriteOptions()
"""Made once: without options, each RecordBatchStream builds its own from two environment
variables (legacy IPC formats, which sigmaflight never writes)."""


class FlightDataServer(flight.FlightServerBase):
    """The Flight RPC surface over a ResultStore (do_get, get_flight_info, get_schema,
    list_flights, do_action, list_actions) for trajectories and their extra streams.

    Each RPC looks the store up and maps its errors to typed Flight errors (dataplane/errors.py).
    What a call names is parsed in dataplane/descriptors.py, the open streams are counted in
    dataplane/slots.py; tickets, entries, budget and files live in the store's modules."""

    def __init__(
        self,
        store: ResultStore,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        tokens: Collection[str] | None = None,
        tls_certificates: list[tuple[bytes, bytes]] | None = None,
        on_cancel: Callable[[str], bool] | None = None,
        on_release: Callable[[str], bool] | None = None,
        max_concurrent_streams: int = 64,
    ) -> None:
        scheme = "grpc+tls" if tls_certificates else "grpc+tcp"
        middleware: dict[str, flight.ServerMiddlewareFactory] = {"slots": CallSlotFactory()}
        self._auth = BearerTokenMiddlewareFactory(tokens) if tokens else None
        if self._auth is not None:
            middleware["auth"] = self._auth
        super().__init__(
            f"{scheme}://{host}:{port}",
            tls_certificates=tls_certificates or None,
            middleware=middleware,
        )
        self.store = store
        self._scheme = scheme
        everywhere = host in ("0.0.0.0", "::", "")
        # a wildcard is no address to connect to: a trainer elsewhere needs this machine's name
        self._host = (advertise_host or socket.gethostname()) if everywhere else host
        self._on_cancel = on_cancel
        self._on_release = on_release
        self.slots = StreamSlots(max_concurrent_streams)
        self._thread: threading.Thread | None = None
        self.weights: WeightsPushes | None = None
        """Weights pushes (do_put), once the control plane gives a sink (`accept_weights`)."""
        self._stop = threading.Event()
        """This server's own: stop() ends its waiting streams, never the store's (a later
        server on the same store serves on; only ResultStore.close sets the store's)."""

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def locations(self) -> list[str]:
        return [f"{self._scheme}://{self._host}:{self.port}"]

    def start(self) -> FlightDataServer:
        """Serve in a background thread (the port is bound already)."""
        if self._thread is None:
            # wait(), not serve(): serve() installs C++ SIGINT/SIGTERM handlers that run a blocking
            # Flight shutdown before the process's own handler (uvicorn's) ever sees the signal.
            self._thread = threading.Thread(target=self.wait, name="flight-data-server", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Wake waiting live streams (they end with an error) and shut down.

        gRPC's shutdown waits for every open call, and a consumer that stopped reading keeps
        its call open forever (its write is blocked on flow control): after ``timeout``
        seconds we stop waiting, so SIGTERM still exits in time."""
        self._stop.set()
        if self.weights is not None:
            self.weights.close()
        self.store.wake_all()
        closer = threading.Thread(target=self.shutdown, name="flight-shutdown", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            log.warning("Flight shutdown: streams still open (stalled consumers); not waiting",
                        extra={"streams": self.active_streams, "waited_s": timeout})
            return
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def accept_weights(self, pushes: WeightsPushes) -> None:
        """Take weights pushes over do_put from now on (dataplane/weights.py), into `pushes`' sink."""
        self.weights = pushes.start()

    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader, writer: flight.FlightMetadataWriter) -> None:
        """A weights push (the only thing this server takes in): see dataplane/weights.py."""
        if self.weights is None:
            raise flight_error("bad_request", "this Flight server takes no weights pushes (no control plane)")
        self.weights.receive(descriptor, reader, writer)

    def __enter__(self) -> FlightDataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_tokens(self, tokens: Collection[str]) -> None:
        """Replace the accepted bearer tokens (a reload); calls already admitted go on. Raises
        ValueError for an empty set, or on a server started without tokens (auth stays as it was)."""
        if self._auth is None:
            raise ValueError("this Flight server has no auth; restart it with tokens to turn it on")
        self._auth.tokens.replace(tokens)

    def metrics(self) -> dict[str, int]:
        return self.slots.metrics()

    @property
    def active_streams(self) -> int:
        return self.slots.active

    @property
    def bytes_served(self) -> int:
        return self.slots.bytes_served

    @property
    def streams_served(self) -> int:
        return self.slots.streams_served

    # -- helpers ---------------------------------------------------------------------------
    def _should_stop(self, context: flight.ServerCallContext | None) -> Callable[[], str | None]:
        """Why a call waiting for a rollout must stop now: this server stops, or the call is
        cancelled (the client left or its deadline passed), which frees its stream slot."""

        def check() -> str | None:
            if self._stop.is_set():
                return "server shutting down"
            if context is not None and context.is_cancelled():
                return "call cancelled by the client (or its deadline passed)"
            return None

        return check

    def _entry(self, rollout_id: str) -> Entry:
        """The entry a rollout id or ticket names, at once (a queued rollout: not found, saying
        so; do_get on its id or ticket is what waits for it). A failed one is the error do_get
        gives, not a FlightInfo whose -1 totals read as "still running"."""
        try:
            entry = self.store.find(rollout_id)
        except TicketNotFound as e:
            raise not_found(e) from None
        if entry.state not in (RolloutState.RUNNING, RolloutState.SUCCEEDED):
            raise rollout_ended(RolloutEnded(entry.rollout_id, entry.state, entry.message or entry.state))
        return entry

    def _flight_info(self, entry: Entry, partitions: int = 1) -> flight.FlightInfo:
        tickets = self.store.partition_tickets(entry.rollout_id, partitions)
        locations = [flight.Location(u) for u in self.locations]
        endpoints = [flight.FlightEndpoint(t.encode(), locations) for t in tickets]
        file = self.store.file_location(entry) if partitions == 1 else None
        if file is not None:  # extended location (GH-46193): same-host clients read it directly
            endpoints = [flight.FlightEndpoint(tickets[0].encode(), [*locations, flight.Location(file)])]
        descriptor = flight.FlightDescriptor.for_path(DESCRIPTOR_ROOT, entry.rollout_id)
        return flight.FlightInfo(entry.schema, descriptor, endpoints, entry.total_records, entry.total_bytes)

    def _waiting_entry(self, rollout_id: str, should_stop: Callable[[], str | None]) -> Entry:
        """The entry of a rollout id; waits while it is queued (as do_get on its ticket does)."""
        try:
            return self.store.lookup_ticket(rollout_id, should_stop=should_stop)[0]
        except TicketNotFound as e:
            raise not_found(e) from None

    def _stream_table(self, entry: Entry, stream: str, should_stop: Callable[[], str | None]) -> pa.Table:
        """An extra stream's table (waits while the rollout runs, until `should_stop` answers: the
        call's client left or its deadline passed, or this server stops); Flight errors otherwise."""
        try:
            return entry.stream_table(stream, should_stop=should_stop)
        except StreamNotFound as e:
            raise flight_error("not_found", str(e), rollout=entry.rollout_id, stream=stream) from None
        except RolloutEnded as e:
            raise rollout_ended(e) from None

    def _stream_info(self, entry: Entry, stream: str, should_stop: Callable[[], str | None]) -> flight.FlightInfo:
        table = self._stream_table(entry, stream, should_stop)
        locations = [flight.Location(u) for u in self.locations]
        ticket = stream_ticket(entry.ticket, stream).encode()
        descriptor = flight.FlightDescriptor.for_path(DESCRIPTOR_ROOT, entry.rollout_id, stream)
        return flight.FlightInfo(table.schema, descriptor, [flight.FlightEndpoint(ticket, locations)],
                                 table.num_rows, table.nbytes)

    def _serve(
        self, entry: Entry, start: int, stride: int, slot: StreamSlot, should_stop: Callable[[], str | None]
    ) -> Iterator[pa.RecordBatch]:
        try:
            for batch in entry.iter_batches(start, stride, stop=self.store.stop_event, should_stop=should_stop):
                self.slots.count_bytes(batch.nbytes)
                yield batch
        except RolloutEnded as e:
            raise rollout_ended(e) from None
        finally:
            slot.free()

    # -- Flight methods --------------------------------------------------------------------
    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        # Take a stream slot first: a consumer of a queued rollout waits inside lookup_ticket,
        # and that wait must count against max_concurrent_streams too.
        slot = self.slots.take()
        should_stop = self._should_stop(context)
        if self.store.stream_of(ticket.ticket) is not None:
            return self._do_get_stream(context, ticket, slot, should_stop)
        try:
            entry, start, stride = self.store.lookup_ticket(ticket.ticket, should_stop=should_stop)
            try:
                self.store.check_served(entry)  # a mapped file still whole and unchanged
            except RolloutEnded:
                pass  # the entry is failed now: answered below
            if entry.state not in (RolloutState.RUNNING, RolloutState.SUCCEEDED):
                raise rollout_ended(RolloutEnded(entry.rollout_id, entry.state, entry.message or entry.state))
        except TicketNotFound as e:
            slot.free()
            raise not_found(e) from None
        except BaseException:
            slot.free()
            raise
        call = context.get_middleware("slots")
        done = entry.served_table(start, stride) if isinstance(call, CallSlot) else None
        if done is not None:  # finished: the whole table at once
            return self._send_table(context, slot, *done)
        return flight.GeneratorStream(entry.schema, self._serve(entry, start, stride, slot, should_stop))

    def _do_get_stream(
        self, context: flight.ServerCallContext, ticket: flight.Ticket, slot: StreamSlot,
        should_stop: Callable[[], str | None],
    ) -> flight.FlightDataStream:
        """An extra stream: one finished table, streamed by a C++ table reader."""
        try:
            entry, stream = self.store.lookup_stream(ticket.ticket, should_stop=should_stop)
            table = self._stream_table(entry, stream, should_stop)
        except TicketNotFound as e:
            slot.free()
            raise not_found(e) from None
        except BaseException:
            slot.free()
            raise
        return self._send_table(context, slot, table, int(table.nbytes))

    def _send_table(self, context: flight.ServerCallContext, slot: StreamSlot, table: pa.Table,
                    nbytes: int) -> flight.RecordBatchStream:
        """Stream a whole table by a C++ table reader, with no Python (and no GIL) per batch; the
        slot is freed, and the bytes counted if the consumer took them all, when gRPC says the
        call is over (the slots middleware); without it, at once."""
        call = context.get_middleware("slots")
        if isinstance(call, CallSlot):
            call.slot, call.whole = slot, (self.slots, nbytes, context)
        else:
            slot.free()
            self.slots.count_bytes(nbytes)
        return flight.RecordBatchStream(table, options=_IPC_OPTIONS)

    def get_flight_info(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.FlightInfo:
        """``for_path("rollouts", id)``: one endpoint streaming the whole rollout.
        ``for_path("rollouts", id, "partitions", n)``: n endpoints (batches k, k+n, ...)
        that a client may pull concurrently; concatenated in step order they are the rollout.
        ``for_path("rollouts", id, "outputs" | "conditioning")``: that extra stream; waits until
        the rollout publishes it (after its last step), as do_get does."""
        rid, n = path_partitions(descriptor)
        if rid is not None:
            return self._flight_info(self._entry(rid), n)
        rid, stream = path_stream(descriptor)
        if stream is not None:
            should_stop = self._should_stop(context)  # a wait a client gave up on holds no thread
            return self._stream_info(self._waiting_entry(rid, should_stop), stream, should_stop)
        return self._flight_info(self._entry(path_rollout(descriptor)))

    def get_schema(
        self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor
    ) -> flight.SchemaResult:
        rid, stream = path_stream(descriptor)
        if stream is not None:
            should_stop = self._should_stop(context)
            return flight.SchemaResult(self._stream_table(self._waiting_entry(rid, should_stop), stream, should_stop).schema)
        return flight.SchemaResult(self._entry(path_rollout(descriptor)).schema)

    def list_flights(self, context: flight.ServerCallContext, criteria: bytes) -> Iterator[flight.FlightInfo]:
        """Every rollout that can be streamed (running or succeeded), each followed by its
        published extra streams."""
        for rid in self.store.ids():
            try:
                e = self.store.get(rid)
            except TicketNotFound:
                continue
            if e.state in (RolloutState.RUNNING, RolloutState.SUCCEEDED):
                yield self._flight_info(e)
                for stream in [s for s in e.streams_requested if s in e.extras]:
                    try:
                        yield self._stream_info(e, stream, self._should_stop(context))
                    except flight.FlightError:
                        continue  # released meanwhile

    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return list(ACTIONS.items())

    def do_action(self, context: flight.ServerCallContext, action: flight.Action) -> Iterator[bytes]:
        kind = action.type
        if kind not in ACTIONS:
            raise flight_error("bad_request", f"unknown action {kind[:40]!r}; known: {sorted(ACTIONS)}")
        if kind == WEIGHTS_STATUS_ACTION:
            push_id = action.body.to_pybytes().decode("utf-8", "replace") if action.body is not None else ""
            if self.weights is None:
                raise flight_error("bad_request", "this Flight server takes no weights pushes (no control plane)")
            try:
                return iter([json.dumps(self.weights.status(push_id)).encode()])
            except PushRefused as exc:
                raise flight_error("not_found", exc.message, reason=exc.reason, push_id=push_id[:200]) from None
        named = action_rollout(action.body.to_pybytes() if action.body is not None else b"")
        rid = (self.store.rollout_of(named) or named) if is_minted(named) else named  # a ticket: its rollout
        if kind == "cancel":
            if self._on_cancel is None:
                raise flight_error("bad_request", "this server has no cancel handler (no control plane)")
            done = bool(self._on_cancel(rid))
            return iter([json.dumps({"id": rid, "cancelled": done}).encode()])
        done = bool(self._on_release(rid) if self._on_release is not None else self.store.release(rid))
        return iter([json.dumps({"id": rid, "released": done}).encode()])
