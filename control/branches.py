"""`branch_from` at POST (contract, "Branch rollouts"): resolve the parent from this server's
backend's results (`Backend.parent`) and build the branch's `RolloutSpec`.

The parent's x_k rows, schedule (sigmas, timesteps, set_timesteps kwargs), prompt indices and,
when it published one, its "conditioning/v1" stream are read from the trajectory the backend
holds; the branch inherits model, prompts, negative_prompt, guidance_scale, height, width,
num_frames and num_inference_steps from the parent's recorded request. With the Ray backend the
parent's trajectory lives in a worker's store and comes to the control plane through the Ray
object store (`RayBackend.parent`); x_k and the conditioning rows travel on in the branch's spec
to whichever worker runs it; see docs/trainers.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
from sigmaflight.control.jobs.backend import Backend
from sigmaflight.dataplane.codec import batch_to_tensors
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.streams import KEY_COLUMNS, column_tensor
from sigmaflight.pipeline.spec import BranchStart, RolloutInputError, RolloutSpec

INHERITED = ("model", "prompts", "negative_prompt", "guidance_scale", "height", "width", "num_frames",
             "num_inference_steps")
"""Request fields a branch takes from its parent (omit them; a different value is a 422)."""


class StaleParent(Exception):
    """The parent ran with other weights than the model has now (409 "stale_parent")."""

    def __init__(self, parent: str, parent_digest: str, digest: str, weights_version: int) -> None:
        super().__init__(
            f"parent rollout {parent} ran with weights {parent_digest[:12]}..., the model has {digest[:12]}... now: "
            "its x_k is not a state of the current policy"
        )
        self.parent, self.parent_digest, self.digest = parent, parent_digest, digest
        self.weights_version = weights_version


@dataclass(frozen=True)
class Parent:
    """A succeeded parent rollout: its header, stored batches and conditioning stream."""

    rollout_id: str
    header: TrajectoryHeader
    request: Mapping[str, Any]
    """The parent's `sigmaflight.rollout.request` (its RolloutSpec as JSON)."""
    digest: str
    batches: list[pa.RecordBatch]
    conditioning: pa.Table | None
    """The parent's "conditioning/v1" table when it published one and it is still held."""

    @property
    def model(self) -> str:
        return str(self.request.get("model") or self.header.rollout.get("model", {}).get("id", ""))


def find_parent(backend: Backend, rollout_id: str) -> Parent:
    """The succeeded parent `rollout_id` as the backend holds it (the local store, or a Ray worker's
    through the object store). RolloutInputError ("branch_from.rollout") when unknown or not
    succeeded."""
    found = backend.parent(rollout_id)
    if found is None:
        raise RolloutInputError(
            "branch_from.rollout", f"no succeeded rollout {rollout_id!r} on this server (unknown, unfinished, released or expired)"
        )
    header = found.header
    return Parent(rollout_id, header, header.rollout.get("request") or {},
                  str((header.rollout.get("model") or {}).get("digest", "")), found.batches, found.conditioning)


def check_inherited(body: Mapping[str, Any], parent: Parent, defaults: Any) -> None:
    """A field the branch inherits may be omitted or repeated; a different value is refused."""
    for name in INHERITED:
        given = body.get(name)
        if given is None:
            continue
        had = parent.request.get(name) if name != "model" else parent.model
        if had is None and defaults is not None:
            had = getattr(defaults, name, None)
        same = list(given) == list(had or ()) if name == "prompts" else given == had
        if not same:
            inherits = ("from its parent, which had none; omit it" if had is None
                        else f"from its parent ({had!r}); omit it or give the same value")
            raise RolloutInputError(name, f"a branch inherits {name} {inherits}, got {given!r}")


def _step_rows(parent: Parent, step: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The parent's x_k for all its samples [B, ...] in the stored dtype, and its prompt indices."""
    header = parent.header
    t = header.num_steps
    if not 0 <= step < t:
        raise RolloutInputError("branch_from.step", f"{step} is out of range: must be in 0..{t - 1} (the parent's T={t})")
    if step not in header.steps:
        raise RolloutInputError(
            "branch_from.step", f"the parent did not stream step {step} (its return.steps: {list(header.steps)})"
        )
    b = header.num_samples
    latents = torch.empty((b, *header.latent_shape), dtype=header.latent_dtype)
    prompt_index = [0] * b
    seen = torch.zeros(b, dtype=torch.bool)
    for batch in parent.batches:
        if batch.num_rows == 0 or int(batch.column("step")[0].as_py()) != step:
            continue
        st = batch_to_tensors(batch, copy=True, dtype=header.latent_dtype)
        latents[st.sample] = st.latent
        seen[st.sample] = True
        for s, p in zip(st.sample.tolist(), st.prompt_index.tolist(), strict=True):
            prompt_index[s] = int(p)
    if not bool(seen.all()):
        raise RolloutInputError("branch_from.step", f"the parent's step {step} is incomplete in the store")
    return latents, tuple(prompt_index)


def _conditioning(parent: Parent, rows: list[int]) -> dict[str, torch.Tensor] | None:
    table = parent.conditioning
    if table is None:
        return None
    index = torch.tensor(rows, dtype=torch.int64)
    return {c: column_tensor(table, c).index_select(0, index).contiguous()
            for c in table.schema.names if c not in KEY_COLUMNS}


def branch_spec(parent: Parent, base: RolloutSpec, *, step: int,
                samples: list[int] | None) -> RolloutSpec:
    """`base` (the branch's own sampler, return, seeds, num_outputs_per_prompt) on the parent's
    model, prompts, size and schedule, starting at the parent's x_k rows `samples`."""
    b = parent.header.num_samples
    latents, prompt_index = _step_rows(parent, step)
    rows = list(range(b)) if samples is None else list(samples)
    bad = [j for j in rows if not 0 <= j < b]
    if bad:
        raise RolloutInputError("branch_from.samples", f"{bad} out of range: the parent has samples 0..{b - 1}")
    if len(set(rows)) != len(rows):
        raise RolloutInputError("branch_from.samples", "each parent sample may be given once")
    index = torch.tensor(rows, dtype=torch.int64)
    start = BranchStart(
        step=step,
        latents=latents.index_select(0, index).contiguous(),
        sigmas=parent.header.sigmas.clone(),
        timesteps=parent.header.timesteps.clone(),
        set_timesteps_kwargs=dict((parent.header.rollout.get("scheduler") or {}).get("set_timesteps") or {}),
        samples=tuple(rows),
        prompt_index=tuple(prompt_index[j] for j in rows),
        rollout=parent.rollout_id,
        parent_digest=parent.digest,
        conditioning=_conditioning(parent, rows),
    )
    had = RolloutSpec.json_fields(parent.request)
    inherited: dict[str, Any] = {name: had.get(name) for name in INHERITED}
    inherited.update(model=parent.model, prompts=had.get("prompts") or (),
                     num_inference_steps=int(had.get("num_inference_steps") or parent.header.num_steps))
    return dataclasses.replace(base, **inherited, branch_from=start)
