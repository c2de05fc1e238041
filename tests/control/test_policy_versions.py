"""Policy versions through the real server: digest and weights_version at GET /v1/models and in
the trajectory metadata, expected_digest refused at POST (409 stale_policy) and at the start."""

from __future__ import annotations

import pyarrow.flight as flight
import torch
from sigmaflight.pipeline.models import ModelRegistry, weights_digest

from sigmaflight import Client
from sigmaflight.errors import ApiError
from tests.servers import InProcessServer, wait_for_status


def _rollout_meta(ticket: dict) -> dict:
    import json

    with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
        schema = fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all().schema
    return json.loads(schema.metadata[b"sigmaflight.rollout"])


def test_policy_version_and_stale_policy(tmp_path):
    base = ModelRegistry().get("tiny-sd3")
    state = {k: v.clone() for k, v in base.pipeline.transformer.state_dict().items()}
    first = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[first] += 0.01
    pushed = ModelRegistry().get("tiny-sd3")
    pushed.pipeline.transformer.load_state_dict(state)
    new_digest = weights_digest(pushed.pipeline)  # independent: the digest of those weights, made here

    with InProcessServer("--workers", "1", "--max-steps", "5000") as s, s.client() as c, Client(s.rest_url) as client:
        (m,) = [m for m in client.models() if m["id"] == "tiny-sd3"]
        assert m["digest"] == base.digest and m["weights_version"] == 0

        ok = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 1,
                                          "expected_digest": base.digest}).json()
        wait_for_status(c, ok["id"], {"succeeded"})
        assert _rollout_meta(ok)["model"] == {"id": "tiny-sd3", "dtype": "float32", "digest": base.digest,
                                              "weights_version": 0, "components": base.components}

        # hold the only worker, queue a rollout that expects the current weights, then push new ones
        blocker = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 4000, "seed": 2,
                                               "return": {"steps": [0]}}).json()
        wait_for_status(c, blocker["id"], {"running"})
        queued = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 3,
                                              "expected_digest": base.digest})
        assert queued.status_code == 202, queued.text
        assert client.push_weights("tiny-sd3", state) == new_digest
        assert c.get(f"/v1/rollouts/{queued.json()['id']}").json()["status"] == "queued"
        c.delete(f"/v1/rollouts/{blocker['id']}")
        failed = wait_for_status(c, queued.json()["id"], {"succeeded", "failed"})
        assert failed["status"] == "failed" and failed["error"]["type"] == "stale_policy", failed
        assert base.digest[:12] in failed["error"]["message"]

        (m,) = [m for m in client.models() if m["id"] == "tiny-sd3"]
        assert m["digest"] == new_digest and m["weights_version"] == 1

        stale = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2,
                                             "expected_digest": base.digest})
        assert stale.status_code == 409, stale.text
        err = stale.json()["error"]
        assert err["type"] == "stale_policy" and err["details"]["digest"] == new_digest
        assert err["details"]["weights_version"] == 1
        try:
            client.submit(prompts=["a"], num_inference_steps=2, expected_digest=base.digest)
        except ApiError as exc:
            assert exc.status == 409 and exc.type == "stale_policy"
        else:
            raise AssertionError("a stale expected_digest was accepted")

        fresh = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 1,
                                             "expected_digest": new_digest}).json()
        wait_for_status(c, fresh["id"], {"succeeded"})
        meta = _rollout_meta(fresh)["model"]
        assert meta["digest"] == new_digest and meta["weights_version"] == 1
        assert meta["digest"] != base.digest
        assert {n for n in meta["components"] if meta["components"][n] != base.components[n]} == {"transformer"}
        assert torch.equal(state[first], pushed.pipeline.transformer.state_dict()[first])


def test_a_branch_queued_before_a_weights_push_fails_stale_instead_of_running_on_the_new_weights():
    """A branch's x_k is a state of its parent's policy: posted on those weights and started after a
    push, it would run its steps k..T on other ones and mix two policies in one trajectory."""
    base = ModelRegistry().get("tiny-sd3")
    state = {k: v.clone() for k, v in base.pipeline.transformer.state_dict().items()}
    first = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[first] += 0.01
    with InProcessServer("--workers", "1", "--max-steps", "5000") as s, s.client() as c, Client(s.rest_url) as client:
        parent = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 4, "seed": 1,
                                              "sampler": {"type": "ode"}}).json()
        wait_for_status(c, parent["id"], {"succeeded"})
        blocker = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 4000, "seed": 2,
                                               "return": {"steps": [0]}}).json()
        wait_for_status(c, blocker["id"], {"running"})
        branch = c.post("/v1/rollouts", json={"branch_from": {"rollout": parent["id"], "step": 2}, "seed": 3})
        assert branch.status_code == 202, branch.text
        client.push_weights("tiny-sd3", state)
        assert c.get(f"/v1/rollouts/{branch.json()['id']}").json()["status"] == "queued"
        c.delete(f"/v1/rollouts/{blocker['id']}")
        ended = wait_for_status(c, branch.json()["id"], {"succeeded", "failed"})
        assert ended["status"] == "failed" and ended["error"]["type"] == "stale_policy", ended
        assert parent["id"] in ended["error"]["message"] and base.digest[:12] in ended["error"]["message"]
        # the same branch posted now is the contract's 409, as before
        again = c.post("/v1/rollouts", json={"branch_from": {"rollout": parent["id"], "step": 2}, "seed": 3})
        assert again.status_code == 409 and again.json()["error"]["type"] == "stale_parent", again.text
