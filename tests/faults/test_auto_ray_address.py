"""`--backend ray` with no `--ray-address` joins any Ray cluster running on this machine (Ray's "auto"
looks for a local raylet), so it can be refused only while none runs. The suite's own Ray tests
start clusters: this file is marked `after_ray`, which tests/conftest.py hands out last, and the test
waits for the clusters of tests still running to stop before it skips."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.faults.conftest import serve_refused

pytestmark = [pytest.mark.e2e, pytest.mark.after_ray]

RAY_GONE_S = 60.0


def _ray_cluster_runs() -> bool:
    return any("gcs_server" in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def test_backend_ray_with_no_cluster_here_names_auto_and_how_to_start_one():
    pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")
    deadline = time.monotonic() + RAY_GONE_S
    while _ray_cluster_runs():
        if time.monotonic() > deadline:
            pytest.skip("a Ray cluster runs on this machine: --ray-address auto would join it")
        time.sleep(0.5)
    line = serve_refused("--port", "0", "--flight-port", "0", "--backend", "ray")
    assert "--backend ray --ray-address auto" in line and "ray start --head" in line, line
