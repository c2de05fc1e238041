"""Kernel bounds and non-finite rollouts through the real server (REST on uvicorn)."""

from __future__ import annotations

import pytest

from tests.servers import InProcessServer, wait_for_status


@pytest.fixture(scope="module")
def client():
    with InProcessServer() as server, server.client() as c:
        yield c


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"sampler": {"type": "cps", "noise_level": 1.5}}, ["body", "sampler", "noise_level"]),
        ({"sampler": {"type": "cps", "noise_level": 2.5}}, ["body", "sampler", "noise_level"]),
        ({"guidance_scale": 1e308}, ["body", "guidance_scale"]),
        ({"guidance_scale": -2.0}, ["body", "guidance_scale"]),
    ],
)
def test_out_of_range_kernel_inputs_get_422_naming_the_field(client, body, loc):
    r = client.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, **body})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "validation_error" and err["message"]
    assert [d["loc"] for d in err["details"]] == [loc] and all(d["msg"] and d["type"] for d in err["details"])
    # The edge of the range is accepted and runs.
    ok = client.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "sampler": {"type": "cps", "noise_level": 1.0}})
    assert ok.status_code == 202, ok.text


def test_a_rollout_that_overflows_fails_with_non_finite_and_the_server_keeps_serving(client):
    r = client.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 3, "seed": 1,
                                          "sampler": {"type": "sde", "noise_level": 1e308}})
    assert r.status_code == 202, r.text
    done = wait_for_status(client, r.json()["id"], {"succeeded", "failed"})
    assert done["status"] == "failed", done
    assert done["error"]["type"] == "non_finite"
    assert "absolute step 0" in done["error"]["message"]  # every transition is stochastic: the first one overflows
    good = client.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 1})
    assert wait_for_status(client, good.json()["id"], {"succeeded", "failed"})["status"] == "succeeded"
