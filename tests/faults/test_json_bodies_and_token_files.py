"""Auth must fail closed, POST bodies must be JSON, Idempotency-Key bounded."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import pytest

from tests.faults.conftest import SMALL
from tests.servers import InProcessServer, ServerProcess

TOKEN = "sfk-faults-0123456789abcdef0123456789"


def _start_refused(*flags: str) -> str:
    """Start a server that must refuse to start; return its stderr. Fails if it becomes ready."""
    try:
        server = ServerProcess(*flags, timeout=60)
    except RuntimeError as exc:  # exited before the ready line: what we want
        return str(exc)
    ready = [line for line in server.logs if '"sigmaflight ready"' in line]
    with contextlib.suppress(Exception):
        server.kill()
    pytest.fail(f"server started with {flags}: {ready}")


@pytest.mark.e2e
@pytest.mark.timeout(90)
@pytest.mark.parametrize("content", ["", "# only a comment\n\n   \n# another\n"], ids=["empty", "comments-only"])
def test_token_file_without_tokens_refuses_to_start(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text(content)
    os.chmod(path, 0o600)
    out = _start_refused("--token-file", str(path))
    assert str(path) in out
    assert "Traceback" not in out


@pytest.mark.e2e
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8"])
def test_missing_token_file_is_one_line_error(tmp_path: Path, kind: str) -> None:
    """Missing, unreadable as a file (a directory: we run as root, so chmod 000 would not stop a
    read) or not text: one line naming the file and the reason, no traceback."""
    path = tmp_path / "no-such-tokens.txt"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-utf8":
        path.write_bytes(b"\xff\xfe\x00token\n")
    out = _start_refused("--token-file", str(path))
    assert str(path) in out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "--token-file" in line]
    assert len(lines) == 1, out
    assert {"missing": "no such file", "directory": "is a directory", "not-utf8": "not UTF-8"}[kind] in lines[0]


def _served_with_token_file(tmp_path: Path, mode: int) -> list[str]:
    """The log lines of a server whose --token-file has `mode`, after one authorized request."""
    path = tmp_path / "tokens.txt"
    path.write_text(TOKEN + "\n")
    os.chmod(path, mode)
    with InProcessServer("--token-file", str(path)) as server:
        with server.client(TOKEN) as c:
            assert c.get("/v1/models").status_code == 200
        return list(server.logs)


@pytest.mark.timeout(90)
def test_world_readable_token_file_warns_once(tmp_path: Path) -> None:
    logs = _served_with_token_file(tmp_path, 0o644)
    path = str(tmp_path / "tokens.txt")
    lines = [line for line in logs if path in line and '"warning"' in line.lower()]
    assert len(lines) == 1, "\n".join(logs)[-3000:]
    assert TOKEN not in "\n".join(logs)


def test_private_token_file_does_not_warn(tmp_path: Path) -> None:
    """The control case of the warning above: mode 0600 draws no warning (holds today)."""
    logs = _served_with_token_file(tmp_path, 0o600)
    assert not [line for line in logs if str(tmp_path / "tokens.txt") in line]


@pytest.fixture(scope="module")
def open_server():
    with InProcessServer() as server:
        yield server


def _error_type(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) >= {"type", "message"}, body
    return str(body["error"]["type"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_post_requires_json_content_type(open_server: InProcessServer, content_type: str | None) -> None:
    import json

    headers = {"content-type": content_type} if content_type else {}
    with httpx.Client(base_url=open_server.rest_url, timeout=30) as c:
        before = len(c.get("/v1/rollouts", params={"limit": 1000}).json()["rollouts"])
        r = c.post("/v1/rollouts", content=json.dumps(SMALL).encode(), headers=headers)
        after = len(c.get("/v1/rollouts", params={"limit": 1000}).json()["rollouts"])
    assert r.status_code == 415, r.text
    assert "content-type" in r.json()["error"]["message"].lower()
    _error_type(r)
    assert after == before  # nothing was started


@pytest.mark.timeout(60)
def test_post_without_body_or_content_type_is_415(open_server: InProcessServer) -> None:
    with httpx.Client(base_url=open_server.rest_url, timeout=30) as c:
        r = c.post("/v1/rollouts")
    assert r.status_code == 415, r.text
    assert r.json()["error"]["type"] == "unsupported_media_type"
    assert r.json()["error"]["details"][0]["loc"] == ["header", "content-type"]


def test_post_json_content_type_with_charset_is_accepted(open_server: InProcessServer) -> None:
    """Control case (holds today): application/json, with or without charset, is a rollout."""
    import json

    with httpx.Client(base_url=open_server.rest_url, timeout=30) as c:
        r = c.post("/v1/rollouts", content=json.dumps(SMALL).encode(),
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 202, r.text


@pytest.mark.timeout(60)
def test_idempotency_key_length_is_bounded(open_server: InProcessServer) -> None:
    key = "k" * 100_000
    with open_server.client() as c:
        r = c.post("/v1/rollouts", json=SMALL, headers={"Idempotency-Key": key})
        assert r.status_code == 431, r.status_code  # past the 16 KiB bound on the request's headers
        body = r.json()["error"]
        assert "idempotency-key" in (body["message"] + str(body.get("details"))).lower()
        assert body["details"][0]["loc"] == ["header", "idempotency-key"]
        # a key of ordinary length still works, up to 255 characters
        ok = c.post("/v1/rollouts", json=SMALL, headers={"Idempotency-Key": "k" * 64})
        assert ok.status_code == 202, ok.text
        assert c.post("/v1/rollouts", json=SMALL, headers={"Idempotency-Key": "m" * 255}).status_code == 202
        for bad in ("m" * 256, "with space", "tab\tkey"):
            r = c.post("/v1/rollouts", json=SMALL, headers={"Idempotency-Key": bad})
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["error"]["details"][0]["loc"] == ["header", "idempotency-key"]
