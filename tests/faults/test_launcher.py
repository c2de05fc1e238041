"""`sigmaflight.launcher.ServerProcess` never leaves a server behind: dropping the last reference
kills the child at garbage collection; and a caller's `--log-format` other than json, which would
hide the JSON ready line the launcher waits for, is refused at once."""

from __future__ import annotations

import gc
import time

import pytest

from sigmaflight.launcher import ServerProcess

pytestmark = pytest.mark.e2e


def _start() -> tuple[object, int]:
    server = ServerProcess("--torch-threads", "1", "--workers", "1")
    return server.proc, server.proc.pid


@pytest.mark.timeout(180)
def test_a_dropped_server_process_is_killed_at_garbage_collection() -> None:
    """The reader thread's target was the bound method `self._read`: it kept the object alive while
    the child ran, so the weakref.finalize that kills the child waited for interpreter exit."""
    proc, pid = _start()  # the ServerProcess itself is gone with the frame
    try:
        gc.collect()
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        assert proc.poll() is not None, f"server {pid} still runs after its ServerProcess was collected"  # type: ignore[attr-defined]
    finally:
        if proc.poll() is None:  # type: ignore[attr-defined]
            proc.kill()  # type: ignore[attr-defined]
            proc.wait(10)  # type: ignore[attr-defined]


@pytest.mark.parametrize("flags", [("--log-format", "text"), ("--log-format=text",), ("--log-format", "TEXT")])
def test_a_log_format_other_than_json_is_refused_at_once(flags: tuple[str, ...]) -> None:
    """It waited its whole timeout and raised "server did not become ready" with a server that was serving."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="--log-format.*JSON ready line"):
        ServerProcess("--torch-threads", "1", *flags, timeout=20)
    assert time.monotonic() - t0 < 10  # before: the whole 20 s timeout


@pytest.mark.timeout(180)
def test_log_format_json_is_taken() -> None:
    with ServerProcess("--torch-threads", "1", "--workers", "1", "--log-format=json") as server:
        assert server.rest_url.startswith("http://") and server.flight_url
        assert any('"sigmaflight ready"' in line for line in server.logs)


def test_the_ready_line_is_info_at_any_log_level_and_its_command_works_with_a_list_of_tokens():
    """Alerts on error lines must not fire on a healthy start, and the `try` command, run in the
    server's own shell (SIGMAFLIGHT_TOKEN holding the comma-separated list serve takes), must work."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    env = {"SIGMAFLIGHT_TOKEN": "tok-a,tok-b"}
    with ServerProcess("--port", "0", "--flight-port", "0", "--log-level", "error", "--torch-threads", "1",
                       env=env) as server:
        ready = next(json.loads(line) for line in server.logs if '"sigmaflight ready"' in line)
        assert ready["level"] == "info", ready
        argv = shlex.split(ready["try"].replace('"$SIGMAFLIGHT_TOKEN"', env["SIGMAFLIGHT_TOKEN"]))
        assert argv[0] == "sigmaflight"
        done = subprocess.run([sys.executable, "-m", "sigmaflight.cli", *argv[1:]], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "succeeded"
