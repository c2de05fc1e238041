"""Bad tickets, descriptors and actions get typed errors at once; the server keeps serving.
Auth: no / wrong / right bearer token. Concurrent stream limit."""

import logging
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from sigmaflight.dataplane.client import TrajectoryClient
from sigmaflight.dataplane.server import FlightDataServer

from tests.dataplane.helpers import build_header, fill

BAD_TICKETS = [b"", b"nope", b"\xff\xfe\x00garbage", b"sft1_" + b"x" * 5000, b"__import__('os')"]


@pytest.mark.parametrize("ticket", BAD_TICKETS)
def test_bad_tickets_answer_at_once_and_server_keeps_serving(server, store, ticket):
    fill(store, build_header("ok"))
    with flight.FlightClient(server.locations[0]) as c:
        t0 = time.monotonic()
        with pytest.raises(flight.FlightServerError, match="ticket .* not found"):
            c.do_get(flight.Ticket(ticket)).read_all()
        assert time.monotonic() - t0 < 3.0  # at once (slack for a loaded box: pytest runs a worker per core, and one more)
        assert c.do_get(flight.Ticket(store.ticket_for("ok").encode())).read_all().num_rows == 15


BAD_DESCRIPTORS = [
    (flight.FlightDescriptor.for_command(b"SELECT 1"), "unsupported descriptor type CMD"),
    (flight.FlightDescriptor.for_path("rollouts"), "bad descriptor path"),
    (flight.FlightDescriptor.for_path("other", "ok"), "bad descriptor path"),
    (flight.FlightDescriptor.for_path("rollouts", "ok", "x"), "bad descriptor path"),
    (flight.FlightDescriptor.for_path("rollouts", "missing"), "rollout 'missing' not found"),
    (flight.FlightDescriptor.for_path("rollouts", "ok", "partitions", "zero"), "bad partition count"),
    (flight.FlightDescriptor.for_path("rollouts", "ok", "partitions", "1000"), "bad partition count"),
    (flight.FlightDescriptor.for_path("rollouts", "ok", "partitions", "2_0"), "bad partition count"),  # int(): 20
    (flight.FlightDescriptor.for_path("rollouts", "ok", "partitions", "+4"), "bad partition count"),
    (flight.FlightDescriptor.for_path("rollouts", "ok", "partitions", " 3 "), "bad partition count"),
    (flight.FlightDescriptor.for_path("rollouts", "ok", "partitions", "05"), "bad partition count"),
]


@pytest.mark.parametrize(("descriptor", "message"), BAD_DESCRIPTORS)
def test_bad_descriptors(server, store, descriptor, message):
    fill(store, build_header("ok"))
    with flight.FlightClient(server.locations[0]) as c:
        with pytest.raises(flight.FlightServerError, match=message):
            c.get_flight_info(descriptor)
        if len(descriptor.path or []) != 4:
            # pyarrow 26 loses the Flight error type on get_schema (ArrowException, message kept)
            with pytest.raises(pa.ArrowException, match=message):
                c.get_schema(descriptor)
        assert c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "ok")).total_records == 15


def test_non_utf8_descriptor_is_refused_by_grpc_and_server_survives(server, store):
    fill(store, build_header("ok"))
    with flight.FlightClient(server.locations[0]) as c:
        with pytest.raises(flight.FlightError):  # protobuf rejects it before our code runs
            c.get_flight_info(flight.FlightDescriptor.for_path(b"rollouts", b"\xff\xfe"))
        assert c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "ok")).total_records == 15


@pytest.mark.parametrize(
    ("action", "message"),
    [(flight.Action("drop_tables", b"ok"), "unknown action"), (flight.Action("release", b""), "names no rollout id"),
     (flight.Action("release", b"{not json"), "not valid JSON"), (flight.Action("release", b"\xff"), "UTF-8"),
     (flight.Action("cancel", b"ok"), "no cancel handler")],
)
def test_bad_actions(server, store, action, message):
    fill(store, build_header("ok"))
    with flight.FlightClient(server.locations[0]) as c:
        with pytest.raises(flight.FlightServerError, match=message):
            list(c.do_action(action))
        assert list(c.list_flights())


def test_cancel_and_release_handlers(store):
    seen = []
    fill(store, build_header("a"))
    def on_cancel(i: str) -> bool:
        seen.append(("c", i))
        return True

    def on_release(i: str) -> bool:
        seen.append(("r", i))
        return False

    with FlightDataServer(store, on_cancel=on_cancel, on_release=on_release) as srv, TrajectoryClient(srv.locations[0]) as c:
        assert c.cancel("a") is True
        assert c.release("a") is False
        (r,) = list(c.flight_client.do_action(flight.Action("cancel", b"plain-id")))
        assert r.body.to_pybytes() == b'{"id": "plain-id", "cancelled": true}'
    assert seen == [("c", "a"), ("r", "a"), ("c", "plain-id")]


def test_auth_no_wrong_right_token(store, caplog):
    fill(store, build_header("sec"))
    caplog.set_level(logging.DEBUG)
    secret = "s3cret-token-value"
    with FlightDataServer(store, tokens=["other", secret]) as srv:
        loc = srv.locations[0]
        with flight.FlightClient(loc) as c:
            with pytest.raises(flight.FlightUnauthenticatedError):
                c.do_get(flight.Ticket(store.ticket_for("sec").encode())).read_all()
            with pytest.raises(flight.FlightUnauthenticatedError):
                list(c.list_flights())
            bad = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer nope")])
            with pytest.raises(flight.FlightUnauthenticatedError):
                c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "sec"), bad)
            basic = flight.FlightCallOptions(headers=[(b"authorization", f"Basic {secret}".encode())])
            with pytest.raises(flight.FlightUnauthenticatedError):
                list(c.list_actions(basic))
        with TrajectoryClient(loc, token="wrong") as tc, pytest.raises(flight.FlightUnauthenticatedError):
            tc.pull("sec")
        with TrajectoryClient(loc, token=secret) as tc:
            assert tc.pull("sec").latents.shape[0] == 3
    assert secret not in caplog.text


def test_concurrent_stream_limit(store):
    w = store.create(build_header("slow"))
    with FlightDataServer(store, max_concurrent_streams=1) as srv, flight.FlightClient(srv.locations[0]) as c:
        first = c.do_get(flight.Ticket(w.ticket.encode()))  # waits on the live rollout
        with pytest.raises(flight.FlightUnavailableError, match="too many concurrent streams") as full:
            c.do_get(flight.Ticket(w.ticket.encode())).read_all()
        assert _info(full.value)["type"] == "too_many_streams"
        w.fail("cancelled", "test over")
        with pytest.raises(flight.FlightServerError):
            first.read_all()
        del first
        deadline = time.monotonic() + 5
        while srv.metrics()["active_streams"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.metrics()["active_streams"] == 0


def _info(exc: BaseException) -> dict:
    """What the server put in the error's extra_info, read with nothing but json."""
    import json

    return json.loads(bytes(exc.extra_info))  # type: ignore[attr-defined]


def test_every_error_carries_its_type_in_extra_info(server, store):
    """Clients branch on extra_info's type, never on message text: a failed, a cancelled, a
    cancelled-while-queued, an unknown and a malformed request each say what they are."""
    fill(store, build_header("ok"))
    failed = store.create(build_header("bad"))
    failed.fail("failed", "non-finite latent at absolute step 2")
    cancelled = store.create(build_header("stopped"))
    cancelled.fail("cancelled", "cancelled by client")
    store.reserve("queued")
    store.abandon("queued", "cancelled", "cancelled by client")
    with flight.FlightClient(server.locations[0]) as c:
        def error_of(ticket: str) -> flight.FlightError:
            with pytest.raises(flight.FlightError) as e:
                c.do_get(flight.Ticket(ticket.encode())).read_all()
            return e.value

        e = error_of(store.ticket_for("bad"))
        assert isinstance(e, flight.FlightInternalError)
        assert _info(e) == {"type": "failed", "rollout": "bad", "reason": "non-finite latent at absolute step 2"}
        e = error_of(store.ticket_for("stopped"))
        assert _info(e) == {"type": "cancelled", "rollout": "stopped", "reason": "cancelled by client"}
        e = error_of("queued")
        assert _info(e)["type"] == "not_found" and _info(e)["ended"] == "cancelled"
        e = error_of("no-such-ticket")
        assert _info(e) == {"type": "not_found", "rollout": None, "reason": "unknown", "ended": None}
        with pytest.raises(flight.FlightError) as bad:
            c.get_flight_info(flight.FlightDescriptor.for_path("rollouts"))
        assert _info(bad.value)["type"] == "bad_request"
        with pytest.raises(flight.FlightError) as action:
            list(c.do_action(flight.Action("explode", b"")))
        assert _info(action.value)["type"] == "bad_request"


def test_a_refused_token_says_so_in_extra_info(store):
    fill(store, build_header("ok"))
    with FlightDataServer(store, tokens=["s3cret"]) as srv, flight.FlightClient(srv.locations[0]) as c:
        with pytest.raises(flight.FlightUnauthenticatedError) as e:
            c.list_actions()
        assert _info(e.value)["type"] == "unauthenticated"


def _waiting_in_stream_table() -> int:
    """Threads of this process (the in-process Flight server's) blocked waiting for a stream."""
    import sys
    import traceback

    return sum(any(f.name == "stream_table" for f in traceback.extract_stack(frame))
               for frame in sys._current_frames().values())


@pytest.mark.parametrize("call", ["get_flight_info", "get_schema"])
def test_a_stream_wait_the_client_gave_up_on_holds_no_server_thread(store, call):
    """get_flight_info / get_schema on a running rollout's extra stream wait until it is
    published, as do_get does; they ignored the call's deadline, so each call a client gave up on
    kept a server thread until the rollout ended (400 calls: 400 threads, past any stream limit)."""
    import dataclasses

    h = build_header("live")
    w = store.create(dataclasses.replace(h, rollout={**h.rollout, "streams": ["trajectory", "outputs"]}))
    descriptor = flight.FlightDescriptor.for_path("rollouts", "live", "outputs")
    with FlightDataServer(store) as srv, flight.FlightClient(srv.locations[0]) as c:
        for _ in range(4):
            # (pyarrow 26 loses the Flight error type on get_schema: an OSError, message kept)
            with pytest.raises((flight.FlightTimedOutError, OSError), match="Deadline Exceeded"):
                getattr(c, call)(descriptor, flight.FlightCallOptions(timeout=0.3))
        deadline = time.monotonic() + 30  # generous: a busy 2-core box; the waits end within a poll
        while _waiting_in_stream_table() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _waiting_in_stream_table() == 0
        w.fail("cancelled", "test over")


def test_a_stream_ticket_not_found_is_named_as_it_was_sent(server, store):
    """The error named the trajectory's part of the ticket (the ":outputs" cut off), as if the
    trajectory's ticket had been sent, and not the stream."""
    fill(store, build_header("ok"))
    ticket = store.ticket_for("ok")
    store.release("ok")
    with flight.FlightClient(server.locations[0]) as c:
        for sent, why in (("nosuchticket:outputs", "unknown"), (f"{ticket}:conditioning", "released")):
            with pytest.raises(flight.FlightServerError) as info:
                c.do_get(flight.Ticket(sent.encode())).read_all()
            stream = sent.rpartition(":")[2]
            assert f"the '{stream}' stream's ticket '{sent}' not found ({why})" in str(info.value), str(info.value)
