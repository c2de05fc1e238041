"""`sigmaflight serve --backend ray --ray-address local` starts its own Ray instance;
SIGTERM must stop all of it. Before, ray::DashboardAgent and ray::RuntimeEnvAgent (about 85 MB
each, deaf to SIGTERM) outlived the server as orphans."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.servers import ServerProcess

pytestmark = pytest.mark.e2e

pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")


def _tree(pid: int) -> dict[int, str]:
    """Every process under `pid` now, by pid, with its command line (Ray names its own ray::...)."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out[p.pid] = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
    return out


def _alive(pid: int, since: float) -> bool:
    """Still running, and the same process (a pid reused after it died has a later start time)."""
    try:
        p = psutil.Process(pid)
        return p.create_time() <= since and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sigterm_stops_every_process_of_the_ray_instance_the_server_started():
    with ServerProcess("--backend", "ray", "--ray-address", "local", "--workers", "1", "--ray-num-cpus", "1",
                       timeout=240) as server:
        started = time.time()
        tree = _tree(server.proc.pid)
        agents = [cmd for cmd in tree.values() if "DashboardAgent" in cmd or "RuntimeEnvAgent" in cmd
                  or "raylet" in cmd or "gcs_server" in cmd]
        assert agents, f"the probe sees no Ray process under the server: {sorted(tree.values())}"
        assert server.terminate(timeout=60) in (0, -15)  # uvicorn re-raises SIGTERM after a clean shutdown
        assert "Finished server process" in server.log_text
    deadline = time.monotonic() + 30
    while (left := {pid: cmd for pid, cmd in tree.items() if _alive(pid, started)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == {}, f"outlived the server: {sorted(left.values())}"
