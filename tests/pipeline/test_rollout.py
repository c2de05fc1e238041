import dataclasses
import threading
from typing import Any

import pytest
import torch
from sigmaflight.pipeline.rollout import (
    derive_seeds,
    estimate_latent_bytes,
    rollout_metadata,
    run_rollout,
    validate_spec,
)
from sigmaflight.pipeline.spec import (
    RolloutCancelled,
    RolloutInputError,
    RolloutNonFinite,
    RolloutSpec,
    SamplerSpec,
)


def _latents(res):
    return torch.stack([c.latent for c in res.captures], dim=1)  # [B, K, ...]


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux"])
def test_batch_equal_to_steps_plus_one(registry, model_id):
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, prompts=("a cat", "the dog"), num_outputs_per_prompt=2, num_inference_steps=3, seed=7)
    events: list[tuple[Any, ...]] = []
    res = run_rollout(
        model,
        spec,
        on_schedule=lambda s: events.append(("schedule", s.sigmas.shape[0])),
        on_step=lambda c: events.append(("step", c.step)),
        on_progress=lambda d, t: events.append(("progress", d, t)),
    )
    assert events[0] == ("schedule", 4)
    assert [e[1] for e in events if e[0] == "step"] == [0, 1, 2, 3]
    assert [e[1:] for e in events if e[0] == "progress"] == [(1, 3), (2, 3), (3, 3)]
    assert res.snapshot.sigmas.shape == (4,) and res.snapshot.timesteps.shape == (3,)
    assert res.seeds == derive_seeds(7, 4) and len(set(res.seeds)) == 4
    lat = _latents(res)
    assert lat.shape[:2] == (4, 4)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(lat[a], lat[b])
    assert res.log_probs.shape == (4, 3) and torch.isfinite(res.log_probs).all()
    first = res.captures[0].log_prob
    assert res.captures[-1].log_prob is None and first is not None and first.shape == (4,)
    assert torch.equal(res.captures[-1].latent, res.final_latents)
    assert estimate_latent_bytes(model, spec) == sum(c.latent.nbytes for c in res.captures)
    assert res.snapshot.latent_shape == tuple(lat.shape[2:])


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux"])
def test_twice_in_a_row_is_bit_identical(registry, model_id):
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, prompts=("a cat", "the dog"), num_outputs_per_prompt=2, num_inference_steps=3, seed=11)
    a, b = run_rollout(model, spec), run_rollout(model, spec)
    assert torch.equal(_latents(a), _latents(b))
    assert torch.equal(a.log_probs, b.log_probs)


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux"])
def test_alone_equals_inside_a_batch_of_16_with_per_sample_calls(registry, model_id):
    model = registry.get(model_id)
    prompts = tuple(f"prompt {chr(97 + k)}" for k in range(8))
    batch = RolloutSpec(model=model_id, prompts=prompts, num_outputs_per_prompt=2, num_inference_steps=3, seed=5,
                        negative_prompt="blur")
    big = run_rollout(model, batch, per_sample_model_calls=True)
    for k in (0, 9, 15):
        alone = RolloutSpec(model=model_id, prompts=(prompts[k // 2],), num_inference_steps=3,
                            seeds=(big.seeds[k],), negative_prompt="blur")
        one = run_rollout(model, alone, per_sample_model_calls=True)
        assert torch.equal(_latents(one)[0], _latents(big)[k])
        assert torch.equal(one.log_probs[0], big.log_probs[k])


def test_step_selection_keeps_absolute_indices_and_full_sigmas(registry):
    model = registry.get("tiny-sd3")
    base = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_outputs_per_prompt=2, num_inference_steps=3, seed=2)
    full = run_rollout(model, base)
    sel = run_rollout(model, RolloutSpec(**{**base.__dict__, "return_steps": (0, 3)}))
    assert [c.step for c in sel.captures] == [0, 3]
    assert sel.snapshot.steps == (0, 3)
    assert torch.equal(sel.snapshot.sigmas, full.snapshot.sigmas) and sel.snapshot.sigmas.shape == (4,)
    assert torch.equal(sel.snapshot.timesteps, full.snapshot.timesteps)
    assert torch.equal(sel.captures[0].latent, full.captures[0].latent)
    assert torch.equal(sel.captures[1].latent, full.captures[3].latent)
    assert torch.equal(sel.log_probs, full.log_probs)


def test_sde_steps_window_and_noise_independent_of_other_transitions(registry):
    model = registry.get("tiny-sd3")
    base = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=4, seed=4)
    win = run_rollout(model, RolloutSpec(**{**base.__dict__, "sampler": SamplerSpec(sde_steps=(1, 2))}))
    assert win.snapshot.sde_steps == (1, 2)
    lp = win.log_probs[0]
    assert torch.isnan(lp[0]) and torch.isnan(lp[3]) and torch.isfinite(lp[1:3]).all()
    # Transition 1's noise is the same whether or not transition 0 was stochastic.
    only1 = run_rollout(model, RolloutSpec(**{**base.__dict__, "sampler": SamplerSpec(sde_steps=(1,))}))
    assert torch.equal(only1.captures[2].latent, win.captures[2].latent)


def test_capture_off_and_cancel(registry):
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=3, seed=1, capture=False)
    seen: list[Any] = []
    res = run_rollout(model, spec, on_step=seen.append)
    assert seen == [] and res.captures == () and estimate_latent_bytes(model, spec) == 0
    calls = []
    with pytest.raises(RolloutCancelled):
        run_rollout(model, RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=3),
                    on_progress=lambda d, t: calls.append(d), should_stop=lambda: len(calls) >= 1)
    assert calls == [1]


def test_latent_dtype_conversion_keeps_native_log_probs(registry):
    model = registry.get("tiny-sd3")
    base = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=2, seed=1)
    native = run_rollout(model, base)
    bf = run_rollout(model, RolloutSpec(**{**base.__dict__, "latent_dtype": "bfloat16"}))
    assert bf.captures[1].latent.dtype == torch.bfloat16 and bf.snapshot.native_dtype == torch.float32
    assert torch.equal(bf.log_probs, native.log_probs)


def test_concurrent_rollouts_on_one_model(registry):
    model = registry.get("tiny-flux")
    spec = RolloutSpec(model="tiny-flux", prompts=("a cat", "the dog"), num_inference_steps=3, seed=9)
    ref = run_rollout(model, spec)
    results: list[Any] = [None] * 4

    def work(k):
        results[k] = run_rollout(model, spec)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert torch.equal(_latents(r), _latents(ref)) and torch.equal(r.log_probs, ref.log_probs)


def test_metadata_is_json(registry):
    import json

    model = registry.get("tiny-flux")
    spec = RolloutSpec(model="tiny-flux", prompts=("a cat",), num_inference_steps=2, seed=1)
    res = run_rollout(model, spec)
    meta = json.loads(json.dumps(rollout_metadata(model, spec, res.snapshot)))
    assert meta["model"] == {"id": "tiny-flux", "dtype": "float32", "digest": model.digest, "weights_version": 0,
                             "components": model.components}
    assert sorted(meta["model"]["components"]) == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert meta["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    assert meta["scheduler"]["config"]["use_dynamic_shifting"] is True
    assert "mu" in meta["scheduler"]["set_timesteps"]
    assert meta["seeds"] == list(res.seeds) and meta["num_samples"] == 1
    # diffusers keeps this list in set order, which differs between processes: it is sorted.
    defaults = meta["scheduler"]["config"]["_use_default_values"]
    assert defaults == sorted(defaults) and len(defaults) > 1


BAD = [
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"sampler": SamplerSpec(type="ddim")}, "sampler.type"),  # type: ignore[arg-type]  # refused on purpose
    ({"sampler": SamplerSpec(noise_level=-0.1)}, "sampler.noise_level"),
    ({"sampler": SamplerSpec(noise_level=float("nan"))}, "sampler.noise_level"),
    ({"sampler": SamplerSpec(sde_steps=(3,))}, "sampler.sde_steps"),
    ({"sampler": SamplerSpec(sde_steps=(1, 1))}, "sampler.sde_steps"),
    ({"sampler": SamplerSpec(log_prob="sum")}, "sampler.log_prob"),  # type: ignore[arg-type]  # refused on purpose
    ({"return_steps": (4,)}, "return.steps"),
    ({"return_steps": (2, 0)}, "return.steps"),
    ({"return_steps": (1, 1)}, "return.steps"),
    ({"height": 30}, "height"),
    ({"width": 18}, "width"),
    ({"height": 132}, "height"),  # beyond tiny-sd3's position embedding (128)
    ({"seeds": (1, 2, 3)}, "seeds"),
    ({"num_frames": 5}, "num_frames"),
    ({"guidance_scale": float("inf")}, "guidance_scale"),
    ({"guidance_scale": 1e308}, "guidance_scale"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"sampler": SamplerSpec(type="cps", noise_level=1.5)}, "sampler.noise_level"),
    ({"sampler": SamplerSpec(type="cps", noise_level=2.5)}, "sampler.noise_level"),
    ({"prompts": ()}, "prompts"),
    ({"latent_dtype": "int8"}, "latent_dtype"),
]


@pytest.mark.parametrize("change,field", BAD)
def test_bad_input_names_the_field(registry, change, field):
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(**{"model": "tiny-sd3", "prompts": ("a cat",), "num_inference_steps": 3, **change})
    with pytest.raises(RolloutInputError) as err:
        validate_spec(model, spec)
    assert err.value.field == field
    with pytest.raises(RolloutInputError):
        run_rollout(model, spec)


def test_unknown_model(registry):
    with pytest.raises(RolloutInputError) as err:
        registry.get("no-such-model")
    assert err.value.field == "model"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_gpu_captures_native_and_replays():
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.replay import Replayer

    model = ModelRegistry(device="cuda", dtype=torch.bfloat16).get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=3, seed=1)
    res = run_rollout(model, spec)
    assert res.captures[0].latent.dtype == torch.bfloat16 and res.captures[0].latent.device.type == "cpu"
    lat = torch.stack([c.latent for c in res.captures], dim=1)
    got = Replayer(model).log_probs(spec, latents=lat, steps=res.snapshot.steps, sigmas=res.snapshot.sigmas,
                                    timesteps=res.snapshot.timesteps, seeds=res.seeds)
    torch.testing.assert_close(got, res.log_probs, equal_nan=True)


def test_zero_std_transitions_are_deterministic_not_nan(registry):
    """cps into sigma' = 0 and noise_level 0 have no density: Euler step, no log-prob, not in sde_steps."""
    model = registry.get("tiny-sd3")
    base = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=4, seed=4)
    cps = run_rollout(model, RolloutSpec(**{**base.__dict__, "sampler": SamplerSpec(type="cps")}))
    assert cps.snapshot.sde_steps == (0, 1, 2)  # the last transition lands on sigma = 0
    assert torch.isfinite(cps.log_probs[:, :3]).all() and torch.isnan(cps.log_probs[:, 3]).all()
    assert cps.captures[2].log_prob is not None and cps.captures[2].log_prob.isfinite().all()
    assert cps.captures[3].log_prob is None  # the row of a deterministic transition holds a null
    quiet = run_rollout(model, RolloutSpec(**{**base.__dict__, "sampler": SamplerSpec(noise_level=0.0)}))
    ode = run_rollout(model, RolloutSpec(**{**base.__dict__, "sampler": SamplerSpec(type="ode")}))
    assert quiet.snapshot.sde_steps == ()
    assert torch.isnan(quiet.log_probs).all()
    assert torch.equal(quiet.final_latents, ode.final_latents)


def test_largest_size_the_position_embedding_covers_still_runs(registry):
    model = registry.get("tiny-sd3")
    res = run_rollout(model, RolloutSpec(model="tiny-sd3", prompts=("a",), num_inference_steps=1, height=128, width=16))
    assert res.final_latents.shape[-2:] == (64, 8)  # vae factor 2


def test_bounds_are_inclusive(registry):
    model = registry.get("tiny-sd3")
    changes: list[dict[str, Any]] = [{"sampler": SamplerSpec(type="cps", noise_level=1.0)}, {"guidance_scale": 100.0}, {"guidance_scale": 0.0}]
    for change in changes:
        validate_spec(model, RolloutSpec(**{"model": "tiny-sd3", "prompts": ("a cat",), "num_inference_steps": 3, **change}))


@pytest.mark.parametrize("log_probs", [True, False])
def test_non_finite_rollout_fails_naming_the_first_step(registry, log_probs):
    """sde noise_level 1e20 is a valid request whose std_t^2 overflows float32: it must fail, not succeed."""
    model = registry.get("tiny-sd3")
    spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=3, seed=1, return_log_probs=log_probs,
                       sampler=SamplerSpec(type="sde", noise_level=1e20, sde_steps=(1, 2)))
    seen: list[Any] = []
    with pytest.raises(RolloutNonFinite) as err:
        run_rollout(model, spec, on_step=seen.append)
    # Transition 0 is deterministic and finite; transition 1 is the first to overflow: its log-prob row
    # (step 1) when log-probs are scored, else the latent x_2 it produces.
    assert (err.value.step, err.value.what) == ((1, "log_prob") if log_probs else (2, "latent"))
    assert f"absolute step {err.value.step}" in str(err.value) and err.value.error_type == "non_finite"
    assert [c.step for c in seen] == [0]  # nothing non-finite was handed out
    assert all(torch.isfinite(c.latent).all() for c in seen)


def test_latents_finite_natively_but_past_the_stored_dtypes_range_fail_non_finite(registry):
    """return.latent_dtype float16 stores each x_k as float16: an x_k finite in float32 but past
    float16's largest value (numpy's finfo) would be stored as Inf, so the rollout fails at that k."""
    import numpy as np

    model = registry.get("tiny-sd3")
    base = RolloutSpec(model="tiny-sd3", prompts=("a",), num_inference_steps=4, seed=3,
                       sampler=SamplerSpec(type="sde", noise_level=20.0))
    native = run_rollout(model, base)
    assert all(torch.isfinite(c.latent).all() for c in native.captures)
    with np.errstate(over="ignore"):  # numpy's own float32 -> float16 cast: the reference for what float16 holds
        fits = [bool(np.isfinite(c.latent.numpy().astype(np.float16)).all()) for c in native.captures]
    first = next((c.step for c, ok in zip(native.captures, fits, strict=True) if not ok), None)
    assert first is not None, fits  # the request does leave float16's range
    seen: list[Any] = []
    with pytest.raises(RolloutNonFinite) as err:
        run_rollout(model, dataclasses.replace(base, latent_dtype="float16"), on_step=seen.append)
    assert err.value.step == first and "float16" in str(err.value) and "latent_dtype" in str(err.value)
    # found as transition first-1 produces x_first, before that step's row is handed out (as a
    # non-finite x_first is): nothing non-finite was handed out
    assert [c.step for c in seen] == list(range(first - 1))
    assert all(torch.isfinite(c.latent).all() and c.latent.dtype == torch.float16 for c in seen)
