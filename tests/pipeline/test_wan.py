"""The built-in tiny Wan video model (WanPipeline, FlowMatchEulerDiscreteScheduler shift 5.0), on CPU."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.replay import Replayer
from sigmaflight.pipeline.rollout import estimate_latent_bytes, latent_shape, run_rollout, validate_spec
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec, SamplerSpec

WAN = "tiny-wan"


def _latents(res):
    return torch.stack([c.latent for c in res.captures], dim=1)  # [B, K, C, F, H, W]


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _spec(**kw):
    base = dict(model=WAN, prompts=("a cat", "the dog"), num_outputs_per_prompt=2, num_inference_steps=3, seed=7,
                negative_prompt="blurry")
    return RolloutSpec(**{**base, **kw})


def test_builds_deterministically_in_eval_mode(registry):
    a, b = registry.get(WAN), ModelRegistry().get(WAN)
    assert a.digest == b.digest and a.family == "wan"
    assert type(a.pipeline).__name__ == "WanPipeline"
    for module in a.pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            assert not module.training
    sched = a.pipeline.scheduler
    config: Any = sched.config  # diffusers' FrozenDict config (untyped)
    assert type(sched) is FlowMatchEulerDiscreteScheduler and config.shift == 5.0
    assert not config.use_dynamic_shifting
    row = {r["id"]: r for r in registry.describe()}[WAN]
    assert row["is_video"] is True and row["size_multiple"] == 16 and row["family"] == "wan"
    assert row["defaults"]["num_frames"] == 9


@pytest.mark.parametrize("kind", ["sde", "cps"])
@pytest.mark.parametrize("frames", [5, 9])
def test_rollout_shapes_and_sigmas(registry, kind, frames):
    model = registry.get(WAN)
    spec = _spec(num_frames=frames, sampler=SamplerSpec(type=kind, noise_level=0.7))
    res = run_rollout(model, spec)
    f = (frames - 1) // 4 + 1
    assert latent_shape(model, spec) == (16, f, 4, 4) == res.snapshot.latent_shape
    lat = _latents(res)
    assert lat.shape == (4, 4, 16, f, 4, 4) and lat.dtype == torch.float32
    assert res.final_latents.shape == (4, 16, f, 4, 4) and torch.equal(res.captures[-1].latent, res.final_latents)
    assert estimate_latent_bytes(model, spec) == sum(c.latent.nbytes for c in res.captures) == lat.nbytes
    # sigmas / timesteps: the scheduler's own tensors after set_timesteps, bit for bit.
    ref = FlowMatchEulerDiscreteScheduler.from_config(model.pipeline.scheduler.config)
    ref.set_timesteps(3)
    assert res.snapshot.sigmas.dtype == torch.float32 and res.snapshot.sigmas.shape == (4,)
    assert torch.equal(res.snapshot.sigmas, ref.sigmas) and torch.equal(res.snapshot.timesteps, ref.timesteps)
    stochastic = list(res.snapshot.sde_steps)
    assert stochastic == ([0, 1, 2] if kind == "sde" else [0, 1])
    assert torch.isfinite(res.log_probs[:, stochastic]).all()
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(lat[a], lat[b])


def test_same_seed_twice_is_bit_identical(registry):
    model = registry.get(WAN)
    a, b = run_rollout(model, _spec(seed=11)), run_rollout(model, _spec(seed=11))
    assert torch.equal(_latents(a), _latents(b)) and _same(a.log_probs, b.log_probs)
    c = run_rollout(model, _spec(seed=12))
    assert not torch.equal(_latents(a)[:, 1], _latents(c)[:, 1])


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_replay_equals_rollout_with_cfg(registry, kind):
    model = registry.get(WAN)
    spec = _spec(seed=21, guidance_scale=5.0, sampler=SamplerSpec(type=kind, noise_level=0.7))
    res = run_rollout(model, spec)
    no_cfg = run_rollout(model, RolloutSpec(**{**spec.__dict__, "guidance_scale": 1.0}))
    assert not torch.equal(no_cfg.captures[1].latent, res.captures[1].latent)  # CFG really is on
    got = Replayer(model).log_probs(spec, latents=_latents(res), steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                    timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(got[:, list(res.snapshot.sde_steps)]).all()
    assert _same(got, res.log_probs)


def test_alone_equals_inside_a_batch_with_per_sample_calls(registry):
    # WanPipeline calls text_encoder(input_ids, mask) with the mask positional: both are sliced per row.
    model = registry.get(WAN)
    prompts = ("a cat", "the dog and a fish", "x")
    big = run_rollout(model, _spec(prompts=prompts, num_inference_steps=2, seed=5), per_sample_model_calls=True)
    for k in (0, 3, 5):
        alone = _spec(prompts=(prompts[k // 2],), num_outputs_per_prompt=1, num_inference_steps=2,
                      seed=None, seeds=(big.seeds[k],))
        one = run_rollout(model, alone, per_sample_model_calls=True)
        assert torch.equal(_latents(one)[0], _latents(big)[k])
        assert torch.equal(one.log_probs[0], big.log_probs[k])


@pytest.mark.parametrize("frames", [0, 2, 4, 6, 8, 10])
def test_num_frames_must_be_4k_plus_1(registry, frames):
    model = registry.get(WAN)
    with pytest.raises(RolloutInputError) as err:
        validate_spec(model, _spec(num_frames=frames))
    assert err.value.field == "num_frames" and "4k + 1" in str(err.value)


@pytest.mark.parametrize("change,field", [({"height": 24}, "height"), ({"width": 40}, "width")])
def test_size_must_be_a_multiple_of_16(registry, change, field):
    # VAE factor 8 x patch 2: WanPipeline would otherwise round the size down with a log line.
    with pytest.raises(RolloutInputError) as err:
        validate_spec(registry.get(WAN), _spec(**change))
    assert err.value.field == field


def test_local_directory_round_trip(registry, tmp_path):
    model = registry.get(WAN)
    model.pipeline.save_pretrained(tmp_path / "wan")
    local = ModelRegistry().register_local("local-wan", str(tmp_path / "wan"))
    assert local.digest == model.digest and local.family == "wan"
    assert local.defaults.is_video and local.defaults.size_multiple == 16
    spec = dict(num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=5.0)
    a = run_rollout(model, _spec(**spec))
    b = run_rollout(local, _spec(model="local-wan", **spec))
    assert torch.equal(_latents(a), _latents(b)) and _same(a.log_probs, b.log_probs)


def test_served_end_to_end_as_a_fixed_shape_tensor():
    """The real server with --model tiny-wan; the latent column is fixed_shape_tensor [C, F, H, W]."""
    import pyarrow as pa
    import pyarrow.flight as flight

    from tests.servers import InProcessServer, wait_for_status

    with InProcessServer("--model", WAN) as server, server.client() as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["models"]}
        assert models[WAN]["is_video"] is True
        r = client.post("/v1/rollouts", json={"model": WAN, "prompts": ["a cat"], "num_outputs_per_prompt": 2,
                                              "num_inference_steps": 3, "num_frames": 5, "seed": 3})
        assert r.status_code == 202, r.text
        ticket = r.json()
        done = wait_for_status(client, ticket["id"], {"succeeded", "failed"})
        assert done["status"] == "succeeded", done
        with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
            table = fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all()
        bad = client.post("/v1/rollouts", json={"model": WAN, "prompts": ["a cat"], "num_frames": 6})
        assert bad.status_code in (400, 422) and "num_frames" in bad.text
    col = table.schema.field("latent").type
    assert isinstance(col, pa.FixedShapeTensorType)
    assert tuple(col.shape) == (16, 2, 4, 4) and col.value_type == pa.float32()
    assert table.num_rows == 4 * 2
    rollout = json.loads(table.schema.metadata[b"sigmaflight.rollout"])
    assert rollout["model"]["id"] == WAN and rollout["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    assert rollout["request"]["num_frames"] == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_wan_stores_the_float32_x0_its_loop_consumed(dtype):
    """WanPipeline keeps x_0 in float32 whatever the transformer's dtype. The "native" capture
    stored it in the model's dtype, rounded: the metadata called it a lossy conversion nobody asked
    for, step 0's recorded log-prob was not that of the stored tensors, and the replay was off at
    step 0. Reference: the stock WanPipeline's own x_0 at its first scheduler step."""
    from sigmaflight.pipeline.seeds import sample_generators

    model = ModelRegistry(dtype=dtype).get(WAN)
    spec = RolloutSpec(model=WAN, prompts=("a red cube",), num_inference_steps=3, seed=5,
                       sampler=SamplerSpec(type="sde", noise_level=0.7))
    res = run_rollout(model, spec)
    seen: list[torch.Tensor] = []

    class Spy(FlowMatchEulerDiscreteScheduler):
        def step(self, model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(sample.detach().clone())
            return super().step(model_output, timestep, sample, *args, **kwargs)  # type: ignore[misc]

    pipe, d = model.pipeline, model.defaults
    stock = type(pipe)(**{**pipe.components, "scheduler": Spy.from_config(pipe.scheduler.config)})
    stock.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        stock(prompt=list(spec.prompts), num_inference_steps=3, height=d.height, width=d.width,
              guidance_scale=d.guidance_scale, num_frames=d.num_frames, generator=sample_generators(res.seeds),
              output_type="latent", **d.call_kwargs)
    x0 = res.captures[0].latent
    assert seen[0].dtype == torch.float32 and torch.equal(x0, seen[0].cpu())  # dtype included
    assert res.snapshot.latent_dtype == res.snapshot.native_dtype == torch.float32  # "native" is not lossy
    got = Replayer(model).log_probs(spec, latents=_latents(res), steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                    timesteps=res.snapshot.timesteps, seeds=res.seeds)
    assert torch.isfinite(res.log_probs).all() and torch.equal(got, res.log_probs)


@pytest.mark.parametrize(("height", "width", "frames"),
                         [(512, 32, 1), (528, 32, 1), (32, 512, 1), (32, 528, 1), (32, 32, 125), (32, 32, 129)])
def test_the_sizes_and_frames_taken_are_those_the_stock_pipeline_can_place(registry, height, width, frames):
    """Wan's RoPE table covers rope_max_seq_len positions an axis: past it the stock WanPipeline
    raises a shape error. A request the stock call cannot run is a RolloutInputError naming the
    field (it was accepted, then failed at run time as internal_error); one it can run is taken."""
    model = registry.get(WAN)
    try:
        model.pipeline(prompt="x", height=height, width=width, num_frames=frames, num_inference_steps=1,
                       output_type="latent")
        stock_runs = True
    except RuntimeError:
        stock_runs = False
    spec = _spec(height=height, width=width, num_frames=frames, num_inference_steps=1)
    if stock_runs:
        validate_spec(model, spec)
    else:
        with pytest.raises(RolloutInputError) as err:
            validate_spec(model, spec)
        assert err.value.field == ("height" if height > 32 else "width" if width > 32 else "num_frames")
        assert "position embedding covers" in str(err.value)
