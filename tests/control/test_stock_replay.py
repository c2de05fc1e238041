"""A trainer replays a rollout with its own stock diffusers pipeline (`from_pretrained`, as it
loaded it; with or without a peft adapter; with gradients) and gets the recorded log-probs bit for
bit: the trajectory's metadata (`request`, `call`) holds every keyword the server passed to the
pipeline, so the stock pipeline needs nothing else.

The trainer's pipeline is built independently of the server: the built-in's weights saved with
`save_pretrained` and loaded back with the stock `StableDiffusion3Pipeline.from_pretrained` /
`FluxPipeline.from_pretrained`, the way a trainer loads a hub model; the server is a real
`sigmaflight serve` process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight import Client, replay_log_probs
from tests.servers import InProcessServer

STOCK = {"tiny-sd3": StableDiffusion3Pipeline, "tiny-flux": FluxPipeline}
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each built-in saved as a diffusers folder (what a hub id downloads to)."""
    out = {}
    for model_id in STOCK:
        out[model_id] = tmp_path_factory.mktemp(model_id)
        ModelRegistry().get(model_id).pipeline.save_pretrained(out[model_id])
    return out


def stock(saved: dict[str, Path], model_id: str) -> Any:
    pipe = STOCK[model_id].from_pretrained(saved[model_id])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--workers", "1") as s:
        yield s


def rollout(client: Client, model_id: str, **extra: Any):
    ticket = client.submit(model=model_id, prompts=["a red cube", "the dog"], num_outputs_per_prompt=2,
                           num_inference_steps=3, seed=21, sampler={"type": "sde", "noise_level": 0.7}, **extra)
    client.wait(ticket, timeout=120)
    return client.pull(ticket)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.timeout(240)
def test_a_rollout_of_a_batch_invariant_server_replays_bit_for_bit_as_it_ran(saved):
    """A --batch-invariant server calls the model one row at a time (CFG's two halves too, so even
    one sample): a replay that batches the rows differs in the last bits. The trajectory says how
    its model was called, and replay_log_probs calls the trainer's stock pipeline the same way by
    default (trainers.md promised bit for bit here, and a batched replay gave 1.2e-7 off)."""
    pipe = stock(saved, "tiny-sd3")
    with InProcessServer("--batch-invariant") as s, Client(s.rest_url) as client:
        ticket = client.submit(prompts=["a cat"], num_inference_steps=4, seed=5,
                               sampler={"type": "sde", "noise_level": 0.7})
        client.wait(ticket, timeout=120)
        traj = client.pull(ticket)
    assert traj.metadata["batch"]["per_sample_model_calls"] is True
    sde = list(traj.sde_steps)
    assert sde and torch.isfinite(traj.log_probs[:, sde]).all()
    assert same(replay_log_probs(pipe, traj, strict=True), traj.log_probs)
    # what the replay did before: one batched call of the rows, not the rollout's own bits here
    batched = replay_log_probs(pipe, traj, strict=True, per_sample_model_calls=False)
    assert not torch.equal(batched[:, sde], traj.log_probs[:, sde])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_id", sorted(STOCK))
def test_a_stock_pipeline_replays_the_recorded_log_probs_bit_for_bit(server, saved, model_id):
    pipe = stock(saved, model_id)
    with Client(server.rest_url) as client:
        traj = rollout(client, model_id)
    call = traj.metadata["call"]
    assert call["max_sequence_length"] == 16  # the built-in's short T5 length, not the pipeline's default
    assert {"height", "width", "guidance_scale"} <= set(call)
    sde = list(traj.sde_steps)
    assert sde and torch.isfinite(traj.log_probs[:, sde]).all()

    logp = replay_log_probs(pipe, traj, strict=True)  # same weights: the check passes
    assert same(logp, traj.log_probs)
    with_grad = replay_log_probs(pipe, traj, grad=True, strict=True)
    assert torch.equal(with_grad.detach()[:, sde], traj.log_probs[:, sde])
    with_grad[:, sde].sum().backward()
    assert pipe.transformer.proj_out.weight.grad is not None  # a graph to the trainer's parameters

    # The recorded call is what makes it exact: the pipeline's own default max_sequence_length differs.
    kept = traj.metadata
    traj.metadata = copy.deepcopy(kept)
    del traj.metadata["call"]["max_sequence_length"]
    assert not torch.equal(replay_log_probs(pipe, traj, strict=True)[:, sde], traj.log_probs[:, sde])
    traj.metadata = kept


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrap", ["get_peft_model", "add_adapter"])
def test_a_stock_pipeline_with_a_peft_adapter_replays_the_adapters_rollout(server, saved, wrap):
    pipe = stock(saved, "tiny-sd3")
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=TARGETS)
    if wrap == "get_peft_model":
        pipe.transformer = get_peft_model(pipe.transformer, config)
    else:
        pipe.transformer.add_adapter(config)
    factors = [p for n, p in pipe.transformer.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        for p in factors:
            p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(factors))))
    with Client(server.rest_url) as client:
        digest = client.push_lora("tiny-sd3", get_peft_model_state_dict(pipe.transformer), config)["digest"]
        try:
            traj = rollout(client, "tiny-sd3", expected_digest=digest)
        finally:
            client.delete_lora("tiny-sd3")
    sde = list(traj.sde_steps)
    logp = replay_log_probs(pipe, traj, grad=True, strict=True)
    assert torch.equal(logp.detach()[:, sde], traj.log_probs[:, sde])
    logp[:, sde].sum().backward()
    assert all(p.grad is not None for p in factors)
    # the base alone does not replay the adapter's rollout (the check names the transformer)
    with pytest.raises(ValueError, match="transformer"):
        replay_log_probs(stock(saved, "tiny-sd3"), traj, strict=True)


def test_a_pipeline_argument_that_is_not_a_pipeline_is_a_type_error(server, saved):
    with Client(server.rest_url) as client:
        traj = rollout(client, "tiny-sd3")
    with pytest.raises(TypeError, match="pipeline must be a diffusers pipeline"):
        replay_log_probs(object(), traj)
    old = copy.deepcopy(traj.metadata)
    del old["call"]  # a trajectory from an older server
    traj.metadata = old
    with pytest.raises(ValueError, match="`call`"):
        replay_log_probs(stock(saved, "tiny-sd3"), traj)


def test_a_pipeline_of_another_family_or_size_is_a_value_error_naming_both_shapes(server, saved):
    """A warning (the weights differ), then torch's own shape error from deep in the transformer:
    the pipeline's latents for the request are compared with the trajectory's first."""
    with Client(server.rest_url) as client:
        traj = rollout(client, "tiny-sd3")
    for other, made in (("tiny-flux", r"FluxPipeline \(flux\) makes \[64, 16\]"),
                        ("small-sd3", r"StableDiffusion3Pipeline \(sd3\) makes \[4, 32, 32\]")):
        with pytest.raises(ValueError, match=rf"latents are \[4, 16, 16\] a sample, and this {made} .*'tiny-sd3'"):
            replay_log_probs(ModelRegistry().get(other), traj, check_weights=False)


@pytest.mark.timeout(240)
def test_a_transformer_and_scheduler_replay_on_the_conditioning_stream(server, saved):
    """The transformer (peft-wrapped) and scheduler alone, as a trainer that loaded only those holds them."""
    pipe = stock(saved, "tiny-sd3")
    config = LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=["attn.to_q", "attn.to_v"])
    transformer = get_peft_model(pipe.transformer, config)
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            if "lora_B" in n:
                p.fill_(0.02)
    with Client(server.rest_url) as client:
        digest = client.push_lora("tiny-sd3", get_peft_model_state_dict(transformer), config)["digest"]
        try:
            traj = rollout(client, "tiny-sd3", expected_digest=digest, return_={"conditioning": True})
            cond = client.pull_conditioning(traj.rollout_id)
        finally:
            client.delete_lora("tiny-sd3")
    sde = list(traj.sde_steps)
    logp = replay_log_probs(transformer, traj, scheduler=pipe.scheduler, conditioning=cond, grad=True, strict=True)
    assert torch.equal(logp.detach()[:, sde], traj.log_probs[:, sde])
    with pytest.raises(ValueError, match="conditioning"):
        replay_log_probs(transformer, traj, scheduler=pipe.scheduler)
