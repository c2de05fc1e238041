"""`return.velocities`, `return.conditioning` and `branch_from` through the real server (REST +
Flight), read with plain pyarrow.

References: the replay (`sigmaflight.pipeline.replay.Replayer`) on the pulled latents for velocities; the
stock diffusers pipeline fed the pulled conditioning instead of prompts (latents=x_0, same
guidance) for the conditioning stream; for branches, the parent's own stored x_k and schedule
read back with plain pyarrow.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.replay import Replayer

from sigmaflight import Client
from sigmaflight.client import replay_log_probs, rollout_spec
from tests.pipeline.test_loop_returns import TEXT_ENCODERS, _stock_call, _without_text_encoders
from tests.servers import InProcessServer

CASE: dict[str, Any] = dict(prompts=["a cat", "the dog"], num_outputs_per_prompt=2, guidance_scale=4.5,
                            negative_prompt="blurry")
T = 4


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--workers", "1") as s:
        yield s


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry()


def _read(location: str, ticket: str, token: str | None = None) -> pa.Table:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    with flight.FlightClient(location) as fc:
        return fc.do_get(flight.Ticket(ticket.encode()), flight.FlightCallOptions(headers=headers)).read_all()


def _tensor(column: pa.ChunkedArray | pa.Array) -> torch.Tensor:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return torch.from_numpy(np.asarray(arr.to_numpy_ndarray()).copy())


def _rows(table: pa.Table, step: int) -> pa.Table:
    mask = pc.equal(table.column("step"), step)
    return table.filter(mask).sort_by("sample")


def test_velocity_column_is_what_the_replay_computes(server, registry):
    model = registry.get("tiny-sd3")
    with Client(server.rest_url) as client:
        t = client.submit(model="tiny-sd3", num_inference_steps=3, seed=4, sampler={"type": "sde"},
                          return_={"velocities": True}, **CASE)
        client.wait(t, timeout=120)
        table = _read(t.flight.locations[0], t.flight.ticket)  # plain pyarrow
        traj = client.pull(t)  # a reader that does not know the column keeps working
    field = table.schema.field("velocity")
    assert field.type == pa.fixed_shape_tensor(pa.float32(), list(traj.latents.shape[2:]))
    last = _rows(table, 3)
    assert last.column("velocity").null_count == last.num_rows  # null at i = T
    rep = Replayer(model).replay(rollout_spec(traj), latents=traj.latents, steps=[int(s) for s in traj.steps],
                                 sigmas=traj.sigmas, timesteps=traj.timesteps, seeds=[int(s) for s in traj.seeds])
    for i in range(3):
        rows = _rows(table, i)
        assert rows.column("velocity").null_count == 0
        got = _tensor(rows.column("velocity"))
        assert got.dtype == torch.float32 and torch.equal(got, rep.velocities[i]), f"velocity {i}"
    assert torch.equal(rep.log_probs, traj.log_probs)
    # Without the flag the column is absent (v1 schema unchanged).
    with Client(server.rest_url) as client:
        plain = client.submit(model="tiny-sd3", num_inference_steps=2, seed=4, prompts=["a"])
        client.wait(plain, timeout=60)
        assert "velocity" not in _read(plain.flight.locations[0], plain.flight.ticket).column_names


def test_conditioning_stream_reproduces_the_ode_rollout_and_replays_without_text_encoders(server, registry):
    model = registry.get("tiny-sd3")
    with Client(server.rest_url) as client:
        t = client.submit(model="tiny-sd3", num_inference_steps=3, seed=9, sampler={"type": "ode"},
                          return_={"conditioning": True}, **CASE)
        assert set(t.flight.streams) == {"trajectory", "conditioning"}
        assert t.flight.streams["conditioning"].descriptor_path == ["rollouts", t.id, "conditioning"]
        client.wait(t, timeout=120)
        traj = client.pull(t)
        table = _read(t.flight.locations[0], t.flight.streams["conditioning"].ticket)
        cond = client.pull_conditioning(t)
        sde = client.submit(model="tiny-sd3", num_inference_steps=3, seed=3, sampler={"type": "sde"},
                            return_={"conditioning": True}, **CASE)
        client.wait(sde, timeout=120)
        sde_traj = client.pull(sde)
        sde_cond = client.pull_conditioning(sde)
    assert json.loads(table.schema.metadata[b"sigmaflight.format"]) == "conditioning/v1"
    assert table.column_names[:3] == ["sample", "prompt_index", "seed"]
    assert set(table.column_names[3:]) == {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                                           "negative_pooled_prompt_embeds"}
    assert table.column("prompt_index").to_pylist() == [0, 0, 1, 1]
    for name in table.column_names[3:]:  # plain pyarrow agrees with the client
        assert torch.equal(_tensor(table.column(name)), cond[name]), name
        assert cond[name].dtype == model.pipeline.transformer.dtype
    spec = rollout_spec(traj)
    steps, _ = _stock_call(model, spec, traj.latent(0), num_images_per_prompt=1, **cond)
    for i, stock in enumerate(steps, start=1):
        assert torch.equal(traj.latent(i), stock.cpu()), f"x_{i} differs from the stock pipeline's"
    trainer = _without_text_encoders(model)
    assert all(getattr(trainer.pipeline, n) is None for n in TEXT_ENCODERS["tiny-sd3"])
    # The weights check runs on the components the trainer holds (transformer, VAE): silent here
    # (warnings are errors), and a moved transformer weight is named.
    replayed = replay_log_probs(trainer, sde_traj, conditioning=sde_cond, strict=True)
    assert torch.isfinite(sde_traj.log_probs).all() and torch.equal(replayed, sde_traj.log_probs)
    with torch.no_grad():
        next(trainer.pipeline.transformer.parameters()).view(-1)[0] += 1e-3
    with pytest.raises(ValueError, match=r"made with other weights .*: transformer \("):
        replay_log_probs(trainer, sde_traj, conditioning=sde_cond, strict=True)


def _parent(client: Client, **extra: Any) -> Any:
    t = client.submit(model="tiny-sd3", num_inference_steps=T, seed=21, sampler={"type": "ode"}, **CASE, **extra)
    client.wait(t, timeout=120)
    return t


def test_branch_from_step_k_of_an_ode_parent(server, registry):
    k, samples, n = 2, [3, 0], 2
    with Client(server.rest_url) as client:
        parent = _parent(client, return_={"conditioning": True})
        ptable = _read(parent.flight.locations[0], parent.flight.ticket)
        t = client.branch(parent.id, k, samples, branches=n, seed=5,
                          sampler={"type": "sde", "noise_level": 0.9, "sde_steps": [k]}, return_={"velocities": True})
        client.wait(t, timeout=120)
        table = _read(t.flight.locations[0], t.flight.ticket)
        traj = client.pull(t)
    meta = table.schema.metadata
    assert json.loads(meta[b"sigmaflight.parent"]) == {"rollout": parent.id, "step": k, "samples": samples}
    assert meta[b"sigmaflight.sigmas"] == ptable.schema.metadata[b"sigmaflight.sigmas"]
    assert meta[b"sigmaflight.timesteps"] == ptable.schema.metadata[b"sigmaflight.timesteps"]
    assert json.loads(meta[b"sigmaflight.steps"]) == list(range(k, T + 1))
    assert sorted(set(table.column("step").to_pylist())) == list(range(k, T + 1))
    b = len(samples) * n
    parent_sample = [3, 3, 0, 0]
    parent_prompt = [1, 1, 0, 0]  # the parent's prompt_index (2 outputs per prompt): not s // n
    first = _rows(table, k)
    assert first.num_rows == b and first.column("sample").to_pylist() == list(range(b))
    assert first.column("parent_sample").to_pylist() == parent_sample
    assert first.column("prompt_index").to_pylist() == parent_prompt
    assert table.schema.field("parent_sample").type == pa.int32()
    x_k_parent = _tensor(_rows(ptable, k).column("latent"))
    assert torch.equal(_tensor(first.column("latent")), x_k_parent[parent_sample])  # bit-identical x_k
    sde = {i: _rows(table, i).column("sde").to_pylist() for i in range(k, T)}
    assert sde == {2: [True] * b, 3: [False] * b}  # stochastic only where asked
    lp = _rows(table, k).column("log_prob")
    assert lp.null_count == 0 and _rows(table, k + 1).column("log_prob").null_count == b
    nxt = _tensor(_rows(table, k + 1).column("latent"))
    assert not torch.equal(nxt[0], nxt[1])  # two branches of one parent sample differ after the noisy step
    assert torch.equal(traj.prompt_index, torch.tensor(parent_prompt))
    assert traj.parent_sample is not None and traj.parent_sample.tolist() == parent_sample
    assert traj.metadata["request"]["prompts"] == CASE["prompts"]
    # A trainer replays the branch's log-prob of transition k bit for bit (prompts encoded again).
    replayed = replay_log_probs(registry.get("tiny-sd3"), traj)
    assert torch.isfinite(traj.log_probs[:, k]).all() and torch.equal(replayed[:, k], traj.log_probs[:, k])
    assert replayed[:, k + 1:].isnan().all() and traj.log_probs[:, :k].isnan().all()


def test_branch_refused_when_the_parent_did_not_stream_k(server):
    with Client(server.rest_url) as client, httpx_client(server) as c:
        parent = _parent(client, return_={"steps": [0, T]})
        r = c.post("/v1/rollouts", json={"branch_from": {"rollout": parent.id, "step": 2}})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["details"][0]["loc"] == ["body", "branch_from", "step"] and "did not stream step 2" in err["message"]


def httpx_client(server: InProcessServer) -> Any:
    return server.client(None)


BAD: list[tuple[dict[str, Any], list[Any]]] = [
    ({"return": {"velocities": "yes"}}, ["body", "return", "velocities"]),
    ({"return": {"conditioning": 1}}, ["body", "return", "conditioning"]),
    ({"branch_from": {"rollout": "nope", "step": 1}}, ["body", "branch_from", "rollout"]),
    ({"branch_from": {"step": 1}}, ["body", "branch_from", "rollout"]),
    ({"branch_from": {"rollout": "@", "step": -1}}, ["body", "branch_from", "step"]),
    ({"branch_from": {"rollout": "@", "step": T}}, ["body", "branch_from", "step"]),
    ({"branch_from": {"rollout": "@", "step": 1, "samples": [9]}}, ["body", "branch_from", "samples"]),
    ({"branch_from": {"rollout": "@", "step": 1, "samples": []}}, ["body", "branch_from", "samples"]),
    ({"branch_from": {"rollout": "@", "step": 1, "samples": [1, 1]}}, ["body", "branch_from", "samples"]),
    ({"branch_from": {"rollout": "@", "step": 1, "extra": 1}}, ["body", "branch_from", "extra"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "guidance_scale": 2.0}, ["body", "guidance_scale"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "prompts": ["other"]}, ["body", "prompts"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "num_inference_steps": 6}, ["body", "num_inference_steps"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "sampler": {"sde_steps": [0]}}, ["body", "sampler", "sde_steps"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "return": {"steps": [0, 4]}}, ["body", "return", "steps"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "model": "tiny-flux"}, ["body", "model"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "height": 64}, ["body", "height"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "negative_prompt": "sharp"}, ["body", "negative_prompt"]),
    ({"branch_from": {"rollout": "@", "step": 1}, "num_outputs_per_prompt": 1000}, ["body", "num_outputs_per_prompt"]),
    ({}, ["body", "prompts"]),
]


def test_bad_values_are_422_naming_the_field(server):
    with Client(server.rest_url) as client, httpx_client(server) as c:
        parent = _parent(client)
        for body, loc in BAD:
            if "branch_from" in body and body["branch_from"].get("rollout") == "@":
                body = {**body, "branch_from": {**body["branch_from"], "rollout": parent.id}}
            if "branch_from" not in body and body:
                body = {**body, "prompts": ["a"], "num_inference_steps": 2}
            r = c.post("/v1/rollouts", json=body)
            assert r.status_code == 422, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "validation_error" and err["details"][0]["loc"] == loc, (body, err)
        # a parent without a negative prompt: the refusal says so in words, not as Python's None
        plain = client.submit(model="tiny-sd3", prompts=["a cat"], num_inference_steps=T, seed=2, sampler={"type": "ode"})
        client.wait(plain, timeout=120)
        r = c.post("/v1/rollouts", json={"branch_from": {"rollout": plain.id, "step": 1}, "negative_prompt": "sharp"})
        assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body", "negative_prompt"], r.text
        assert "from its parent, which had none; omit it, got 'sharp'" in r.json()["error"]["message"], r.text
        # the same inherited value is accepted; the server keeps serving
        ok = client.branch(parent.id, 1, [0], guidance_scale=CASE["guidance_scale"], prompts=CASE["prompts"], seed=1)
        assert client.wait(ok, timeout=60).status == "succeeded"
        assert c.get("/healthz").status_code == 200


def test_branch_of_a_parent_made_with_other_weights_is_409_stale_parent(server, registry):
    with Client(server.rest_url) as client, httpx_client(server) as c:
        parent = _parent(client)
        state = {k: v.clone() for k, v in registry.get("tiny-sd3").pipeline.transformer.state_dict().items()}
        first = next(iter(state))
        state[first] = state[first] + 1.0
        client.push_weights("tiny-sd3", state)
        r = c.post("/v1/rollouts", json={"branch_from": {"rollout": parent.id, "step": 1}})
        assert r.status_code == 409, r.text
        assert r.json()["error"]["type"] == "stale_parent"
        assert c.get("/healthz").status_code == 200


def test_branch_of_an_unfinished_parent_is_refused(server):
    with Client(server.rest_url) as client, httpx_client(server) as c:
        running = client.submit(model="tiny-sd3", num_inference_steps=200, seed=1, prompts=["a"],
                                return_={"steps": [0, 1]})
        r = c.post("/v1/rollouts", json={"branch_from": {"rollout": running.id, "step": 0}})
        client.cancel(running)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"][0]["loc"] == ["body", "branch_from", "rollout"]
        assert "succeeded" in r.json()["error"]["message"]
