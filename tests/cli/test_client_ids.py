"""Ids and tickets a caller hands the client never change the route a request reaches, and every
string given to a client method ends in the documented typed errors, on a real server."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight import ApiError, Client, NotFound

HOSTILE = [
    "../models/tiny-sd3/lora", "../models", "..", ".", "", "?status=succeeded", "#x", "a/b", "%2e%2e",
    "..%2Fmodels%2Ftiny-sd3%2Flora", "a b", "a\nb", "\x00", "\ud800", "é", "x" * 129, "x" * 2000, "x" * 100_000,
]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.rest_url) as c:
        yield c


def _push_lora(client: Client) -> dict:
    base = ModelRegistry().get("tiny-sd3")
    config = LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=["attn.to_q"])
    wrapped = get_peft_model(copy.deepcopy(base.pipeline.transformer), config)
    return client.push_lora("tiny-sd3", get_peft_model_state_dict(wrapped), config)


def _tiny(client: Client) -> dict:
    (m,) = [m for m in client.models() if m["id"] == "tiny-sd3"]
    return m


def test_a_hostile_cancel_removes_no_lora(client):
    """`cancel("../models/tiny-sd3/lora")` once sent DELETE /v1/models/tiny-sd3/lora: the LoRA went."""
    put = _push_lora(client)
    with pytest.raises(NotFound):
        client.cancel("../models/tiny-sd3/lora")
    for hostile in ("..%2Fmodels%2Ftiny-sd3%2Flora", "../../v1/models/tiny-sd3/lora"):
        with pytest.raises(NotFound):
            client.cancel(hostile)
    after = _tiny(client)
    assert after["weights_version"] == put["weights_version"] and after["digest"] == put["digest"]
    client.delete_lora("tiny-sd3")


@pytest.mark.parametrize("method", ["status", "cancel", "locate", "pull", "wait", "pull_outputs", "pull_conditioning"])
@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v[:24]) + (f"..{len(v)}" if len(v) > 24 else ""))
def test_every_string_is_not_found(client, method, value):
    """Any string that names no rollout is NotFound: never httpx's InvalidURL, a pydantic error on
    another route's answer, a JSONDecodeError on a redirect, or a 422 about the query."""
    with pytest.raises(NotFound) as info:
        getattr(client, method)(value)
    assert type(info.value) is NotFound and info.value.status == 404


def test_model_ids_stay_in_their_route(client):
    before = _tiny(client)
    for hostile in ("../rollouts", "tiny-sd3/..", "./tiny-sd3", "tiny-sd3/../tiny-sd3", "tiny-sd3?x=1", "", "\n"):
        with pytest.raises(NotFound):
            client.delete_lora(hostile)
        with pytest.raises(NotFound):
            client.push_weights(hostile, {})
    assert _tiny(client) == before
    # a real id still works, a well-formed unknown one is the server's own 404
    with pytest.raises(NotFound, match="no model 'org/no-such-model'"):
        client.delete_lora("org/no-such-model")


def test_non_strings_are_a_type_error_and_bad_idempotency_keys_a_value_error(client):
    with pytest.raises(TypeError, match="rollout_id"):
        client.status(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="idempotency_key"):
        client.submit(prompts=["a"], num_inference_steps=2, idempotency_key="a\nb")
    with pytest.raises(ValueError, match="idempotency_key"):
        client.submit(prompts=["a"], num_inference_steps=2, idempotency_key="é")


def test_the_rollout_list_has_no_owner_for_an_impossible_ticket(client):
    assert client.rollouts(ticket="x" * 2000) == []
    with pytest.raises(ValueError, match="status must be one of"):  # no state: named before any request
        client.rollouts(status="nope")
    with pytest.raises(ApiError) as info:  # a well-formed id the server never made: its 422 naming it
        client.rollouts(after="nope")
    assert info.value.status == 422 and info.value.details[0]["loc"] == ["query", "after"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(max_size=300))
def test_any_text_is_not_found_or_a_real_rollout(client, value):
    for method in (client.status, client.locate, client.cancel, client.delete_lora):
        with pytest.raises(NotFound):
            method(value)


def test_real_ids_and_tickets_still_work(client):
    ticket = client.submit(prompts=["a"], num_inference_steps=2, seed=1)
    client.wait(ticket.id, timeout=60)
    traj = client.pull(ticket.id)
    assert torch.equal(client.pull(ticket.flight.ticket).latents, traj.latents)
    assert client.locate(ticket.flight.ticket) == (ticket.flight.locations[0], ticket.flight.ticket)
    assert client.cancel(ticket.id).status == "expired"
