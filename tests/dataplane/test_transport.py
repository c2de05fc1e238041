"""Disconnects free their stream slot; TLS with a certificate the test generates."""

import shutil
import subprocess
import time

import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import TrajectoryClient
from sigmaflight.dataplane.server import FlightDataServer

from tests.dataplane.helpers import build_header, fill


def test_client_disconnect_mid_stream_frees_the_stream(store):
    # 64 MiB in 1 MiB batches: far more than gRPC's flow-control windows and the loopback socket
    # buffers hold, so the server is still writing when the client stops reading. (With 4 MiB the
    # whole table could be in flight before read_chunk returned, and the call was already over.)
    store.max_batch_bytes = 1 << 20
    fill(store, build_header("big", T=7, B=8, shape=(16, 128, 128)))
    with FlightDataServer(store) as srv:
        c = flight.FlightClient(srv.locations[0])
        reader = c.do_get(flight.Ticket(store.ticket_for("big").encode()))
        reader.read_chunk()
        assert srv.metrics()["active_streams"] == 1
        reader.cancel()
        del reader
        c.close()
        deadline = time.monotonic() + 10
        while srv.metrics()["active_streams"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.metrics()["active_streams"] == 0
        with TrajectoryClient(srv.locations[0]) as tc:  # still serving
            assert tc.pull("big").latents.shape == (8, 8, 16, 128, 128)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_a_generated_certificate(store, tmp_path):
    key, crt = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )
    steps = fill(store, build_header("tls"))
    cert = crt.read_bytes()
    with FlightDataServer(store, tls_certificates=[(cert, key.read_bytes())], tokens=["t"]) as srv:
        (loc,) = srv.locations
        assert loc.startswith("grpc+tls://127.0.0.1:")
        with TrajectoryClient(loc, tls_root_certs=cert, token="t") as c:
            assert torch.equal(c.pull("tls").latent(2), steps[2].latent)
        with TrajectoryClient(loc, token="t") as c, pytest.raises(flight.FlightError):
            c.pull("tls")  # an untrusted certificate is refused


def test_advertise_host_when_bound_to_all_interfaces(store):
    with FlightDataServer(store, host="0.0.0.0", advertise_host="trainer-visible.example") as srv:
        assert srv.locations == [f"grpc+tcp://trainer-visible.example:{srv.port}"]
    with FlightDataServer(store, advertise_host="ignored") as srv:
        assert srv.locations == [f"grpc+tcp://127.0.0.1:{srv.port}"]


def test_bound_to_all_interfaces_without_advertise_host_the_location_names_this_machine(store):
    """A location of 0.0.0.0 sends a trainer on another host to itself; --help promises the
    machine's host name by default."""
    import socket

    steps = fill(store, build_header("everywhere"))
    with FlightDataServer(store, host="0.0.0.0") as srv:
        assert srv.locations == [f"grpc+tcp://{socket.gethostname()}:{srv.port}"]
        with TrajectoryClient(srv.locations[0]) as c:  # and it serves there
            assert torch.equal(c.pull("everywhere").latent(2), steps[2].latent)
