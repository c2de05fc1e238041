"""Servers for tests, and polling.

`InProcessServer` is `sigmaflight serve` built and run in the test's process: the same flags and
SIGMAFLIGHT_* variables into the same Settings, the same Service, the real uvicorn server and
the real Flight server on loopback ports, so tests talk to it with real HTTP and Flight clients.
Tests whose subject is the process itself (signals, exit status, kill -9, start-up, its stderr)
start the real `sigmaflight serve` as a child, `ServerProcess` (sigmaflight/launcher.py), and
are marked `e2e`.

Tests wait for events the server shows (a status, a /metrics value, a log line) with these
polls and a generous deadline, never with a sleep standing in for the event.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import httpx

from sigmaflight.launcher import ServerProcess

__all__ = ["BLOCKER", "AnyServer", "InProcessServer", "ServerProcess", "flight_streams", "log_entries", "metric", "wait_for", "wait_for_entry", "wait_for_log",
           "wait_for_status"]

T = TypeVar("T")

BLOCKER: dict[str, Any] = {"prompts": ["blocker"] * 8, "num_outputs_per_prompt": 32, "num_inference_steps": 200,
                           "seed": 1, "return": {"steps": [0]}}
"""A rollout request of 256 samples x 200 steps (x_0 kept only): tens of seconds of work on the one
worker, nothing else can join its batch, and what comes after it stays queued until it is
cancelled. A POST body as is, or `Client.submit(**BLOCKER)`."""


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """os.environ with `env` added, while Settings reads its SIGMAFLIGHT_* variables."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _LogLines(logging.Handler):
    """The server's log records as the JSON lines `--log-format json` writes; notes the ready line."""

    def __init__(self, server: InProcessServer, level: str) -> None:
        from sigmaflight.control.logs import JsonFormatter

        super().__init__()
        self.setFormatter(JsonFormatter())
        self.server = server
        self.min_level = logging.getLevelName(level.upper())

    def emit(self, record: logging.LogRecord) -> None:
        # as --log-level filters the server's lines; the ready line passes any level, as it does there
        if record.levelno < self.min_level and record.name != "sigmaflight.ready":
            return
        line = self.format(record)
        self.server.logs.append(line)
        if record.getMessage() == "sigmaflight ready" and not self.server.rest_url:
            entry = json.loads(line)
            self.server.rest_url, self.server.flight_url = entry["rest_url"], entry["flight_url"]
            self.server._ready.set()


_live_lock = threading.Lock()
_live: list[InProcessServer] = []
_root_level = logging.WARNING


class InProcessServer:
    """`sigmaflight serve --port 0 --flight-port 0 --log-format json FLAGS` on a thread of this process.

    The surface of `ServerProcess` that tests use: `.rest_url`, `.flight_url`, `.client()`,
    `.logs` / `.log_text` (every record logged while it runs: two servers alive at once see each
    other's lines), `.terminate()` and the context manager; `.poll()` is None while it serves.
    No `.proc` and no `.kill()`: a test
    about the process or kill -9 uses `ServerProcess`. The built-in models cost about 0.1 s to
    build once this process has imported diffusers, so each server builds its own (a test that
    pushes weights cannot leak them into the next)."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, timeout: float = 90.0) -> None:
        from sigmaflight.control.serve import build_server, settings_from_argv
        from sigmaflight.control.startup import StartupError, preflight

        self.flags = flags
        self.logs: list[str] = []
        self.rest_url = ""
        self.flight_url = ""
        self._ready = threading.Event()
        with _environment(env):
            self.settings = settings_from_argv(["--port", "0", "--flight-port", "0", "--log-format", "json", *flags])
        try:
            preflight(self.settings)
        except StartupError as exc:  # what `sigmaflight serve` refuses with exit status 2
            raise RuntimeError(f"sigmaflight serve refuses to start: {exc}") from exc
        self._handler = _LogLines(self, self.settings.log_level)
        self._attach()
        try:
            self._server = build_server(self.settings)
        except BaseException:
            self._detach()
            raise
        self._thread = threading.Thread(target=self._run, name="sigmaflight-in-process", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or not self.rest_url:
            self.terminate()
            raise RuntimeError("server did not become ready:\n" + "\n".join(self.logs[-40:]))

    def _attach(self) -> None:
        global _root_level
        root = logging.getLogger()
        with _live_lock:
            if not _live:
                _root_level = root.level
            _live.append(self)
            root.addHandler(self._handler)
            if root.level == logging.NOTSET or root.level > self._handler.level:
                root.setLevel(self._handler.level)

    def _detach(self) -> None:
        root = logging.getLogger()
        with _live_lock:
            root.removeHandler(self._handler)
            if self in _live:
                _live.remove(self)
            if not _live:
                root.setLevel(_root_level)

    def _run(self) -> None:
        try:
            self._server.run()
        except BaseException:
            logging.getLogger("sigmaflight").exception("in-process server ended with an error")
        finally:
            self._ready.set()

    @property
    def log_text(self) -> str:
        return "\n".join(self.logs)

    def poll(self) -> int | None:
        """None while the server runs (as `Popen.poll` of a live process), else 0."""
        return None if self._thread.is_alive() else 0

    @property
    def app(self) -> Any:
        return self._server.config.app

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.rest_url, headers=headers, timeout=30.0)

    def terminate(self, timeout: float = 30.0) -> int:
        """Shut down as on SIGTERM (uvicorn's graceful path, then the lifespan stops the Service)."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._detach()
        if self._thread.is_alive():
            raise TimeoutError(f"the in-process server did not stop within {timeout}s")
        return 0

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


AnyServer = InProcessServer | ServerProcess
"""Either server, for helpers that tests of both kinds call."""


def wait_for(condition: Callable[[], T | None], what: str, timeout: float = 30.0, every: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail naming `what`
    (and the last value seen) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what} (last seen: {value!r})")
        time.sleep(every)


def wait_for_status(client: httpx.Client, rollout_id: str, statuses: set[str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/rollouts/{rollout_id}").json()
        if body["status"] in statuses:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout {rollout_id} still {body['status']} after {timeout}s: {body}")
        time.sleep(0.02)


def wait_for_log(server: AnyServer, text: str, timeout: float = 30.0, since: int = 0) -> str:
    """The first log line (from index `since` of `server.logs`) that contains `text`, once the
    test process has read it from the server's stderr."""
    return wait_for(lambda: next((line for line in server.logs[since:] if text in line), None),
                    f"a log line with {text!r}", timeout)


def log_entries(server: AnyServer, msg: str, **fields: object) -> list[dict]:
    """The server's JSON log lines whose `msg` is `msg` and which carry `fields`, parsed."""
    found = []
    for line in list(server.logs):
        if msg not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:  # not a JSON line (a library's own print)
            continue
        if entry.get("msg") == msg and all(entry.get(k) == v for k, v in fields.items()):
            found.append(entry)
    return found


def wait_for_entry(server: AnyServer, msg: str, timeout: float = 30.0, **fields: object) -> dict:
    """The first JSON log line `log_entries` finds, once the server has written it."""
    return wait_for(lambda: next(iter(log_entries(server, msg, **fields)), None),
                    f"a log line {msg!r} with {fields}", timeout)


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text exposition."""
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def flight_streams(client: httpx.Client) -> int:
    """The server's open Flight do_get streams (its stream slots in use), from /metrics."""
    return int(metric(client.get("/metrics").text, "sigmaflight_flight_streams"))
