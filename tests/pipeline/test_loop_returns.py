"""Velocities and conditioning of a rollout, against the stock diffusers pipeline and the replay.

References: the stock pipeline `__call__` with a fresh stock FlowMatchEulerDiscreteScheduler
(whose `step` records the model output it is given), fed the rollout's conditioning instead of
prompts; and the replay with the text encoders deleted.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from sigmaflight.pipeline.conditioning import CONDITIONING_NAMES
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.replay import Replayer
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec, SamplerSpec
from sigmaflight.pipeline.validation import estimate_latent_bytes

CASES: dict[str, dict[str, Any]] = {
    "tiny-sd3": dict(prompts=("a cat", "the dog"), num_outputs_per_prompt=2, guidance_scale=4.5, negative_prompt="blurry"),
    "tiny-flux": dict(prompts=("a cat", "the dog"), num_outputs_per_prompt=2, guidance_scale=3.5),
    "tiny-wan": dict(prompts=("a cat",), num_outputs_per_prompt=2, guidance_scale=5.0, negative_prompt="blurry"),
}
TEXT_ENCODERS = {"tiny-sd3": ("text_encoder", "text_encoder_2", "text_encoder_3"),
                 "tiny-flux": ("text_encoder", "text_encoder_2"), "tiny-wan": ("text_encoder",)}


class _RecordingStockScheduler(FlowMatchEulerDiscreteScheduler):
    """The stock scheduler; `step` also keeps the model output (the CFG-combined velocity) it got."""

    seen: list[Any]

    def step(self, model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(model_output.detach().clone())
        return super().step(model_output, timestep, sample, *args, **kwargs)  # type: ignore[misc]


def _stock_call(model, spec, x0, **inputs):
    """The stock pipeline on the same modules: every x_{i+1} and every velocity it stepped with."""
    d, pipe = model.defaults, model.pipeline
    scheduler = _RecordingStockScheduler.from_config(pipe.scheduler.config)
    scheduler.seen = []
    stock = type(pipe)(**{**pipe.components, "scheduler": scheduler})
    stock.set_progress_bar_config(disable=True)
    steps: list[torch.Tensor] = []

    def on_step_end(p, i, t, callback_kwargs):
        steps.append(callback_kwargs["latents"].detach().clone())
        return callback_kwargs

    kwargs = dict(guidance_scale=spec.guidance_scale, height=d.height, width=d.width, num_inference_steps=spec.num_inference_steps,
                  latents=x0.to(model.device, model.dtype), output_type="latent", callback_on_step_end=on_step_end,
                  callback_on_step_end_tensor_inputs=["latents"], **d.call_kwargs, **inputs)
    if d.is_video:
        kwargs["num_frames"] = d.num_frames
    with torch.inference_mode():
        stock(**kwargs)
    return steps, scheduler.seen


def _prompt_inputs(model, spec):
    inputs = {"prompt": list(spec.prompts), ("num_videos_per_prompt" if model.defaults.is_video else "num_images_per_prompt"):
              spec.num_outputs_per_prompt}
    if spec.negative_prompt is not None:
        inputs["negative_prompt"] = spec.negative_prompt
    return inputs


def test_velocities_are_what_the_stock_scheduler_stepped_with_and_what_replay_computes(registry):
    model = registry.get("tiny-sd3")
    ode = RolloutSpec(model="tiny-sd3", num_inference_steps=3, seed=4, sampler=SamplerSpec(type="ode"),
                      return_velocities=True, **CASES["tiny-sd3"])
    res = run_rollout(model, ode)
    _, seen = _stock_call(model, ode, res.captures[0].latent, **_prompt_inputs(model, ode))
    assert len(seen) == 3
    for i, v in enumerate(seen):
        got = res.captures[i].velocity
        assert got is not None and got.dtype == torch.float32 and got.shape == res.captures[i].latent.shape
        assert torch.equal(got, v.float().cpu()), f"velocity at step {i} is not what the stock step got"
    assert res.captures[3].velocity is None  # i = T: no step
    # sde with a gap in the capture: the replay computes the same velocity at every captured i < T.
    sde = dataclasses.replace(ode, sampler=SamplerSpec(type="sde", noise_level=0.7), return_steps=(0, 2, 3))
    res = run_rollout(model, sde)
    latents = torch.stack([c.latent for c in res.captures], dim=1)
    rep = Replayer(model).replay(sde, latents=latents, steps=(0, 2, 3), sigmas=res.snapshot.sigmas,
                                 timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert sorted(rep.velocities) == [0, 2]
    for c in res.captures[:-1]:
        assert c.velocity is not None and torch.equal(c.velocity, rep.velocities[c.step])
    assert not torch.equal(rep.velocities[0], rep.velocities[2])
    assert torch.equal(rep.log_probs[:, 2], res.log_probs[:, 2]) and rep.log_probs[:, :2].isnan().all()


def test_velocities_cost_nothing_unless_requested_and_are_counted_in_the_estimate(registry):
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=2, seed=1)
    plain = run_rollout(model, spec)
    assert all(c.velocity is None for c in plain.captures) and plain.conditioning is None
    with_v = dataclasses.replace(spec, return_velocities=True)
    per = plain.captures[0].latent.numel() * 4  # one float32 latent
    assert estimate_latent_bytes(model, spec) == 3 * per  # x_0, x_1, x_2
    assert estimate_latent_bytes(model, with_v) == 5 * per  # + v_0, v_1


@pytest.mark.parametrize("model_id", list(CASES))
def test_conditioning_given_to_the_stock_pipeline_reproduces_the_ode_rollout(registry, model_id):
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, num_inference_steps=3, seed=9, sampler=SamplerSpec(type="ode"),
                       return_conditioning=True, **CASES[model_id])
    res = run_rollout(model, spec)
    cond = res.conditioning
    assert cond is not None
    assert cond is not None and res.snapshot.conditioning is cond
    assert set(cond) == set(CONDITIONING_NAMES[model.family])  # all three have CFG or a pooled vector
    b = spec.num_samples
    for name, t in cond.items():
        assert t.shape[0] == b and t.dtype == model.pipeline.transformer.dtype, name
    per = "num_videos_per_prompt" if model.defaults.is_video else "num_images_per_prompt"
    steps, _ = _stock_call(model, spec, res.captures[0].latent, **{per: 1}, **cond)
    assert len(steps) == 3
    for i, stock in enumerate(steps, start=1):
        assert torch.equal(res.captures[i].latent, stock.cpu()), f"x_{i} differs"
    # The prompts really matter: other prompts' conditioning gives other latents.
    other = run_rollout(model, dataclasses.replace(spec, prompts=tuple(p + " x" for p in spec.prompts)))
    assert other.conditioning is not None and not torch.equal(other.conditioning["prompt_embeds"], cond["prompt_embeds"])
    assert not torch.equal(other.captures[-1].latent, res.captures[-1].latent)


def _without_text_encoders(model: LoadedModel) -> LoadedModel:
    """A trainer's pipeline: its own trainable copy of the transformer, no text encoders."""
    pipe = model.pipeline
    own = copy.deepcopy(pipe.transformer).requires_grad_(True)
    stripped = type(pipe)(**{**pipe.components, "transformer": own, **{name: None for name in TEXT_ENCODERS[model.id]}})
    return LoadedModel(id=model.id, family=model.family, pipeline=stripped, device=model.device, dtype=model.dtype,
                       digest=model.digest, defaults=model.defaults)


@pytest.mark.parametrize("model_id", list(CASES))
def test_replay_from_conditioning_needs_no_text_encoders(registry, model_id):
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, num_inference_steps=3, seed=3, sampler=SamplerSpec(type="sde", noise_level=0.7),
                       return_conditioning=True, **CASES[model_id])
    res = run_rollout(model, spec)
    latents = torch.stack([c.latent for c in res.captures], dim=1)
    trainer = _without_text_encoders(model)
    assert all(getattr(trainer.pipeline, name) is None for name in TEXT_ENCODERS[model_id])
    args: dict[str, Any] = dict(latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                timesteps=res.snapshot.timesteps, seeds=res.seeds)
    with pytest.raises((TypeError, AttributeError)):  # the prompts cannot be encoded any more: no encoder
        Replayer(trainer).log_probs(spec, **args)
    replayed = Replayer(trainer).log_probs(spec, conditioning=res.conditioning, **args)
    assert torch.isfinite(res.log_probs).all() and torch.equal(replayed, res.log_probs)
    # A trainer's policy loss: the same bits with a graph back to the transformer.
    with_grad = Replayer(trainer).log_probs(spec, conditioning=res.conditioning, grad=True, **args)
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), res.log_probs)
    with_grad.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.pipeline.transformer.parameters())


def test_bad_conditioning_names_the_key(registry):
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=2, seed=3, return_conditioning=True)
    res = run_rollout(model, spec)
    latents = torch.stack([c.latent for c in res.captures], dim=1)
    args: dict[str, Any] = dict(latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert res.conditioning is not None
    cond = dict(res.conditioning)
    bad = {**cond, "prompt_embedz": cond["prompt_embeds"]}
    with pytest.raises(RolloutInputError) as e:
        Replayer(model).log_probs(spec, conditioning=bad, **args)
    assert e.value.field == "conditioning.prompt_embedz"
    two = {k: torch.cat([v, v]) for k, v in cond.items()}
    with pytest.raises(RolloutInputError) as e:
        Replayer(model).log_probs(spec, conditioning=two, **args)
    assert e.value.field.startswith("conditioning.") and "one row per sample" in e.value.reason
    no_pooled = {k: v for k, v in cond.items() if k != "pooled_prompt_embeds"}
    with pytest.raises(RolloutInputError) as e:
        Replayer(model).log_probs(spec, conditioning=no_pooled, **args)
    assert e.value.field == "conditioning.pooled_prompt_embeds"
