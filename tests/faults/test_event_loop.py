"""Journal writes (sqlite, synchronous=FULL) never run on the event loop, and a
status read never waits for one. The real server with --data-dir; the test itself holds an
exclusive sqlite lock on the server's journal, so the server's next journal write stalls (for
sqlite's 5 s busy timeout) exactly as a slow fsync would, and measures what still answers."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import InProcessServer, wait_for, wait_for_status

BODY = {"prompts": ["a red cube"], "num_inference_steps": 2, "seed": 5}


BUSY_TIMEOUT_S = 5.0
"""How long the server's journal write waits on a locked database: sqlite3.connect's default timeout."""
READS = {"healthz": "/healthz", "list": "/v1/rollouts?limit=10", "metrics": "/metrics"}


@pytest.mark.timeout(120)
def test_a_stalled_journal_write_blocks_neither_the_event_loop_nor_status_reads(tmp_path: Path) -> None:
    """The test holds the lock until the stalled POST answers: it can only answer 503
    journal_unavailable, after waiting the whole busy timeout inside its journal write. So that
    write ran at least from (answered - timeout) to (sent + timeout), and the reads that started in
    that window were made while it stalled (the POST itself is the event, no sleep stands for it)."""
    data = tmp_path / "data"
    with InProcessServer("--data-dir", str(data)) as server, server.client() as c:
        done = c.post("/v1/rollouts", json=BODY).json()
        assert wait_for_status(c, done["id"], {"succeeded"})["status"] == "succeeded"
        reads = {**READS, "status": f"/v1/rollouts/{done['id']}"}
        # timeout: wait for a write the server may be doing right now (its reaper, the finish row)
        journal = sqlite3.connect(data / "jobs.sqlite3", timeout=10, isolation_level=None)
        journal.execute("BEGIN EXCLUSIVE")  # the server's next INSERT waits on this lock
        stalled: dict[str, Any] = {}

        def post() -> None:
            with httpx.Client(base_url=server.rest_url, timeout=60) as other:
                stalled["sent"] = time.monotonic()
                stalled["response"] = other.post("/v1/rollouts", json={**BODY, "seed": 6})
                stalled["answered"] = time.monotonic()

        poster = threading.Thread(target=post, daemon=True)
        took: list[tuple[str, float, float]] = []  # (read, started, seconds)
        try:
            poster.start()
            while poster.is_alive():  # read, over and over, for as long as the POST is stalled
                for name, path in reads.items():
                    t0 = time.monotonic()
                    r = c.get(path, timeout=30)
                    took.append((name, t0, time.monotonic() - t0))
                    assert r.status_code == 200, (name, r.text)
                    assert name != "status" or r.json()["status"] == "succeeded", r.text
                poster.join(0.05)
        finally:
            journal.execute("ROLLBACK")
            journal.close()
        answer = stalled["response"]
        assert answer.status_code == 503, f"the POST was not stalled in its journal write: {answer.text}"
        assert answer.json()["error"]["type"] == "journal_unavailable", answer.text
        assert "database is locked" in answer.json()["error"]["message"], answer.text
        # the write stalls for 5 s; 2.5 s leaves slack for a loaded box (a pytest worker per core, and one more)
        slowest = max(took, key=lambda t: t[2])
        assert slowest[2] < 2.5, f"reads waited for the stalled journal write: {slowest} of {len(took)}"
        lo, hi = stalled["answered"] - BUSY_TIMEOUT_S, stalled["sent"] + BUSY_TIMEOUT_S
        during = [(name, seconds) for name, t0, seconds in took if lo <= t0 <= hi]
        assert {name for name, _ in during} == set(reads), f"no read of each kind during the stalled write: {during}"
        # once the lock is gone the journal is writable again and rollouts are taken
        wait_for(lambda: c.get("/readyz").status_code == 200, "/readyz 200 again once the journal is writable")
        assert c.post("/v1/rollouts", json={**BODY, "seed": 7}).status_code == 202
        assert c.get("/healthz").status_code == 200
