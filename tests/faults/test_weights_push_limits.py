"""A `PUT .../weights` that declares a huge Content-Length
and sends one byte must not make the server allocate the declared size, a stalled body ends
with a 408 and the contract's error body, and only `--max-weights-pushes` bodies are taken at
once (429 beyond, before the body is read). The server keeps serving throughout.

Raw sockets speak HTTP/1.1 here (httpx would not send a body shorter than its Content-Length);
the server's RSS is read with psutil.
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import psutil
import pytest

from tests.servers import AnyServer, InProcessServer, ServerProcess

MiB = 1 << 20
DECLARED = 512 * MiB  # the default --max-weights-bytes: the largest body the server accepts


def _address(server: AnyServer) -> tuple[str, int]:
    u = urlsplit(server.rest_url)
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


def stalled_push(server: AnyServer, route: str = "weights", declared: int = DECLARED) -> socket.socket:
    """A PUT whose headers promise `declared` bytes, then one byte of body, then nothing."""
    s = socket.create_connection(_address(server), timeout=60)
    s.sendall(f"PUT /v1/models/tiny-sd3/{route} HTTP/1.1\r\nhost: test\r\n"
              f"content-type: application/octet-stream\r\ncontent-length: {declared}\r\n\r\n".encode() + b"\0")
    return s


def response(s: socket.socket, timeout: float = 60.0) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of the one response on `s`."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(rest) < int(headers.get("content-length", "0")):
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, json.loads(rest) if rest else {}


def _version(server: AnyServer) -> int:
    with server.client() as c:
        (m,) = [m for m in c.get("/v1/models").json()["models"] if m["id"] == "tiny-sd3"]
        return int(m["weights_version"])


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_huge_content_length_with_a_tiny_body_allocates_nothing_and_times_out() -> None:
    with ServerProcess("--body-timeout-s", "3") as server:
        proc = psutil.Process(server.proc.pid)
        before = proc.memory_info().rss
        with stalled_push(server) as s:
            peak = before
            t0 = time.monotonic()
            while not select.select([s], [], [], 0.02)[0]:  # sample RSS until the server answers
                peak = max(peak, proc.memory_info().rss)
                assert time.monotonic() - t0 < 60, \
                    f"no answer to a stalled body after 60 s (RSS +{(peak - before) / MiB:.0f} MiB)"
            elapsed = time.monotonic() - t0
            status, _, body = response(s)
        print(f"RSS before {before / MiB:.1f} MiB, peak +{(peak - before) / MiB:.1f} MiB; 408 after {elapsed:.1f} s")
        assert peak - before < 64 * MiB, f"RSS grew {(peak - before) / MiB:.0f} MiB for a 1-byte body"
        assert status == 408, body
        assert body["error"]["type"] == "request_timeout"
        assert "3" in body["error"]["message"] and "body" in body["error"]["message"]
        assert elapsed >= 2.5
        assert _version(server) == 0  # nothing was pushed, and the server answers
        with server.client() as c:
            assert c.get("/healthz").status_code == 200


@pytest.mark.timeout(120)
def test_only_max_weights_pushes_bodies_at_once_and_a_slot_comes_back(tmp_path) -> None:
    with InProcessServer("--body-timeout-s", "4", "--max-weights-pushes", "1", "--weights-file-dir", str(tmp_path)) as server:
        with stalled_push(server, "lora") as held, server.client() as c:
            deadline = time.monotonic() + 30
            while True:  # the stalled push holds the one slot once its route runs
                r = c.put("/v1/models/tiny-sd3/weights", content=b"not safetensors",
                          headers={"content-type": "application/octet-stream"})
                if r.status_code == 429 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "too_many_pushes"
            assert "1" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
            # a same-host file push holds a thread and staging as a PUT does: it takes a slot too
            r = c.post("/v1/models/tiny-sd3/weights/file", json={"path": str(tmp_path / "w.safetensors")})
            assert r.status_code == 429 and r.json()["error"]["type"] == "too_many_pushes", r.text
            assert c.get("/healthz").status_code == 200  # other routes are not limited
            status, _, body = response(held)
            assert status == 408, body
            r = c.put("/v1/models/tiny-sd3/weights", content=b"not safetensors",
                      headers={"content-type": "application/octet-stream"})
            assert r.status_code == 422, r.text  # the slot came back: the body was read and refused
        assert _version(server) == 0
