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


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (signal 1: bit 0 of /proc's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("SigCgt:"))
    return bool(int(line.split()[1], 16) & 1)


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_sighup_is_caught_before_serve_loads_its_libraries_and_does_not_kill_it():
    """A SIGHUP in the first moments of `sigmaflight serve` (a closing terminal, an early `kill -HUP`)
    ended the process (129): the handler came only after the command's imports (pydantic, about
    0.3 s on a loaded box). It is set before them now: when it is first seen, pydantic's compiled
    core is not loaded yet, and a SIGHUP sent at that moment leaves the server to start."""
    import subprocess
    import sys

    from sigmaflight.launcher import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "sigmaflight.cli", "serve", "--port", "0", "--flight-port", "0",
                             "--torch-threads", "1"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sighup(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.0005)
        loaded_first = "pydantic_core" in _maps(proc.pid)
        proc.send_signal(signal.SIGHUP)
        assert not loaded_first, "the SIGHUP handler came only after the command's libraries had loaded"
        assert proc.stderr is not None
        for line in proc.stderr:
            if '"sigmaflight ready"' in line:
                break
        assert proc.poll() is None, f"rc={proc.poll()}"
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
