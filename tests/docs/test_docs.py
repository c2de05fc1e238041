"""The docs' code blocks run (README.md, docs/*.md), so the docs cannot drift from the code.

One real server (tests/servers.py InProcessServer) is started for the module, on the documented
default ports 8000 / 8815 when they are free; otherwise on free ports, and the blocks' URLs
(http://127.0.0.1:8000, grpc+tcp://127.0.0.1:8815) are replaced by the server's. SIGMAFLIGHT_URL
points the CLI's default at it either way. Each page runs in
its own subprocess (tests/docs/run_page.py) in a fresh folder holding `.venv` and `ops` links,
so `.venv/bin/python`, `.venv/bin/sigmaflight` and `ops/...` resolve as in a checkout.
Blocks marked `<!-- not run: reason -->` are counted, never silently skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.docs.markdown import CODE, KINDS, PAGES, ROOT, all_blocks, blocks
from tests.servers import InProcessServer

DEFAULT_REST = "http://127.0.0.1:8000"
DEFAULT_FLIGHT = "grpc+tcp://127.0.0.1:8815"
# Every code block not run in CI, by page: a change here is a change to what the docs promise.
NOT_RUN = {
    "README.md": 1,
    "docs/control.md": 1,
    "docs/dataplane.md": 1,
    "docs/operations.md": 2,
    "docs/scaling.md": 2,
    "docs/trainers.md": 5,
}
FRESH_ENV_PAGES = ("docs/trainers.md",)
"""Pages whose blocks run in a trainer's fresh environment (the wheel with [train] alone) instead:
tests/cli/test_install.py."""
RUNNABLE_PAGES = sorted({b.page for b in all_blocks() if b.lang in CODE and b.not_run is None} - set(FRESH_ENV_PAGES))


def test_every_block_is_typed_and_run_or_marked():
    seen = all_blocks()
    assert len(PAGES) >= 8 and seen
    for b in seen:
        assert b.lang in KINDS, f"{b.where}: fence language {b.lang!r}; use one of {KINDS}"
        if b.lang == "text":
            assert b.not_run is None, f"{b.where}: a text block needs no not-run mark"
        if b.not_run is not None:
            assert len(b.not_run) > 10, f"{b.where}: say why the block cannot run"
    not_run = Counter(b.page for b in seen if b.lang in CODE and b.not_run is not None)
    assert dict(not_run) == NOT_RUN
    ran = [b for b in seen if b.lang in CODE and b.not_run is None]
    text = [b for b in seen if b.lang == "text"]
    assert len(ran) + sum(not_run.values()) + len(text) == len(seen)
    assert {b.page for b in ran} == set(RUNNABLE_PAGES) | set(FRESH_ENV_PAGES)


def test_the_fence_parser_sees_marks_languages_and_lines(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n<!-- not run: serves until stopped -->\n```bash\nserve\n```\n\n```python\nx = 1\n```\n"
                    "- item\n  ```text\n  out\n  ```\n")
    got = blocks(page, root=tmp_path)
    assert [(b.line, b.lang, b.code, b.not_run) for b in got] == [
        (4, "bash", "serve", "serves until stopped"), (8, "python", "x = 1", None), (12, "text", "out", None)]


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def server():
    """On the documented ports when they are free (the blocks then run verbatim), else on free ones."""
    s = None
    if _free(8000) and _free(8815):
        try:
            s = InProcessServer("--port", "8000", "--flight-port", "8815")
        except RuntimeError:  # taken in between
            s = None
    with s or InProcessServer() as s:
        yield s


def _workdir(tmp_path: Path) -> Path:
    venv = ROOT / ".venv" if (ROOT / ".venv" / "bin" / "python").exists() else Path(sys.prefix)
    (tmp_path / ".venv").symlink_to(venv, target_is_directory=True)
    (tmp_path / "ops").symlink_to(ROOT / "ops", target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_page_blocks_run(page, server, tmp_path):
    work = _workdir(tmp_path)
    todo = []
    for b in blocks(ROOT / page):
        if b.lang in CODE and b.not_run is None:
            code = b.code.replace(DEFAULT_REST, server.rest_url).replace(DEFAULT_FLIGHT, server.flight_url)
            todo.append({"page": b.page, "line": b.line, "lang": b.lang, "code": code})
    (work / "blocks.json").write_text(json.dumps(todo))
    env = {**os.environ, "SIGMAFLIGHT_URL": server.rest_url, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    env.pop("SIGMAFLIGHT_TOKEN", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("run_page.py")), "blocks.json"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=120)
    print(proc.stdout)  # `ran PAGE:LINE (lang, seconds)` per block; pytest -rP shows it
    assert proc.returncode == 0, f"{page}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    # A block that hands Arrow's read-only memory to torch.from_numpy teaches undefined behaviour.
    assert "The given NumPy array is not writable" not in proc.stderr, f"{page}:\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("\nran ") + proc.stdout.startswith("ran ") == len(todo), proc.stdout
