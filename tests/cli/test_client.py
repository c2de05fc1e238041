"""The Python API round trip and the weights endpoint, on a real server."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save
from sigmaflight.pipeline.kernels import step_log_prob as step_log_prob_impl
from sigmaflight.pipeline.models import ModelRegistry, weights_digest
from sigmaflight.pipeline.replay import Replayer as ReplayerImpl

from sigmaflight import AsyncClient, Replayer, Trajectory, step_log_prob
from sigmaflight import Client as ReExported
from sigmaflight.client import ApiError, Client, NotFound, RolloutFailed, replay_log_probs, rollout_spec
from sigmaflight.wire import Ticket
from tests.servers import BLOCKER, InProcessServer, flight_streams, metric, wait_for


def _stock_velocity(model, spec, x, t):
    """v at x (step time t) as the stock StableDiffusion3Pipeline computes it: its own
    encode_prompt, the transformer on [uncond; cond], then classifier-free guidance."""
    pipe = model.pipeline
    g = model.defaults.guidance_scale if spec.guidance_scale is None else spec.guidance_scale
    with torch.no_grad():
        pe, npe, pp, npp = pipe.encode_prompt(
            prompt=list(spec.prompts), prompt_2=None, prompt_3=None, do_classifier_free_guidance=True,
            num_images_per_prompt=spec.num_outputs_per_prompt, negative_prompt=spec.negative_prompt,
            **model.defaults.call_kwargs,
        )
        out = pipe.transformer(hidden_states=torch.cat([x, x]), timestep=t.expand(2 * len(x)),
                               encoder_hidden_states=torch.cat([npe, pe]), pooled_projections=torch.cat([npp, pp]),
                               return_dict=False)[0]
    uncond, cond = out.chunk(2)
    return uncond + g * (cond - uncond)


@pytest.fixture(scope="module")
def model():
    return ModelRegistry().get("tiny-sd3")  # the server's weights, bit for bit


def test_round_trip_and_replay(server, model):
    # The users' package re-exports the real objects (not stand-ins).
    assert ReExported is Client and Replayer is ReplayerImpl and step_log_prob is step_log_prob_impl
    with Client(server.rest_url) as client:
        ids = {m["id"]: m for m in client.models()}
        assert ids["tiny-sd3"]["default"] and ids["tiny-sd3"]["digest"] == weights_digest(model.pipeline)
        ticket = client.submit(prompts=["a red cube", "a dog"], num_outputs_per_prompt=2, num_inference_steps=4,
                               seed=5, sampler={"type": "sde", "sde_steps": [1, 2]}, return_={"steps": [0, 1, 2, 3, 4]})
        status = client.wait(ticket, timeout=60)
        assert status.status == "succeeded" and status.result is not None and status.result.steps == [0, 1, 2, 3, 4]
        traj = client.pull(ticket)
        assert isinstance(traj, Trajectory) and traj.rollout_id == ticket.id
        assert traj.latents.shape == (4, 5, 4, 16, 16) and traj.log_probs.shape == (4, 4)
        assert traj.sde_steps == (1, 2) and traj.metadata["model"]["digest"] == ids["tiny-sd3"]["digest"]
        # The same trajectory by rollout id and by bare Flight ticket.
        assert torch.equal(client.pull(ticket.id).latents, traj.latents)
        assert torch.equal(client.pull(ticket.flight.ticket).latents, traj.latents)
        # transitions() aligned by absolute index; the recorded log-probs are step_log_prob of the pair.
        spec = rollout_spec(traj)
        assert spec.seed == 5 and spec.sampler.sde_steps == (1, 2) and spec.num_samples == 4
        got = [t.i for t in traj.transitions([1, 2])]
        assert got == [1, 2]
        first = next(traj.transitions([1]))  # indexed as it unpacks: Transition(i, x, x_next, sigma, sigma_next, log_prob)
        assert len(first) == 6 and (first[0], first[3], first[4]) == (1, first.sigma, first.sigma_next)
        assert first[1] is first.x and first[2] is first.x_next and first[-1] is first.log_prob
        for t in traj.transitions([1, 2]):  # against the stock diffusers transformer's CFG velocity
            v = _stock_velocity(model, spec, t.x, traj.timesteps[t.i])
            assert torch.equal(step_log_prob(t.x, t.x_next, v, traj.sigmas, t.i, sampler=spec.sampler), t.log_prob)
        # Replay with the trainer's own model gives the recorded log-probs bit for bit, with and without grad.
        replayed = replay_log_probs(model, traj)
        assert torch.equal(replayed[:, [1, 2]], traj.log_probs[:, [1, 2]])
        assert torch.isnan(replayed[:, [0, 3]]).all() and torch.isnan(traj.log_probs[:, [0, 3]]).all()
        with_grad = replay_log_probs(model, traj, grad=True)
        assert torch.equal(with_grad.detach()[:, [1, 2]], traj.log_probs[:, [1, 2]])
        # cancel on a finished rollout releases it.
        assert client.cancel(ticket.id).status == "expired"
        with pytest.raises(RolloutFailed):
            client.wait(ticket.id, timeout=5)
        with pytest.raises(ApiError) as e:
            client.status("nope")
        assert e.value.status == 404 and e.value.type == "not_found"


def _sample(client: Client, seed: int = 11) -> Trajectory:
    t = client.submit(prompts=["a red cube"], num_outputs_per_prompt=2, num_inference_steps=3, seed=seed)
    client.wait(t, timeout=60)
    return client.pull(t)


def test_weights_endpoint_changes_digest_and_trajectories(server, model):
    original = {k: v.clone() for k, v in model.pipeline.transformer.state_dict().items()}
    with Client(server.rest_url) as client:
        before = _sample(client)
        changed = {k: v.clone() for k, v in original.items()}
        key = next(k for k in changed if k.endswith("proj_out.weight"))
        changed[key] += 0.05
        digest = client.push_weights("tiny-sd3", changed)
        assert digest != before.metadata["model"]["digest"]
        assert {m["id"]: m["digest"] for m in client.models()}["tiny-sd3"] == digest
        after = _sample(client)
        assert after.metadata["model"]["digest"] == digest
        # Same seed: the same initial noise x_0, different latents once the new model has run.
        assert torch.equal(after.latent(0), before.latent(0))
        assert not torch.equal(after.latent(3), before.latent(3))

        # Refusals name the model or the key; nothing changes.
        with pytest.raises(ApiError) as e:
            client.push_weights("no-such-model", original)
        assert e.value.status == 404
        bad_shape = {**original, key: torch.zeros(3)}
        with pytest.raises(ApiError) as e:
            client.push_weights("tiny-sd3", bad_shape)
        assert e.value.status == 422 and key in e.value.message and e.value.details[0]["loc"] == ["body", key]
        missing = {k: v for k, v in original.items() if k != key}
        with pytest.raises(ApiError) as e:
            client.push_weights("tiny-sd3", missing)
        assert e.value.status == 422 and key in e.value.message and "missing" in e.value.message
        nan = {**original, key: torch.full_like(original[key], float("nan"))}
        with pytest.raises(ApiError) as e:
            client.push_weights("tiny-sd3", nan)
        assert e.value.status == 422 and key in e.value.message
        assert {m["id"]: m["digest"] for m in client.models()}["tiny-sd3"] == digest

        # The route has its own size limit: 1.5 MiB passes the body limit (422 names the extra key),
        # while the same size on POST /v1/rollouts is refused with 413.
        big = {**original, "extra.weight": torch.zeros(3 * 2**17)}
        with server.client() as http:
            r = http.put("/v1/models/tiny-sd3/weights", content=save(big),
                         headers={"content-type": "application/octet-stream"})
            assert r.status_code == 422 and "extra.weight" in r.json()["error"]["message"]
            r = http.post("/v1/rollouts", content=b" " * (3 * 2**19), headers={"content-type": "application/json"})
            assert r.status_code == 413
            r = http.put("/v1/models/tiny-sd3/weights", content=b"not safetensors")
            assert r.status_code == 422
            assert "put" in http.get("/openapi.json").json()["paths"]["/v1/models/{model_id}/weights"]

        # Pushing the original weights back restores the original digest and trajectories, bit for bit.
        assert client.push_weights("tiny-sd3", original) == before.metadata["model"]["digest"]
        again = _sample(client)
        assert torch.equal(again.latents, before.latents) and torch.equal(again.log_probs.nan_to_num(),
                                                                          before.log_probs.nan_to_num())


def _bytes_served(server: InProcessServer) -> float:
    import re

    with server.client() as c:
        m = re.search(r"^sigmaflight_flight_bytes_served_total (\S+)$", c.get("/metrics").text, re.M)
    assert m is not None
    return float(m.group(1))


def _served_more(server: InProcessServer, than: float) -> bool:
    """The server counted more bytes served than `than` (it counts a stream once its call ended)."""
    return _bytes_served(server) > than


def test_transport_and_host_reach_the_flight_client(tmp_path):
    """With --shm-dir, Client's default reads the same-host file (no gRPC bytes); transport="flight"
    and a foreign host id stream over gRPC: the arguments reach the TrajectoryClient."""
    with InProcessServer("--shm-dir", str(tmp_path / "shm")) as server, Client(server.rest_url) as client:
        ticket = client.submit(prompts=["a red cube"], num_inference_steps=2, seed=3)
        client.wait(ticket, timeout=60)
        served = _bytes_served(server)
        local = client.pull(ticket)
        assert _bytes_served(server) == served  # read from the shared-memory file
        for kwargs in ({"transport": "flight"}, {"host": "another-host"}):
            with Client(server.rest_url, **kwargs) as other:  # type: ignore[arg-type]
                assert torch.equal(other.pull(ticket).latents, local.latents)
            wait_for(functools.partial(_served_more, server, served), f"bytes served over gRPC with {kwargs}")
            served = _bytes_served(server)
    with pytest.raises(ValueError, match="transport"):
        Client("http://127.0.0.1:1", transport="grpc")  # type: ignore[arg-type]


def _get_200s(c) -> float:
    """GET 200s the server answered so far, read with prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = c._http.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sigmaflight_http_responses_total" and s.labels == {"method": "GET", "code": "200"})


def _queued_behind_a_blocker(c: Client) -> tuple[Ticket, Ticket]:
    """(blocker, queued): BLOCKER and a rollout that waits behind it; cancel both at the end."""
    blocker = c.submit(**BLOCKER)
    return blocker, c.submit(prompts=["a"], num_inference_steps=2, seed=2)


def test_wait_holds_each_read_until_the_rollout_ends(server):
    """`wait` asks the server to hold each status read until the rollout ends: a rollout that stays
    queued for 4 s costs one read (two at most), and one that ends costs one read, answered with its end
    (counted by the server's own /metrics)."""
    with Client(server.rest_url) as c:
        blocker, queued = _queued_behind_a_blocker(c)
        try:
            before = _get_200s(c)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="still queued"):
                c.wait(queued, timeout=4)
            took = time.monotonic() - t0
            reads = _get_200s(c) - before - 1  # this /metrics GET itself
            c.cancel(blocker)
            before = _get_200s(c)
            st = c.wait(queued, timeout=60)  # runs now: two steps
            reads_to_end = _get_200s(c) - before - 1
        finally:
            c.cancel(queued)
            c.cancel(blocker)
    # one read held the whole 4 s (a second, of a millisecond, when the hold ended a hair before
    # the deadline); polling with backoff made 9
    assert reads <= 2, reads
    assert 3.9 <= took < 10, took
    assert st.status == "succeeded" and reads_to_end == 1, (st.status, reads_to_end)


def test_async_wait_holds_its_reads_too(server):
    """AsyncClient.wait sends the same held reads: three waits on rollouts queued behind a blocker
    for a second, then run, cost three reads."""
    async def main(c: Client) -> list[str]:
        async with AsyncClient(server.rest_url) as ac:
            blocker = await ac.submit(**BLOCKER)
            tickets = [await ac.submit(prompts=[f"held {i}"], num_inference_steps=2, seed=i) for i in range(3)]
            waits = asyncio.gather(*(ac.wait(t, timeout=60) for t in tickets))
            await asyncio.sleep(1.0)
            await ac.cancel(blocker)
            return [st.status for st in await waits]

    with Client(server.rest_url) as c:
        before = _get_200s(c)
        statuses = asyncio.run(main(c))
        reads = _get_200s(c) - before - 1  # this /metrics GET itself
    assert statuses == ["succeeded"] * 3
    assert reads == 3, reads


def test_wait_backs_off_between_polls_on_a_server_that_holds_no_reads():
    """A server that answers a held read at once (here --max-held-reads 0; an older server ignores
    wait_s) is polled with backoff: about ten reads in 4 s, not one every 50 ms."""
    with InProcessServer("--max-held-reads", "0") as s, Client(s.rest_url) as c:
        blocker, queued = _queued_behind_a_blocker(c)
        try:
            before = _get_200s(c)
            with pytest.raises(TimeoutError, match="still queued"):
                c.wait(queued, timeout=4)
            polls = _get_200s(c) - before - 1  # this /metrics GET itself
        finally:
            c.cancel(queued)
            c.cancel(blocker)
    assert 3 <= polls <= 12, polls  # 0.05, 0.1, 0.2, 0.4, 0.8, then 1 s apart


def test_a_bare_flight_ticket_is_found_through_the_rollout_it_belongs_to():
    """`Client.locate`/`pull` with a Flight ticket string (as `sigmaflight pull TICKET` passes it):
    GET /v1/rollouts?ticket= names its rollout, on an empty server too (NotFound naming it)."""
    with InProcessServer() as s, Client(s.rest_url) as c:
        with pytest.raises(NotFound, match="no rollout or ticket 'sft1_nothing'"):
            c.locate("sft1_nothing")
        first = c.submit(prompts=["a red cube"], num_inference_steps=2, seed=1)
        newest = c.submit(prompts=["a dog"], num_inference_steps=2, seed=2)
        c.wait(newest, timeout=60)
        raw = first.flight.ticket
        assert c.locate(raw) == (first.flight.locations[0], raw)
        assert c.pull(raw).rollout_id == first.id
        assert [r.id for r in c.rollouts(ticket=raw)] == [first.id]
        assert c.rollouts(ticket=raw + ":outputs") == []  # the ticket of a stream it does not publish is none of its
        assert c.rollouts(ticket=raw[:-1]) == []  # a prefix of a ticket is no ticket
        r = httpx.get(f"{s.rest_url}/v1/rollouts", params={"ticket": ""})
        assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["query", "ticket"]


def test_pull_by_the_ticket_of_one_of_its_other_streams_gives_the_trajectory(server, capsys):
    """pull_outputs takes any of the rollout's tickets; pull of the "outputs" or "conditioning"
    stream's ticket raised "ValueError: not a trajectory/v1 schema", and `sigmaflight inspect` of
    it 'Field "step" does not exist in schema'. Both read the trajectory now."""
    from sigmaflight.cli import main

    with Client(server.rest_url) as client:
        ticket = client.submit(prompts=["a red cube"], num_inference_steps=2, seed=4,
                               return_={"outputs": True, "conditioning": True})
        client.wait(ticket, timeout=60)
        whole = client.pull(ticket)
        for stream in ("outputs", "conditioning"):
            other = ticket.flight.streams[stream].ticket
            assert other != ticket.flight.ticket
            got = client.pull(other)
            assert got.rollout_id == ticket.id and torch.equal(got.latents, whole.latents), stream
            assert main(["inspect", other, "--url", server.rest_url, "--json"]) == 0, capsys.readouterr().err
            report = json.loads(capsys.readouterr().out)
            assert [r["i"] for r in report["schedule"]] == [0, 1, 2], stream


def test_a_released_rollout_pulled_by_any_handle_is_rollout_failed(server):
    """One rollout, one answer: after a release (it becomes expired), a pull by its Ticket, its id
    or its bare Flight ticket raises RolloutFailed carrying its last status, never NotFound."""
    with Client(server.rest_url) as client:
        ticket = client.submit(prompts=["a red cube"], num_inference_steps=2, seed=3)
        client.wait(ticket, timeout=60)
        assert client.cancel(ticket.id).status == "expired"
        for handle in (ticket, ticket.id, ticket.flight.ticket):
            with pytest.raises(RolloutFailed) as e:
                client.pull(handle)
            assert type(e.value) is RolloutFailed and e.value.rollout is not None
            assert e.value.rollout.id == ticket.id and e.value.rollout.status == "expired"


def test_wait_refuses_a_timeout_that_is_no_number_of_seconds_and_takes_none_as_no_limit(server):
    """`wait(timeout=nan)` never timed out (nothing is <= NaN), `timeout=None` was a bare TypeError from
    `monotonic() + None`; a negative one or a bad poll was taken. Named before any request, both clients."""
    bad: list[tuple[dict[str, Any], type[Exception]]] = [({"timeout": float("nan")}, ValueError), ({"timeout": -1.0}, ValueError), ({"timeout": "60"}, TypeError),
           ({"timeout": True}, TypeError), ({"poll_s": 0.0}, ValueError), ({"poll_s": float("nan")}, ValueError),
           ({"max_poll_s": -1.0}, ValueError), ({"max_poll_s": float("inf")}, ValueError)]
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["a"], num_inference_steps=2, seed=11)
        for kwargs, kind in bad:
            with pytest.raises(kind, match=f"^{next(iter(kwargs))} must be"):
                c.wait(ticket, **kwargs)
        assert c.wait(ticket, timeout=None).status == "succeeded"
        assert c.wait(ticket, timeout=float("inf")).status == "succeeded"

    async def main() -> str:
        async with AsyncClient(server.rest_url) as ac:
            for kwargs, kind in bad:
                with pytest.raises(kind, match=f"^{next(iter(kwargs))} must be"):
                    await ac.wait(ticket, **kwargs)
            return (await ac.wait(ticket, timeout=None)).status

    assert asyncio.run(main()) == "succeeded"


def test_cancelling_async_pulls_frees_their_flight_streams_at_once(server):
    """Cancelling the tasks that await `AsyncClient.pull`, `pull_stream` and `pull_outputs` of a
    running rollout ends what they hold on the server. Before, their threads read on, and the server
    kept each Flight stream (a `--max-flight-streams` slot) until the rollout ended. Nor does a
    cancelled pull take its broken stream for a lost connection and hold a status read for up to
    10 s to learn how the rollout ended. `pull_outputs` waits for the end (the stream is made then)
    in a held status read, which the cancel ends; it waited inside pyarrow's do_get, out of reach."""
    def held(c: httpx.Client) -> float:
        return metric(c.get("/metrics").text, "sigmaflight_held_reads")

    async def main(c: httpx.Client) -> tuple[int, float, str]:
        async with AsyncClient(server.rest_url) as ac:
            ticket = await ac.submit(**{**BLOCKER, "return": {"steps": [0], "outputs": True}})
            pulls = [asyncio.create_task(ac.pull(ticket)), asyncio.create_task(ac.pull(ticket)),
                     asyncio.create_task(ac.pull_stream(ticket, "trajectory")),
                     asyncio.create_task(ac.pull_outputs(ticket))]
            await asyncio.to_thread(wait_for, lambda: flight_streams(c) + held(c) == 4 or None, "the pulls waiting")
            with pytest.raises(NotFound, match="no 'conditioning' stream"):  # not asked for: at once, not at the end
                await asyncio.wait_for(ac.pull_conditioning(ticket), 10)
            for task in pulls:
                task.cancel()
            outcomes = await asyncio.gather(*pulls, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            await asyncio.to_thread(wait_for, lambda: flight_streams(c) + held(c) == 0 or None, "all freed", 3.0)
            await asyncio.sleep(0.3)  # and nothing comes back: no status read held for the end
            running = str((await ac.status(ticket)).status)
            await ac.cancel(ticket)
            return flight_streams(c), held(c), running

    with httpx.Client(base_url=server.rest_url) as c:
        streams, reads, running = asyncio.run(main(c))
    assert streams == 0 and reads == 0 and running == "running"  # freed while the rollout still ran


def test_cancelling_an_async_pull_of_a_queued_rollout_lets_the_program_end(server):
    """A pull of a queued rollout waits for it to start in a status poll, where the cancel reaches. It
    waited inside pyarrow's do_get, which nothing interrupts: its thread ran on, and `asyncio.run`
    (which waits for the loop's threads) returned only once the rollout started, here when the
    blocker ahead of it was cancelled 20 s later."""
    async def main() -> str:
        async with AsyncClient(server.rest_url) as ac:
            queued = await ac.submit(prompts=["queued"], num_inference_steps=2, seed=3)
            pull = asyncio.create_task(ac.pull(queued))
            await asyncio.sleep(0.5)
            status = str((await ac.status(queued)).status)
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            return f"{queued.id} {status}"

    with Client(server.rest_url) as c:
        blocker = c.submit(**BLOCKER)
        unblock = threading.Timer(20.0, c.cancel, args=(blocker,))  # old code: its only way out
        unblock.start()
        try:
            t0 = time.monotonic()
            queued, status = asyncio.run(main()).split()
            took = time.monotonic() - t0
            c.cancel(queued)
        finally:
            unblock.cancel()
            c.cancel(blocker)
    assert status == "queued" and took < 5.0, (status, took)
