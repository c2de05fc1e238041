"""Fuzz Flight tickets, descriptors and actions (hypothesis): random bytes, long strings, wrong
descriptor types and paths get typed errors at once, never a hang or a crash; the server keeps serving."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.servers import InProcessServer, wait_for_status

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
# What the server answers bad input with (dataplane/server.py): FlightServerError, naming the problem.
TYPED: tuple[type[BaseException], ...] = (flight.FlightServerError,)
# pyarrow 26 loses the Flight type of a get_schema error (a bare ArrowException, "Unknown error: ...");
# the server's own message must still be there.
SCHEMA_TYPED: tuple[type[BaseException], ...] = (flight.FlightServerError, pa.ArrowException)
SERVER_SAYS: tuple[str, ...] = ("not found", "descriptor", "partition count")


@pytest.fixture(scope="module")
def live():
    with InProcessServer() as server, server.client() as c:
        ticket = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 1}).json()
        wait_for_status(c, ticket["id"], {"succeeded"})
        with flight.FlightClient(server.flight_url) as client:
            yield server, client, ticket


def _still_serves(client: flight.FlightClient, ticket: dict) -> None:
    assert client.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all().num_rows == 3


def _refused(call, typed: tuple[type[BaseException], ...] = TYPED, *, says: tuple[str, ...] = ()) -> BaseException:
    """The call fails at once with one of ``typed`` (never an arbitrary exception), its message
    holding one of ``says`` when given."""
    t0 = time.monotonic()
    with pytest.raises(BaseException) as info:
        call()
    assert time.monotonic() - t0 < 3.0  # at once, not at the 60 s deadline (slack for a loaded box: pytest runs a worker per core, and one more)
    assert isinstance(info.value, typed), f"{type(info.value).__name__} is not one of {typed}: {info.value}"
    assert not says or any(w in str(info.value) for w in says), str(info.value)
    return info.value


tickets = st.one_of(
    st.binary(max_size=256),
    st.text(max_size=256).map(str.encode),
    st.integers(1, 200_000).map(lambda n: b"sft1_" + b"A" * n),
    st.sampled_from([b"", b"sft1_", b"../../etc/passwd", b"__import__('os').system('true')", b"\x00" * 64]),
)


@FUZZ
@given(raw=tickets)
def test_random_tickets_get_not_found(live, raw):
    server, client, ticket = live
    if raw == ticket["flight"]["ticket"].encode():
        return
    error = _refused(lambda: client.do_get(flight.Ticket(raw)).read_all())
    assert "not found" in str(error)


segments = st.one_of(st.text(max_size=64), st.binary(max_size=64), st.just("rollouts"), st.just("partitions"),
                     st.integers(-5, 100).map(str), st.text(min_size=5000, max_size=6000))


@FUZZ
@given(path=st.lists(segments, max_size=6), command=st.binary(max_size=512), use_cmd=st.booleans())
def test_random_descriptors_get_typed_errors(live, path, command, use_cmd):
    server, client, ticket = live
    typed, schema_typed, says = TYPED, SCHEMA_TYPED, SERVER_SAYS
    if use_cmd:
        descriptor = flight.FlightDescriptor.for_command(command)
    else:
        descriptor = flight.FlightDescriptor.for_path(*path)
        as_text = [p.decode("utf-8", "replace") if isinstance(p, bytes) else p for p in path]
        if as_text[:2] == ["rollouts", ticket["id"]]:
            return
        if any(isinstance(p, bytes) and p != p.decode("utf-8", "replace").encode() for p in path):
            # protobuf refuses a non-UTF-8 path before it leaves the client: gRPC INTERNAL with no
            # message (FlightInternalError) or an OSError, not the server's answer
            client_side = (flight.FlightInternalError, OSError)
            typed, schema_typed, says = (*TYPED, *client_side), (*SCHEMA_TYPED, *client_side), ()
    _refused(lambda: client.get_flight_info(descriptor), typed, says=says)
    _refused(lambda: client.get_schema(descriptor), schema_typed, says=says)


@FUZZ
@given(kind=st.one_of(st.text(max_size=64), st.sampled_from(["cancel", "release"])), body=st.binary(max_size=512))
def test_random_actions_get_typed_errors_or_answers(live, kind, body):
    server, client, ticket = live
    if ticket["id"].encode() in body:
        return
    t0 = time.monotonic()
    try:
        results = [r.body.to_pybytes() for r in client.do_action(flight.Action(kind, body))]
    except flight.FlightServerError as e:  # the server's typed refusal, naming what was wrong
        assert "action" in str(e) or "not found" in str(e) or "JSON" in str(e), str(e)
    else:  # a well-formed cancel / release of an unknown id answers False
        assert kind in ("cancel", "release") and len(results) == 1 and b"false" in results[0]
    assert time.monotonic() - t0 < 3.0  # at once, not at the 60 s deadline (slack for a loaded box: pytest runs a worker per core, and one more)


def test_json_nested_past_pythons_stack_is_a_typed_refusal(live):
    """An action body or a do_put header nested 5000 deep raised RecursionError inside the
    server: an untyped error (no extra_info) with a Python traceback. It is bad input, typed."""
    import json

    from sigmaflight.dataplane.weights_wire import SCHEMA

    server, client, ticket = live
    deep = b"[" * 5000 + b"]" * 5000
    for kind in ("cancel", "release"):
        err = _refused(lambda kind=kind: list(client.do_action(flight.Action(kind, b'{"id": ' + deep + b"}"))))
        assert isinstance(err, flight.FlightError) and json.loads(err.extra_info)["type"] == "bad_request", err
        assert "Traceback" not in str(err)
    header = flight.FlightDescriptor.for_command(b'{"sigmaflight.weights": 1, "tensors": ' + deep + b"}")
    with pytest.raises(flight.FlightError) as caught:
        writer, reader = client.do_put(header, SCHEMA)
        try:
            writer.done_writing()
            reader.read()
        finally:
            writer.close()
    info = json.loads(caught.value.extra_info)
    assert (info["type"], info["reason"]) == ("bad_weights", "bad_header"), info
    _still_serves(client, ticket)


def test_server_still_serves_after_fuzzing(live):
    server, client, ticket = live
    _still_serves(client, ticket)
    assert {a.type for a in client.list_actions()} == {"cancel", "release", "weights_push_status"}
    assert [i.descriptor.path[1].decode() for i in client.list_flights()] == [ticket["id"]]
    assert server.poll() is None
    assert '"level": "critical"' not in server.log_text
