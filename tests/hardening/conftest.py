"""Shared fixtures of the hardening suites: tokens, a self-signed certificate, pulls, RSS."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from sigmaflight.launcher import ROOT
from tests.servers import metric as metric  # re-exported: the /metrics parser lives in tests/servers.py

TOKEN = "sfk-3b1f0c2e9d7a4e58a6c4f1e2d3c4b5a6"
OTHER_TOKEN = "sfk-second-token-0f9e8d7c6b5a"
WRONG_TOKEN = "sfk-wrong-wrong-wrong-wrong-000000"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.txt"
    path.write_text(f"# sigmaflight tokens\n\n{TOKEN}\n  {OTHER_TOKEN}  \n")
    return path


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost, made with the openssl command line."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


def call_options(token: str | None) -> flight.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return flight.FlightCallOptions(headers=headers, timeout=60)


def pull(location: str, ticket: str, token: str | None = None, **client_kwargs: object) -> pa.Table:
    with flight.FlightClient(location, **client_kwargs) as c:  # type: ignore[arg-type]
        return c.do_get(flight.Ticket(ticket.encode()), options=call_options(token)).read_all()


def latent_bytes(table: pa.Table) -> bytes:
    """The latent column's raw values, in row order."""
    col = table.column("latent").combine_chunks()
    return col.storage.flatten().to_numpy(zero_copy_only=False).tobytes()


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


class RssSampler:
    """Samples a process's RSS every `every` seconds on a thread; `.peak`, `.samples`."""

    def __init__(self, pid: int, every: float = 0.02) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - t0, rss(self.pid)))
            self._stop.wait(self.every)

    @property
    def peak(self) -> int:
        return max(v for _, v in self.samples)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


SERVE = [sys.executable, "-m", "sigmaflight.cli", "serve", "--log-format", "json"]
"""The real `sigmaflight serve` command (JSON logs)."""


def serve_refused(*flags: str, env: dict[str, str] | None = None) -> str:
    """Run `sigmaflight serve FLAGS` that must refuse to start: exit 2 and one stderr line (no
    traceback, no log line: nothing loaded before it). Returns that line."""
    done = subprocess.run([*SERVE, *flags], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sigmaflight serve: "), lines
    return lines[0]
