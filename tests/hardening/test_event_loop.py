"""Issue 12 item 22: journal writes (sqlite, synchronous=FULL) never run on the event loop, and a
status read never waits for one. The real server with --data-dir; the test itself holds an
exclusive sqlite lock on the server's journal, so the server's next journal write stalls (for
sqlite's 5 s busy timeout) exactly as a slow fsync would, and measures what still answers."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import ServerProcess, wait_for_status

BODY = {"prompts": ["a red cube"], "num_inference_steps": 2, "seed": 5}


@pytest.mark.timeout(120)
def test_a_stalled_journal_write_blocks_neither_the_event_loop_nor_status_reads(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ServerProcess("--data-dir", str(data)) as server, server.client() as c:
        done = c.post("/v1/rollouts", json=BODY).json()
        assert wait_for_status(c, done["id"], {"succeeded"})["status"] == "succeeded"
        # timeout: wait for a write the server may be doing right now (its reaper, the finish row)
        journal = sqlite3.connect(data / "jobs.sqlite3", timeout=10, isolation_level=None)
        journal.execute("BEGIN EXCLUSIVE")  # the server's next INSERT waits on this lock
        stalled: dict[str, object] = {}

        def post() -> None:
            t0 = time.monotonic()
            with httpx.Client(base_url=server.rest_url, timeout=60) as other:
                stalled["status"] = other.post("/v1/rollouts", json={**BODY, "seed": 6}).status_code
            stalled["seconds"] = time.monotonic() - t0

        poster = threading.Thread(target=post, daemon=True)
        try:
            poster.start()
            time.sleep(0.5)  # the POST is now inside its journal write
            took = {}
            for name, path in (("healthz", "/healthz"), ("status", f"/v1/rollouts/{done['id']}"),
                               ("list", "/v1/rollouts?limit=10"), ("metrics", "/metrics")):
                t0 = time.monotonic()
                r = c.get(path, timeout=30)
                took[name] = time.monotonic() - t0
                assert r.status_code == 200, (name, r.text)
            assert c.get(f"/v1/rollouts/{done['id']}").json()["status"] == "succeeded"
            # the write stalls for 5 s; 2.5 s leaves slack for a loaded box (a pytest worker per core)
            assert max(took.values()) < 2.5, f"reads waited for the stalled journal write: {took}"
            assert poster.is_alive(), f"the POST was not stalled while we measured: {stalled}"
        finally:
            journal.execute("ROLLBACK")
            journal.close()
        poster.join(30)
        assert not poster.is_alive()
        # whatever the stalled POST answered (202 once the lock went, or a 5xx after sqlite's busy
        # timeout), the reads above did not wait for it
        assert float(stalled["seconds"]) >= 0.5  # type: ignore[arg-type]
        assert c.get("/healthz").status_code == 200
