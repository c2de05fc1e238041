"""`sigmaflight serve --backend ray` (its own local Ray cluster, two workers) and its faults: a LoRA
adapter put and deleted reaches every worker and a replacement, a branch starts from the x_k its
parent's worker stored, pushed weights reach every worker, and a placement that fails leaves
nothing behind. One server for the module, in that order."""

from __future__ import annotations

import copy
import json
import os
import signal
import time

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
import torch

from sigmaflight import Client
from tests.faults.conftest import latent_bytes, options
from tests.servers import InProcessServer, ServerProcess, wait_for_status

pytestmark = pytest.mark.e2e

pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")

RAY = ("--backend", "ray", "--ray-address", "local", "--workers", "2", "--ray-num-cpus", "1")
REQ = {"prompts": ["a red cube"], "num_inference_steps": 3, "seed": 61}


def _pull(ticket: dict) -> object:
    with flight.FlightClient(ticket["flight"]["locations"][0]) as c:
        return c.do_get(flight.Ticket(ticket["flight"]["ticket"].encode()), options=options(60)).read_all()


def _digest(table) -> str:
    return json.loads(table.schema.metadata[b"sigmaflight.rollout"])["model"]["digest"]


def _actor_pids(server: ServerProcess) -> list[int]:
    """The worker actors' processes: descendants of the server whose title is ray::_ActorWorker."""
    out = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "_ActorWorker" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def _pid_of(server: ServerProcess, location: str) -> int | None:
    """The worker process whose Flight server listens at `location`."""
    port = int(location.rsplit(":", 1)[1])
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if any(cn.status == "LISTEN" and cn.laddr.port == port for cn in p.net_connections(kind="tcp")):
                return p.pid
        except psutil.Error:
            continue
    return None


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    """One Ray-backed server for the module's tests (a Ray cluster and two workers take ~20 s to
    start): the LoRA test first (it counts weights versions from a fresh server's 0 and leaves the
    base weights), then the branch and weights tests, the placement test (which kills the workers) last.
    With a --data-dir: a replacement worker adopts what its predecessor finished."""
    data = tmp_path_factory.mktemp("ray-data")
    with ServerProcess(*RAY, "--queue-size", "2", "--data-dir", str(data), timeout=240) as server:
        yield server


OCTET = {"content-type": "application/octet-stream"}


def _adapter_body() -> bytes:
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
def test_lora_put_and_delete_reach_every_ray_worker_and_replacements(ray_server: ServerProcess) -> None:
    """`PUT`/`DELETE /v1/models/{id}/lora` with 2 workers: every worker runs with the adapter (or
    without it) once the route answers, and a replacement worker gets the adapter that is on
    before it takes rollouts. Reference: the same adapter on a local-backend server."""
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

    server = ray_server
    with server.client() as c:
        r = c.put("/v1/models/tiny-sd3/lora", content=body, headers=OCTET)
        assert r.status_code == 200, r.text
        assert r.json()["digest"] == put.json()["digest"] and r.json()["weights_version"] == 1
        for table in _run_on_both(c):
            assert _digest(table) == put.json()["digest"] and latent_bytes(table) == lora_bytes

        # a replacement worker gets the adapter before it takes rollouts: kill one; the rollout placed
        # on it fails (worker died), which starts its replacement; retry until both workers run again
        pids = _actor_pids(server)
        assert len(pids) == 2, pids
        # a rollout the victim finished: with --data-dir its replacement adopts the file; REST named
        # the dead worker's address for it until the control plane restarted
        finished = c.post("/v1/rollouts", json=REQ).json()
        assert wait_for_status(c, finished["id"], {"succeeded"}, timeout=120)["status"] == "succeeded"
        expected = latent_bytes(_pull(finished))
        victim = _pid_of(server, finished["flight"]["locations"][0])
        assert victim in pids, (victim, pids)
        os.kill(victim, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(victim)], timeout=10)
        deadline = time.monotonic() + 240
        while (tables := _try_on_both(c)) is None:
            assert time.monotonic() < deadline, "the replacement worker never took rollouts"
            time.sleep(1.0)
        assert victim not in _actor_pids(server)
        for table in tables:
            assert _digest(table) == put.json()["digest"] and latent_bytes(table) == lora_bytes
        adopted = c.get(f"/v1/rollouts/{finished['id']}").json()
        assert adopted["status"] == "succeeded"
        assert adopted["flight"]["locations"] != finished["flight"]["locations"]  # the replacement's
        assert latent_bytes(_pull({**finished, "flight": adopted["flight"]})) == expected

        gone = c.delete("/v1/models/tiny-sd3/lora")
        assert gone.status_code == 200, gone.text
        assert gone.json()["weights_version"] == 2
        for table in _run_on_both(c):
            assert latent_bytes(table) == base_bytes and _digest(table) == gone.json()["digest"]
        assert c.delete("/v1/models/tiny-sd3/lora").json()["error"]["type"] == "lora_not_loaded"


def _read(location: str, ticket: str) -> pa.Table:
    with flight.FlightClient(location) as fc:
        return fc.do_get(flight.Ticket(ticket.encode())).read_all()


def _latents(table: pa.Table, step: int) -> torch.Tensor:
    rows = table.filter(pc.equal(table.column("step"), step)).sort_by("sample")
    return torch.from_numpy(rows.column("latent").combine_chunks().to_numpy_ndarray().copy())


def test_branch_on_ray_starts_from_the_workers_stored_x_k(ray_server: ServerProcess) -> None:
    """The parent's x_k comes from the worker that ran it (through the Ray object store) and the
    branch starts from it bit for bit."""
    server = ray_server
    with Client(server.rest_url) as client:
        parent = client.submit(prompts=["a cat", "the dog"], num_inference_steps=3, seed=2, sampler={"type": "ode"})
        assert parent.flight.locations[0] != server.flight_url  # held by the worker
        client.wait(parent, timeout=120)
        branch = client.branch(parent.id, 1, [1], branches=2, seed=3, sampler={"type": "sde", "sde_steps": [1]})
        client.wait(branch, timeout=120)
        ptable = _read(parent.flight.locations[0], parent.flight.ticket)
        table = _read(branch.flight.locations[0], branch.flight.ticket)
        with server.client() as c:
            missing = c.post("/v1/rollouts", json={"branch_from": {"rollout": "nope", "step": 1}})
    assert torch.equal(_latents(table, 1), _latents(ptable, 1)[[1, 1]])
    assert table.schema.metadata[b"sigmaflight.sigmas"] == ptable.schema.metadata[b"sigmaflight.sigmas"]
    assert json.loads(table.schema.metadata[b"sigmaflight.parent"]) == {"rollout": parent.id, "step": 1, "samples": [1]}
    assert missing.status_code == 422 and missing.json()["error"]["details"][0]["loc"] == ["body", "branch_from", "rollout"]


def _changed_weights() -> tuple[bytes, dict]:
    """The tiny SD3 transformer's state dict, every float tensor nudged by seeded noise."""
    from safetensors.torch import save
    from sigmaflight.pipeline.models import ModelRegistry

    state = ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict()
    g = torch.Generator().manual_seed(7)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)) if v.is_floating_point() else v.clone()
           for k, v in state.items()}
    return save(new), new


@pytest.mark.timeout(400)
def test_pushed_weights_reach_every_ray_worker(ray_server: ServerProcess) -> None:
    body, _ = _changed_weights()
    # Reference: the same push on a local-backend server, same request and seed.
    with InProcessServer() as local, local.client() as c:
        pushed = c.put("/v1/models/tiny-sd3/weights", content=body,
                       headers={"content-type": "application/octet-stream"})
        assert pushed.status_code == 200, pushed.text
        ref = c.post("/v1/rollouts", json=REQ).json()
        assert wait_for_status(c, ref["id"], {"succeeded"})
        reference = _pull(ref)
    assert _digest(reference) == pushed.json()["digest"]

    server = ray_server
    with server.client() as c:
        r = c.put("/v1/models/tiny-sd3/weights", content=body, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        digest = r.json()["digest"]
        assert digest == pushed.json()["digest"]
        tickets = [c.post("/v1/rollouts", json=REQ).json() for _ in range(2)]
        assert len({t["flight"]["locations"][0] for t in tickets}) == 2  # one rollout on each worker
        for t in tickets:
            assert wait_for_status(c, t["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
            table = _pull(t)
            assert _digest(table) == digest, f"worker {t['flight']['locations'][0]} ran the old weights"
            assert latent_bytes(table) == latent_bytes(reference)


@pytest.mark.timeout(300)
def test_failed_placement_leaves_no_queued_job(ray_server: ServerProcess) -> None:
    server = ray_server
    with server.client() as c:
        first = c.post("/v1/rollouts", json=REQ).json()
        assert wait_for_status(c, first["id"], {"succeeded"}, timeout=120)
        pids = _actor_pids(server)
        assert len(pids) == 2, pids
        procs = [psutil.Process(pid) for pid in pids]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # both workers die; their replacements take seconds to load
        psutil.wait_procs(procs, timeout=10)
        r = c.post("/v1/rollouts", json=REQ, headers={"Idempotency-Key": "placement-1"})
        assert r.status_code == 503, r.text  # no worker can take it now: say so
        assert r.json()["error"]["type"] != "internal_error", r.text
        assert c.get("/v1/rollouts", params={"status": "queued"}).json()["rollouts"] == []
        ready = c.get("/readyz")  # it answered 200 while every POST was a 503
        assert ready.status_code == 503 and ready.json()["checks"]["workers_live"] is False, ready.text
        # Once the replacements are up, the same key makes a new rollout that runs.
        deadline = time.monotonic() + 180
        while True:
            again = c.post("/v1/rollouts", json=REQ, headers={"Idempotency-Key": "placement-1"})
            if again.status_code == 202:
                break
            assert again.status_code == 503 and time.monotonic() < deadline, again.text
            time.sleep(1.0)
        assert wait_for_status(c, again.json()["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
        assert c.get("/readyz").json()["checks"]["workers_live"] is True
