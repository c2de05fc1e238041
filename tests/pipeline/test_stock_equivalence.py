"""A rollout against the stock diffusers pipeline: same latents, same tensors the model saw.

The reference here is always diffusers itself: the pipeline's own `__call__` with a fresh
stock FlowMatchEulerDiscreteScheduler, its own `prepare_latents`, and forward pre-hooks on
the transformer that record what it was really given.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from sigmaflight.pipeline.models import LoadedModel, ModelRegistry
from sigmaflight.pipeline.replay import Replayer
from sigmaflight.pipeline.rollout import rollout_metadata, run_rollout
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

from tests.stock import stock_scheduler

CASES: dict[str, dict[str, Any]] = {
    # tiny-sd3 with CFG (guidance 4.5 > 1) and a negative prompt; tiny-flux (guidance embedding);
    # tiny-wan (CFG 5.0, video latents).
    "tiny-sd3": dict(prompts=("a cat", "the dog"), num_outputs_per_prompt=2, guidance_scale=4.5, negative_prompt="blurry"),
    "tiny-flux": dict(prompts=("a cat", "the dog"), num_outputs_per_prompt=2, guidance_scale=3.5),
    "tiny-wan": dict(prompts=("a cat",), num_outputs_per_prompt=2, guidance_scale=5.0, negative_prompt="blurry"),
}


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


@contextmanager
def _hidden_states_seen(transformer):
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        seen.append(kwargs["hidden_states"].detach().clone())

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _stock_call(model, spec, x0):
    """The stock pipeline __call__ with the rollout's arguments, every step's latent captured."""
    d = model.defaults
    steps: list[torch.Tensor] = []

    def on_step_end(pipe, i, t, callback_kwargs):
        steps.append(callback_kwargs["latents"].detach().clone())
        return callback_kwargs

    kwargs = dict(
        prompt=list(spec.prompts), guidance_scale=spec.guidance_scale, height=d.height, width=d.width,
        num_inference_steps=spec.num_inference_steps, latents=x0.to(model.device, model.dtype), output_type="latent",
        callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"], **d.call_kwargs,
    )
    kwargs["num_videos_per_prompt" if d.is_video else "num_images_per_prompt"] = spec.num_outputs_per_prompt
    if d.is_video:
        kwargs["num_frames"] = d.num_frames
    if spec.negative_prompt is not None:
        kwargs["negative_prompt"] = spec.negative_prompt
    with stock_scheduler(model.pipeline) as pipe, torch.inference_mode():
        out = pipe(**kwargs)
    return steps, (out.frames if d.is_video else out.images)


def _stock_x0(model, seeds):
    """What the stock prepare_latents draws with one CPU generator per recorded seed."""
    pipe, d = model.pipeline, model.defaults
    gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
    cin = int(pipe.transformer.config.in_channels)
    if model.family == "flux":
        x0, _ = pipe.prepare_latents(len(seeds), cin // 4, d.height, d.width, model.dtype, model.device, gens)
    elif model.family == "wan":
        x0 = pipe.prepare_latents(len(seeds), cin, d.height, d.width, d.num_frames, model.dtype, model.device, gens)
    else:
        x0 = pipe.prepare_latents(len(seeds), cin, d.height, d.width, model.dtype, model.device, gens)
    return x0


@pytest.mark.parametrize("model_id", list(CASES))
def test_ode_rollout_equals_the_stock_pipeline_bit_for_bit(registry, model_id):
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, num_inference_steps=3, seed=13, sampler=SamplerSpec(type="ode"), **CASES[model_id])
    res = run_rollout(model, spec)
    x0 = res.captures[0].latent
    assert torch.equal(x0, _stock_x0(model, res.seeds).cpu())
    steps, final = _stock_call(model, spec, x0)
    assert len(steps) == spec.num_inference_steps
    for i, stock in enumerate(steps, start=1):
        assert torch.equal(res.captures[i].latent, stock.cpu()), f"x_{i} differs from the stock pipeline"
    assert torch.equal(res.final_latents, final)


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux"])
def test_stored_x_i_is_exactly_what_the_transformer_saw(registry, model_id):
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, num_inference_steps=3, seed=5, **CASES[model_id])
    with _hidden_states_seen(model.pipeline.transformer) as seen:
        res = run_rollout(model, spec)
    b = spec.num_samples
    assert len(seen) == spec.num_inference_steps
    cfg = model.family == "sd3"  # SD3 doubles the batch for CFG; Flux conditions on guidance instead
    for i, hidden in enumerate(seen):
        x_i = res.captures[i].latent
        if cfg:
            assert hidden.shape[0] == 2 * b
            assert torch.equal(hidden[:b], x_i) and torch.equal(hidden[b:], x_i)
        else:
            assert torch.equal(hidden, x_i)


def test_the_schedule_that_ran_last_wins(registry):
    class TwiceSD3(StableDiffusion3Pipeline):
        """Sets a 2-step custom schedule first; its own __call__ then sets the requested one."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            scheduler: Any = self.scheduler  # type: ignore[attr-defined]  # diffusers registers it at runtime
            scheduler.set_timesteps(sigmas=[1.0, 0.5])
            return super().__call__(*args, **kwargs)  # type: ignore[misc]

    base = registry.get("tiny-sd3")
    model = LoadedModel(id="twice-sd3", family="sd3", pipeline=TwiceSD3(**base.pipeline.components), device=base.device,
                        dtype=base.dtype, digest=base.digest, defaults=base.defaults)
    res = run_rollout(model, RolloutSpec(model="twice-sd3", prompts=("a cat",), num_inference_steps=3, seed=2))
    stock = FlowMatchEulerDiscreteScheduler.from_config(base.pipeline.scheduler.config)
    stock.set_timesteps(num_inference_steps=3)
    assert torch.equal(res.snapshot.sigmas, stock.sigmas) and torch.equal(res.snapshot.timesteps, stock.timesteps)
    assert dict(res.snapshot.set_timesteps_kwargs) == {"num_inference_steps": 3}
    assert len(res.captures) == 4 and torch.isfinite(res.log_probs).all()


def test_bf16_model_on_cpu_stores_what_the_model_saw_and_replays_bit_for_bit():
    model = ModelRegistry(dtype=torch.bfloat16).get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat", "the dog"), num_inference_steps=3, seed=3,
                       guidance_scale=4.5, negative_prompt="blurry", sampler=SamplerSpec(type="sde", noise_level=0.7))
    with _hidden_states_seen(model.pipeline.transformer) as seen:
        res = run_rollout(model, spec)
    b = spec.num_samples
    for i, hidden in enumerate(seen):
        x_i = res.captures[i].latent
        assert x_i.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16
        assert torch.equal(hidden[:b], x_i) and torch.equal(hidden[b:], x_i)
    assert res.captures[-1].latent.dtype == torch.bfloat16
    latents = torch.stack([c.latent for c in res.captures], dim=1)
    replayed = Replayer(model).log_probs(spec, latents=latents, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                         timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(res.log_probs).all() and _same(replayed, res.log_probs)


def test_lossy_latent_dtype_is_recorded_and_changes_only_the_stored_latents(registry):
    model = registry.get("tiny-sd3")
    base = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_outputs_per_prompt=2, num_inference_steps=3, seed=8)
    native = run_rollout(model, base)
    lossy_spec = RolloutSpec(**{**base.__dict__, "latent_dtype": "float16"})
    lossy = run_rollout(model, lossy_spec)
    meta = json.loads(json.dumps(rollout_metadata(model, lossy_spec, lossy.snapshot)))
    assert (meta["latent_dtype"], meta["native_dtype"], meta["request"]["latent_dtype"]) == ("float16", "float32", "float16")
    assert rollout_metadata(model, base, native.snapshot)["latent_dtype"] == "float32"
    for a, b in zip(native.captures, lossy.captures, strict=True):
        assert b.latent.dtype == torch.float16 and torch.equal(b.latent, a.latent.to(torch.float16))
        assert (a.log_prob is None) == (b.log_prob is None)
        assert a.log_prob is None or (b.log_prob is not None and torch.equal(a.log_prob, b.log_prob))
    assert not torch.equal(lossy.captures[1].latent.float(), native.captures[1].latent)  # it really is lossy
    assert torch.equal(native.log_probs, lossy.log_probs) and torch.equal(native.final_latents, lossy.final_latents)
    assert torch.equal(native.snapshot.sigmas, lossy.snapshot.sigmas) and native.seeds == lossy.seeds
