import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.schedules import make_rollout_scheduler
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec


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
    model = registry.get("tiny-sd3")
    drifted = []
    for n in range(1, 41):
        stock = _stock(model, num_inference_steps=n)
        if not torch.equal(stock.timesteps / 1000, stock.sigmas[:-1]):
            drifted.append(n)
    assert drifted, "expected t/1000 to differ from the sigmas in at least one schedule"
    # timesteps given without sigmas: the sigma that runs is shifted, t/1000 is not it at all.
    stock = _stock(model, timesteps=[1000.0, 500.0, 250.0])
    assert (stock.timesteps / 1000 - stock.sigmas[:-1]).abs().max() > 0.1


def test_non_flow_match_scheduler_is_refused(registry):
    with pytest.raises(RolloutInputError) as err:
        make_rollout_scheduler(DDIMScheduler(), driver=None)  # type: ignore[arg-type]  # refused before use
    assert err.value.field == "model" and "flow-match" in err.value.reason
