"""Every limit answered with a clear error naming the numbers, before anything runs."""

from __future__ import annotations

import threading
import time

import pyarrow.flight as flight
import pytest

from tests.servers import InProcessServer, wait_for_status

LIMITS = ("--max-body-bytes", "4096", "--max-prompts", "3", "--max-prompt-chars", "100", "--max-samples", "6", "--max-steps", "10",
          "--max-rollout-bytes", str(256 * 1024), "--max-flight-streams", "2")


@pytest.fixture(scope="module")
def limited():
    with InProcessServer(*LIMITS) as server, server.client() as c:
        yield server, c


def _error(r, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == type_
    return error


def test_body_size(limited):
    server, c = limited
    big = {"prompts": ["x" * 5000]}
    error = _error(c.post("/v1/rollouts", json=big), 413, "body_too_large")
    assert "exceeds the limit of 4096 bytes" in error["message"]

    def chunks():  # no Content-Length: refused while streaming
        for _ in range(10):
            yield b" " * 1000

    error = _error(c.post("/v1/rollouts", content=chunks(), headers={"content-type": "application/json"}),
                   413, "body_too_large")
    assert "4096" in error["message"]


@pytest.mark.parametrize(
    ("body", "field", "numbers"),
    [({"prompts": ["a"] * 4}, "prompts", ("4 prompts", "limit of 3")),
     ({"prompts": ["a", "b"], "num_outputs_per_prompt": 4}, "num_outputs_per_prompt", ("8 samples", "limit of 6")),
     ({"prompts": ["a"], "num_inference_steps": 11}, "num_inference_steps", ("11", "limit of 10"))],
)
def test_prompts_samples_steps(limited, body, field, numbers):
    server, c = limited
    error = _error(c.post("/v1/rollouts", json=body), 422, "validation_error")
    assert error["details"][0]["loc"] == ["body", field]
    for n in numbers:
        assert n in error["message"]


def _ids(c) -> list[str]:
    """The rollouts the server holds, by id: their status bodies move (the previous test's last
    rollout may still run), which rollouts there are does not, unless something was queued."""
    return [r["id"] for r in c.get("/v1/rollouts", params={"limit": 1000}).json()["rollouts"]]


@pytest.mark.parametrize(
    ("body", "loc"),
    [({"prompts": ["a", "x" * 101]}, ["body", "prompts", 1]),
     ({"prompts": ["a"], "negative_prompt": "y" * 101}, ["body", "negative_prompt"])],
)
def test_prompt_length(limited, body, loc):
    """A long text would hold the worker in the tokenizer (a 900 KB prompt took 15 s on the tiny
    models), though the encoders keep only its first tokens."""
    server, c = limited
    before = _ids(c)
    error = _error(c.post("/v1/rollouts", json=body), 422, "validation_error")
    assert error["details"][0]["loc"] == loc
    assert "101 characters exceed the limit of 100 (--max-prompt-chars)" in error["message"]
    assert _ids(c) == before
    assert c.post("/v1/rollouts", json={"prompts": ["x" * 100], "num_inference_steps": 1}).status_code == 202


def test_estimated_trajectory_bytes(limited):
    server, c = limited
    # 6 samples x 11 latents x 16x32x32 fp32 (64 KiB) = 4.1 MiB > 256 KiB
    body = {"prompts": ["a", "b", "c"], "num_outputs_per_prompt": 2, "num_inference_steps": 10,
            "height": 128, "width": 128}
    before = _ids(c)
    error = _error(c.post("/v1/rollouts", json=body), 413, "rollout_too_large")
    assert error["details"] == {"estimated_bytes": 6 * 11 * 65536, "limit_bytes": 256 * 1024}
    assert str(6 * 11 * 65536) in error["message"] and str(256 * 1024) in error["message"]
    assert _ids(c) == before  # refused up front: nothing queued
    # fewer samples and streamed steps fit: 1 x 2 x 64 KiB
    ok = c.post("/v1/rollouts", json={**body, "prompts": ["a"], "num_outputs_per_prompt": 1,
                                      "return": {"steps": [0, 10]}})
    assert ok.status_code == 202


def test_latents_the_loop_holds_count_whatever_is_streamed(limited):
    server, c = limited
    # return.steps [] streams no latent, but the loop holds x_i of its 6 samples: 6 x 64 KiB > 256 KiB
    body = {"prompts": ["a", "b", "c"], "num_outputs_per_prompt": 2, "num_inference_steps": 1,
            "height": 128, "width": 128, "return": {"steps": []}}
    before = _ids(c)
    error = _error(c.post("/v1/rollouts", json=body), 413, "rollout_too_large")
    assert error["details"] == {"estimated_bytes": 6 * 65536, "limit_bytes": 256 * 1024}
    assert "denoising loop" in error["message"] and "6 samples" in error["message"]
    # a FLUX size no pipeline can allocate (the stock prepare_latents cannot: "Storage size calculation
    # overflowed") was accepted and failed as internal_error
    huge = {"model": "tiny-flux", "prompts": ["a"], "num_inference_steps": 1, "height": 4, "width": 1 << 62,
            "return": {"steps": []}}
    error = _error(c.post("/v1/rollouts", json=huge), 413, "rollout_too_large")
    assert error["details"]["estimated_bytes"] > 1 << 62
    assert _ids(c) == before  # nothing queued
    ok = c.post("/v1/rollouts", json={**body, "prompts": ["a"], "num_outputs_per_prompt": 1})  # 64 KiB fits
    assert ok.status_code == 202, ok.text


def test_concurrent_flight_streams(limited):
    server, c = limited
    ticket = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 10,
                                           "return": {"steps": [0, 10]}}).json()
    wait_for_status(c, ticket["id"], {"succeeded"})
    # two followers of a queued-behind-nothing rollout hold both slots while it runs
    slow = c.post("/v1/rollouts", json={"prompts": ["a", "b", "c"], "num_inference_steps": 10, "seed": 1}).json()
    readers, clients = [], []
    for _ in range(2):
        fc = flight.FlightClient(server.flight_url)
        clients.append(fc)
        readers.append(fc.do_get(flight.Ticket(slow["flight"]["ticket"].encode())))
    held = threading.Event()

    def hold() -> None:
        for r in readers:
            r.read_chunk()
        held.set()

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(30)
    with flight.FlightClient(server.flight_url) as fc:
        try:
            with pytest.raises(flight.FlightUnavailableError, match=r"too many concurrent streams \(2 of max_concurrent_streams=2\)"):
                fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all()
        finally:
            for r in readers:
                r.read_all()
            for fc2 in clients:
                fc2.close()
        deadline = time.monotonic() + 10
        while True:  # slots come back
            try:
                assert fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all().num_rows == 2
                break
            except flight.FlightUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
