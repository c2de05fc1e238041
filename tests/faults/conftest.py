"""Fixtures of the fault and hardening suite: small tmpfs mounts (a full or read-only data dir
without touching the real disk), tokens, a self-signed certificate, Flight pulls with
deadlines, raw-table helpers, a server's RSS, and `sigmaflight serve` runs that must refuse.

The tests drive a real server (tests/servers.py) with plain httpx and plain pyarrow.flight
clients; nothing of control/ or sigmaflight/ is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from sigmaflight.launcher import ROOT
from tests.servers import metric as metric  # re-exported: the /metrics parser lives in tests/servers.py

TOKEN = "sfk-3b1f0c2e9d7a4e58a6c4f1e2d3c4b5a6"
OTHER_TOKEN = "sfk-second-token-0f9e8d7c6b5a"
WRONG_TOKEN = "sfk-wrong-wrong-wrong-wrong-000000"

# A rollout that runs for seconds on one CPU worker and captures only its ends.
LONG = {"prompts": ["slow"], "num_inference_steps": 3000, "seed": 21, "return": {"steps": [0, 3000]}}
SMALL = {"prompts": ["a red cube", "a blue ball"], "num_inference_steps": 3, "seed": 22}
# 64 samples x 2 steps x 64 KiB = 8 MiB of latents: spills past a 1 MiB store budget.
BIG = {"prompts": [f"p{i}" for i in range(16)], "num_outputs_per_prompt": 4, "num_inference_steps": 1,
       "height": 128, "width": 128, "guidance_scale": 1.0, "seed": 23}
BIG_FLAGS = ("--store-budget-bytes", str(1 << 20), "--max-samples", "1024")
LONG_FLAGS = ("--max-steps", "5000")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Tmpfs:
    """A small tmpfs mounted at `path` (we run as root, so chmod cannot make a directory
    unwritable: a read-only remount or a full tmpfs is the honest way to make writes fail)."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
        self.mounted = True

    def read_only(self) -> None:
        _run("mount", "-o", "remount,ro", str(self.path))

    def read_write(self) -> None:
        _run("mount", "-o", "remount,rw", str(self.path))

    def fill(self) -> Path:
        """Write a filler file until the filesystem is full; returns it (delete it to free space)."""
        filler = self.path / "filler.bin"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 16, 1 << 12, 1):  # big writes, then the last partial blocks
                while True:
                    try:
                        if os.write(fd, b"\0" * chunk) < chunk:
                            break
                    except OSError:
                        break
        finally:
            os.close(fd)
        return filler

    def free(self) -> None:
        (self.path / "filler.bin").unlink(missing_ok=True)

    def umount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self.mounted = False


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[object]:
    """tmpfs(name, size) -> Tmpfs under tmp_path; all unmounted (innermost first) at teardown."""
    mounts: list[Tmpfs] = []

    def make(name: str, size: str = "16m", under: Path | None = None) -> Tmpfs:
        m = Tmpfs((under or tmp_path) / name, size)
        mounts.append(m)
        return m

    try:
        probe = tmp_path / "probe"
        probe.mkdir()
        _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe))
        _run("umount", str(probe))
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc}); the full/read-only disk cases need one")
    yield make
    for m in reversed(mounts):
        if m.mounted:
            subprocess.run(["mount", "-o", "remount,rw", str(m.path)], check=False, capture_output=True)
        m.umount()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.txt"
    path.write_text(f"# sigmaflight tokens\n\n{TOKEN}\n  {OTHER_TOKEN}  \n")
    return path


def options(timeout: float = 10.0) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(timeout=timeout)


def call_options(token: str | None, timeout: float = 60.0) -> flight.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return flight.FlightCallOptions(headers=headers, timeout=timeout)


def pull(location: str, ticket: str, token: str | None = None, timeout: float = 10.0,
         **client_kwargs: object) -> pa.Table:
    with flight.FlightClient(location, **client_kwargs) as c:  # type: ignore[arg-type]
        return c.do_get(flight.Ticket(ticket.encode()), options=call_options(token, timeout)).read_all()


def latent_bytes(table: pa.Table) -> bytes:
    """The latent column's raw values, in row order."""
    col = table.column("latent").combine_chunks()
    return col.storage.flatten().to_numpy(zero_copy_only=False).tobytes()


def wait_running(client: httpx.Client, rollout_id: str, steps: int = 2, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/rollouts/{rollout_id}").json()
        if body["status"] == "running" and body["progress"]["steps_done"] >= steps:
            return
        assert body["status"] in ("queued", "running"), body
        assert time.monotonic() < deadline, f"rollout {rollout_id} not running after {timeout}s: {body}"
        time.sleep(0.02)


class Pull(threading.Thread):
    """A do_get on a thread: `.table` or `.error` once done, `.elapsed` seconds."""

    def __init__(self, location: str, ticket: str, timeout: float) -> None:
        super().__init__(daemon=True)
        self.location, self.ticket, self.timeout = location, ticket, timeout
        self.table: pa.Table | None = None
        self.error: BaseException | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.table = pull(self.location, self.ticket, timeout=self.timeout)
        except BaseException as exc:  # handed to the test
            self.error = exc
        self.elapsed = time.monotonic() - t0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
