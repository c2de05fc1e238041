"""The users' package loads no server code; the server imports no users' CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sigmaflight import Client

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


# ---- the users' side loads no model stack until it needs one -----------------------

MODEL_STACK = ("torch", "diffusers", "transformers")


def _model_stack(mods: list[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in mods} & set(MODEL_STACK))


def _cli_modules(*argv: str) -> tuple[int, list[str]]:
    """(exit status, modules loaded) of `sigmaflight ARGV` run in a fresh interpreter."""
    probe = (f"import json, sys\nfrom sigmaflight.cli import main\ntry:\n    rc = main({list(argv)!r})\n"
             "except SystemExit as e:\n    rc = e.code\nprint()\nprint(json.dumps([rc, sorted(sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    rc, mods = json.loads(out.stdout.strip().splitlines()[-1])
    return rc, mods


def test_import_sigmaflight_loads_no_model_stack():
    assert _model_stack(_modules_after("import sigmaflight")) == []
    assert _model_stack(_modules_after("from sigmaflight import Client, ApiError, ServerUnreachable")) == []


def test_the_probe_sees_the_model_stack():
    """The names that need torch or diffusers load them when they are used, and the probe sees it."""
    assert _model_stack(_modules_after("from sigmaflight import Trajectory")) == ["torch"]
    assert "diffusers" in _model_stack(_modules_after("from sigmaflight import Replayer"))


def test_help_and_the_rest_commands_load_no_model_stack(server):
    url = server.rest_url
    rc, mods = _cli_modules("--help")
    assert rc == 0 and _model_stack(mods) == [] and "httpx" not in mods
    rc, mods = _cli_modules("submit", "--url", url, "-p", "a", "--steps", "1", "--seed", "1", "--wait")
    assert rc == 0 and _model_stack(mods) == []
    with Client(url) as c:
        rollout = c.rollouts(limit=1)[0].id
    for argv in (("status", rollout), ("list",), ("cancel", rollout)):
        rc, mods = _cli_modules(*argv, "--url", url)
        assert rc in (0, 1) and "sigmaflight.commands" in mods, argv
        assert _model_stack(mods) == [], argv


# ---- every module fits in one head ---------------------------------------------------

PACKAGES = ("control", "dataplane", "pipeline", "sigmaflight")
MAX_MODULE_LINES = 450


def test_no_module_is_longer_than_450_lines():
    """A module past this does several things; split it by what each part does."""
    modules = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    assert len(modules) > 50  # the walk found the tree
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
