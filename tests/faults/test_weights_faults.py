"""A weights push (the memory figure is ops/bench_faults.py): a weights
push keeps a rollout that is running on the weights it started with, and the next one runs
on the new weights. Holds today (copy-on-write); kept as the guard for the cheaper push."""

from __future__ import annotations

import json

import pytest

from tests.faults.conftest import LONG_FLAGS, SMALL, latent_bytes, pull, wait_running
from tests.servers import InProcessServer, wait_for_status


def _digest(table) -> str:
    return json.loads(table.schema.metadata[b"sigmaflight.rollout"])["model"]["digest"]


@pytest.mark.timeout(180)
def test_push_keeps_running_rollout_on_old_weights_and_next_on_new() -> None:
    import torch
    from safetensors.torch import save
    from sigmaflight.pipeline.models import ModelRegistry, weights_digest

    pipe = ModelRegistry().get("tiny-sd3").pipeline
    old_digest = weights_digest(pipe)
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v.clone()
           for k, v in pipe.transformer.state_dict().items()}
    mid = {"prompts": ["mid"], "num_inference_steps": 2000, "seed": 71, "return": {"steps": [0, 2000]}}
    with InProcessServer("--workers", "2", *LONG_FLAGS) as server, server.client() as c:
        before = c.post("/v1/rollouts", json={**SMALL, "seed": 72}).json()
        assert wait_for_status(c, before["id"], {"succeeded"})
        running = c.post("/v1/rollouts", json=mid).json()
        wait_running(c, running["id"], steps=5)
        r = c.put("/v1/models/tiny-sd3/weights", content=save(new), headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        new_digest = r.json()["digest"]
        assert new_digest != old_digest
        assert c.get(f"/v1/rollouts/{running['id']}").json()["status"] == "running"  # the push did not wait for it
        after = c.post("/v1/rollouts", json={**SMALL, "seed": 72}).json()
        assert wait_for_status(c, after["id"], {"succeeded"})
        assert wait_for_status(c, running["id"], {"succeeded"}, timeout=120)
        assert _digest(pull(server.flight_url, running["flight"]["ticket"])) == old_digest
        assert _digest(pull(server.flight_url, before["flight"]["ticket"])) == old_digest
        t_after = pull(server.flight_url, after["flight"]["ticket"])
        assert _digest(t_after) == new_digest
        assert latent_bytes(t_after) != latent_bytes(pull(server.flight_url, before["flight"]["ticket"]))
