"""The result store when file operations fail or files change.

Read-only data dir: `<data_dir>/trajectories` is its own small tmpfs, remounted read-only
(we run as root: chmod would not stop a write; the journal stays on a writable directory).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tests.faults.conftest import BIG, BIG_FLAGS, LONG_FLAGS, SMALL, Pull, alive, options, pull
from tests.servers import (
    InProcessServer,
    ServerProcess,
    metric,
    wait_for,
    wait_for_entry,
    wait_for_log,
    wait_for_status,
)

BIG_ROWS = 64 * 2  # samples x streamed steps
MID = {"prompts": ["mid"], "num_inference_steps": 600, "seed": 41, "return": {"steps": [0, 600]}}


def _listed(location: str) -> set[str]:
    with flight.FlightClient(location) as c:
        return {bytes(f.descriptor.path[1]).decode() for f in c.list_flights(options=options(10))}


def _assert_fails_fast(location: str, ticket: str, what: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(flight.FlightError) as info:
        pull(location, ticket, timeout=5)
    assert not isinstance(info.value, flight.FlightTimedOutError), f"{what}: do_get hung until its deadline"
    assert time.monotonic() - t0 < 3, what
    assert "failed" in str(info.value), (what, str(info.value))


@pytest.mark.timeout(120)
def test_read_only_trajectory_dir_ends_the_stream_as_failed(tmpfs) -> None:
    data = tmpfs("data", "8m")
    traj = tmpfs("trajectories", "8m", under=data.path)
    with InProcessServer("--data-dir", str(data.path), "--workers", "1") as server, server.client() as c:
        traj.read_only()
        ticket = c.post("/v1/rollouts", json=SMALL).json()
        # The consumer's deadline is far past the joins below: on a slow box the rollout may take
        # longer than a short deadline, and only a stream the failure never ended may outlive them.
        live = Pull(server.flight_url, ticket["flight"]["ticket"], timeout=90)
        live.start()  # a consumer already waiting on the ticket
        status = wait_for_status(c, ticket["id"], {"succeeded", "failed"}, timeout=30)
        assert status["status"] == "failed", status
        assert "Read-only" in status["error"]["message"], status
        live.join(15)
        assert not live.is_alive(), "the live consumer still waits after the rollout failed"
        assert live.error is not None, "the waiting consumer got a table from a failed rollout"
        assert not isinstance(live.error, flight.FlightTimedOutError), "the live consumer waited forever"
        assert "failed" in str(live.error)
        _assert_fails_fast(server.flight_url, ticket["flight"]["ticket"], "a new do_get")
        assert ticket["id"] not in _listed(server.flight_url)
        traj.read_write()
        again = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, again["id"], {"succeeded", "failed"})["status"] == "succeeded"


def test_a_full_stream_dir_fails_the_rollout_naming_the_stream_and_the_server_goes_on(tmpfs) -> None:
    data = tmpfs("data", "8m")
    streams = tmpfs("streams", "64k", under=data.path)
    streams.fill()
    with InProcessServer("--data-dir", str(data.path), "--workers", "1") as server, server.client() as c:
        ticket = c.post("/v1/rollouts", json={**SMALL, "return": {"conditioning": True}}).json()
        status = wait_for_status(c, ticket["id"], {"succeeded", "failed"}, timeout=30)
        assert status["status"] == "failed", status
        assert "'conditioning' stream file" in status["error"]["message"], status
        assert "No space left" in status["error"]["message"], status
        assert not (data.path / "trajectories" / f"{ticket['id']}.arrow").exists()  # never committed
        plain = c.post("/v1/rollouts", json=SMALL).json()  # the server goes on
        assert wait_for_status(c, plain["id"], {"succeeded", "failed"})["status"] == "succeeded"
        streams.free()
        again = c.post("/v1/rollouts", json={**SMALL, "return": {"conditioning": True}}).json()
        assert wait_for_status(c, again["id"], {"succeeded", "failed"})["status"] == "succeeded"
        assert (streams.path / f"{again['id']}.conditioning.arrow").exists()


@pytest.mark.timeout(120)
def test_failed_rename_ends_the_stream_as_failed(tmp_path) -> None:
    """The final rename fails: a directory stands at `<id>.arrow` (put there from outside
    while the rollout runs), so os.replace raises IsADirectoryError."""
    data = tmp_path / "data"
    flags = ("--data-dir", str(data), "--workers", "1", "--max-flight-streams", "4", *LONG_FLAGS)
    with InProcessServer(*flags) as server, server.client() as c:
        ticket = c.post("/v1/rollouts", json=MID).json()
        blocker = data / "trajectories" / f"{ticket['id']}.arrow"
        blocker.mkdir(parents=True)
        (blocker / "keep").write_text("in the way")
        live = Pull(server.flight_url, ticket["flight"]["ticket"], timeout=90)  # see the read-only test
        live.start()
        status = wait_for_status(c, ticket["id"], {"succeeded", "failed"}, timeout=60)
        assert status["status"] == "failed", status
        live.join(25)
        assert not live.is_alive(), "the live consumer still waits after the rollout failed"
        assert live.error is not None
        assert not isinstance(live.error, flight.FlightTimedOutError), "the live consumer waited forever"
        _assert_fails_fast(server.flight_url, ticket["flight"]["ticket"], "a new do_get")
        assert ticket["id"] not in _listed(server.flight_url)
        # No stream slot stays held: 4 pulls of a fresh rollout at once all succeed.
        fresh = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, fresh["id"], {"succeeded"})
        pulls = [Pull(server.flight_url, fresh["flight"]["ticket"], timeout=10) for _ in range(4)]
        for p in pulls:
            p.start()
        for p in pulls:
            p.join(15)
            assert p.error is None, p.error


def _corrupt_latents(path: Path, batch: int = 0, n: int = 4096) -> None:
    """Flip n bytes in the middle of one batch's latent values, found in the file with plain
    pyarrow (the values' bytes are unique: random floats), and check from the file that exactly
    those values changed, so the damage cannot miss the data."""
    def latents() -> bytes:
        with pa.memory_map(str(path)) as source:
            values = pa.ipc.open_file(source).get_batch(batch).column("latent").storage.flatten()
            return values.to_numpy(zero_copy_only=False).tobytes()

    before = latents()
    data = path.read_bytes()
    at = data.find(before)
    assert at >= 0 and data.find(before, at + 1) < 0, "the latent values should be in the file once"
    at += len(before) // 2
    with open(path, "r+b") as f:  # in place, as a bad disk or a stray writer would
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in data[at:at + n]))  # every byte differs from what was there
    after = latents()
    changed = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8))
    assert changed.tolist() == list(range(len(before) // 2, len(before) // 2 + n)), "the flipped bytes missed the latents"


@pytest.mark.timeout(120)
def test_corrupted_spilled_file_is_not_served_silently(tmp_path) -> None:
    """docs/dataplane.md, "Checksums": a file served memory-mapped is checked before each do_get;
    a changed batch ends the rollout as failed (FlightInternalError naming the batch, REST
    `result_unavailable`, not listed)."""
    data = tmp_path / "data"
    with InProcessServer("--data-dir", str(data), *BIG_FLAGS) as server, server.client() as c:
        big = c.post("/v1/rollouts", json=BIG).json()
        assert wait_for_status(c, big["id"], {"succeeded"}, timeout=60)
        wait_for_entry(server, "spilled rollout to its file", rollout=big["id"])  # served from its file now
        assert pull(server.flight_url, big["flight"]["ticket"]).num_rows == BIG_ROWS
        _corrupt_latents(data / "trajectories" / f"{big['id']}.arrow")
        with pytest.raises(flight.FlightInternalError) as info:
            pull(server.flight_url, big["flight"]["ticket"])
        assert "checksum mismatch in batch 0" in str(info.value), str(info.value)
        status = wait_for(lambda: (body := c.get(f"/v1/rollouts/{big['id']}").json())["status"] == "failed" and body,
                          "REST reports the rollout failed")
        assert status["error"]["type"] == "result_unavailable", status
        assert big["id"] not in _listed(server.flight_url)
        assert c.get("/healthz").status_code == 200
        # one rollout finished once: it was counted succeeded, then failed too (1 + 1 for 1)
        text = c.get("/metrics").text
        finished = {s: metric(text, f'sigmaflight_rollouts_finished_total{{status="{s}"}}')
                    for s in ("succeeded", "failed", "cancelled")}
        assert finished == {"succeeded": 1, "failed": 0, "cancelled": 0}, finished


@pytest.mark.timeout(180)
def test_corrupted_file_is_not_restored_after_restart(tmp_path) -> None:
    """docs/operations.md: a corrupt `<id>.arrow` is moved to `<id>.arrow.corrupt` at start with one
    error line, never served; the rollout reports `expired`, its ticket answers not found, and
    list_flights does not list it."""
    data = tmp_path / "data"
    flags = ("--data-dir", str(data), *BIG_FLAGS)
    with InProcessServer(*flags) as server, server.client() as c:
        big = c.post("/v1/rollouts", json=BIG).json()
        assert wait_for_status(c, big["id"], {"succeeded"}, timeout=60)
    path = data / "trajectories" / f"{big['id']}.arrow"
    _corrupt_latents(path, batch=1)
    with InProcessServer(*flags) as again, again.client() as c:
        line = wait_for_log(again, "discarding corrupt trajectory file", timeout=5)  # logged before "ready"
        assert big["id"] in line and '"level": "error"' in line, line
        assert not path.exists() and path.with_name(path.name + ".corrupt").exists()
        assert c.get(f"/v1/rollouts/{big['id']}").json()["status"] == "expired"
        t0 = time.monotonic()
        with pytest.raises((KeyError, flight.FlightError)) as info:
            pull(again.flight_url, big["flight"]["ticket"], timeout=5)
        assert not isinstance(info.value, flight.FlightTimedOutError) and time.monotonic() - t0 < 3, info.value
        assert "not found" in str(info.value), str(info.value)
        assert big["id"] not in _listed(again.flight_url)


@pytest.mark.timeout(180)
def test_a_rollout_failed_for_its_changed_shm_file_stays_failed_on_flight_after_a_restart(tmp_path) -> None:
    """The shared-memory copy changed: REST says failed (result_unavailable). Its intact durable copy
    was served again after a restart, listed and streamed, while REST still said failed. A restart
    now frees what a failed rollout still holds, and Flight names the failure as REST does."""
    data, shm = tmp_path / "data", tmp_path / "shm"
    flags = ("--data-dir", str(data), "--shm-dir", str(shm))
    with InProcessServer(*flags) as server, server.client() as c:
        t = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, t["id"], {"succeeded"}, timeout=60)
        with flight.FlightClient(server.flight_url) as fc:
            info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", t["id"]))
        (shm_file,) = [urlsplit(loc.uri.decode()).path for loc in info.endpoints[0].locations
                       if loc.uri.startswith(b"file:")]
        _corrupt_latents(Path(unquote(shm_file)), n=64)
        with pytest.raises(flight.FlightInternalError):
            pull(server.flight_url, t["flight"]["ticket"])
        wait_for(lambda: c.get(f"/v1/rollouts/{t['id']}").json()["status"] == "failed" or None, "REST says failed")
    durable = data / "trajectories" / f"{t['id']}.arrow"
    assert durable.exists()  # intact: only the shared-memory copy was changed
    with InProcessServer(*flags) as again, again.client() as c:
        status = c.get(f"/v1/rollouts/{t['id']}").json()
        assert (status["status"], status["error"]["type"]) == ("failed", "result_unavailable"), status
        with pytest.raises(flight.FlightError) as info_after:
            pull(again.flight_url, t["flight"]["ticket"], timeout=5)
        assert "failed: " in str(info_after.value), str(info_after.value)  # the reason REST gives, not served
        assert t["id"] not in _listed(again.flight_url)
        assert not durable.exists()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_truncated_spilled_file_makes_the_rollout_unavailable(tmp_path) -> None:
    data = tmp_path / "data"
    with ServerProcess("--data-dir", str(data), *BIG_FLAGS) as server, server.client() as c:
        big = c.post("/v1/rollouts", json=BIG).json()
        assert wait_for_status(c, big["id"], {"succeeded"}, timeout=60)
        wait_for_entry(server, "spilled rollout to its file", rollout=big["id"])
        path = data / "trajectories" / f"{big['id']}.arrow"
        os.truncate(path, path.stat().st_size // 3)
        with pytest.raises(flight.FlightError) as info:
            pull(server.flight_url, big["flight"]["ticket"], timeout=10)
        assert not isinstance(info.value, flight.FlightTimedOutError)
        assert alive(server.proc.pid), "the server died serving a truncated file"
        assert c.get("/healthz").status_code == 200
        status = c.get(f"/v1/rollouts/{big['id']}").json()
        assert status["status"] != "succeeded", status
        assert status["error"] and status["error"]["message"], status
        assert big["id"] not in _listed(server.flight_url)


@pytest.mark.timeout(60)
def test_a_second_flight_server_on_the_same_store_serves_live_streams() -> None:
    """Not reachable from outside (one Flight server per process): uses sigmaflight.dataplane.server and
    sigmaflight.dataplane.store directly, with the data-plane test helpers for a header and its steps."""
    from sigmaflight.dataplane.server import FlightDataServer
    from sigmaflight.dataplane.store import ResultStore

    from tests.dataplane.helpers import build_header, make_steps

    store = ResultStore(memory_budget_bytes=1 << 30)
    try:
        first = FlightDataServer(store).start()
        first.stop()
        second = FlightDataServer(store).start()
        try:
            header = build_header("after-restart", T=3, B=2)
            steps = make_steps(header)
            ticket = store.reserve(header.rollout_id)
            consumer = Pull(second.locations[0], ticket, timeout=15)
            consumer.start()
            wait_for(lambda: second.active_streams == 1, "the consumer's do_get waits on the reserved ticket")
            writer = store.create(header)
            for i in header.steps:  # each step reaches the consumer before the next is made: live
                def streamed(before: int = second.bytes_served) -> bool:
                    return second.bytes_served > before

                writer.append(steps[i])
                wait_for(streamed, f"step {i} streamed by the second server")
            writer.finish()
            consumer.join(20)
            assert consumer.error is None, consumer.error
            assert consumer.table is not None and consumer.table.num_rows == header.num_samples * len(header.steps)
        finally:
            second.stop()
    finally:
        store.close()


@pytest.mark.timeout(180)
def test_a_release_whose_file_cannot_be_deleted_still_releases_and_the_restart_deletes_it(tmpfs) -> None:
    """DELETE, Flight release and the TTL on a rollout whose trajectory file cannot be unlinked (its
    directory turned read-only): each used to raise after the store had forgotten the rollout, so
    DELETE was a 500 (REST said succeeded, Flight said released), Flight's answer a traceback, and
    the reaper's pass died. Each releases it now, logging the file it could not delete; the
    journal says expired, and the restart scan, on a writable disk, deletes the file instead of
    serving an expired rollout again."""
    data = tmpfs("data", "8m")
    traj = tmpfs("trajectories", "8m", under=data.path)
    flags = ("--data-dir", str(data.path), "--workers", "1", "--ttl-s", "3")
    with InProcessServer(*flags) as server, server.client() as c:
        deleted, released, timed_out = (c.post("/v1/rollouts", json={**SMALL, "seed": s}).json() for s in (1, 2, 3))
        for t in (deleted, released, timed_out):
            wait_for_status(c, t["id"], {"succeeded"}, timeout=60)
        traj.read_only()
        r = c.delete(f"/v1/rollouts/{deleted['id']}")
        assert r.status_code == 200 and r.json()["status"] == "expired", r.text
        with flight.FlightClient(server.flight_url) as fc:
            (answer,) = fc.do_action(flight.Action("release", released["id"].encode()), options=options(10))
            assert b'"released": true' in answer.body.to_pybytes()
        wait_for_status(c, timed_out["id"], {"expired"}, timeout=30)  # the TTL's pass went through
        for t in (deleted, released, timed_out):
            assert c.get(f"/v1/rollouts/{t['id']}").json()["status"] == "expired"
            with pytest.raises(flight.FlightError, match="released"):
                pull(server.flight_url, t["flight"]["ticket"], timeout=5)
        wait_for_log(server, "released rollout's file could not be deleted", timeout=10)
        assert "reaper error" not in server.log_text
        assert {p.name for p in traj.path.iterdir()} >= {f"{t['id']}.arrow" for t in (deleted, released, timed_out)}
    traj.read_write()
    with InProcessServer(*flags) as again, again.client() as c:
        for t in (deleted, released, timed_out):
            assert c.get(f"/v1/rollouts/{t['id']}").json()["status"] == "expired"
            with pytest.raises(flight.FlightError):
                pull(again.flight_url, t["flight"]["ticket"], timeout=5)
            assert not (traj.path / f"{t['id']}.arrow").exists()
        assert _listed(again.flight_url) == set()
        assert "trajectory of an ended rollout found after restart; deleted" in again.log_text
