"""Co-batched rollouts through the real server: who shares a call, what each member
keeps, and what one member's cancel, stale policy or a weights push does to the others.

Batches are made deterministic with a blocker: a long rollout no other request can join keeps the
one worker busy while the requests under test queue; cancelling it lets them start together."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight.client import Client, RolloutCancelled, RolloutFailed
from tests.pipeline.test_kernels import flow_grpo_step
from tests.servers import BLOCKER, InProcessServer, ServerProcess, log_entries, wait_for

T = 4
BASE: dict[str, Any] = {"num_inference_steps": T, "guidance_scale": 4.5, "sampler": {"type": "sde", "noise_level": 0.7}}


@pytest.fixture(scope="module")
def server():
    """The defaults, spelled out: co-batching on, no wait (each test's requests queue behind a blocker)."""
    with InProcessServer("--max-batch-samples", "64", "--batch-wait-ms", "0") as s:
        yield s


@pytest.fixture(scope="module")
def model():
    return ModelRegistry().get("tiny-sd3")


def blocker(c: Client) -> str:
    """BLOCKER (tests/servers.py): seconds of work nothing else can join."""
    return c.submit(**BLOCKER).id


def until_running(c: Client, rollout_id: str, steps: int = 1) -> None:
    wait_for(lambda: c.status(rollout_id).progress.steps_done >= steps, f"{rollout_id} runs")


def table(c: Client, ticket) -> pa.Table:
    location, flight_ticket = c.locate(ticket)
    with flight.FlightClient(location) as fc:
        return fc.do_get(flight.Ticket(flight_ticket.encode())).read_all()


def batch(t: pa.Table) -> dict:
    return json.loads(t.schema.metadata[b"sigmaflight.rollout"])["batch"]


def histogram_counts(c: Client, of: str = "_count") -> dict[str, float]:
    """The batch histograms' counts (or, with of="_sum", their sums) from /metrics."""
    text = c._http.get("/metrics").text
    return {f.name: sum(s.value for s in f.samples if s.name.endswith(of))
            for f in text_string_to_metric_families(text) if f.name.startswith("sigmaflight_batch_")}


def test_compatible_requests_share_one_call_and_each_keeps_its_own(server, model):
    """Three compatible requests (other prompts, counts, negative prompt, seeds, sde window) share one
    call: one batch id, disjoint rows covering it. Two incompatible ones (another T, another size) run
    alone, each on its own schedule. Every member's x_0 is the stock prepare_latents draw of its
    seeds, and each log-prob is Flow-GRPO's step on its own stored x_i, x_{i+1} and velocity."""
    with Client(server.rest_url) as c:
        before = histogram_counts(c)
        block = blocker(c)
        until_running(c, block)
        a = c.submit(prompts=["a red cube", "a blue ball"], seed=11, **{**BASE, "sampler": {
            "type": "sde", "noise_level": 0.7, "sde_steps": [0, 1]}}, return_={"velocities": True})
        b = c.submit(prompts=["a dog"], num_outputs_per_prompt=2, seed=12, **BASE, return_={"velocities": True})
        d = c.submit(prompts=["a cat"], negative_prompt="blurry", seeds=[123456789], **BASE,
                     return_={"velocities": True})
        other_t = c.submit(prompts=["a dog"], seed=13, **{**BASE, "num_inference_steps": T + 2})
        other_size = c.submit(prompts=["a dog"], seed=14, height=64, width=64, **BASE)
        c.cancel(block)
        tickets = [a, b, d, other_t, other_size]
        for t in tickets:
            c.wait(t, timeout=120)
        tables = [table(c, t) for t in tickets]
        after = histogram_counts(c)
    members = [batch(t) for t in tables[:3]]
    assert len({m["id"] for m in members}) == 1 and {m["requests"] for m in members} == {3}
    # each member's own "rollout started" line, found by its id as every line about it is (the
    # batch's one line named them in a list only), with the batch it started in
    for t in tickets[:3]:
        (line,) = log_entries(server, "rollout started", rollout=t.id)
        assert sorted(line["batch"]) == sorted(x.id for x in tickets[:3]), line
    rows = sorted(tuple(m["rows"]) for m in members)
    assert rows == [(0, 2), (2, 4), (4, 5)] and {m["samples"] for m in members} == {5}
    for alone in tables[3:]:
        info = batch(alone)
        assert info["requests"] == 1 and info["rows"] == [0, info["samples"]]
        assert info["id"] != members[0]["id"]
    # the histograms counted the batches: the blocker's, the three-member one, and the two alone
    assert after["sigmaflight_batch_requests"] - before.get("sigmaflight_batch_requests", 0) == 4
    # each incompatible one ran its own schedule: the stock scheduler's sigmas for its T
    from diffusers import FlowMatchEulerDiscreteScheduler

    for t, steps in ((tables[3], T + 2), (tables[4], T)):
        stock = FlowMatchEulerDiscreteScheduler.from_config(model.pipeline.scheduler.config)
        stock.set_timesteps(steps)
        traj = Trajectory.from_table(t)
        assert torch.equal(traj.sigmas, stock.sigmas.to(torch.float32))
    pipe, d_ = model.pipeline, model.defaults
    for t, sde in zip(tables[:3], [(0, 1), (0, 1, 2, 3), (0, 1, 2, 3)], strict=True):
        traj = Trajectory.from_table(t)
        gens = [torch.Generator("cpu").manual_seed(int(s)) for s in traj.seeds]
        x0 = pipe.prepare_latents(traj.num_samples, pipe.transformer.config.in_channels, d_.height, d_.width,
                                  torch.float32, torch.device("cpu"), gens)
        assert torch.equal(traj.latent(0), x0)
        for i in range(T):
            if i not in sde:
                assert torch.isnan(traj.log_probs[:, i]).all()
                continue
            v = torch.from_numpy(t.filter(pc.equal(t["step"], i))["velocity"].combine_chunks().to_numpy_ndarray())
            _, ref, *_ = flow_grpo_step(traj.sigmas, i, traj.latent(i), v, 0.7, "sde", prev_sample=traj.latent(i + 1))
            torch.testing.assert_close(traj.log_probs[:, i], ref, rtol=0, atol=1e-6 * max(1.0, ref.abs().max().item()))


def test_a_cancelled_member_ends_at_once_while_the_other_finishes(server):
    with Client(server.rest_url) as c:
        block = blocker(c)
        until_running(c, block)
        long: dict[str, Any] = {**BASE, "num_inference_steps": 200, "return": {"steps": [0, 200]}}
        x = c.submit(prompts=["x"], seed=21, **long)
        y = c.submit(prompts=["y"], seed=22, **long)
        c.cancel(block)
        until_running(c, x.id, 5)
        c.cancel(x)
        st = wait_for(lambda: c.status(x) if c.status(x).status == "cancelled" else None, "the cancelled member ends")
        other = c.status(y)
        assert other.status == "running" and other.progress.steps_done < 200, other  # y runs on
        with pytest.raises(RolloutCancelled):
            c.pull(x)
        assert st.progress.steps_done < 200
        c.wait(y, timeout=120)
        info = batch(table(c, y))
    assert info["requests"] == 2


def _nudged_weights(model, seed: int) -> bytes:
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    state = model.pipeline.transformer.state_dict()
    return save({k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point()
                 else v.clone() for k, v in state.items()})


def _digest(c: Client) -> str:
    (m,) = [m for m in c.models() if m["id"] == "tiny-sd3"]
    return str(m["digest"])


def test_a_stale_member_fails_alone_and_a_push_during_a_batch_keeps_its_weights(server, model):
    """A member whose expected_digest went stale while it queued fails stale_policy and takes no
    rows; the other runs. Then a push while a two-member batch runs: both finish on the weights
    they started with and record that digest."""
    body = _nudged_weights(model, 7)
    with Client(server.rest_url) as c:
        base = _digest(c)
        calls, sums = histogram_counts(c), histogram_counts(c, "_sum")
        block = blocker(c)
        until_running(c, block)
        stale = c.submit(prompts=["s"], seed=31, expected_digest=base, **BASE)
        fresh = c.submit(prompts=["f"], seed=32, **BASE)
        r = c._http.put("/v1/models/tiny-sd3/weights", content=body,
                        headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        pushed = r.json()["digest"]
        c.cancel(block)
        with pytest.raises(RolloutFailed) as e:
            c.wait(stale, timeout=120)
        assert e.value.rollout is not None and e.value.rollout.error is not None
        assert e.value.rollout.error.type == "stale_policy"
        c.wait(fresh, timeout=120)
        t = table(c, fresh)
        assert batch(t)["requests"] == 1 and batch(t)["rows"] == [0, 1]
        assert json.loads(t.schema.metadata[b"sigmaflight.rollout"])["model"]["digest"] == pushed
        # the histograms count the model calls that ran, as their `batch` metadata says: the
        # blocker's (256 samples) and the fresh member's (1), not the stale one that took no rows
        ran, ran_sums = histogram_counts(c), histogram_counts(c, "_sum")
        assert ran["sigmaflight_batch_samples"] - calls.get("sigmaflight_batch_samples", 0) == 2
        assert ran_sums["sigmaflight_batch_samples"] - sums.get("sigmaflight_batch_samples", 0) == 256 + 1
        assert ran_sums["sigmaflight_batch_requests"] - sums.get("sigmaflight_batch_requests", 0) == 1 + 1

        long: dict[str, Any] = {**BASE, "num_inference_steps": 200, "return": {"steps": [0, 200]}}
        block = blocker(c)
        until_running(c, block)
        x = c.submit(prompts=["x"], seed=33, **long)
        y = c.submit(prompts=["y"], seed=34, **long)
        c.cancel(block)
        until_running(c, x.id, 5)
        r = c._http.put("/v1/models/tiny-sd3/weights", content=_nudged_weights(model, 8),
                        headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200 and r.json()["digest"] != pushed
        assert c.status(x).status == "running"  # the push came while the batch ran
        for t in (x, y):
            c.wait(t, timeout=120)
            meta = json.loads(table(c, t).schema.metadata[b"sigmaflight.rollout"])
            assert meta["model"]["digest"] == pushed and meta["batch"]["requests"] == 2


def test_an_older_request_is_never_overtaken_by_younger_ones(server):
    """The age bound: an older request that nobody can join starts before younger compatible ones,
    however many of them queue behind it."""
    with Client(server.rest_url) as c:
        block = blocker(c)
        until_running(c, block)
        old = c.submit(prompts=["old"], seed=41, height=64, width=64, **BASE)
        young = [c.submit(prompts=[f"young {k}"], seed=50 + k, **BASE) for k in range(4)]
        c.cancel(block)
        for t in (old, *young):
            c.wait(t, timeout=120)
        first = c.status(old).started_at
        starts = [c.status(t).started_at for t in young]
        young_batches = {batch(table(c, t))["id"] for t in young}
    assert first is not None and all(s is not None and first <= s for s in starts), (first, starts)
    assert len(young_batches) == 1


def test_with_batch_invariance_a_member_is_bit_identical_to_the_request_alone(tmp_path):
    with InProcessServer("--batch-invariant") as s, Client(s.rest_url) as c:
        block = blocker(c)
        until_running(c, block)
        req: dict[str, Any] = {"prompts": ["a red cube", "a blue ball"], "seed": 61, **BASE}
        together = c.submit(**req)
        other = c.submit(prompts=["another"], num_outputs_per_prompt=3, seed=62, **BASE)
        c.cancel(block)
        c.wait(together, timeout=120)
        c.wait(other, timeout=120)
        alone = c.submit(**req)
        c.wait(alone, timeout=120)
        t1, t2 = table(c, together), table(c, alone)
    assert batch(t1)["requests"] == 2 and batch(t2)["requests"] == 1
    a, b = Trajectory.from_table(t1), Trajectory.from_table(t2)
    assert torch.equal(a.latents, b.latents)
    assert torch.equal(a.log_probs.nan_to_num(-7.0), b.log_probs.nan_to_num(-7.0))


def test_max_batch_samples_1_runs_every_request_alone():
    with InProcessServer("--max-batch-samples", "1") as s, Client(s.rest_url) as c:
        block = blocker(c)
        until_running(c, block)
        queued = [c.submit(prompts=[f"p{k}"], seed=70 + k, **BASE) for k in range(3)]
        c.cancel(block)
        infos = []
        for t in queued:
            c.wait(t, timeout=120)
            infos.append(batch(table(c, t)))
    assert [i["requests"] for i in infos] == [1, 1, 1] and len({i["id"] for i in infos}) == 3


@pytest.mark.e2e
def test_kill_9_during_a_batch_fails_every_member_and_loses_nothing_finished(tmp_path):
    data = str(tmp_path / "data")
    with ServerProcess("--data-dir", data) as s, Client(s.rest_url) as c:
        done = c.submit(prompts=["kept"], seed=81, **BASE)
        c.wait(done, timeout=120)
        kept = table(c, done)
        long: dict[str, Any] = {**BASE, "num_inference_steps": 200, "return": {"steps": [0]}}
        block = blocker(c)
        until_running(c, block)
        members = [c.submit(prompts=[f"m{k}"], seed=82 + k, **long) for k in range(2)]
        c.cancel(block)
        for m in members:
            until_running(c, m.id, 3)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(30)
    with InProcessServer("--data-dir", data) as restarted, Client(restarted.rest_url) as c:
        for m in members:
            st = c.status(m.id)
            assert st.status == "failed" and st.error is not None and st.error.type == "server_restarted", st
        assert c.status(done.id).status == "succeeded"
        again = table(c, done.id)
    assert again.equals(kept)
