"""TLS on both planes with a certificate the test generates: https for REST, grpc+tls for Flight."""

from __future__ import annotations

import ssl

import httpx
import pyarrow.flight as flight
import pytest

from tests.faults.conftest import TOKEN, call_options, pull
from tests.servers import InProcessServer, wait_for_status

BODY = {"prompts": ["a red cube", "a blue ball"], "num_inference_steps": 2, "seed": 5}


@pytest.fixture(scope="module")
def tls_server(certificate, tmp_path_factory):
    cert, key = certificate
    tokens = tmp_path_factory.mktemp("tls-auth") / "tokens.txt"
    tokens.write_text(TOKEN + "\n")
    with InProcessServer("--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(tokens)) as server:
        yield server


def test_both_planes_announce_tls(tls_server):
    assert tls_server.rest_url.startswith("https://127.0.0.1:")
    assert tls_server.flight_url.startswith("grpc+tls://127.0.0.1:")


def test_rest_over_https_and_flight_over_grpc_tls(tls_server, certificate):
    cert, _ = certificate
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=tls_server.rest_url, verify=ssl.create_default_context(cafile=str(cert)), headers=headers, timeout=30) as c:
        assert c.get("/healthz").status_code == 200
        ticket = c.post("/v1/rollouts", json=BODY).json()
        assert ticket["flight"]["locations"][0].startswith("grpc+tls://")
        wait_for_status(c, ticket["id"], {"succeeded"})
    location = ticket["flight"]["locations"][0]
    table = pull(location, ticket["flight"]["ticket"], TOKEN, tls_root_certs=cert.read_bytes(), timeout=60)
    assert table.num_rows == 2 * 3
    with flight.FlightClient(location, tls_root_certs=cert.read_bytes()) as fc:
        info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", ticket["id"]), options=call_options(TOKEN))
        assert info.total_records == 6
        assert [str(loc.uri, "utf-8") if isinstance(loc.uri, bytes) else str(loc.uri)
                for loc in info.endpoints[0].locations][0].startswith("grpc+tls://")
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(fc.list_flights())


def test_clients_that_do_not_trust_the_certificate_are_refused(tls_server):
    with httpx.Client(base_url=tls_server.rest_url, timeout=10) as c, pytest.raises(httpx.ConnectError):
        c.get("/healthz")
    with pytest.raises(httpx.RemoteProtocolError):  # plain http to the https port
        httpx.get(tls_server.rest_url.replace("https://", "http://") + "/healthz", timeout=10)
    with flight.FlightClient(tls_server.flight_url) as fc, pytest.raises(flight.FlightUnavailableError):
        list(fc.list_actions(options=flight.FlightCallOptions(timeout=5, headers=[(b"authorization", f"Bearer {TOKEN}".encode())])))
    plain = tls_server.flight_url.replace("grpc+tls://", "grpc+tcp://")
    with flight.FlightClient(plain) as fc, pytest.raises(flight.FlightUnavailableError):
        list(fc.list_actions(options=flight.FlightCallOptions(timeout=5)))
    assert tls_server.poll() is None
