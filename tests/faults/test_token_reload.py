"""SIGHUP re-reads --token-file on both planes (REST and Flight, and every Ray worker's Flight
server), and fails closed: a file that is now empty or gone changes nothing, and a server
without a token file stays up and says so. Real servers, plain httpx and pyarrow.flight. (The Ray
workers' part is in tests/ray/test_serve_on_ray.py, on a server that test starts anyway.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow.flight as flight
import pytest

from tests.servers import ServerProcess

pytestmark = pytest.mark.e2e

OLD = "sfk-reload-old-0123456789abcdef0123"
NEW = "sfk-reload-new-fedcba9876543210fedc"


def _hup_and_wait(server: ServerProcess, line: str, before: int) -> None:
    """Send SIGHUP and wait until `line` appears in the log more often than `before` times."""
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while server.log_text.count(line) <= before:
        assert time.monotonic() < deadline, server.log_text[-3000:]
        assert server.proc.poll() is None, "the server died on SIGHUP"
        time.sleep(0.05)


def _rest(server: ServerProcess, token: str) -> int:
    with server.client(token) as c:
        return c.get("/v1/models").status_code


def _flight_ok(location: str, token: str, ticket: str | None = None) -> bool:
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())], timeout=10)
    with flight.FlightClient(location) as fc:
        try:
            if ticket is None:
                list(fc.list_flights(options=options))
            else:
                fc.do_get(flight.Ticket(ticket.encode()), options=options).read_all()
        except flight.FlightUnauthenticatedError:
            return False
    return True


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    os.chmod(path, 0o600)


@pytest.mark.timeout(120)
def test_sighup_swaps_the_tokens_on_both_planes_and_a_bad_file_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    _write(path, OLD + "\n")
    with ServerProcess("--token-file", str(path)) as server:
        assert _rest(server, OLD) == 200 and _rest(server, NEW) == 401
        _write(path, f"# rotated\n{NEW}\n")
        _hup_and_wait(server, '"tokens reloaded"', 0)
        assert _rest(server, NEW) == 200 and _rest(server, OLD) == 401
        assert _flight_ok(server.flight_url, NEW) and not _flight_ok(server.flight_url, OLD)

        for bad in ("# nothing here\n", None):  # empty, then gone: fail closed, keep NEW
            if bad is None:
                path.unlink()
            else:
                _write(path, bad)
            _hup_and_wait(server, '"token reload failed', server.log_text.count('"token reload failed'))
            assert _rest(server, NEW) == 200 and _rest(server, OLD) == 401
            assert _flight_ok(server.flight_url, NEW)
        assert OLD not in server.log_text and NEW not in server.log_text


@pytest.mark.timeout(60)
def test_sighup_without_a_token_file_keeps_the_server_up_and_open(tmp_path: Path) -> None:
    with ServerProcess() as server:
        _hup_and_wait(server, '"token reload failed', 0)
        assert "no --token-file to reload" in server.log_text
        assert _rest(server, "anything") == 200  # auth stays off, the server serves on
