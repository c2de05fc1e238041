"""LoRA routes through the real server: PUT /v1/models/{id}/lora changes trajectories and digest,
DELETE restores the base bit for bit, a trainer's peft-wrapped transformer replays the log-probs
bit for bit (CPU fp32), bad input is a 422 naming the key, tokens are required when configured."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save
from sigmaflight.pipeline.models import LoadedModel, ModelRegistry
from sigmaflight.pipeline.replay import Replayer

from sigmaflight import Client
from sigmaflight.client import replay_log_probs, rollout_spec
from sigmaflight.errors import ApiError
from tests.servers import InProcessServer

TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]  # Flow-GRPO's SD3 targets
REQ: dict[str, Any] = {"model": "tiny-sd3", "prompts": ["a cat", "the dog"], "num_outputs_per_prompt": 2, "num_inference_steps": 3,
       "guidance_scale": 4.5, "seed": 11, "sampler": {"type": "sde", "noise_level": 0.7}}
A = "base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight"
OCTET = {"content-type": "application/octet-stream"}


def _trainer():
    """A trainer's own peft-wrapped transformer over the same (seeded) base, with non-zero factors."""
    base = ModelRegistry().get("tiny-sd3")
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=TARGETS)
    wrapped = get_peft_model(copy.deepcopy(base.pipeline.transformer), config)
    g = torch.Generator().manual_seed(5)
    set_peft_model_state_dict(wrapped, {k: 0.3 * torch.randn(v.shape, generator=g)
                                        for k, v in get_peft_model_state_dict(wrapped).items()})
    wrapped.eval()
    pipe = base.pipeline
    trainer_pipe = type(pipe)(**{**pipe.components, "transformer": wrapped})
    trainer_pipe.set_progress_bar_config(disable=True)
    trainer = LoadedModel(id="tiny-sd3", family="sd3", pipeline=trainer_pipe, device=base.device, dtype=base.dtype,
                          digest="trainer", defaults=base.defaults)
    return base, wrapped, config, trainer


def _body(tensors: dict, config: dict | None) -> bytes:
    meta = {"lora_config": json.dumps(config, default=sorted)} if config is not None else None
    return save({k: v.detach().clone() for k, v in tensors.items()}, metadata=meta)


def _run(client: Client):
    t = client.submit(**REQ)
    client.wait(t, timeout=120)
    return client.pull(t)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.timeout(240)
def test_lora_put_changes_trajectories_delete_restores_base_and_a_peft_trainer_replays_bit_for_bit():
    base, wrapped, config, trainer = _trainer()
    # get_peft_model's state dict keys carry peft's `base_model.model.` prefix; add_adapter's do not
    adapter = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(wrapped).items()}
    cfg = json.loads(json.dumps(config.to_dict(), default=sorted))
    # the same adapter put on a registry in this process: the digest is deterministic across processes
    want_digest = ModelRegistry().load_lora("tiny-sd3", dict(adapter), cfg).digest
    with InProcessServer("--workers", "1") as s, Client(s.rest_url) as client:
        before = _run(client)
        assert before.metadata["model"]["digest"] == base.digest
        put = client.push_lora("tiny-sd3", adapter, config)
        assert put["digest"] == want_digest != base.digest and put["weights_version"] == 1
        assert put["lora"]["r"] == 4 and put["lora"]["target_modules"] == sorted(TARGETS)
        (m,) = [m for m in client.models() if m["id"] == "tiny-sd3"]
        assert m["digest"] == want_digest and m["weights_version"] == 1
        with_lora = _run(client)
        assert with_lora.metadata["model"]["digest"] == want_digest
        assert with_lora.metadata["model"]["weights_version"] == 1
        assert not _same(with_lora.latents, before.latents)
        # the trainer's own peft-wrapped transformer replays the rollout's log-probs bit for bit
        kw = dict(latents=with_lora.latents, steps=[int(x) for x in with_lora.steps], sigmas=with_lora.sigmas,
                  timesteps=with_lora.timesteps, seeds=[int(x) for x in with_lora.seeds])
        replayed = Replayer(trainer).log_probs(rollout_spec(with_lora), **kw)
        assert torch.isfinite(with_lora.log_probs[:, list(with_lora.sde_steps)]).all()
        assert _same(replayed, with_lora.log_probs)
        assert not _same(Replayer(base).log_probs(rollout_spec(with_lora), **kw), with_lora.log_probs)
        # ... and the weights check knows it: its peft-wrapped transformer gets the adapter digest the
        # server recorded (base weights, config, factors); the base alone is refused, naming the transformer
        assert with_lora.metadata["model"]["components"]["transformer"] != base.components["transformer"]
        assert _same(replay_log_probs(trainer, with_lora, strict=True), with_lora.log_probs)
        with pytest.raises(ValueError, match="made with other weights .*: transformer "):
            replay_log_probs(base, with_lora, strict=True)
        factor = next(p for n, p in wrapped.named_parameters() if "lora_B" in n)
        kept = factor.detach().clone()
        with torch.no_grad():  # one factor moved (an optimizer step): no longer the rollout's policy
            factor.add_(1e-3)
        with pytest.raises(ValueError, match="transformer "):
            replay_log_probs(trainer, with_lora, strict=True)
        with torch.no_grad():
            factor.copy_(kept)  # `adapter` shares these tensors: the pushes below need the original

        gone = client.delete_lora("tiny-sd3")
        assert gone["digest"] == base.digest and gone["weights_version"] == 2 and gone["lora"] is None
        after = _run(client)
        assert after.metadata["model"] == {**before.metadata["model"], "weights_version": 2}
        assert torch.equal(after.latents, before.latents) and _same(after.log_probs, before.log_probs)
        with pytest.raises(ApiError) as exc:
            client.delete_lora("tiny-sd3")
        assert exc.value.status == 404 and exc.value.type == "lora_not_loaded"

        # the prefixed keys (get_peft_model's own state_dict naming) give the same adapter and digest
        prefixed = {f"base_model.model.{k}": v for k, v in adapter.items()}
        again = client.push_lora("tiny-sd3", prefixed, cfg)
        assert again["digest"] == want_digest and again["weights_version"] == 3


def _bad_cases():
    _, wrapped, config, _ = _trainer()
    good = dict(get_peft_model_state_dict(wrapped))
    assert A in good
    cfg = json.loads(json.dumps(config.to_dict(), default=sorted))
    nan = dict(good)
    nan[A] = good[A].clone()
    nan[A][0, 0] = float("nan")
    unknown = {**good, "base_model.model.transformer_blocks.0.attn.to_zz.lora_A.weight": good[A]}
    rank = {**good, A: torch.zeros(8, good[A].shape[1])}
    return [
        ("unknown_target", _body(unknown, cfg), ["body", "base_model.model.transformer_blocks.0.attn.to_zz.lora_A.weight"]),
        ("wrong_rank", _body(rank, cfg), ["body", A]),
        ("nan", _body(nan, cfg), ["body", A]),
        ("missing_lora_config", _body(good, None), ["body", "lora_config"]),
        ("bad_lora_config", _body(good, {**cfg, "r": 0}), ["body", "lora_config.r"]),
        ("not_safetensors", b"PK\x03\x04 not a safetensors file", ["body"]),
    ]


@pytest.mark.timeout(180)
def test_bad_lora_input_is_a_422_naming_the_key_and_tokens_are_required(tmp_path):
    cases = _bad_cases()
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    flags = ("--workers", "1", "--token-file", str(tokens), "--max-body-bytes", "65536", "--max-weights-bytes", "1048576")
    with InProcessServer(*flags) as s, s.client(token="s3cret") as c:
        # the weights limit, not the general one: 512 KiB passes (and is not safetensors), 2 MiB is a 413
        junk = b"\xff" * (512 << 10)
        assert c.put("/v1/models/tiny-sd3/lora", content=junk, headers=OCTET).status_code == 422
        assert c.put("/v1/models/tiny-sd3/lora", content=junk * 4, headers=OCTET).status_code == 413
        for name, body, loc in cases:
            r = c.put("/v1/models/tiny-sd3/lora", content=body, headers=OCTET)
            assert r.status_code == 422, (name, r.text)
            (detail,) = r.json()["error"]["details"]
            assert detail["loc"][:len(loc)] == loc and (len(loc) == 2 or detail["loc"] == loc), (name, detail)
            assert r.json()["error"]["type"] == "validation_error"
        models = c.get("/v1/models").json()["models"]
        assert [m["weights_version"] for m in models if m["id"] == "tiny-sd3"] == [0]  # nothing changed
        with s.client() as anonymous:
            assert anonymous.put("/v1/models/tiny-sd3/lora", content=cases[0][1], headers=OCTET).status_code == 401
            assert anonymous.delete("/v1/models/tiny-sd3/lora").status_code == 401
        assert c.delete("/v1/models/tiny-sd3/lora").status_code == 404
        assert c.put("/v1/models/nope/lora", content=cases[0][1], headers=OCTET).status_code == 404
        ok = c.get("/v1/models")
        assert ok.status_code == 200  # still serving
