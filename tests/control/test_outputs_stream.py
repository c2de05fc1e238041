"""The "outputs/v1" stream through the real server (REST + Flight), read with plain pyarrow.

Reference: the stock diffusers pipeline itself. An "ode" rollout's x_T equals the stock
`__call__` run with `latents=x_0` (contract), so the stock pipeline's own decode of that run
(`output_type="pil"`, images or video frames, as tests/pipeline/test_decode.py) is what the stream
must hold, byte for byte.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from PIL import Image
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight import Client, NotFound
from tests.servers import InProcessServer, wait_for_status
from tests.stock import stock_scheduler

TOKEN = "outputs-e2e-token-0123456789"

CASES: dict[str, dict[str, Any]] = {
    "tiny-sd3": dict(prompts=["a red cube", "a dog"], num_outputs_per_prompt=2, guidance_scale=4.5,
                     negative_prompt="blurry"),
    "tiny-flux": dict(prompts=["a red cube", "a dog"], num_outputs_per_prompt=1, guidance_scale=3.5),
    "tiny-wan": dict(prompts=["a red cube"], num_outputs_per_prompt=2, guidance_scale=5.0, negative_prompt="blurry"),
}


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--max-steps", "5000", "--workers", "1") as s:
        yield s


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry()


def _stock_outputs(model, case: dict[str, Any], steps: int, x0: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 outputs of the stock pipeline's own decode, the x_T its loop ended on)."""
    d = model.defaults
    seen: dict[str, torch.Tensor] = {}

    def on_step_end(pipe, i, t, kwargs):
        seen["x"] = kwargs["latents"].clone()
        return kwargs

    kw: dict[str, Any] = dict(
        prompt=case["prompts"], guidance_scale=case["guidance_scale"], height=d.height, width=d.width,
        num_inference_steps=steps, latents=x0.to(model.device, model.dtype),
        callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"], **d.call_kwargs,
    )
    kw["num_videos_per_prompt" if d.is_video else "num_images_per_prompt"] = case["num_outputs_per_prompt"]
    if "negative_prompt" in case:
        kw["negative_prompt"] = case["negative_prompt"]
    with stock_scheduler(model.pipeline) as pipe, torch.inference_mode():
        if d.is_video:
            frames = pipe(output_type="pil", num_frames=d.num_frames, **kw).frames  # B lists of F PIL frames
            want = np.stack([np.stack([np.asarray(f) for f in v]) for v in frames])
        else:
            images = pipe(output_type="pil", **kw).images
            want = np.stack([np.asarray(im) for im in images])
    return want, seen["x"]


def _read(location: str, ticket: str, token: str | None = None) -> pa.Table:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    with flight.FlightClient(location) as fc:
        return fc.do_get(flight.Ticket(ticket.encode()), flight.FlightCallOptions(headers=headers)).read_all()


@pytest.mark.parametrize("model_id", list(CASES))
def test_outputs_equal_the_stock_pipelines_decode(server, registry, model_id):
    case = CASES[model_id]
    steps = 3
    model = registry.get(model_id)
    with Client(server.rest_url) as client:
        served = {m["id"]: m for m in client.models()}
        ticket = client.submit(model=model_id, num_inference_steps=steps, seed=11, sampler={"type": "ode"},
                               return_={"outputs": True, "steps": [0, steps]}, **case)
        assert set(ticket.flight.streams) == {"trajectory", "outputs"}
        assert ticket.flight.streams["trajectory"].ticket == ticket.flight.ticket
        assert ticket.flight.streams["outputs"].descriptor_path == ["rollouts", ticket.id, "outputs"]
        client.wait(ticket, timeout=120)
        traj = client.pull(ticket)
        table = _read(ticket.flight.locations[0], ticket.flight.streams["outputs"].ticket)  # plain pyarrow
        pulled = client.pull_outputs(ticket)
    assert served[model_id]["digest"] == model.digest  # the same seeded weights as the server's
    want, x_t = _stock_outputs(model, case, steps, traj.latent(0))
    assert torch.equal(x_t.cpu(), traj.latent(steps).to(x_t.dtype))  # the reference ran the rollout's own latents

    meta = table.schema.metadata
    assert meta[b"sigmaflight.format"] == b'"outputs/v1"'
    column = "video" if model.defaults.is_video else "image"
    assert table.column_names == ["sample", "prompt_index", "seed", column]
    assert table.schema.field(column).type == pa.fixed_shape_tensor(pa.uint8(), list(want.shape[1:]))
    b = len(case["prompts"]) * case["num_outputs_per_prompt"]
    assert table.column("sample").to_pylist() == list(range(b))
    assert table.column("prompt_index").to_pylist() == [s // case["num_outputs_per_prompt"] for s in range(b)]
    assert table.column("seed").to_pylist() == [int(s) for s in traj.seeds]
    got = table.column(column).combine_chunks().to_numpy_ndarray()
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    assert np.array_equal(pulled, want)
    assert want.std() > 5  # a real picture


def test_a_reward_from_the_outputs_stream(server):
    """DDPO's JPEG compressibility: the size of each decoded image's JPEG encoding."""
    with Client(server.rest_url) as client:
        ticket = client.submit(prompts=["a red cube", "a dog"], num_outputs_per_prompt=2, num_inference_steps=2,
                               seed=5, return_={"outputs": True, "steps": [0]})
        client.wait(ticket, timeout=60)
        images = client.pull_outputs(ticket)
        # every handle `pull` takes: the rollout id, and the bare Flight ticket (it was a NotFound)
        assert np.array_equal(client.pull_outputs(ticket.id), images)
        assert np.array_equal(client.pull_outputs(ticket.flight.ticket), images)

    def jpeg_bytes(img: np.ndarray) -> int:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        return len(buf.getvalue())

    rewards = [-jpeg_bytes(im) for im in images]
    assert images.shape[0] == 4 and all(r < 0 for r in rewards)
    assert len(set(rewards)) > 1  # different samples, different rewards


def test_a_stream_not_asked_for_is_not_found_naming_it(server):
    with server.client() as c:
        t = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 1}).json()
        assert set(t["flight"]["streams"]) == {"trajectory"}
        wait_for_status(c, t["id"], {"succeeded"})
    location = t["flight"]["locations"][0]
    with flight.FlightClient(location) as fc:
        with pytest.raises(flight.FlightServerError, match="stream 'outputs' of rollout .* not found .*return.outputs"):
            fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", t["id"], "outputs"))
        with pytest.raises(flight.FlightServerError, match="stream 'outputs' .*not requested"):
            fc.do_get(flight.Ticket((t["flight"]["ticket"] + ":outputs").encode())).read_all()
        with pytest.raises(flight.FlightServerError, match="unknown stream 'latents'"):
            fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", t["id"], "latents"))
        assert fc.do_get(flight.Ticket(t["flight"]["ticket"].encode())).read_all().num_rows == 3  # still serving
    with Client(server.rest_url) as client:
        with pytest.raises(NotFound, match=r"no 'outputs' stream .*ask for it with return\.outputs$"):
            client.pull_outputs(t["id"])
        # a name no rollout can have: the names there are, not a return field that does not exist
        with pytest.raises(NotFound, match=r"no 'latents' stream .*the streams are trajectory, outputs, conditioning$"):
            client.pull_stream(t["id"], "latents")


def test_a_ticket_lookup_matches_only_the_tickets_a_rollout_has(server):
    """GET /v1/rollouts?ticket= finds a rollout by its ticket or the ticket of a stream it publishes,
    exactly: its ticket with any other suffix, or a stream it did not ask for, finds nothing."""
    with server.client() as c:
        t = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 3,
                                         "return": {"outputs": True}}).json()
        raw, streams = t["flight"]["ticket"], t["flight"]["streams"]
        assert set(streams) == {"trajectory", "outputs"}

        def found(ticket: str) -> list[str]:
            r = c.get("/v1/rollouts", params={"ticket": ticket})
            assert r.status_code == 200, r.text
            return [x["id"] for x in r.json()["rollouts"]]

        assert found(raw) == [t["id"]]
        assert found(streams["outputs"]["ticket"]) == [t["id"]]
        for other in (f"{raw}:no-such-stream", f"{raw}:conditioning", f"{raw}:", f"{raw}:outputs:x", raw[:-1]):
            assert found(other) == [], other


def test_flight_info_list_and_release_of_the_outputs_stream(server):
    with server.client() as c:
        t = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 2,
                                         "return": {"outputs": True}}).json()
        location = t["flight"]["locations"][0]
        with flight.FlightClient(location) as fc:
            # asked while it runs: waits for the stream (published after the last step)
            info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", t["id"], "outputs"))
            assert info.schema.metadata[b"sigmaflight.format"] == b'"outputs/v1"'
            assert info.total_records == 1
            assert info.endpoints[0].ticket.ticket.decode() == t["flight"]["streams"]["outputs"]["ticket"]
            paths = [tuple(p.decode() for p in i.descriptor.path) for i in fc.list_flights()]
            assert ("rollouts", t["id"], "outputs") in paths and ("rollouts", t["id"]) in paths
            # the outputs stream is published after the last step, a moment before the rollout ends
            # succeeded: a DELETE in between would be a cancel that arrives too late, not a release
            wait_for_status(c, t["id"], {"succeeded"})
            assert c.delete(f"/v1/rollouts/{t['id']}").json()["status"] == "expired"  # released
            with pytest.raises(flight.FlightServerError, match="released"):
                fc.do_get(flight.Ticket(t["flight"]["streams"]["outputs"]["ticket"].encode())).read_all()
            paths = [tuple(p.decode() for p in i.descriptor.path) for i in fc.list_flights()]
            assert ("rollouts", t["id"], "outputs") not in paths


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"return": {"outputs": "yes"}}, ["body", "return", "outputs"]),
        ({"return": {"outputs": 1}}, ["body", "return", "outputs"]),
        ({"expected_digest": 123}, ["body", "expected_digest"]),
        ({"expected_digest": "abc"}, ["body", "expected_digest"]),
        ({"expected_digest": "G" * 64}, ["body", "expected_digest"]),
    ],
)
def test_bad_new_fields_get_422_naming_them(server, body, loc):
    with server.client() as c:
        r = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, **body})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "validation_error" and err["details"][0]["loc"] == loc
        assert ".".join(loc[1:]) in err["message"]
        assert c.get("/healthz").status_code == 200


@pytest.mark.parametrize("stream", ["outputs", "conditioning"])
def test_extra_streams_honour_tokens(stream):
    with InProcessServer("--token", TOKEN) as s, s.client(TOKEN) as c:
        t = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 2, "seed": 3,
                                         "return": {stream: True}}).json()
        wait_for_status(c, t["id"], {"succeeded"})
        location, ticket = t["flight"]["locations"][0], t["flight"]["streams"][stream]["ticket"]
        for token in (None, "wrong-token"):
            with pytest.raises(flight.FlightUnauthenticatedError, match="bearer token"):
                _read(location, ticket, token)
        assert _read(location, ticket, TOKEN).num_rows == 1
        with Client(s.rest_url, token=TOKEN) as client:
            if stream == "outputs":
                assert client.pull_outputs(t["id"]).shape == (1, 32, 32, 3)
            else:
                assert client.pull_conditioning(t["id"])["prompt_embeds"].shape[0] == 1
