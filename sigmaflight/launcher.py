"""Start `sigmaflight serve` as a child process and wait until it is ready.

Used by the end-to-end tests and the ops/ benchmarks; handy in notebooks too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python -m sigmaflight.cli serve --port 0 --flight-port 0 ...` as a child process.

    Reads its JSON log lines on a thread (kept in `.logs`), waits for the "sigmaflight ready"
    line, and exposes the URLs it announced.
    """

    def __init__(self, *flags: str, env: dict[str, str] | None = None, timeout: float = 90.0) -> None:
        self.flags = flags
        self.logs: list[str] = []
        self.rest_url = ""
        self.flight_url = ""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = [sys.executable, "-m", "sigmaflight.cli", "serve", "--port", "0", "--flight-port", "0",
               "--log-format", "json", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True)
        # Never leave a server behind: killed at garbage collection or interpreter exit at the latest.
        weakref.finalize(self, _kill_quietly, self.proc)
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or not self.rest_url:
            self.kill()
            raise RuntimeError("server did not become ready:\n" + "\n".join(self.logs[-40:]))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.logs.append(line.rstrip("\n"))
            if '"sigmaflight ready"' in line:
                entry = json.loads(line)
                self.rest_url, self.flight_url = entry["rest_url"], entry["flight_url"]
                self._ready.set()
        self._ready.set()

    @property
    def log_text(self) -> str:
        return "\n".join(self.logs)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.rest_url, headers=headers, timeout=30.0)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._close_pipe()
        return rc

    def _close_pipe(self) -> None:
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipe()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.kill()


def _kill_quietly(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
