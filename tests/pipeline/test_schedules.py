import json

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from sigmaflight.control.backends.local import header_for
from sigmaflight.dataplane.schema import trajectory_schema
from sigmaflight.pipeline.rollout import rollout_metadata, run_rollout
from sigmaflight.pipeline.schedules import make_rollout_scheduler
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec, SamplerSpec


def _stock(model, **set_kwargs):
    sched = FlowMatchEulerDiscreteScheduler.from_config(model.pipeline.scheduler.config)
    sched.set_timesteps(**set_kwargs)
    return sched


@pytest.mark.parametrize("model_id", ["tiny-sd3", "tiny-flux"])
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_sigmas_snapshot_is_the_schedule_that_ran(registry, model_id, steps):
    model = registry.get(model_id)
    res = run_rollout(model, RolloutSpec(model=model_id, prompts=("a cat",), num_inference_steps=steps, seed=3))
    snap = res.snapshot
    kwargs = dict(snap.set_timesteps_kwargs)
    if model_id == "tiny-flux":
        assert "mu" in kwargs  # dynamic shifting: mu computed from the image size
    else:
        assert kwargs == {"num_inference_steps": steps}  # static shift
    stock = _stock(model, **kwargs)
    assert snap.sigmas.dtype == torch.float32 and snap.sigmas.shape == (steps + 1,)
    assert snap.timesteps.shape == (steps,)
    assert torch.equal(snap.sigmas, stock.sigmas)
    assert torch.equal(snap.timesteps, stock.timesteps)
    assert snap.sigmas[-1].item() == 0.0
    assert snap.sigmas.data_ptr() != stock.sigmas.data_ptr()


def test_caller_supplied_sigmas_and_last_call_wins(registry):
    model = registry.get("tiny-sd3")
    sched = make_rollout_scheduler(model.pipeline.scheduler, driver=None)  # type: ignore[arg-type]  # no steps run
    sched.set_timesteps(num_inference_steps=5)
    custom = [1.0, 0.8, 0.5, 0.1]
    sched.set_timesteps(sigmas=custom)
    stock = _stock(model, sigmas=custom)
    snapshot = sched.sigmas_snapshot
    assert snapshot is not None and torch.equal(snapshot, stock.sigmas)
    assert snapshot.shape == (5,)
    assert sched.set_timesteps_kwargs == {"sigmas": custom}
    # The snapshot is a clone: later changes to the scheduler's tensor do not reach it.
    sched.sigmas.mul_(0)
    assert torch.equal(snapshot, stock.sigmas)


def test_timesteps_over_1000_drifts_from_the_snapshot(registry):
    """sigmaflight ships the snapshot's bits, and they are not t/1000. Where stock diffusers'
    t/1000 drifts from its own sigmas, the `sigmaflight.sigmas` a trajectory's schema carries
    (built as the server builds it: header_for, trajectory_schema) parse back, with plain json
    and numpy float32, to the stock schedule bit for bit, and the shipped timesteps / 1000 do not."""
    model = registry.get("tiny-sd3")
    drifted = [n for n in range(1, 41)
               if not torch.equal((s := _stock(model, num_inference_steps=n)).timesteps / 1000, s.sigmas[:-1])]
    assert drifted, "expected t/1000 to differ from the sigmas in at least one schedule"
    for n in drifted[:2]:
        spec = RolloutSpec(model="tiny-sd3", prompts=("a cat",), num_inference_steps=n, seed=3, return_steps=(0, n))
        res = run_rollout(model, spec)
        header = header_for("drift", res.snapshot, rollout_metadata(model, spec, res.snapshot), log_probs=True)
        meta = trajectory_schema(header).metadata
        sigmas = torch.from_numpy(np.asarray(json.loads(meta[b"sigmaflight.sigmas"]), dtype=np.float32))
        timesteps = torch.from_numpy(np.asarray(json.loads(meta[b"sigmaflight.timesteps"]), dtype=np.float32))
        stock = _stock(model, num_inference_steps=n)
        assert torch.equal(sigmas, stock.sigmas), f"T={n}: the shipped sigmas are not the schedule that ran"
        assert torch.equal(timesteps, stock.timesteps), f"T={n}: the shipped timesteps are not the schedule's"
        assert not torch.equal(timesteps / 1000, sigmas[:-1]), f"T={n}: t/1000 should drift here"


def test_non_flow_match_scheduler_is_refused(registry):
    with pytest.raises(RolloutInputError) as err:
        make_rollout_scheduler(DDIMScheduler(), driver=None)  # type: ignore[arg-type]  # refused before use
    assert err.value.field == "model" and "flow-match" in err.value.reason


@pytest.mark.parametrize(("height", "width"), [(640, 640), (768, 768), (16, 36864), (4, 1048576)])
def test_a_size_whose_shifted_schedule_is_not_finite_names_the_larger_side(registry, height, width):
    """FLUX shifts its schedule by mu, which grows with the image's tokens: the stock pipeline's
    own functions (prepare_latents' packed length, calculate_shift, retrieve_timesteps) give a NaN
    schedule for tiny-flux past its config's range, and past float64's exp (4 x 1048576) raise
    OverflowError. Such a request fails before its first step as a RolloutInputError naming the
    larger side (it used to run on, or raise, and fail as an internal error)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    model = registry.get("tiny-flux")
    pipe = model.pipeline
    cfg = pipe.scheduler.config
    packed, _ = pipe.prepare_latents(1, pipe.transformer.config.in_channels // 4, height, width, torch.float32, "cpu",
                                     torch.Generator().manual_seed(0))
    mu = calculate_shift(packed.shape[1], cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
    stock = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            retrieve_timesteps(stock, 2, "cpu", sigmas=np.linspace(1.0, 1 / 2, 2).tolist(), mu=mu)
        runs = bool(torch.isfinite(stock.sigmas).all())
    except OverflowError:
        runs = False
    spec = RolloutSpec(model="tiny-flux", prompts=("a cat",), num_inference_steps=2, seed=1, height=height, width=width,
                       sampler=SamplerSpec(type="ode"))
    if runs:
        assert torch.isfinite(run_rollout(model, spec).final_latents).all()
    else:
        with pytest.raises(RolloutInputError) as err:
            run_rollout(model, spec)
        assert err.value.field == ("width" if width > height else "height") and "not finite" in str(err.value)
        assert f"{height} x {width}" in str(err.value)
