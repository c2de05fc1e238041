"""The job journal (`<data_dir>/jobs.sqlite3`) cannot be written.

How writes are made to fail, honestly and without touching the real disk: `--data-dir` is a
small tmpfs. "Full" = a filler file takes every free block (sqlite then answers `database or
disk is full`); "read-only" = the tmpfs is remounted read-only (we run as root, so chmod
would not stop a write). For a full disk under a running rollout the trajectories directory is its own tmpfs mounted
inside the data dir, so the journal can fail while trajectory files are still written.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.conftest import LONG_FLAGS, SMALL, pull, wait_running
from tests.servers import (
    AnyServer,
    InProcessServer,
    ServerProcess,
    log_entries,
    wait_for,
    wait_for_log,
    wait_for_status,
)

# Short rollouts that still write a journal row at each state change.
QUICK = {**SMALL, "num_inference_steps": 2}
MID = {"prompts": ["mid"], "num_inference_steps": 1500, "seed": 31, "return": {"steps": [0, 1500]}}


def _readyz(server: AnyServer) -> int:
    with server.client() as c:
        return c.get("/readyz").status_code


@pytest.mark.timeout(180)
def test_worker_survives_a_full_data_dir(tmpfs) -> None:
    """The journal's filesystem fills up while a rollout runs; its trajectory file (on a
    separate tmpfs inside the data dir, so aborting it cannot free journal space) is fine.
    docs/operations.md: a rollout that ran to the end keeps the status it earned (succeeded and
    served) though its row cannot be written; no worker dies; rollouts run once space returns."""
    data = tmpfs("data", "8m")
    tmpfs("trajectories", "16m", under=data.path)
    with InProcessServer("--data-dir", str(data.path), "--workers", "1", *LONG_FLAGS) as server, server.client() as c:
        running = c.post("/v1/rollouts", json=MID).json()
        wait_running(c, running["id"], steps=2)
        data.fill()  # the disk fills up while the rollout runs
        wait_for_log(server, "job journal cannot be written", timeout=60)  # its finish row, refused
        done = wait_for_status(c, running["id"], {"succeeded", "failed"}, timeout=60)
        assert done["status"] == "succeeded", done
        assert pull(server.flight_url, running["flight"]["ticket"], timeout=10).num_rows == done["result"]["num_rows"]
        data.free()  # space returns: the server must run rollouts again
        wait_for_log(server, "job journal writable again")
        after = c.post("/v1/rollouts", json=QUICK)
        assert after.status_code == 202, after.text
        status = wait_for_status(c, after.json()["id"], {"succeeded", "failed"}, timeout=30)
        assert status["status"] == "succeeded", status
        assert c.get(f"/v1/rollouts/{running['id']}").json()["status"] == "succeeded"
    # Read to the end after exit; in process an exception in a server thread also fails the test itself
    # (pytest reports it as a warning, and warnings are errors here).
    assert "Exception in thread" not in server.log_text


@pytest.mark.timeout(180)
def test_readyz_503_while_journal_unwritable_then_recovers(tmpfs) -> None:
    data = tmpfs("data", "8m")
    tmpfs("trajectories", "16m", under=data.path)
    with InProcessServer("--data-dir", str(data.path), "--workers", "1", *LONG_FLAGS) as server, server.client() as c:
        running = c.post("/v1/rollouts", json=MID).json()
        wait_running(c, running["id"], steps=2)
        data.fill()
        done = wait_for_status(c, running["id"], {"succeeded", "failed"}, timeout=60)
        if done["status"] == "failed":
            assert done["error"]["message"]
        deadline = time.monotonic() + 5
        while _readyz(server) != 503:
            assert time.monotonic() < deadline, "/readyz still 200 while the journal cannot be written"
            time.sleep(0.1)
        data.free()
        deadline = time.monotonic() + 30
        while _readyz(server) != 200:
            assert time.monotonic() < deadline, "/readyz did not recover once space returned"
            time.sleep(0.2)


@pytest.mark.timeout(180)
def test_post_while_journal_full_is_503_and_leaves_nothing(tmpfs) -> None:
    data = tmpfs("data", "8m")
    flags = ("--data-dir", str(data.path), "--workers", "1", "--queue-size", "1")
    with InProcessServer(*flags) as server, server.client() as c:
        assert wait_for_status(c, c.post("/v1/rollouts", json=QUICK).json()["id"], {"succeeded"})
        data.fill()
        r = c.post("/v1/rollouts", json=QUICK, headers={"Idempotency-Key": "zombie-1"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] != "internal_error"
        data.free()
        # Nothing is left of the refused POST: no queued job, no slot in the queue, the key unused.
        assert c.get("/v1/rollouts", params={"status": "queued"}).json()["rollouts"] == []
        again = c.post("/v1/rollouts", json=QUICK, headers={"Idempotency-Key": "zombie-1"})
        assert again.status_code == 202, again.text
        status = wait_for_status(c, again.json()["id"], {"succeeded", "failed"}, timeout=30)
        assert status["status"] == "succeeded", status
        # Its ticket streams (a zombie's ticket would hang do_get).
        pull(server.flight_url, again.json()["flight"]["ticket"], timeout=10)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_finished_file_and_journal_agree_after_kill_9(tmpfs) -> None:
    """The crash window between the trajectory rename and the journal's 'succeeded' row,
    widened from outside: the journal's tmpfs fills up while the rollout runs (the
    trajectories dir is a separate tmpfs with room), the rollout finishes (file renamed
    into place, journal row not written: the server logs that), then kill -9 and restart.
    (A read-only remount is refused while sqlite holds the journal open for writing.)
    docs/operations.md: the restart scan finds the journal saying running and a finished file;
    the rollout comes back succeeded with its result from the file, and Flight serves it."""
    data = tmpfs("data", "8m")
    traj = tmpfs("trajectories", "16m", under=data.path)
    flags = ("--data-dir", str(data.path), "--workers", "1", *LONG_FLAGS)
    server = ServerProcess(*flags)
    try:
        with server.client() as c:
            running = c.post("/v1/rollouts", json=MID).json()
            wait_running(c, running["id"], steps=2)
            data.fill()  # the journal can no longer be written; trajectory files can
            wait_for(lambda: (traj.path / f"{running['id']}.arrow").exists(), "the trajectory file is renamed into place",
                     timeout=60)
            wait_for_log(server, "job journal cannot be written", timeout=60)  # the 'succeeded' row was not written
            before = wait_for_status(c, running["id"], {"succeeded", "failed"})
            assert before["status"] == "succeeded", before
    finally:
        server.kill()
    data.free()
    with InProcessServer(*flags) as again, again.client() as c:
        status = c.get(f"/v1/rollouts/{running['id']}").json()
        assert status["status"] == "succeeded", status
        assert status["result"] == before["result"], (status["result"], before["result"])
        assert "rollout found finished after restart; marked succeeded" in again.log_text  # logged before "ready"
        # REST and Flight tell the same story: succeeded and served.
        table = pull(again.flight_url, running["flight"]["ticket"], timeout=10)
        assert table.num_rows == status["result"]["num_rows"]


@pytest.mark.timeout(180)
def test_a_rollout_whose_start_cannot_be_journaled_gets_the_failed_line_every_rollout_gets(tmpfs) -> None:
    """Its running row refused (the disk full), a queued rollout fails journal_unavailable at its
    start. Its one line was "rollout failed: journal unwritable" with only its id: a filter on
    msg == "rollout failed", or on its type, missed it."""
    data = tmpfs("data", "8m")
    tmpfs("trajectories", "16m", under=data.path)
    with InProcessServer("--data-dir", str(data.path), "--workers", "1", *LONG_FLAGS) as server, server.client() as c:
        running = c.post("/v1/rollouts", json=MID).json()
        wait_running(c, running["id"], steps=2)
        queued = c.post("/v1/rollouts", json=QUICK).json()  # its queued row is written
        data.fill()
        try:
            status = wait_for_status(c, queued["id"], {"succeeded", "failed"}, timeout=90)
            assert status["status"] == "failed" and status["error"]["type"] == "journal_unavailable", status
            (line,) = log_entries(server, "rollout failed", rollout=queued["id"])
            assert (line["level"], line["type"], line["was"], line["steps_done"]) == (
                "error", "journal_unavailable", "queued", 0), line
            assert "cannot be written" in line["reason"], line
        finally:
            data.free()
