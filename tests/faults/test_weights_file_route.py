"""`POST /v1/models/{id}/weights/file` with paths and bodies a careless or hostile client sends: a
file cut short while the server reads it, FIFOs, paths outside the allowed directories (existing or
not), a NUL byte, JSON nested past Python's recursion limit. Each is a 422 on a real server, which
serves on with its weights unchanged."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.servers import InProcessServer

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _served(c: httpx.Client, model: str) -> str:
    return next(m["digest"] for m in c.get("/v1/models").json()["models"] if m["id"] == model)


def _refusal(r: httpx.Response) -> tuple[list, str]:
    assert r.status_code == 422, r.text
    detail = r.json()["error"]["details"][0]
    return detail["loc"], detail["msg"]


def _holds_open(path: Path) -> bool:
    """Whether this process (the in-process server) has `path` open."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


@pytest.mark.timeout(240)
def test_a_file_cut_short_while_it_is_read_is_a_422_and_the_server_serves_on(tmp_path):
    """A trainer saving over the file it pushed (`save_file` truncates first) while the server
    reads it: the read finds the end early. A memory map of the file used to kill the whole
    server with SIGBUS there. The cut lands after the server opened the file (seen in
    /proc/self/fd), so mostly mid-read; a cut before the header was read is the header's 422, one
    after the last byte a 200: each is fine, a dead server is not, and the mid-read case must be
    seen at least once."""
    model = "small-sd3"  # 53 MiB of weights: reading them takes long enough to cut into
    allowed = tmp_path / "weights"
    allowed.mkdir()
    path = allowed / "w.safetensors"
    with InProcessServer("--model", model, "--weights-file-dir", str(allowed)) as s, \
            httpx.Client(base_url=s.rest_url, timeout=120) as c:
        specs = c.get(f"/v1/models/{model}/weights/manifest").json()["specs"]
        state = {k: torch.full(v["shape"], 0.01, dtype=DT[v["dtype"]]) for k, v in specs.items()}
        before = _served(c, model)
        answers: list[tuple[int, str]] = []
        for _ in range(8):
            save_file(state, path)
            got: dict[str, httpx.Response] = {}
            push = threading.Thread(target=lambda got=got: got.update(r=c.post(f"/v1/models/{model}/weights/file",
                                                                               json={"path": str(path)})))
            push.start()
            deadline = time.monotonic() + 30
            while not _holds_open(path) and push.is_alive() and time.monotonic() < deadline:
                time.sleep(0.0005)
            os.truncate(path, 4096)
            push.join(60)
            r = got["r"]
            answers.append((r.status_code, r.text))
            if r.status_code == 200:
                before = _served(c, model)  # the whole file landed before the cut
                continue
            loc, msg = _refusal(r)
            assert loc == ["body"], r.text
            assert _served(c, model) == before  # nothing of a refused push is served
            if "while it was read" in msg:
                break
        assert any("while it was read" in text for _, text in answers), answers
        assert c.get("/healthz").status_code == 200
        assert c.post("/v1/rollouts", json={"prompts": ["after"], "num_inference_steps": 1}).status_code == 202


def test_paths_outside_fifos_nul_bytes_and_deep_json_are_422s_answered_at_once(tmp_path):
    """A FIFO (inside or outside the allowed directory) used to block a server thread in open()
    for good; a path outside was opened, and the answer said whether it existed; a NUL byte and a
    body nested deeper than Python's recursion limit were 500s."""
    allowed, outside = tmp_path / "weights", tmp_path / "elsewhere"
    allowed.mkdir()
    outside.mkdir()
    os.mkfifo(allowed / "in.fifo")
    os.mkfifo(outside / "out.fifo")
    (outside / "exists.safetensors").write_bytes(b"x" * 64)
    with InProcessServer("--weights-file-dir", str(allowed)) as s, httpx.Client(base_url=s.rest_url, timeout=20) as c:
        route = "/v1/models/tiny-sd3/weights/file"
        before = _served(c, "tiny-sd3")
        for fifo in (allowed / "in.fifo", outside / "out.fifo"):
            started = time.monotonic()
            loc, msg = _refusal(c.post(route, json={"path": str(fifo)}))
            assert loc == ["body", "path"] and "is not a regular file inside" in msg, msg
            assert time.monotonic() - started < 10
        # outside: the same words whether the path exists or not
        said = {name: _refusal(c.post(route, json={"path": str(outside / name)}))[1].replace(name, "NAME")
                for name in ("exists.safetensors", "missing.safetensors")}
        assert said["exists.safetensors"] == said["missing.safetensors"], said
        assert _refusal(c.post(route, json={"path": str(allowed / "w\x00.safetensors")}))[0] == ["body", "path"]
        deep = "[" * 100_000 + "]" * 100_000
        for body in (deep, '{"path": ' + deep + "}"):
            r = c.post(route, content=body, headers={"content-type": "application/json"})
            assert _refusal(r)[0][0] == "body", r.text
        assert _served(c, "tiny-sd3") == before
        assert c.get("/v1/rollouts").status_code == 200  # every thread of the pool is free
