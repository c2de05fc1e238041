"""`PUT`/`DELETE /v1/models/{id}/lora` with `--backend ray` and 2 workers: every worker runs with
the adapter (or without it) once the route answers, and a replacement worker gets the adapter
that is on before it takes rollouts. Reference: the same adapter on a local-backend server."""

from __future__ import annotations

import copy
import json
import os
import signal
import time

import psutil
import pytest

from tests.faults.conftest import latent_bytes
from tests.faults.test_ray_faults import RAY, _actor_pids, _digest, _pull
from tests.servers import InProcessServer, ServerProcess, wait_for_status

pytestmark = pytest.mark.e2e

pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")

REQ = {"prompts": ["a red cube"], "num_inference_steps": 3, "seed": 61}
OCTET = {"content-type": "application/octet-stream"}


def _adapter_body() -> bytes:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from sigmaflight.pipeline.models import ModelRegistry

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"])
    wrapped = get_peft_model(copy.deepcopy(ModelRegistry().get("tiny-sd3").pipeline.transformer), config)
    g = torch.Generator().manual_seed(9)
    tensors = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(wrapped).items()}
    return save(tensors, metadata={"lora_config": json.dumps(config.to_dict(), default=sorted)})


def _run_on_both(c) -> list:
    tickets = [c.post("/v1/rollouts", json=REQ).json() for _ in range(2)]
    assert len({t["flight"]["locations"][0] for t in tickets}) == 2  # one rollout on each worker
    for t in tickets:
        assert wait_for_status(c, t["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
    return [_pull(t) for t in tickets]


def _try_on_both(c) -> list | None:
    """Both workers' rollouts, or None while one is dead or not back yet."""
    posted = [c.post("/v1/rollouts", json=REQ) for _ in range(2)]
    if any(r.status_code != 202 for r in posted):
        return None
    tickets = [r.json() for r in posted]
    ends = [wait_for_status(c, t["id"], {"succeeded", "failed"}, timeout=120)["status"] for t in tickets]
    if ends != ["succeeded", "succeeded"] or len({t["flight"]["locations"][0] for t in tickets}) != 2:
        return None
    return [_pull(t) for t in tickets]


@pytest.mark.timeout(500)
def test_lora_put_and_delete_reach_every_ray_worker_and_replacements() -> None:
    body = _adapter_body()
    with InProcessServer() as local, local.client() as c:
        base_ref = c.post("/v1/rollouts", json=REQ).json()
        assert wait_for_status(c, base_ref["id"], {"succeeded"})
        put = c.put("/v1/models/tiny-sd3/lora", content=body, headers=OCTET)
        assert put.status_code == 200, put.text
        ref = c.post("/v1/rollouts", json=REQ).json()
        assert wait_for_status(c, ref["id"], {"succeeded"})
        base_bytes, lora_bytes = latent_bytes(_pull(base_ref)), latent_bytes(_pull(ref))
    assert base_bytes != lora_bytes

    with ServerProcess(*RAY, timeout=240) as server, server.client() as c:
        r = c.put("/v1/models/tiny-sd3/lora", content=body, headers=OCTET)
        assert r.status_code == 200, r.text
        assert r.json()["digest"] == put.json()["digest"] and r.json()["weights_version"] == 1
        for table in _run_on_both(c):
            assert _digest(table) == put.json()["digest"] and latent_bytes(table) == lora_bytes

        # a replacement worker gets the adapter before it takes rollouts: kill one; the rollout placed
        # on it fails (worker died), which starts its replacement; retry until both workers run again
        pids = _actor_pids(server)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pids[0])], timeout=10)
        deadline = time.monotonic() + 240
        while (tables := _try_on_both(c)) is None:
            assert time.monotonic() < deadline, "the replacement worker never took rollouts"
            time.sleep(1.0)
        assert pids[0] not in _actor_pids(server)
        for table in tables:
            assert _digest(table) == put.json()["digest"] and latent_bytes(table) == lora_bytes

        gone = c.delete("/v1/models/tiny-sd3/lora")
        assert gone.status_code == 200, gone.text
        assert gone.json()["weights_version"] == 2
        for table in _run_on_both(c):
            assert latent_bytes(table) == base_bytes and _digest(table) == gone.json()["digest"]
        assert c.delete("/v1/models/tiny-sd3/lora").json()["error"]["type"] == "lora_not_loaded"
