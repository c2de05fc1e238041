"""RolloutSpec's one JSON form: `to_json` / `from_json` round-trip every spec, through real JSON text.

The same form is the trajectory's `sigmaflight.rollout.request`, the job journal's record and the
Ray hand-off, so a field added to RolloutSpec and forgotten in either direction fails here."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sigmaflight.pipeline.spec import BranchStart, RolloutSpec, SamplerSpec

small = st.integers(min_value=0, max_value=50)
seeds = st.integers(min_value=0, max_value=(1 << 63) - 1)
text = st.text(max_size=12)

samplers = st.builds(
    SamplerSpec,
    type=st.sampled_from(["sde", "cps", "ode"]),
    noise_level=st.floats(min_value=0, max_value=5, allow_nan=False),
    sde_steps=st.none() | st.lists(small, max_size=5, unique=True).map(tuple),
    log_prob=st.sampled_from(["density", "no_const"]),
)

specs = st.builds(
    RolloutSpec,
    model=st.sampled_from(["tiny-sd3", "tiny-flux", "org/name@main"]),
    prompts=st.lists(text, min_size=1, max_size=4).map(tuple),
    negative_prompt=st.none() | text,
    num_outputs_per_prompt=st.integers(min_value=1, max_value=4),
    num_inference_steps=st.integers(min_value=1, max_value=60),
    guidance_scale=st.none() | st.floats(min_value=0, max_value=100, allow_nan=False),
    height=st.none() | st.integers(min_value=8, max_value=1024),
    width=st.none() | st.integers(min_value=8, max_value=1024),
    num_frames=st.none() | st.integers(min_value=1, max_value=17),
    seed=st.none() | seeds,
    seeds=st.none() | st.lists(seeds, min_size=1, max_size=6).map(tuple),
    sampler=samplers,
    return_steps=st.none() | st.lists(small, max_size=6, unique=True).map(lambda s: tuple(sorted(s))),
    return_log_probs=st.booleans(),
    latent_dtype=st.sampled_from(["native", "float32", "float16", "bfloat16"]),
    capture=st.booleans(),
    return_velocities=st.booleans(),
    return_conditioning=st.booleans(),
    return_outputs=st.booleans(),
    expected_digest=st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)


def _through_text(data: dict) -> dict:
    return json.loads(json.dumps(data))  # the journal and the metadata store text, not dicts


@settings(max_examples=300, deadline=None)
@given(specs)
def test_every_spec_round_trips_through_json_text(spec: RolloutSpec) -> None:
    assert RolloutSpec.from_json(_through_text(spec.to_json())) == spec


def _branch(step: int, samples: tuple[int, ...]) -> BranchStart:
    return BranchStart(
        step=step, latents=torch.zeros(len(samples), 4, 2, 2), sigmas=torch.linspace(1, 0, 5),
        timesteps=torch.linspace(1000, 250, 4), set_timesteps_kwargs={"num_inference_steps": 4},
        samples=samples, prompt_index=tuple(0 for _ in samples), rollout="parent-id",
    )


@settings(max_examples=100, deadline=None)
@given(specs, st.integers(min_value=0, max_value=3), st.lists(small, min_size=1, max_size=4, unique=True))
def test_a_branch_round_trips_with_its_branch_start_beside_it(spec: RolloutSpec, step: int, samples: list[int]) -> None:
    branch = _branch(step, tuple(samples))
    spec = dataclasses.replace(spec, branch_from=branch, seeds=None)
    data = _through_text(spec.to_json())
    # The JSON holds the contract's parent reference only, never tensors.
    assert data["branch_from"] == {"rollout": "parent-id", "step": step, "samples": samples}
    assert RolloutSpec.from_json(data, branch_from=branch) == spec


def test_a_branch_without_its_branch_start_is_refused_by_name() -> None:
    data = dataclasses.replace(RolloutSpec(model="m", prompts=("a",)), branch_from=_branch(2, (0,))).to_json()
    with pytest.raises(ValueError, match="parent 'parent-id', step 2"):
        RolloutSpec.from_json(data)
    with pytest.raises(ValueError, match="step 1"):
        RolloutSpec.from_json(data, branch_from=_branch(1, (0,)))


def test_keys_of_another_version_are_ignored_and_missing_ones_default() -> None:
    """Readers of v1 ignore what they do not know (contract, "Evolution")."""
    data = RolloutSpec(model="m", prompts=("a", "b")).to_json()
    data["a_field_of_a_newer_server"] = {"x": 1}
    data["sampler"]["a_newer_knob"] = 3
    del data["return_velocities"]
    spec = RolloutSpec.from_json(data)
    assert spec == RolloutSpec(model="m", prompts=("a", "b"))


def test_the_json_names_every_field_once() -> None:
    """Independent of to_json's code: the field list of the dataclass itself."""
    spec = RolloutSpec(model="m", prompts=("a",))
    assert set(spec.to_json()) == {f.name for f in dataclasses.fields(RolloutSpec)}
    assert set(spec.to_json()["sampler"]) == {f.name for f in dataclasses.fields(SamplerSpec)}
