"""Live rollouts: consumers that join mid-way, failures, cancels, shared buffers."""

import threading
import time

import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import TrajectoryClient
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore

from tests.dataplane.helpers import build_header, make_steps


def _consume(location, ticket, out, key, received=None):
    """Pull ``ticket``; ``received`` (if given) gets each step as it arrives."""
    try:
        with TrajectoryClient(location) as c:
            got = []
            for s in c.iter_steps(ticket):
                got.append((s.step, s.latent.clone()))
                if received is not None:
                    received.append(s.step)
            out[key] = got
    except Exception as e:  # recorded for the asserting thread
        out[key] = e


def _wait_until(cond, what, timeout=10.0):
    """Wait for ``cond()``, failing the test naming ``what`` (no sleep stands for an event)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def _waiting_streams(srv, n):
    """``n`` streams are open on ``srv`` (each consumer is inside its do_get, waiting)."""
    _wait_until(lambda: srv.metrics()["active_streams"] >= n, f"{n} streams are open")


def test_consumer_joining_mid_way_gets_every_step_once(server, store):
    h = build_header("live", T=8, B=2)
    steps = make_steps(h)
    w = store.create(h)
    ticket = w.ticket
    out: dict = {}
    received: dict[int, list[int]] = {}
    threads = []
    for i in h.steps:
        if i in (0, 3, 7):  # consumers join before the start, mid-way and near the end
            received[i] = []
            th = threading.Thread(target=_consume, args=(server.locations[0], ticket, out, i, received[i]))
            th.start()
            threads.append(th)
            _waiting_streams(server, len(threads))  # it joined: its stream is open before step i exists
            # before step i is appended it has the steps produced so far (iter_steps yields a step
            # once the next one begins, so 0..i-2) and waits for the rest
            _wait_until(lambda k=i: received[k] == list(range(k - 1)), f"the consumer joining at {i} has steps before {i - 1}")
        w.append(steps[i])
    for i in (0, 3, 7):  # every consumer follows live: steps 0..7 arrive before the rollout finishes
        _wait_until(lambda k=i: received[k] == list(range(8)), f"the consumer joining at {i} has steps 0..7")
    assert store.get("live").state == "running"
    w.finish()
    for th in threads:
        th.join(timeout=10)
        assert not th.is_alive()
    for key in (0, 3, 7):
        got = out[key]
        assert not isinstance(got, Exception), got
        assert [s for s, _ in got] == list(range(9))
        assert all(torch.equal(x, steps[s].latent) for s, x in got)


def test_running_flight_info_reports_unknown_totals(server, store):
    w = store.create(build_header("run"))
    with flight.FlightClient(server.locations[0]) as c:
        info = c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "run"))
        assert info.total_records == -1 and info.total_bytes == -1
        assert info.endpoints[0].ticket.ticket.decode() == w.ticket
    w.fail("cancelled", "stop")


@pytest.mark.parametrize(
    ("kind", "error", "when"),
    [("failed", flight.FlightInternalError, "during"), ("cancelled", flight.FlightServerError, "during"),
     ("failed", flight.FlightInternalError, "after"), ("cancelled", flight.FlightServerError, "after")],
)
def test_failed_or_cancelled_rollout_ends_streams_with_reason(server, store, kind, error, when):
    h = build_header(f"end-{kind}-{when}", T=4)
    steps = make_steps(h)
    w = store.create(h)
    w.append(steps[0])
    out: dict = {}
    if when == "during":
        th = threading.Thread(target=_consume, args=(server.locations[0], w.ticket, out, "x"))
        th.start()
        _waiting_streams(server, 1)
        _wait_until(lambda: server.metrics()["bytes_served"] > 0, "the stream has sent step 0 (and waits for step 1)")
        assert "x" not in out
    w.fail(kind, "out of memory in step 1")
    if when == "during":
        th.join(timeout=10)
        exc = out["x"]
    else:
        with TrajectoryClient(server.locations[0]) as c, pytest.raises(error) as ei:
            list(c.iter_steps(w.ticket))
        exc = ei.value
    assert isinstance(exc, error), exc
    assert kind in str(exc) and "out of memory in step 1" in str(exc)
    assert not isinstance(exc, flight.FlightCancelledError)  # would become a KeyboardInterrupt in read_all
    assert store.get(h.rollout_id).state == kind
    assert store.stats()["bytes_in_memory"] == 0


@pytest.mark.parametrize("mapped", [False, True])
def test_live_stream_runs_to_its_end_when_the_rollout_is_released_just_after_it_succeeds(tmp_path, mapped):
    # a consumer that followed the rollout live wakes only after it succeeded and was released
    # (the TTL reaper, a DELETE or a Flight release at the moment REST says succeeded): it had
    # only to read the batches that exist, so it gets them all, as a consumer that began on
    # the finished rollout does (docs/dataplane.md, Store); mapped: over the budget, so spilled
    # to its file as it finishes (the batches the entry holds are replaced by the file's)
    store = ResultStore(memory_budget_bytes=1 if mapped else 1 << 30, data_dir=tmp_path if mapped else None)
    server = FlightDataServer(store).start()
    try:
        h = build_header("released-live", T=4)
        steps = make_steps(h)
        w = store.create(h)
        w.append(steps[0])
        out: dict = {}
        th = threading.Thread(target=_consume, args=(server.locations[0], w.ticket, out, "x"))
        th.start()
        _waiting_streams(server, 1)
        _wait_until(lambda: server.metrics()["bytes_served"] > 0, "the stream has sent step 0 (and waits for step 1)")
        e = store.get(h.rollout_id)
        with e.cond:  # the waiting stream wakes only once all of this is done
            for i in h.steps[1:]:
                w.append(steps[i])
            w.finish()
            assert (e.source is not None) is mapped
            assert store.release(h.rollout_id)
        th.join(timeout=10)
        got = out["x"]
        assert not isinstance(got, Exception), got
        assert [s for s, _ in got] == list(h.steps)
        assert all(torch.equal(x, steps[s].latent) for s, x in got)
        with TrajectoryClient(server.locations[0]) as c, pytest.raises(flight.FlightServerError, match="released"):
            list(c.iter_steps(w.ticket))  # a consumer that begins after the release is refused
    finally:
        server.stop()
        store.close()


def test_consumers_share_the_stored_buffers(store):
    h = build_header("share", T=3)
    steps = make_steps(h)
    w = store.create(h)
    for i in h.steps:
        w.append(steps[i])
    w.finish()
    e = store.get("share")
    a = list(e.iter_batches())
    b = list(e.iter_batches())
    assert all(x is y for x, y in zip(a, b, strict=True))
    addr = [x.column("latent").storage.values.buffers()[1].address for x in a]
    assert addr == [steps[i].latent.data_ptr() for i in h.steps]


def test_stop_ends_a_waiting_stream(tmp_path):
    store = ResultStore(memory_budget_bytes=1 << 20)
    srv = FlightDataServer(store).start()
    w = store.create(build_header("hang"))
    out: dict = {}
    th = threading.Thread(target=_consume, args=(srv.locations[0], w.ticket, out, "x"))
    th.start()
    _waiting_streams(srv, 1)
    assert "x" not in out  # still waiting for a first step
    t0 = time.monotonic()
    srv.stop()
    th.join(timeout=10)
    assert time.monotonic() - t0 < 8
    assert isinstance(out.get("x"), Exception)
    store.close()


def test_reserved_ticket_waits_for_create_then_streams(server, store):
    h = build_header("queued", T=2)
    steps = make_steps(h)
    ticket = store.reserve("queued")
    assert store.ticket_for("queued") == ticket
    out: dict = {}
    th = threading.Thread(target=_consume, args=(server.locations[0], ticket, out, "x"))
    th.start()
    _waiting_streams(server, 1)
    assert "x" not in out  # waiting on the reserved ticket
    w = store.create(h)
    assert w.ticket == ticket
    for i in h.steps:
        w.append(steps[i])
    w.finish()
    th.join(timeout=10)
    assert [s for s, _ in out["x"]] == [0, 1, 2]


def test_abandoned_reservation_ends_waiting_streams(server, store):
    ticket = store.reserve("never")
    out: dict = {}
    th = threading.Thread(target=_consume, args=(server.locations[0], ticket, out, "x"))
    th.start()
    _waiting_streams(server, 1)
    assert "x" not in out  # waiting on the reserved ticket
    assert store.abandon("never", "cancelled", "cancelled while queued")
    th.join(timeout=10)
    assert isinstance(out["x"], flight.FlightServerError) and "cancelled while queued" in str(out["x"])


def test_do_get_and_get_flight_info_take_a_rollout_id_as_well_as_a_ticket(store, server):
    """Clients never inspect a ticket: the server resolves either; a reserved id waits like its ticket."""
    import threading

    import pyarrow.flight as flight

    from tests.dataplane.helpers import build_header, make_steps

    header = build_header("by-id", T=2, B=2)
    ticket = store.reserve("by-id")
    got: dict[str, object] = {}
    with flight.FlightClient(server.locations[0]) as c:
        waiter = threading.Thread(target=lambda: got.update(t=c.do_get(flight.Ticket(b"by-id")).read_all()))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # queued: waits for create, as its ticket does
        steps = make_steps(header)
        w = store.create(header)
        for i in header.steps:
            w.append(steps[i])
        w.finish()
        waiter.join(10)
        by_ticket = c.do_get(flight.Ticket(ticket.encode())).read_all()
        assert got["t"].equals(by_ticket)  # type: ignore[attr-defined]
        for name in ("by-id", ticket):
            fi = c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", name))
            assert fi.endpoints[0].ticket.ticket == ticket.encode() and fi.total_records == by_ticket.num_rows
