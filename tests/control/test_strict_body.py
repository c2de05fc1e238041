"""POST /v1/rollouts takes the body /openapi.json describes: JSON's own types only and the
contract's names only. `true` for an integer, "3" for a number, "yes" or 0 for a boolean and the
Python field name `return_` were taken (and ran: `num_inference_steps: true` ran one step); each is
a 422 naming the field now. An integer for a number stays a number. Real server, in process."""

from __future__ import annotations

import pytest

from tests.servers import InProcessServer

BASE = {"prompts": ["a"], "num_inference_steps": 1}


@pytest.fixture(scope="module")
def client():
    server = InProcessServer()
    try:
        with server.client() as c:
            yield c
    finally:
        server.terminate()


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"num_inference_steps": True}, ["body", "num_inference_steps"]),
        ({"num_inference_steps": "3"}, ["body", "num_inference_steps"]),
        ({"num_outputs_per_prompt": True}, ["body", "num_outputs_per_prompt"]),
        ({"seed": "5"}, ["body", "seed"]),
        ({"height": 32.0}, ["body", "height"]),
        ({"sampler": {"sde_steps": [True]}}, ["body", "sampler", "sde_steps", 0]),
        ({"return": {"log_probs": "yes"}}, ["body", "return", "log_probs"]),
        ({"return": {"log_probs": 0}}, ["body", "return", "log_probs"]),
        ({"return": {"steps": [1.0]}}, ["body", "return", "steps", 0]),
        ({"return_": {"steps": [0]}}, ["body", "return_"]),
        ({"seed": 1, "seeds": [1]}, ["body", "seeds"]),
        ({"seeds": [-1]}, ["body", "seeds", 0]),
    ],
)
def test_a_value_of_another_json_type_or_name_is_422_naming_it(client, body, loc):
    before = [r["id"] for r in client.get("/v1/rollouts").json()["rollouts"]]
    r = client.post("/v1/rollouts", json={**BASE, **body})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "validation_error"
    assert error["details"][0]["loc"] == loc, error
    assert error["message"].startswith(".".join(map(str, loc[1:])) + ": "), error
    assert "Value error" not in error["message"]
    assert [r["id"] for r in client.get("/v1/rollouts").json()["rollouts"]] == before  # nothing queued


def test_what_the_contract_allows_still_runs(client):
    ok = {**BASE, "guidance_scale": 4, "sampler": {"type": "cps", "noise_level": 1}, "height": 32,
          "return": {"steps": [0, 1], "log_probs": False}, "seeds": [7]}
    r = client.post("/v1/rollouts", json=ok)
    assert r.status_code == 202, r.text


def test_bad_json_is_a_422_naming_the_body(client):
    for raw in (b"{", b'{"prompts": ["a"]} x', b"[" * 5000 + b"]" * 5000, b"\xff"):
        r = client.post("/v1/rollouts", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"][0]["loc"] == ["body"], r.text


def test_the_published_schema_bounds_what_the_server_bounds(client):
    """/openapi.json's RolloutRequest gives the bounds the server enforces (guidance_scale had none),
    and the 503 and 409 answers name every error type they can carry."""
    doc = client.get("/openapi.json").json()
    props = doc["components"]["schemas"]["RolloutRequest"]["properties"]
    scale = next(s for s in props["guidance_scale"]["anyOf"] if s.get("type") == "number")
    seed = next(s for s in props["seeds"]["anyOf"] if s.get("type") == "array")["items"]
    assert (scale["minimum"], scale["maximum"]) == (0, 100) and (seed["minimum"], seed["maximum"]) == (0, 2**63 - 1)
    for value, code in [(100, 202), (100.5, 422), (-0.5, 422)]:
        assert client.post("/v1/rollouts", json={**BASE, "guidance_scale": value}).status_code == code, value
    post = doc["paths"]["/v1/rollouts"]["post"]["responses"]
    for word in ("shutting_down", "weights_failed", "journal_unavailable", "no_workers"):
        assert word in post["503"]["description"]
    for word in ("idempotency_conflict", "stale_policy", "stale_parent"):
        assert word in post["409"]["description"]
