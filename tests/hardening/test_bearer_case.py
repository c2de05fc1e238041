"""Issue 20 (decision): the auth scheme is case-insensitive on both planes, as RFC 6750 (and
RFC 9110's auth-scheme) say; docs/operations.md used to claim REST needed `Bearer ` exactly.
The real server, plain httpx and plain pyarrow.flight."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow.flight as flight
import pytest

from tests.hardening.conftest import TOKEN, WRONG_TOKEN
from tests.servers import ServerProcess

SPELLINGS = ["Bearer", "bearer", "BEARER", "bEaReR"]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path: Path = tmp_path_factory.mktemp("bearer-case") / "tokens.txt"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o600)
    with ServerProcess("--token-file", str(path)) as server:
        yield server


def _flight_ok(server: ServerProcess, header: str) -> bool:
    opts = flight.FlightCallOptions(headers=[(b"authorization", header.encode())], timeout=30)
    with flight.FlightClient(server.flight_url) as fc:
        try:
            return {a.type for a in fc.list_actions(options=opts)} == {"cancel", "release", "weights_push_status"}
        except flight.FlightUnauthenticatedError:
            return False


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_any_case_of_the_scheme_with_the_right_token_is_accepted_on_both_planes(secured: ServerProcess, scheme: str):
    with httpx.Client(base_url=secured.rest_url, timeout=30) as c:
        assert c.get("/v1/models", headers={"authorization": f"{scheme} {TOKEN}"}).status_code == 200
    assert _flight_ok(secured, f"{scheme} {TOKEN}")


@pytest.mark.parametrize("scheme", SPELLINGS)
def test_any_case_of_the_scheme_with_a_wrong_token_is_refused_on_both_planes(secured: ServerProcess, scheme: str):
    with httpx.Client(base_url=secured.rest_url, timeout=30) as c:
        r = c.get("/v1/models", headers={"authorization": f"{scheme} {WRONG_TOKEN}"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid bearer token"
    assert not _flight_ok(secured, f"{scheme} {WRONG_TOKEN}")
