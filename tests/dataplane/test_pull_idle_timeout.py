"""A pull of a stream that stalls ends with TimeoutError after the idle timeout (no record batch
for N s), on the TrajectoryClient and on sigmaflight.Client's pulls; the wait of a queued rollout
to start and the consumer's own time between batches are not counted.

The stalling server is this file's own pyarrow FlightServerBase on port 0 (as pyarrow's own tests
do): it sends the schema and some batches of a real trajectory, then nothing, keeping the call open."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import DEFAULT_IDLE_TIMEOUT_S, TrajectoryClient
from sigmaflight.dataplane.codec import encode_step
from sigmaflight.dataplane.schema import trajectory_schema

from sigmaflight import Client
from tests.dataplane.helpers import build_header, make_steps

pytestmark = pytest.mark.timeout(120)  # the bug is a pull that never returns

HEADER = build_header("stall", T=4, B=2, shape=(2, 3))
STEPS = make_steps(HEADER, seed=5)
SCHEMA = trajectory_schema(HEADER)
BATCHES = [b for i in HEADER.steps for b in encode_step(HEADER, STEPS[i], schema=SCHEMA)]


class StallingServer(flight.FlightServerBase):
    """Ticket b"stall": two batches, then silence until shutdown. b"whole": every batch.
    b"late": every batch, after ``start_delay`` s in do_get (as a queued rollout waits there)."""

    def __init__(self, start_delay: float = 0.0) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.released = threading.Event()
        self.start_delay = start_delay

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        if ticket.ticket == b"late":
            threading.Event().wait(self.start_delay)  # the handler holds the call before the schema
        return flight.GeneratorStream(SCHEMA, self._batches(ticket.ticket, context))

    def _batches(self, ticket: bytes, context: flight.ServerCallContext) -> Iterator[pa.RecordBatch]:
        if ticket != b"stall":
            yield from BATCHES
            return
        yield from BATCHES[:2]
        while not self.released.is_set() and not context.is_cancelled():
            self.released.wait(0.05)

    def shutdown(self) -> None:
        self.released.set()
        super().shutdown()


@pytest.fixture
def server() -> Iterator[StallingServer]:
    s = StallingServer(start_delay=1.5)
    yield s
    s.shutdown()


def _location(server: StallingServer) -> str:
    return f"grpc+tcp://127.0.0.1:{server.port}"


def test_a_stalled_stream_ends_in_timeout_error_and_the_connection_keeps_serving(server):
    with TrajectoryClient(_location(server), transport="flight", idle_timeout=0.5) as c:
        for pull in (lambda: c.pull("stall"), lambda: list(c.iter_steps("stall")), lambda: list(c.iter_chunks("stall"))):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"no record batch for 0\.5 s \(idle_timeout\)"):
                pull()
            assert time.monotonic() - t0 < 30  # about 0.5 s; generous on a loaded box
        traj = c.pull("whole")  # the same connection, the next pull
        assert torch.equal(traj.latent(4), STEPS[4].latent)


def test_the_queued_wait_and_the_consumers_own_time_are_not_counted(server):
    """do_get holding the call for 3x the idle timeout (a queued rollout) and a consumer taking
    2x the idle timeout over each batch: both pulls complete."""
    with TrajectoryClient(_location(server), transport="flight", idle_timeout=0.5) as c:
        assert torch.equal(c.pull("late").latent(0), STEPS[0].latent)
        seen = []
        for st in c.iter_chunks("whole"):
            seen.append(st.step)
            threading.Event().wait(1.0)  # the trainer's own work on a batch, not a wait for the server
        assert seen == list(HEADER.steps)


def test_sigmaflight_client_pulls_take_their_idle_timeout_and_rest_keeps_its_own(server):
    with Client("http://127.0.0.1:9", timeout=7.0, pull_idle_timeout=0.5, transport="flight") as client:
        assert client.timeout == 7.0 and client.flight(_location(server)).idle_timeout == 0.5
        with pytest.raises(TimeoutError, match="idle_timeout"):
            client.flight(_location(server)).pull("stall")
    with Client("http://127.0.0.1:9") as client:
        assert client.flight(_location(server)).idle_timeout == DEFAULT_IDLE_TIMEOUT_S == 3600.0
    with pytest.raises(ValueError, match="pull_idle_timeout"):
        Client("http://127.0.0.1:9", pull_idle_timeout=0)
    with pytest.raises(ValueError, match="idle_timeout"):
        TrajectoryClient(_location(server), idle_timeout=-1)


def test_parallel_pulls_take_the_idle_timeout_too():
    """iter_steps_parallel's consumer waits on its pumps' queues: the same limit applies there."""

    class Partitioned(StallingServer):
        def get_flight_info(self, context, descriptor):
            ticket = flight.Ticket(b"stall")
            loc = flight.Location(f"grpc+tcp://127.0.0.1:{self.port}")
            return flight.FlightInfo(SCHEMA, descriptor, [flight.FlightEndpoint(ticket, [loc])] * 2, -1, -1)

    s = Partitioned()
    try:
        with TrajectoryClient(_location(s), transport="flight", idle_timeout=0.5) as c:
            with pytest.raises(TimeoutError, match="idle_timeout"):
                list(c.iter_steps_parallel("stall", streams=2, merge_steps=False))
    finally:
        s.shutdown()
