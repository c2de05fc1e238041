"""Conditioning: the tensors the transformer consumed, named as the stock pipeline's keywords.

A rollout that asks for its conditioning wraps the transformer of its own pipeline copy in a
`TransformerRecorder` (per call, never a hook on the shared module), which keeps the text
tensors of the model calls of the first step; `conditioning_from_calls` names them as the
stock `__call__` keywords that take them, as the model's family says
(`sigmaflight.pipeline.families`: sd3 splits its [negative; positive] CFG batch, Wan takes its
cond call and then its uncond call).

Each tensor has B rows (one per sample, prompt-major) in the dtype the transformer consumed.
Passing them back (`conditioning_call_kwargs`) replaces the prompts: the pipeline then calls
no text encoder, so the replay of a trainer without text encoders is the rollout's call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from sigmaflight.pipeline.families import FAMILIES, family_named
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec

__all__ = ["CONDITIONING_NAMES", "TransformerRecorder", "conditioning_from_calls", "check_conditioning",
           "conditioning_call_kwargs", "encode_prompts", "branch_conditioning"]

CONDITIONING_NAMES: dict[str, tuple[str, ...]] = {
    name: family.conditioning_names for name, family in FAMILIES.items() if family.conditioning_names
}
"""The conditioning names of each family (the negative ones only with CFG)."""

_RECORDED_KEYWORDS = ("encoder_hidden_states", "pooled_projections")


class TransformerRecorder:
    """A per-call stand-in for the transformer that records its text inputs until `stop()`."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[dict[str, torch.Tensor]] = []
        self.recording = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.recording:
            self.calls.append({k: kwargs[k] for k in _RECORDED_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)})
        return self._module(*args, **kwargs)

    def stop(self) -> list[dict[str, torch.Tensor]]:
        """Stop recording; the calls recorded so far (those of the first step)."""
        self.recording = False
        return self.calls


def conditioning_from_calls(family: str, calls: list[dict[str, torch.Tensor]], batch: int) -> dict[str, torch.Tensor]:
    """Name the recorded text inputs of one step's model calls (B = `batch` rows each, CPU)."""
    name_conditioning = family_named(family).name_conditioning
    if name_conditioning is None or not calls:
        raise RuntimeError(f"no conditioning recorded for family {family!r}")
    return name_conditioning(calls, batch)


def check_conditioning(family: str, conditioning: Mapping[str, torch.Tensor], batch: int, *, field: str) -> None:
    """Raise RolloutInputError(`field`.<name>) unless `conditioning` is a usable set of B rows."""
    fam = family_named(family)
    names = fam.conditioning_names
    if not names:
        raise RolloutInputError(field, f"conditioning is not available for family {family!r}")
    for name, value in conditioning.items():
        if name not in names:
            raise RolloutInputError(f"{field}.{name}", f"unknown conditioning name; {family} takes {', '.join(names)}")
        if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.shape[0] != batch:
            raise RolloutInputError(f"{field}.{name}", f"must be a tensor with one row per sample ({batch})")
    for name in fam.required_conditioning:
        if name not in conditioning:
            raise RolloutInputError(f"{field}.{name}", "missing")
    paired = fam.paired_conditioning
    if len({name in conditioning for name in paired}) > 1:
        raise RolloutInputError(f"{field}.{paired[-1]}", "give both negative tensors or neither")


def conditioning_call_kwargs(conditioning: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """`__call__` keywords that replace the prompts: the tensors on `device`, one row per sample."""
    return {name: t.to(device) for name, t in conditioning.items()}


def encode_prompts(model: LoadedModel, pipe: Any, spec: RolloutSpec) -> dict[str, torch.Tensor]:
    """The conditioning of `spec.prompts`, one row per prompt, from the pipeline's own `encode_prompt`
    called exactly as its `__call__` calls it (the same text-encoder batches: the rows are the
    bits a rollout of these prompts feeds the transformer, whatever rows are picked later)."""
    d = model.defaults
    guidance = d.guidance_scale if spec.guidance_scale is None else float(spec.guidance_scale)
    cfg = guidance > 1
    extra = {k: v for k, v in d.call_kwargs.items() if k == "max_sequence_length"}
    encode = family_named(model.family).encode_prompts
    if encode is None:
        raise RolloutInputError("model", f"conditioning is not available for family {model.family!r}")
    return encode(pipe, prompts=list(spec.prompts), negative_prompt=spec.negative_prompt, cfg=cfg,
                  device=model.device, extra=extra)


def branch_conditioning(model: LoadedModel, pipe: Any, spec: RolloutSpec) -> dict[str, torch.Tensor]:
    """B rows of conditioning for a branch: each parent row's, repeated num_outputs_per_prompt
    times (parent-major). From `BranchStart.conditioning` when given, else from `encode_prompts`
    (rows `prompt_index`), so the branch's transformer sees the parent's tensors bit for bit."""
    b = spec.branch_from
    assert b is not None
    n = spec.num_outputs_per_prompt
    if b.conditioning is not None:
        return {k: v.repeat_interleave(n, dim=0) for k, v in b.conditioning.items()}
    rows = torch.tensor(b.prompt_index, dtype=torch.long).repeat_interleave(n)
    return {k: v[rows.to(v.device)] for k, v in encode_prompts(model, pipe, spec).items()}
