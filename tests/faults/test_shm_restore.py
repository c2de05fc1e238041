"""A restart with `--shm-dir` on a tmpfs too small for the durable trajectories.

Three finished rollouts of about 1.3 MB with `--data-dir` and `--shm-dir` on a 2 MiB tmpfs are
served while the server runs (the ones that do not fit stay on the heap); after kill -9 the
restart copied them back into the shm dir and exited 3 on the first ENOSPC, every time. Now a
copy that does not fit is logged and that rollout is served from its durable file; start-up
goes on. A real tmpfs (we run as root) makes the ENOSPC honest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.flight as flight
import pytest

from tests.faults.conftest import latent_bytes, pull
from tests.servers import InProcessServer, ServerProcess, wait_for_status

pytestmark = pytest.mark.e2e

# 5 prompts x 2 outputs x 2 latents of 64 KiB: 1.25 MiB of latents (about 1.3 MB as a file)
MIDDLE = {"prompts": [f"p{i}" for i in range(5)], "num_outputs_per_prompt": 2, "num_inference_steps": 1,
          "height": 128, "width": 128, "guidance_scale": 1.0}


def _file_locations(flight_url: str, rollout_id: str) -> list[str]:
    with flight.FlightClient(flight_url) as fc:
        fi = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", rollout_id))
    return [loc.uri.decode() for loc in fi.endpoints[0].locations if loc.uri.startswith(b"file:")]


@pytest.mark.timeout(300)
def test_restart_on_a_too_small_shm_tmpfs_serves_from_the_data_dir(tmp_path: Path, tmpfs) -> None:
    shm = tmpfs("shm", "2m").path
    data = tmp_path / "data"
    flags = ("--shm-dir", str(shm), "--data-dir", str(data), "--workers", "1")
    first = ServerProcess(*flags)
    try:
        refs = {}
        with first.client() as c:
            for seed in (1, 2, 3):
                t = c.post("/v1/rollouts", json={**MIDDLE, "seed": seed}).json()
                assert wait_for_status(c, t["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
                refs[t["id"]] = (t["flight"]["ticket"], pull(first.flight_url, t["flight"]["ticket"]))
        assert sum(len(_file_locations(first.flight_url, rid)) for rid in refs) == 1  # one fits while running
        total = sum((data / "trajectories" / f"{rid}.arrow").stat().st_size for rid in refs)
        assert total > 2 * shm.stat().st_blksize and total > (2 << 20)  # more than the tmpfs holds
    finally:
        first.kill()  # kill -9: the shm files stay behind as a dead process's

    # the restart runs in this process (before: exit 3, "[Errno 28] No space left on device"; here
    # InProcessServer would raise that the server did not become ready)
    second = InProcessServer(*flags, timeout=120)
    try:
        assert "cannot copy it into shm_dir" in second.log_text
        assert "No space left on device" in second.log_text
        with second.client() as c:
            for rid, (ticket, table) in refs.items():
                assert c.get(f"/v1/rollouts/{rid}").json()["status"] == "succeeded"
                again = pull(second.flight_url, ticket)
                assert again.schema.metadata == table.schema.metadata
                assert latent_bytes(again) == latent_bytes(table)
        offered = {rid: _file_locations(second.flight_url, rid) for rid in refs}
        assert sum(map(len, offered.values())) >= 1  # what fits is in shared memory again, the rest is not
        assert sum(map(len, offered.values())) < len(refs)
        private = shm / f"sigmaflight-{os.geteuid()}"
        assert not [p for p in private.iterdir() if p.name.endswith(".partial")]  # no half copy left
        with second.client() as c:  # and it keeps running rollouts
            t = c.post("/v1/rollouts", json={**MIDDLE, "seed": 4}).json()
            assert wait_for_status(c, t["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
    finally:
        second.terminate()
