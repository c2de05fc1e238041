"""Slow clients: uvicorn has no header or body read timeout, so a client
that trickles its request a byte at a time (or connects and sends nothing) held its connection
and its request forever. Bounded now: the request line and headers must arrive within
SIGMAFLIGHT_HEADER_TIMEOUT_S (the connection is closed, after a 408), the body within
SIGMAFLIGHT_BODY_TIMEOUT_S (408 with the contract's error body). Other clients are served
meanwhile. Raw sockets on the real server; the limits are set by environment variable.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.servers import BLOCKER, InProcessServer

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
REQUEST = (b"POST /v1/rollouts HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
           b"x-padding: " + b"p" * 400 + b"\r\n\r\n")


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    env = {"SIGMAFLIGHT_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "SIGMAFLIGHT_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}
    with InProcessServer(env=env) as s:
        yield s


def _connect(server: InProcessServer) -> socket.socket:
    u = urlsplit(server.rest_url)
    assert u.hostname is not None and u.port is not None
    return socket.create_connection((u.hostname, u.port), timeout=30)


class Trickler(threading.Thread):
    """Sends `data` one byte every `every` s (nothing when empty) until the server closes the
    connection; `.closed_after` is then the seconds it stayed open, `.answer` what it read."""

    def __init__(self, sock: socket.socket, data: bytes, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.every = sock, data, every
        self.closed_after: float | None = None
        self.answer = b""
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        self.sock.settimeout(self.every)
        i = 0
        while not self.stop.is_set():
            try:
                if i < len(self.data):
                    self.sock.sendall(self.data[i:i + 1])
                    i += 1
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset or broken pipe: the server closed it
                chunk = b""
            if not chunk:
                self.closed_after = time.monotonic() - t0
                return
            self.answer += chunk


def _wait_closed(tricklers: list[Trickler], within: float) -> None:
    deadline = time.monotonic() + within
    for t in tricklers:
        t.join(max(0.0, deadline - time.monotonic()))
    still = [t for t in tricklers if t.closed_after is None]
    for t in tricklers:
        t.stop.set()
    assert not still, f"{len(still)} of {len(tricklers)} slow connections still open after {within:.0f} s"


def _status(answer: bytes) -> int | None:
    return int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else None


@pytest.mark.timeout(120)
def test_trickled_and_silent_connections_are_closed_after_the_header_timeout(server: InProcessServer) -> None:
    socks = [_connect(server) for _ in range(24)]
    try:
        tricklers = [Trickler(s, REQUEST if i % 3 else b"") for i, s in enumerate(socks)]  # every third sends nothing
        for t in tricklers:
            t.start()
        t0 = time.monotonic()
        with httpx.Client(base_url=server.rest_url, timeout=10) as c:
            while any(t.closed_after is None for t in tricklers) and time.monotonic() - t0 < 2 * HEADER_TIMEOUT_S:
                started = time.monotonic()
                assert c.get("/healthz").status_code == 200  # others are served meanwhile
                assert time.monotonic() - started < 5
                time.sleep(0.2)
        _wait_closed(tricklers, within=30)
        for t in tricklers:
            assert t.closed_after is not None and t.closed_after >= HEADER_TIMEOUT_S * 0.8, t.closed_after
            assert _status(t.answer) == 408, t.answer[:200]
            body = json.loads(t.answer.partition(b"\r\n\r\n")[2])
            assert body["error"]["type"] == "request_timeout"
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(120)
def test_the_header_timeout_408_carries_a_request_id(server: InProcessServer) -> None:
    """control.md: every response carries x-request-id, the 408 of a request whose headers never
    came in full too (a new id: the caller's header, if any, was never read)."""
    with contextlib.closing(_connect(server)) as a, contextlib.closing(_connect(server)) as b:
        tricklers = [Trickler(a, b""), Trickler(b, REQUEST[:40])]
        for t in tricklers:
            t.start()
        _wait_closed(tricklers, within=30)
    ids = []
    for t in tricklers:
        assert _status(t.answer) == 408, t.answer[:200]
        head = t.answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
        headers = dict(line.lower().split(": ", 1) for line in head)
        assert len(headers.get("x-request-id", "")) >= 16, head
        ids.append(headers["x-request-id"])
    assert ids[0] != ids[1]


@pytest.mark.timeout(120)
def test_next_request_on_a_kept_alive_connection_has_the_same_header_timeout(server: InProcessServer) -> None:
    with contextlib.closing(_connect(server)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: test\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):
            first += s.recv(65536)
        assert _status(first) == 200
        t = Trickler(s, REQUEST)  # then the next request, a byte at a time
        t.start()
        _wait_closed([t], within=30)
        assert _status(t.answer) == 408


@pytest.mark.timeout(120)
def test_trickled_body_is_408_with_the_error_body(server: InProcessServer) -> None:
    body = json.dumps({"prompts": ["slow body " * 20], "num_inference_steps": 2}).encode()
    head = (b"POST /v1/rollouts HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    socks = [_connect(server) for _ in range(8)]
    try:
        for s in socks:
            s.sendall(head)  # headers at once, then the body a byte at a time
        tricklers = [Trickler(s, body) for s in socks]
        for t in tricklers:
            t.start()
        _wait_closed(tricklers, within=30)
        for t in tricklers:
            assert t.closed_after is not None and t.closed_after >= BODY_TIMEOUT_S * 0.8
            assert _status(t.answer) == 408, t.answer[:300]
            error = json.loads(t.answer.partition(b"\r\n\r\n")[2])["error"]
            assert error["type"] == "request_timeout" and "body" in error["message"]
        with httpx.Client(base_url=server.rest_url, timeout=10) as c:
            assert c.get("/v1/rollouts").json()["rollouts"] == []  # none of the slow bodies made a rollout
            assert c.get("/healthz").status_code == 200
    finally:
        for s in socks:
            s.close()


def test_request_headers_over_16_kib_are_refused_with_431_naming_the_header_and_the_connection_closed(server):
    """The request line and headers are bounded (16 KiB, h11's default bound; httptools has none):
    a client cannot hold the server's memory with endless headers inside the header timeout, and
    the refusal is the contract's error body naming the header, as /openapi.json says of every route."""
    with contextlib.closing(_connect(server)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: test\r\n" + b"X-Padding: " + b"p" * (20 * 1024) + b"\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower() and b"x-request-id: " in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "validation_error" and error["details"][0]["loc"] == ["header", "x-padding"]
    with contextlib.closing(_connect(server)) as sock:  # a request line past the bound: loc "url"
        sock.sendall(b"GET /healthz?q=" + b"q" * (20 * 1024) + b" HTTP/1.1\r\nhost: test\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["details"][0]["loc"] == ["url"]
    with httpx.Client(base_url=server.rest_url, timeout=10) as c:  # others are served
        assert c.get("/healthz").status_code == 200
        operations = [(path, method, op) for path, ops in c.get("/openapi.json").json()["paths"].items()
                      for method, op in ops.items()]
    assert len(operations) > 10
    for path, method, op in operations:  # any request may be refused so: the document says it
        assert op["responses"]["431"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"}, (method, path)


@pytest.mark.timeout(120)
def test_a_request_answered_after_longer_than_the_header_timeout_gets_its_answer(server: InProcessServer) -> None:
    """The header timeout counts while a request's headers are due, not while it is handled: a
    status read held past it is answered, not cut with a 408."""
    hold = HEADER_TIMEOUT_S + 1.5
    with httpx.Client(base_url=server.rest_url, timeout=60) as c:
        rid = c.post("/v1/rollouts", json=BLOCKER).json()["id"]  # tens of seconds of work, cancelled at the end
        try:
            t0 = time.monotonic()
            r = c.get(f"/v1/rollouts/{rid}", params={"wait_s": hold})
            took = time.monotonic() - t0
        finally:
            c.delete(f"/v1/rollouts/{rid}")
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("queued", "running")
    assert took >= hold - 0.05, took


def _answer(server: InProcessServer, raw: bytes) -> bytes:
    with contextlib.closing(_connect(server)) as sock:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def _count(server: InProcessServer, method: str, code: int) -> float:
    with httpx.Client(base_url=server.rest_url, timeout=10) as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(f'sigmaflight_http_responses_total{{code="{code}",method="{method}"}} '):
                return float(line.split()[-1])
    return 0.0


@pytest.mark.timeout(120)
def test_what_is_answered_below_the_app_has_the_error_body_and_is_counted(server: InProcessServer) -> None:
    """A request the HTTP parser refuses got uvicorn's text/plain "Invalid HTTP request received.";
    it and the 431 and 408 answered below the app were not counted in
    sigmaflight_http_responses_total, which counts every other answer."""
    before = {code: _count(server, method, code) for code, method in ((400, "POST"), (431, "GET"), (408, "unknown"))}
    reply = _answer(server, b"POST /v1/rollouts HTTP/1.1\r\nhost: test\r\ncontent-length: -5\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower() and b"x-request-id: " in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "bad_request" and "not valid HTTP/1.1" in error["message"], error
    assert _answer(server, b"GET /healthz HTTP/1.1\r\nhost: test\r\nX-Padding: " + b"p" * (20 * 1024) +
                   b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
    with contextlib.closing(_connect(server)) as silent:
        t = Trickler(silent, b"")
        t.start()
        _wait_closed([t], within=30)
    assert _status(t.answer) == 408
    assert _count(server, "POST", 400) == before[400] + 1
    assert _count(server, "GET", 431) == before[431] + 1
    assert _count(server, "unknown", 408) == before[408] + 1
