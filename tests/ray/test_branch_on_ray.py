"""Branch rollouts with `serve --backend ray`: the parent's x_k comes from the worker that ran it
(through the Ray object store) and the branch starts from it bit for bit."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
import torch

from sigmaflight import Client
from tests.servers import ServerProcess

pytestmark = pytest.mark.e2e

pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")


def _read(location: str, ticket: str) -> pa.Table:
    with flight.FlightClient(location) as fc:
        return fc.do_get(flight.Ticket(ticket.encode())).read_all()


def _latents(table: pa.Table, step: int) -> torch.Tensor:
    rows = table.filter(pc.equal(table.column("step"), step)).sort_by("sample")
    return torch.from_numpy(rows.column("latent").combine_chunks().to_numpy_ndarray().copy())


def test_branch_on_ray_starts_from_the_workers_stored_x_k():
    flags = ("--backend", "ray", "--ray-address", "local", "--workers", "1", "--ray-num-cpus", "1")
    with ServerProcess(*flags, timeout=180) as server, Client(server.rest_url) as client:
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
