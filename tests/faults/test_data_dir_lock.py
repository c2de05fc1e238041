"""One live server a --data-dir, on real `sigmaflight serve` processes: a second server on a data dir a
live server uses is refused before it reads anything there (its restart scan would take the live
server's half-written trajectory file and running rollout for a dead process's leftovers), and a
server killed with SIGKILL leaves the directory free."""

from __future__ import annotations

import pytest

from tests.faults.conftest import serve_refused, wait_running
from tests.servers import ServerProcess, wait_for_status

pytestmark = pytest.mark.e2e

# about 20 s on one CPU thread: still running while the second server is refused (then cancelled)
RUNNING = {"prompts": ["slow"], "num_inference_steps": 12000, "seed": 31, "return": {"steps": [0, 12000]}}
FLAGS = ("--torch-threads", "1", "--max-steps", "20000")


def test_a_second_server_on_a_live_servers_data_dir_is_refused_and_a_killed_servers_is_free(tmp_path):
    data = tmp_path / "data"
    first = ServerProcess("--data-dir", str(data), *FLAGS)
    try:
        with first.client() as c:
            running = c.post("/v1/rollouts", json=RUNNING).json()
            partial = data / "trajectories" / f"{running['id']}.arrow.partial"
            wait_running(c, running["id"], steps=10, timeout=30)
            assert partial.exists()

            line = serve_refused("--port", "0", "--flight-port", "0", "--data-dir", str(data))
            assert f"--data-dir {data}: in use by another live server" in line, line
            assert c.get(f"/v1/rollouts/{running['id']}").json()["status"] == "running"
            assert partial.exists()  # the refused server removed nothing
            # the lock file deleted under the live server (the docs say it means nothing by
            # itself): a second server used to lock a new file of that name and start
            (data / ".sigmaflight.lock").unlink()
            line = serve_refused("--port", "0", "--flight-port", "0", "--data-dir", str(data))
            assert f"--data-dir {data}: in use by another live server" in line, line
            assert partial.exists()

            # the first server goes on: it ends its rollout as it would have (cancelled here, not
            # waited out) and journals that
            assert c.delete(f"/v1/rollouts/{running['id']}").status_code == 200
            done = wait_for_status(c, running["id"], {"cancelled", "failed", "succeeded"}, timeout=60)
            assert done["status"] == "cancelled", done
    finally:
        first.kill()  # SIGKILL: no shutdown code runs; the kernel drops the lock with the process

    with ServerProcess("--data-dir", str(data), *FLAGS) as again, again.client() as c:
        status = c.get(f"/v1/rollouts/{running['id']}").json()
        assert status["status"] == "cancelled" and status["error"] == done["error"]
