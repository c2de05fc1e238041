"""Host copies of a rollout: one per step per call, explicit, and bf16 captures stay bf16.

The copies are counted with a `TorchFunctionMode` of the test's own (it sees every
`Tensor.to(...)` / `Tensor.cpu()` that names the CPU), not by replacing any sigmaflight code. On a
GPU each such call is a device-to-host copy; on CPU the same calls run (and are counted) though
they copy nothing, so this covers the GPU path's structure on CPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.rollout import BatchMember, RolloutResult, run_batch, run_rollout
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec
from torch.overrides import TorchFunctionMode

T = 3
CPU = torch.device("cpu")


def _names_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    given = [*args[1:], kwargs.get("device")]
    return any(isinstance(a, (str, torch.device)) and torch.device(a) == CPU for a in given)


class HostCopies(TorchFunctionMode):
    """Records (rows, dtype) of each Tensor.to(<cpu>, ...) / Tensor.cpu() on a latent-shaped tensor."""

    def __init__(self, latent_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.latent_shape = latent_shape
        self.calls: list[tuple[int, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and tuple(x.shape[1:]) == self.latent_shape and (
                func is torch.Tensor.cpu or (func is torch.Tensor.to and _names_cpu(args, kwargs))):
            self.calls.append((int(x.shape[0]), x.dtype))
        return func(*args, **kwargs)


def _spec(**kw: Any) -> RolloutSpec:
    base: dict[str, Any] = dict(model="tiny-sd3", num_inference_steps=T, guidance_scale=4.5,
                                sampler=SamplerSpec(type="sde", noise_level=0.7))
    return RolloutSpec(**{**base, **kw})


# Three members of one call: 2 + 1 + 1 rows.
MEMBERS = (_spec(prompts=("a red cube", "a blue ball"), seed=1), _spec(prompts=("a dog",), seed=2),
           _spec(prompts=("a cat",), seed=3))
ROWS = 4


def _results(outcomes: list[Any]) -> list[RolloutResult]:
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o
    return outcomes


def _copies(model: Any, specs: tuple[RolloutSpec, ...], shape: tuple[int, ...]) -> list[tuple[int, torch.dtype]]:
    with HostCopies(shape) as seen:
        _results(run_batch(model, [BatchMember(spec=s) for s in specs]))
    return seen.calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_co_batched_call_copies_each_step_to_the_host_once_for_all_members(registry, dtype):
    """x_0..x_{T-1}, the velocities and x_T: one host copy each per step for the whole call (rows =
    the call's 4), none per member; what the pipeline itself copies is the same without capture."""
    model = registry.get("tiny-sd3") if dtype == torch.float32 else ModelRegistry(dtype=dtype).get("tiny-sd3")
    shape = tuple(run_rollout(model, MEMBERS[1]).captures[0].latent.shape[1:])
    captured = _copies(model, tuple(dataclasses.replace(s, return_velocities=True) for s in MEMBERS), shape)
    plain = _copies(model, tuple(dataclasses.replace(s, capture=False) for s in MEMBERS), shape)
    extra = list(captured)
    for call in plain:  # the pipeline's own copies (x_0 drawn on the CPU generators) happen in both
        extra.remove(call)
    # T + 1 latents (x_0..x_T) and T velocities (converted to float32 by that same .to), each of the call's rows
    assert extra == [(ROWS, dtype)] * (2 * T + 1), extra


@pytest.mark.parametrize("members", [1, 3])
def test_bf16_captures_stay_bf16_and_are_the_rows_the_model_saw(members):
    """A bf16 model: every stored x_i and x_T is bf16 (no float32 round trip), the velocity float32
    as the contract says, and each member's x_i equals its rows of the transformer's input (a
    forward pre-hook) bit for bit."""
    model = ModelRegistry(dtype=torch.bfloat16).get("tiny-sd3")
    specs = [dataclasses.replace(s, return_velocities=True) for s in MEMBERS[:members]]
    seen: list[torch.Tensor] = []
    handle = model.pipeline.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["hidden_states"].detach().clone()), with_kwargs=True)
    try:
        out = _results(run_batch(model, [BatchMember(spec=s) for s in specs]))
    finally:
        handle.remove()
    rows = sum(s.num_samples for s in specs)
    for res in out:
        first, end = res.snapshot.batch.rows if res.snapshot.batch is not None else (0, rows)
        assert res.snapshot.latent_dtype == res.snapshot.native_dtype == torch.bfloat16
        assert [c.step for c in res.captures] == list(range(T + 1))
        for cap in res.captures:
            assert cap.latent.dtype == torch.bfloat16 and cap.latent.device == CPU
            assert cap.latent.is_contiguous() and cap.latent.shape[0] == end - first
            if cap.step < T:
                assert cap.velocity is not None and cap.velocity.dtype == torch.float32
                assert torch.equal(cap.latent, seen[cap.step][:rows][first:end])
        assert torch.equal(res.captures[T].latent, res.final_latents.to(CPU))


@pytest.mark.parametrize("latent_dtype", ["native", "float16"])
def test_each_member_owns_its_rows_not_a_view_of_the_calls_host_tensor(registry, latent_dtype):
    """The call's host copy is one tensor of all rows; a member stores a copy of its own rows, so
    what a trajectory keeps alive is its own bytes (the data plane's budget counts those)."""
    model = registry.get("tiny-sd3")
    specs = [dataclasses.replace(s, latent_dtype=latent_dtype, return_velocities=True) for s in MEMBERS]
    for res in _results(run_batch(model, [BatchMember(spec=s) for s in specs])):
        for cap in res.captures:
            for t in (cap.latent, cap.velocity):
                if t is not None:
                    assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (cap.step, t.shape)
