"""Fuzz the REST API from its own OpenAPI document (schemathesis): no input gets a 5xx, every
refusal is the contract's JSON error body, and the server keeps serving."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.servers import InProcessServer

# Small limits keep every accepted rollout cheap; 413 / 422 / 429 are fine answers, 5xx never.
LIMITS = ("--max-prompts", "4", "--max-samples", "8", "--max-steps", "6", "--max-rollout-bytes", str(1 << 20),
          "--queue-size", "4", "--max-body-bytes", "65536")


@pytest.fixture(scope="module")
def server():
    with InProcessServer(*LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.rest_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error(case, server):
    response = case.call(base_url=server.rest_url, timeout=30)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["type"], str) and isinstance(error["message"], str)
        if response.status_code == 422:
            assert all(d["loc"][0] in ("body", "query", "path", "header") for d in error["details"])


def test_server_still_serves_after_fuzzing(server):
    with server.client() as c:
        assert c.get("/readyz").status_code == 200
        assert "sigmaflight_http_responses_total" in c.get("/metrics").text
        assert '"unhandled error"' not in server.log_text
