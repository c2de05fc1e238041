"""The model-family table: one row per family, and adding a family is adding a row."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from sigmaflight.pipeline.builtins import BUILTINS
from sigmaflight.pipeline.decode import decode_uint8
from sigmaflight.pipeline.families import FAMILIES, OTHER, SD3, family_named, family_of_pipeline
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.rollout import run_rollout
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec, SamplerSpec


@pytest.mark.parametrize("model_id", sorted(BUILTINS))
def test_each_builtin_is_recognised_by_its_family_row(registry, model_id):
    model = registry.get(model_id)
    family = family_of_pipeline(model.pipeline)
    assert family.name == model.family == BUILTINS[model_id].family
    assert family.is_video == model.defaults.is_video
    assert family.size_multiple(model.pipeline) == model.defaults.size_multiple


class MinePipeline(StableDiffusion3Pipeline):
    """A pipeline class no row of the table knows."""


def _mine(sd3: LoadedModel) -> Any:
    """tiny-sd3's components in a MinePipeline."""
    mine = MinePipeline(**sd3.pipeline.components)
    mine.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]
    return mine


def _as(model: LoadedModel, pipeline: object, family: str) -> LoadedModel:
    return LoadedModel(id=f"{model.id}-as-{family}", family=family, pipeline=pipeline, device=model.device,
                       dtype=model.dtype, digest=model.digest, defaults=model.defaults)


SPEC = RolloutSpec(model="tiny-sd3", prompts=("a cat", "the dog"), num_outputs_per_prompt=2, num_inference_steps=3,
                   seed=11, negative_prompt="blurry", sampler=SamplerSpec(type="sde", noise_level=0.7),
                   return_conditioning=True)


def test_a_pipeline_no_row_knows_runs_as_other_and_refuses_what_needs_a_family(registry):
    sd3 = registry.get("tiny-sd3")
    mine = _mine(sd3)
    assert family_of_pipeline(mine) is OTHER and family_named("no-such-family") is OTHER
    model = _as(sd3, mine, OTHER.name)
    plain = dataclasses.replace(SPEC, return_conditioning=False)
    # It runs (generic image geometry), bit for bit the tiny-sd3 rollout: the family changes no numbers.
    got, want = run_rollout(model, plain), run_rollout(sd3, plain)
    assert all(torch.equal(a.latent, b.latent) for a, b in zip(got.captures, want.captures, strict=True))
    with pytest.raises(RolloutInputError, match="not available for family 'other'"):
        run_rollout(model, SPEC)
    with pytest.raises(RolloutInputError, match="per-sample model calls are not available for family 'other'"):
        run_rollout(model, plain, per_sample_model_calls=True)
    with pytest.raises(ValueError, match="no decode for the 'other' family"):
        decode_uint8(model, got.final_latents)


def test_adding_a_family_is_one_row_of_the_table(registry, monkeypatch):
    """A row for MinePipeline (SD3's functions under another name and class prefix) is all it takes:
    per-row model calls, conditioning and decode then work, bit for bit as for tiny-sd3."""
    sd3 = registry.get("tiny-sd3")
    mine = _mine(sd3)
    monkeypatch.setitem(FAMILIES, "mine", dataclasses.replace(SD3, name="mine", class_prefix="Mine"))
    family = family_of_pipeline(mine)
    assert family.name == "mine"
    model = _as(sd3, mine, family.name)
    got = run_rollout(model, SPEC, per_sample_model_calls=True)
    want = run_rollout(sd3, SPEC, per_sample_model_calls=True)
    assert all(torch.equal(a.latent, b.latent) for a, b in zip(got.captures, want.captures, strict=True))
    assert torch.equal(got.log_probs.nan_to_num(), want.log_probs.nan_to_num())
    assert got.conditioning is not None and want.conditioning is not None
    assert set(got.conditioning) == set(SD3.conditioning_names)
    assert all(torch.equal(got.conditioning[k], want.conditioning[k]) for k in want.conditioning)
    assert (decode_uint8(model, got.final_latents) == decode_uint8(sd3, want.final_latents)).all()
