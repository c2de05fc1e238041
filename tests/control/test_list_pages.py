"""GET /v1/rollouts pages past its `limit` (at most 1000, while --max-records keeps 10 000 records):
`after` continues after a rollout of the last page, `next` names the one to continue after (null
on the last page). Through the real server, in process, and the Client and CLI over it."""

from __future__ import annotations

import asyncio
import json

import pytest

from sigmaflight import AsyncClient, Client
from sigmaflight.cli import main
from tests.servers import InProcessServer, wait_for_status

ONE_STEP = {"prompts": ["a"], "num_inference_steps": 1, "seed": 1}


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--workers", "1", "--batch-wait-ms", "0") as s:
        with s.client() as c:
            for k in range(5):
                t = c.post("/v1/rollouts", json={**ONE_STEP, "seed": k}).json()
                wait_for_status(c, t["id"], {"succeeded"})
        yield s


def _pages(c, limit: int, **query: str) -> list[list[str]]:
    pages, after = [], None
    while True:
        body = c.get("/v1/rollouts", params={"limit": limit, **query, **({"after": after} if after else {})}).json()
        pages.append([r["id"] for r in body["rollouts"]])
        after = body["next"]
        if after is None:
            return pages
        assert after == pages[-1][-1]  # the page's last rollout: continue after it
        assert len(pages) < 10, pages


@pytest.mark.timeout(120)
def test_pages_of_two_follow_the_whole_list_and_the_last_says_no_more(server: InProcessServer) -> None:
    with server.client() as c:
        whole = c.get("/v1/rollouts", params={"limit": 1000}).json()
        assert whole["next"] is None
        ids = [r["id"] for r in whole["rollouts"]]
        assert len(ids) == 5
        assert _pages(c, 2) == [ids[:2], ids[2:4], ids[4:]]
        assert _pages(c, 5) == [ids]  # a full page with nothing after it is the last one
        assert _pages(c, 2, status="succeeded") == [ids[:2], ids[2:4], ids[4:]]
        assert _pages(c, 2, status="failed") == [[]]


@pytest.mark.timeout(120)
def test_after_an_unknown_rollout_is_422_naming_it(server: InProcessServer) -> None:
    with server.client() as c:
        r = c.get("/v1/rollouts", params={"after": "nope"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"][0]["loc"] == ["query", "after"], r.text
        assert "nope" in r.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_the_client_and_the_cli_take_after(server: InProcessServer, capsys: pytest.CaptureFixture[str]) -> None:
    with Client(server.rest_url) as client:
        ids = [r.id for r in client.rollouts(limit=1000)]
        assert [r.id for r in client.rollouts(limit=2, after=ids[1])] == ids[2:4]
        page = client.rollout_page(limit=2, after=ids[1])
        assert ([r.id for r in page.rollouts], page.next) == (ids[2:4], ids[3])

    async def pages() -> tuple[list[str], str | None]:
        async with AsyncClient(server.rest_url) as client:
            assert [r.id for r in await client.rollouts(limit=2, after=ids[0])] == ids[1:3]
            page = await client.rollout_page(limit=2, after=ids[2])
            return [r.id for r in page.rollouts], page.next

    assert asyncio.run(pages()) == (ids[3:5], None)
    assert main(["list", "--json", "--url", server.rest_url, "--limit", "2", "--after", ids[1]]) == 0
    assert json.loads(capsys.readouterr().out)["next"] == ids[3]  # the CLI prints the REST body
    assert main(["list", "--json", "--url", server.rest_url, "--limit", "2", "--after", ids[3]]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert ([r["id"] for r in printed["rollouts"]], printed["next"]) == (ids[4:], None)
