"""Policy versions and full weights pushes, registry side."""

import json
import threading

import pytest
import torch
from sigmaflight.pipeline.models import (
    ModelLoadError,
    ModelRegistry,
    component_digest,
    component_digests,
    weights_digest,
)
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec

SPEC = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=3, seed=3)


def _shifted(model, by: float) -> dict[str, torch.Tensor]:
    return {k: v + by for k, v in model.base_transformer().state_dict().items()}


def test_version_counts_pushes_and_digest_is_the_whole_pipelines():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    p0 = model.policy()
    assert p0.weights_version == 0 and p0.digest == weights_digest(model.pipeline) == p0.base_digest
    p1 = reg.replace_weights("tiny-sd3", _shifted(model, 0.01))
    assert p1.weights_version == 1 and p1.digest != p0.digest
    assert p1.digest == weights_digest(model.pipeline) and p1.pipeline is model.pipeline
    assert reg.replace_weights("tiny-sd3", _shifted(model, 0.01)).digest == model.digest
    assert model.weights_version == 2
    row = next(r for r in reg.describe() if r["id"] == "tiny-sd3")
    assert row["digest"] == model.digest and row["weights_version"] == 2 and row["lora"] is None


def test_per_component_digests_follow_each_module_and_a_push_moves_only_the_transformers():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    p0 = model.policy()
    torch_modules = sorted(n for n, m in model.pipeline.components.items() if isinstance(m, torch.nn.Module))
    assert sorted(p0.components) == torch_modules == ["text_encoder", "text_encoder_2", "text_encoder_3",
                                                      "transformer", "vae"]
    assert len(set(p0.components.values())) == len(torch_modules)
    p1 = reg.replace_weights("tiny-sd3", _shifted(model, 0.01))
    moved = sorted(n for n in p0.components if p0.components[n] != p1.components[n])
    assert moved == ["transformer"] and p1.components == component_digests(model.pipeline)
    # the same weights in another module object (a rebuilt model) have the same digests
    fresh = ModelRegistry().get("tiny-sd3")
    assert fresh.components == p0.components and fresh.pipeline.vae is not model.pipeline.vae
    # one byte of one text encoder moves that component's digest and the whole digest, nothing else
    with torch.no_grad():
        next(fresh.pipeline.text_encoder_2.parameters()).view(-1)[0] += 1.0
    changed = component_digests(fresh.pipeline)
    assert sorted(n for n in changed if changed[n] != p0.components[n]) == ["text_encoder_2"]
    assert weights_digest(fresh.pipeline) != p0.digest
    # the name is part of a component's digest: the same weights under two names differ
    vae = model.pipeline.vae
    assert component_digest("vae", vae) != component_digest("vae_2", vae)


def test_push_takes_the_tensors_without_a_copy_and_leaves_the_old_pipeline_alone():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    old_pipeline, old_digest = model.snapshot()
    old_weight = old_pipeline.transformer.proj_out.weight.clone()
    state = _shifted(model, 0.5)
    reg.replace_weights("tiny-sd3", state)
    new_t = model.pipeline.transformer
    assert new_t.proj_out.weight.data_ptr() == state["proj_out.weight"].data_ptr()
    assert torch.equal(old_pipeline.transformer.proj_out.weight, old_weight)
    assert weights_digest(old_pipeline) == old_digest
    # the other components are the same objects: a push costs the transformer's tensors only
    assert model.pipeline.vae is old_pipeline.vae and model.pipeline.text_encoder_3 is old_pipeline.text_encoder_3
    assert not new_t.training and not any(p.requires_grad for p in new_t.parameters())


def test_a_running_rollout_keeps_its_weights_and_the_next_sees_the_new():
    reference = run_rollout(ModelRegistry().get("tiny-sd3"), SPEC)  # old weights, no push
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    state = _shifted(model, 0.02)
    pushed: list[str] = []

    def push_mid_rollout(step: int, total: int) -> None:
        if step == 1:
            pushed.append(reg.replace_weights("tiny-sd3", state).digest)

    during = run_rollout(model, SPEC, on_progress=push_mid_rollout)
    assert pushed and model.digest == pushed[0]
    assert during.digest == reference.digest != pushed[0]
    assert torch.equal(during.final_latents, reference.final_latents)
    after = run_rollout(model, SPEC)
    assert after.digest == pushed[0] and not torch.equal(after.final_latents, reference.final_latents)


def test_concurrent_pushes_are_serialised():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    states = [_shifted(model, 0.01 * (i + 1)) for i in range(4)]
    versions: list[int] = []
    threads = [threading.Thread(target=lambda s=s: versions.append(reg.replace_weights("tiny-sd3", s).weights_version))
               for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions) == [1, 2, 3, 4] and model.weights_version == 4
    assert model.digest == weights_digest(model.pipeline)
    last = model.pipeline.transformer.state_dict()
    assert any(all(torch.equal(last[k], s[k]) for k in s) for s in states)


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda s: s.pop("proj_out.bias"), "proj_out.bias"),
        (lambda s: s.update({"nope.weight": torch.zeros(1)}), "nope.weight"),
        (lambda s: s.update({"proj_out.weight": s["proj_out.weight"][:1]}), "proj_out.weight"),
        (lambda s: s.update({"proj_out.weight": s["proj_out.weight"].double()}), "proj_out.weight"),
        (lambda s: s["proj_out.weight"].view(-1).__setitem__(0, float("nan")), "proj_out.weight"),
    ],
)
def test_bad_push_is_refused_naming_the_key_and_changes_nothing(registry, edit, key):
    model = registry.get("tiny-sd3")
    before = model.policy()
    state = _shifted(model, 0.0)
    edit(state)
    with pytest.raises(RolloutInputError) as err:
        registry.replace_weights("tiny-sd3", state)
    assert err.value.field == key
    after = model.policy()
    assert after.pipeline is before.pipeline and after.weights_version == before.weights_version


def test_a_local_model_without_a_flow_match_scheduler_is_refused_at_load(registry, tmp_path):
    from diffusers import DDIMScheduler

    pipe = registry.get("tiny-sd3").pipeline
    ddim = type(pipe)(**{**pipe.components, "scheduler": DDIMScheduler()})
    ddim.save_pretrained(tmp_path / "ddim")
    assert json.loads((tmp_path / "ddim" / "model_index.json").read_text())["scheduler"][1] == "DDIMScheduler"
    reg = ModelRegistry()
    with pytest.raises(ModelLoadError) as err:
        reg.register_local("ddim", str(tmp_path / "ddim"))
    message = str(err.value)
    assert str(tmp_path / "ddim") in message and "DDIMScheduler" in message and "\n" not in message
    assert "ddim" not in reg.ids()
