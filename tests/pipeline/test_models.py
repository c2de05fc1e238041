from typing import Any

import torch
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutSpec


def test_builtins_are_deterministic_and_in_eval_mode(registry):
    fresh = ModelRegistry()
    for model_id in ("tiny-sd3", "tiny-flux"):
        a, b = registry.get(model_id), fresh.get(model_id)
        assert a.digest == b.digest and len(a.digest) == 64
        for module in a.pipeline.components.values():
            if isinstance(module, torch.nn.Module):
                assert not module.training
    assert registry.get("tiny-sd3").digest != registry.get("tiny-flux").digest


def test_describe(registry):
    rows = {r["id"]: r for r in registry.describe()}
    assert {"tiny-sd3", "tiny-flux", "small-sd3"} <= set(rows)
    r = rows["tiny-sd3"]
    assert r["family"] == "sd3" and r["dtype"] == "float32" and r["device"] == "cpu"
    assert r["defaults"]["num_frames"] is None and r["is_video"] is False and r["size_multiple"] == 4


def test_local_directory_round_trip(registry, tmp_path):
    model = registry.get("tiny-sd3")
    model.pipeline.save_pretrained(tmp_path / "tiny")
    local = ModelRegistry().register_local("local-sd3", str(tmp_path / "tiny"), device="cpu", dtype=torch.float32)
    assert local.digest == model.digest and local.family == "sd3"
    spec: dict[str, Any] = dict(prompts=("a cat",), num_inference_steps=3, seed=5, height=32, width=32,
                                guidance_scale=4.5)
    a = run_rollout(model, RolloutSpec(model="tiny-sd3", **spec))
    b = run_rollout(local, RolloutSpec(model="local-sd3", **spec))
    assert torch.equal(a.log_probs, b.log_probs)
    assert all(torch.equal(x.latent, y.latent) for x, y in zip(a.captures, b.captures, strict=True))


def test_replace_weights_swaps_digest_and_policy():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    old_digest = model.digest
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=2, seed=1)
    before = run_rollout(model, spec)
    state = {k: v + 0.01 for k, v in model.pipeline.transformer.state_dict().items()}
    new_digest = reg.replace_weights("tiny-sd3", state).digest
    assert new_digest != old_digest and model.digest == new_digest
    after = run_rollout(model, spec)
    assert after.digest == new_digest and before.digest == old_digest
    assert not torch.equal(after.captures[1].latent, before.captures[1].latent)


def test_a_model_built_in_memory_is_served_under_its_id_and_an_id_is_taken_once():
    import dataclasses

    import pytest
    from sigmaflight.pipeline.builtins import sd3_with_tiny_encoders

    registry = ModelRegistry()
    base = registry.get("tiny-sd3")
    config = {**dict(base.pipeline.transformer.config), "in_channels": 16, "out_channels": 16}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    pipe = sd3_with_tiny_encoders(config)
    assert pipe.vae_scale_factor == 8 and pipe.text_encoder_3.config.d_model == config["joint_attention_dim"]
    mine = dataclasses.replace(base, id="mine", pipeline=pipe)
    assert registry.add(mine) is registry.get("mine")
    res = run_rollout(mine, RolloutSpec(model="mine", prompts=("a cat",), num_inference_steps=2, seed=1,
                                        height=64, width=64))
    assert res.final_latents.shape == (1, 16, 8, 8) and torch.isfinite(res.log_probs).all()
    for taken in ("mine", "tiny-sd3"):
        with pytest.raises(ValueError, match=f"model id '{taken}' is taken"):
            registry.add(dataclasses.replace(mine, id=taken))


def test_builds_on_many_threads_leave_torch_its_thread_count():
    """Built-ins are built on one torch thread (their weights the same in every process); builds
    in several registries at once must each give torch back the count it had, not each other's 1."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        builds = [threading.Thread(target=ModelRegistry().get, args=(m,))
                  for m in ("tiny-sd3", "tiny-flux", "tiny-wan", "tiny-sd3", "tiny-flux", "tiny-wan")]
        for b in builds:
            b.start()
        for b in builds:
            b.join()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
