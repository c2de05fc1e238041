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
