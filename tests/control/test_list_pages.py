"""GET /v1/rollouts pages past its `limit` (at most 1000, while --max-records keeps 10 000 records):
`after` continues after a rollout of the last page, `next` names the one to continue after (null
on the last page). Through the real server, in process, and the Client and CLI over it."""

from __future__ import annotations

import asyncio
import json

import pytest

from sigmaflight import ApiError, AsyncClient, Client
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


NOT_IDS = ["", "x" * 100_000, "a\ud800b", "a\x00b", "a\nb", "../x", "?limit=1", "x" * 129]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", NOT_IDS, ids=lambda v: repr(v[:12]) + (f"..{len(v)}" if len(v) > 12 else ""))
def test_an_after_or_status_that_cannot_be_one_is_a_value_error_naming_it(server: InProcessServer,
                                                                          value: str) -> None:
    """Once httpx's InvalidURL (a 100 000-character string), UnicodeEncodeError (a lone surrogate), or
    the first page unfiltered (the empty string, silently dropped from the query)."""
    with Client(server.rest_url) as client:
        for kw in ("after", "status"):
            with pytest.raises(ValueError, match=f"^{kw} must be"):
                client.rollout_page(limit=1, **{kw: value})
            with pytest.raises(ValueError, match=f"^{kw} must be"):
                client.rollouts(limit=1, **{kw: value})
        with pytest.raises(TypeError, match="after"):
            client.rollouts(after=5)  # type: ignore[arg-type]

    async def both() -> None:
        async with AsyncClient(server.rest_url) as client:
            for kw in ("after", "status"):
                with pytest.raises(ValueError, match=f"^{kw} must be"):
                    await client.rollout_page(limit=1, **{kw: value})

    asyncio.run(both())


@pytest.mark.timeout(120)
def test_a_well_formed_after_or_status_still_reaches_the_server(server: InProcessServer) -> None:
    with Client(server.rest_url) as client:
        with pytest.raises(ApiError) as info:  # never made: the server's 422 naming it
            client.rollouts(after="nope")
        assert info.value.status == 422 and info.value.details[0]["loc"] == ["query", "after"]
        ids = [r.id for r in client.rollouts(limit=1000)]
        assert [r.id for r in client.rollouts(status="succeeded", limit=2, after=ids[0])] == ids[1:3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["", "x" * 100_000, "../x"], ids=["empty", "100k", "dots"])
def test_list_after_a_string_that_is_no_rollout_id_is_a_usage_error(
        server: InProcessServer, capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["list", "--json", "--url", server.rest_url, "--after", value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()  # one line, no traceback
    assert line.startswith("sigmaflight list: --after") and "rollout id" in line and len(line) < 300
