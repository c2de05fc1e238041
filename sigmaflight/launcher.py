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
    line, and exposes the URLs it announced. It runs the server with `--log-format json` (that is
    how it reads the ready line): a `--log-format` other than json in `flags` is a ValueError.
    Dropping the last reference kills the server at garbage collection (the reader thread holds
    the process and the log list, not this object); `with` or `terminate()` ends it cleanly.
    """

    def __init__(self, *flags: str, env: dict[str, str] | None = None, timeout: float = 90.0) -> None:
        _check_log_format(flags)
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
        urls: dict[str, str] = {}
        # a function of the process and the lists, not a bound method: the thread must not keep self alive
        self._reader = threading.Thread(target=_read, args=(self.proc, self.logs, urls, self._ready), daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or not urls:
            self.kill()
            raise RuntimeError("server did not become ready:\n" + "\n".join(self.logs[-40:]))
        self.rest_url, self.flight_url = urls["rest_url"], urls["flight_url"]

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


def _check_log_format(flags: tuple[str, ...]) -> None:
    """ValueError for a `--log-format` other than json among `flags` (it would follow the launcher's
    own `--log-format json` and win, and the ready line could not be read: a wait to the timeout)."""
    for i, flag in enumerate(flags):
        if flag == "--log-format":
            value = flags[i + 1] if i + 1 < len(flags) else ""
        elif flag.startswith("--log-format="):
            value = flag.partition("=")[2]
        else:
            continue
        if value != "json":
            raise ValueError(f"--log-format {value!r}: ServerProcess runs the server with --log-format json and "
                             "waits for its JSON ready line; leave the flag out (its log lines are in .logs)")


def _read(proc: subprocess.Popen[str], logs: list[str], urls: dict[str, str], ready: threading.Event) -> None:
    """The child's stderr into `logs` until it closes (then the pipe is closed: a server dropped
    at garbage collection leaves no open file); the ready line's URLs into `urls`."""
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            logs.append(line.rstrip("\n"))
            if '"sigmaflight ready"' in line:
                entry = json.loads(line)
                urls.update(rest_url=entry["rest_url"], flight_url=entry["flight_url"])
                ready.set()
    except ValueError:  # closed by kill() or terminate() after their join gave up waiting
        pass
    finally:
        ready.set()
    proc.stderr.close()


def _kill_quietly(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
