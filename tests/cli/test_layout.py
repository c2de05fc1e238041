"""The users' package loads no server code; the server imports no users' CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER_ONLY = ("starlette", "uvicorn", "ray", "pydantic_settings")


def _modules_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _server_modules(mods: list[str]) -> list[str]:
    return [m for m in mods if m.split(".")[0] in SERVER_ONLY or m == "sqlite3"
            or m == "sigmaflight.control" or m.startswith("sigmaflight.control.")]


def test_import_sigmaflight_loads_no_server_code():
    assert _server_modules(_modules_after("import sigmaflight")) == []


def test_from_sigmaflight_import_client_loads_no_server_code():
    mods = _modules_after("from sigmaflight import Client, RolloutCancelled, RolloutFailed")
    assert "sigmaflight.client" in mods  # the probe did import something
    assert _server_modules(mods) == []


def test_client_commands_load_no_server_code():
    mods = _modules_after("from sigmaflight.cli import build_parser\nbuild_parser().format_help()")
    assert _server_modules(mods) == []


def test_the_probe_sees_server_modules():
    """The check above can fail: importing the server shows up in the same probe."""
    mods = _server_modules(_modules_after("import sigmaflight.control.http.app"))
    assert "starlette" in mods and "sigmaflight.control.jobs.journal" in mods and "sqlite3" in mods
