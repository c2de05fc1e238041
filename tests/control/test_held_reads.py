"""Held status reads: `GET /v1/rollouts/{id}?wait_s=S` answers when the rollout ends or after S
seconds, whichever is first; past --max-held-reads a read answers at once; a bad `wait_s` is a 422
naming it; shutting down answers every held read at once. Real server, in process, httpx."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from tests.servers import BLOCKER, InProcessServer, metric, wait_for, wait_for_status


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--max-held-reads", "2", "--max-batch-samples", "1") as s:
        yield s


@pytest.fixture()
def queued(server):
    """A rollout that stays queued behind a blocker until the test ends; its id."""
    with httpx.Client(base_url=server.rest_url, timeout=60) as c:
        blocker = c.post("/v1/rollouts", json=BLOCKER).json()["id"]
        rid = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 2}).json()["id"]
        wait_for_status(c, blocker, {"running"})
        try:
            yield rid
        finally:
            c.delete(f"/v1/rollouts/{rid}")
            c.delete(f"/v1/rollouts/{blocker}")
            wait_for_status(c, blocker, {"cancelled"})


def held_get(url: str, rid: str, wait_s: float) -> tuple[float, httpx.Response]:
    with httpx.Client(base_url=url, timeout=120) as c:
        t0 = time.monotonic()
        r = c.get(f"/v1/rollouts/{rid}", params={"wait_s": wait_s})
        return time.monotonic() - t0, r


def test_a_held_read_answers_when_its_rollout_ends_with_the_ended_status(server, queued):
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.rest_url, timeout=60) as c:
        read = pool.submit(held_get, server.rest_url, queued, 30)
        wait_for(lambda: metric(c.get("/metrics").text, "sigmaflight_held_reads") == 1 or None, "the read held")
        assert not read.done()
        time.sleep(0.3)
        assert not read.done()  # still queued: still held
        assert c.delete(f"/v1/rollouts/{queued}").status_code == 200
        took, r = read.result(timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"  # read after the end, not the queued status it was held on
    assert took < 10


def test_a_held_read_of_a_rollout_that_does_not_end_answers_after_wait_s(server, queued):
    took, r = held_get(server.rest_url, queued, 0.8)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"
    assert 0.75 <= took < 10, took


def test_concurrent_rollouts_each_held_once_all_see_their_end(server):
    """Reads held across the ends of many rollouts, each registered while its rollout may be ending:
    none is missed (a missed end would answer after 30 s, still queued or running)."""
    url = server.rest_url

    def one(k: int) -> tuple[float, str]:
        with httpx.Client(base_url=url, timeout=120) as c:
            rid = c.post("/v1/rollouts", json={"prompts": [f"p{k}"], "num_inference_steps": 2 + k % 3,
                                               "seed": k}).json()["id"]
            statuses = []
            t0 = time.monotonic()
            while True:  # at most 2 held at once: the others answer at once and read again
                r = c.get(f"/v1/rollouts/{rid}", params={"wait_s": 30})
                assert r.status_code == 200, r.text
                statuses.append(r.json()["status"])
                if statuses[-1] not in ("queued", "running"):
                    return time.monotonic() - t0, statuses[-1]
                time.sleep(0.02)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [s for _, s in results] == ["succeeded"] * 8
    assert max(t for t, _ in results) < 25, results


def test_past_max_held_reads_a_read_answers_at_once(server, queued):
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=server.rest_url, timeout=60) as c:
        held = [pool.submit(held_get, server.rest_url, queued, 30) for _ in range(2)]
        wait_for(lambda: metric(c.get("/metrics").text, "sigmaflight_held_reads") == 2 or None, "two reads held")
        took, r = held_get(server.rest_url, queued, 30)  # the third: --max-held-reads 2
        assert r.status_code == 200 and r.json()["status"] == "queued"
        assert took < 5, took
        assert not any(f.done() for f in held)
        c.delete(f"/v1/rollouts/{queued}")
        assert [f.result(timeout=10)[1].json()["status"] for f in held] == ["cancelled"] * 2
        wait_for(lambda: metric(c.get("/metrics").text, "sigmaflight_held_reads") == 0 or None, "no read held")


def test_a_held_read_whose_client_leaves_is_released_at_once(server, queued):
    """A client that gives up on a held read (closes its connection) frees its place at once, not
    after its wait_s: it stops counting against --max-held-reads."""
    url = urlsplit(server.rest_url)
    with httpx.Client(base_url=server.rest_url, timeout=60) as c:
        with socket.create_connection((url.hostname, url.port)) as s:
            s.sendall(f"GET /v1/rollouts/{queued}?wait_s=30 HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode())
            wait_for(lambda: metric(c.get("/metrics").text, "sigmaflight_held_reads") == 1 or None, "the read held")
        wait_for(lambda: metric(c.get("/metrics").text, "sigmaflight_held_reads") == 0 or None,
                 "the read released once its client left", timeout=5)
        assert c.get(f"/v1/rollouts/{queued}").json()["status"] == "queued"  # the rollout itself is untouched


@pytest.mark.parametrize(("value", "kind"), [("0", "greater_than"), ("-1", "greater_than"), ("61", "less_than_equal"),
                                             ("abc", "float_parsing"), ("nan", "float_parsing"), ("inf", "less_than_equal"),
                                             ("", "float_parsing")])
def test_a_bad_wait_s_is_a_422_naming_it(server, value, kind):
    with httpx.Client(base_url=server.rest_url, timeout=60) as c:
        rid = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 3}).json()["id"]
        r = c.get(f"/v1/rollouts/{rid}?wait_s={value}")
        assert r.status_code == 422, r.text
        (detail,) = r.json()["error"]["details"]
        assert detail["loc"] == ["query", "wait_s"] and detail["type"] == kind
        assert "at most 60" in detail["msg"]
        r = c.get(f"/v1/rollouts/{rid}?wait=5")  # a misspelt hold is refused, not ignored
        assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["query", "wait"]
        assert c.get(f"/v1/rollouts/{rid}").status_code == 200  # the server serves on


def test_shutting_down_answers_held_reads_at_once_with_their_rollouts_failure():
    """uvicorn waits up to 10 s for open requests before the service stops. The rollouts are ended
    before that wait, so a held read answers at once, and with its rollout's failure ("server
    shutting down"); it answered `queued` before, and the client's next read found the port closed."""
    with InProcessServer("--max-batch-samples", "1") as s, httpx.Client(base_url=s.rest_url, timeout=60) as c:
        blocker = c.post("/v1/rollouts", json=BLOCKER).json()["id"]
        rid = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2}).json()["id"]
        wait_for_status(c, blocker, {"running"})
        answers: list[tuple[float, httpx.Response]] = []
        reader = threading.Thread(target=lambda: answers.append(held_get(s.rest_url, rid, 60)))
        reader.start()
        wait_for(lambda: metric(c.get("/metrics").text, "sigmaflight_held_reads") == 1 or None, "the read held")
        t0 = time.monotonic()
        s.terminate()
        stopped = time.monotonic() - t0
        reader.join(10)
    assert answers and answers[0][1].status_code == 200, answers
    body = answers[0][1].json()
    assert body["status"] == "failed" and body["error"]["type"] == "shutdown", body
    assert "server shutting down" in body["error"]["message"], body
    assert answers[0][0] < 9, answers[0][0]
    assert stopped < 9, stopped
