"""Bearer auth on both planes of the real server: no token, wrong token, right token; tokens never logged."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pyarrow.flight as flight
import pytest

from tests.faults.conftest import OTHER_TOKEN, TOKEN, WRONG_TOKEN, call_options, pull
from tests.servers import InProcessServer, ServerProcess, wait_for_status

BODY = {"prompts": ["a red cube"], "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens.txt"
    path.write_text(f"# tokens\n\n{TOKEN}\n{OTHER_TOKEN}\n")
    os.chmod(path, 0o600)
    with InProcessServer("--token-file", str(path)) as server:
        yield server


ROUTES = [("GET", "/v1/rollouts"), ("POST", "/v1/rollouts"), ("GET", "/v1/rollouts/x"), ("DELETE", "/v1/rollouts/x"),
          ("GET", "/v1/models"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"),
          ("GET", "/docs/static/swagger-ui-bundle.js"), ("GET", "/nope")]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("token", [None, WRONG_TOKEN, TOKEN[:-1], TOKEN + "x"])
def test_rest_refuses_missing_and_wrong_tokens(secured, method, path, token):
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    with secured.client() as c:
        r = c.request(method, path, headers=headers, json=BODY if method == "POST" else None)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    error = r.json()["error"]
    assert error["type"] == "unauthorized"
    assert error["message"] == ("missing bearer token" if token is None else "invalid bearer token")


@pytest.mark.parametrize("header", [f"Basic {TOKEN}", TOKEN, f"bearer{TOKEN}", "Bearer", f"Bearer  {WRONG_TOKEN}",
                                    f"Bearer {TOKEN} {TOKEN}", f"Bearer\t{TOKEN}"])
def test_rest_refuses_other_schemes(secured, header):
    with secured.client() as c:
        assert c.get("/v1/models", headers={"authorization": header}).status_code == 401


def test_double_space_after_the_scheme_is_accepted_with_the_right_token_on_both_planes(secured):
    """RFC 6750 section 2.1: credentials = "Bearer" 1*SP b64token, so two spaces are still the scheme
    and the right token; the wrong token with two spaces stays refused (above). Both planes agree."""
    header = f"Bearer  {TOKEN}"
    with secured.client() as c:
        assert c.get("/v1/models", headers={"authorization": header}).status_code == 200
    opts = flight.FlightCallOptions(headers=[(b"authorization", header.encode())])
    with flight.FlightClient(secured.flight_url) as fc:
        assert {a.type for a in fc.list_actions(options=opts)} == {"cancel", "release", "weights_push_status"}
    wrong = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer  {WRONG_TOKEN}".encode())])
    with flight.FlightClient(secured.flight_url) as fc, pytest.raises(flight.FlightUnauthenticatedError):
        list(fc.list_actions(options=wrong))


SPELLINGS = ["Bearer", "bearer", "BEARER", "bEaReR"]
"""The auth scheme is case-insensitive on both planes, as RFC 6750 (and RFC 9110's auth-scheme) say."""


def _flight_ok(server: InProcessServer, header: str) -> bool:
    opts = flight.FlightCallOptions(headers=[(b"authorization", header.encode())], timeout=30)
    with flight.FlightClient(server.flight_url) as fc:
        try:
            return {a.type for a in fc.list_actions(options=opts)} == {"cancel", "release", "weights_push_status"}
        except flight.FlightUnauthenticatedError:
            return False


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_any_case_of_the_scheme_with_the_right_token_is_accepted_on_both_planes(secured: InProcessServer, scheme: str):
    with httpx.Client(base_url=secured.rest_url, timeout=30) as c:
        assert c.get("/v1/models", headers={"authorization": f"{scheme} {TOKEN}"}).status_code == 200
    assert _flight_ok(secured, f"{scheme} {TOKEN}")


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_any_case_of_the_scheme_with_a_wrong_token_is_refused_on_both_planes(secured: InProcessServer, scheme: str):
    with httpx.Client(base_url=secured.rest_url, timeout=30) as c:
        r = c.get("/v1/models", headers={"authorization": f"{scheme} {WRONG_TOKEN}"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid bearer token"
    assert not _flight_ok(secured, f"{scheme} {WRONG_TOKEN}")


def test_healthz_is_open(secured):
    with secured.client() as c:
        r = c.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_right_tokens_work_on_both_planes(secured):
    for token in (TOKEN, OTHER_TOKEN):
        with secured.client(token) as c:
            assert c.get("/readyz").status_code == 200
            ticket = c.post("/v1/rollouts", json=BODY).json()
            assert wait_for_status(c, ticket["id"], {"succeeded"})["status"] == "succeeded"
        table = pull(secured.flight_url, ticket["flight"]["ticket"], token, timeout=60)
        assert table.num_rows == 3
        with flight.FlightClient(secured.flight_url) as fc:
            opts = call_options(token)
            info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", ticket["id"]), options=opts)
            assert info.total_records == 3
            assert any(i.descriptor.path[1] == ticket["id"].encode() for i in fc.list_flights(options=opts))
            assert {a.type for a in fc.list_actions(options=opts)} == {"cancel", "release", "weights_push_status"}


def _flight_calls(client: flight.FlightClient, opts: flight.FlightCallOptions, rollout_id: str, ticket: str):
    yield "do_get", lambda: client.do_get(flight.Ticket(ticket.encode()), options=opts).read_all()
    yield "get_flight_info", lambda: client.get_flight_info(
        flight.FlightDescriptor.for_path("rollouts", rollout_id), options=opts)
    yield "list_flights", lambda: list(client.list_flights(options=opts))
    yield "do_action", lambda: list(client.do_action(flight.Action("release", rollout_id.encode()), options=opts))
    yield "list_actions", lambda: list(client.list_actions(options=opts))


@pytest.mark.parametrize("token", [None, WRONG_TOKEN, TOKEN[:-1]])
def test_flight_refuses_missing_and_wrong_tokens(secured, token):
    with secured.client(TOKEN) as c:
        ticket = c.post("/v1/rollouts", json=BODY).json()
        wait_for_status(c, ticket["id"], {"succeeded"})
    with flight.FlightClient(secured.flight_url) as fc:
        for name, call in _flight_calls(fc, call_options(token), ticket["id"], ticket["flight"]["ticket"]):
            t0 = time.monotonic()
            with pytest.raises(flight.FlightUnauthenticatedError, match="bearer token"):
                call()
            assert time.monotonic() - t0 < 3.0, name  # at once, not at the 60 s deadline (slack for a loaded box: pytest runs a worker per core, and one more)
    # the refused do_action("release") released nothing
    with secured.client(TOKEN) as c:
        assert c.get(f"/v1/rollouts/{ticket['id']}").json()["status"] == "succeeded"
    assert pull(secured.flight_url, ticket["flight"]["ticket"], TOKEN, timeout=60).num_rows == 3


@pytest.mark.e2e
def test_tokens_never_reach_the_logs(tmp_path):
    """Its own server: the log is read whole once the process has exited (SIGTERM), so a line
    written late (a rollout's end, a closed connection, shutdown) is read too."""
    path = tmp_path / "tokens.txt"
    path.write_text(f"# tokens\n\n{TOKEN}\n{OTHER_TOKEN}\n")
    os.chmod(path, 0o600)
    server = ServerProcess("--token-file", str(path))
    try:
        with server.client(WRONG_TOKEN) as c:
            assert c.get("/v1/models").status_code == 401
            assert c.post("/v1/rollouts", json=BODY).status_code == 401
        with server.client(TOKEN) as c:
            assert c.post("/v1/rollouts", content=b"{broken", headers={"content-type": "application/json"}).status_code == 422
            assert c.get("/v1/rollouts/does-not-exist").status_code == 404
            ticket = c.post("/v1/rollouts", json=BODY).json()
            assert wait_for_status(c, ticket["id"], {"succeeded"})["status"] == "succeeded"
        assert pull(server.flight_url, ticket["flight"]["ticket"], OTHER_TOKEN, timeout=60).num_rows == 3
        with flight.FlightClient(server.flight_url) as fc, pytest.raises(flight.FlightUnauthenticatedError):
            fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "x"), options=call_options(WRONG_TOKEN))
    finally:
        assert server.terminate() in (0, -15)  # exits (uvicorn re-raises SIGTERM); its stderr is read to the end
    logs = server.log_text
    assert '"msg": "sigmaflight ready"' in logs and ('"auth": true' in logs or '"auth":true' in logs)
    assert "rollout succeeded" in logs  # the log holds what happened after the requests too
    for secret in (TOKEN, OTHER_TOKEN, WRONG_TOKEN):
        assert secret not in logs
        assert secret[4:20] not in logs


def test_token_from_environment_variable_and_help_hides_it():
    with InProcessServer(env={"SIGMAFLIGHT_TOKEN": f"{TOKEN},{OTHER_TOKEN}"}) as server:
        with server.client() as c:
            assert c.get("/v1/models").status_code == 401
        with server.client(OTHER_TOKEN) as c:
            assert c.get("/v1/models").status_code == 200
        with flight.FlightClient(server.flight_url) as fc, pytest.raises(flight.FlightUnauthenticatedError):
            list(fc.list_flights())
        assert list(flight.FlightClient(server.flight_url).list_flights(options=call_options(TOKEN))) == []
        assert TOKEN not in server.log_text
    # `sigmaflight serve --help` with the token in the environment: the flag is documented, its value is not shown
    env = {**os.environ, "SIGMAFLIGHT_TOKEN": f"{TOKEN},{OTHER_TOKEN}"}
    help_ = subprocess.run([sys.executable, "-m", "sigmaflight.cli", "serve", "--help"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0, help_.stderr
    assert "--token TOKEN" in help_.stdout and "--token-file" in help_.stdout
    assert "SIGMAFLIGHT_TOKEN" in help_.stdout
    for secret in (TOKEN, OTHER_TOKEN):
        assert secret not in help_.stdout + help_.stderr
        assert secret[4:20] not in help_.stdout + help_.stderr
