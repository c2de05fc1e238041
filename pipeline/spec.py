"""Internal records of the rollout engine: what to run, and what the loop hands out.

These are plain frozen dataclasses (no HTTP, no Arrow). control/ converts its wire
models into a `RolloutSpec`; the loop reports a `ScheduleSnapshot` once and one
`StepCapture` per streamed absolute step; control/ turns those into Arrow batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

SamplerType = Literal["sde", "cps", "ode"]
LogProbKind = Literal["density", "no_const"]
LatentDType = Literal["native", "float32", "float16", "bfloat16"]


class RolloutInputError(ValueError):
    """A request the engine refuses before running it.

    `field` is the request path of the offending value ("sampler.sde_steps",
    "num_inference_steps", "height", ...), `reason` says why in plain words. `loc` is the same
    path as parts, under the body (REST's 422 `details[].loc` is ["body", *loc]): by default
    `field` split at its dots, () for "body" itself; a name that holds dots (a tensor key) gives
    it whole.
    """

    def __init__(self, field: str, reason: str, *, loc: tuple[str | int, ...] | None = None) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.loc: tuple[str | int, ...] = loc if loc is not None else () if field == "body" else tuple(field.split("."))


class RolloutCancelled(Exception):
    """Raised by the loop between steps when `should_stop()` answered True."""


class RolloutNonFinite(RuntimeError):
    """A latent or log-prob of the rollout became NaN or Inf; the rollout fails, never succeeds.

    `step` is the first absolute step with a non-finite value: the latent index k of x_k, or the
    transition index i of log p(x_{i+1} | x_i) (the row that would hold it); `what` says which
    ("latent", "log_prob", or "latent as float16 (return.latent_dtype)": finite in the loop, not
    in the dtype it is stored in). control/ reports it as `error.type` `error_type`.
    """

    error_type = "non_finite"

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"non-finite {what} at absolute step {step} (NaN or Inf; the model or the request overflowed)")
        self.step = step
        self.what = what


@dataclass(frozen=True, kw_only=True)
class SamplerSpec:
    type: SamplerType = "sde"
    """Step kernel: Flow-GRPO "sde", "cps" (coefficients-preserving), or deterministic "ode"."""
    noise_level: float = 0.7
    """The kernel's `a`: scales the SDE standard deviation; 0 makes sde/cps deterministic in value.
    "cps" needs it in [0, 1] (std = sigma' sin(a pi / 2)); "sde" has no upper bound."""
    sde_steps: tuple[int, ...] | None = None
    """Absolute transition indices (0..T-1) that are stochastic; None = all of them."""
    log_prob: LogProbKind = "density"
    """"density": full Gaussian log-density; "no_const": -(x' - mean)^2 (no 1 / (2 std^2), no constants),
    as SGLang's `rollout_log_prob_no_const` and Flow-GRPO's cps log-prob. Both averaged over elements."""

    def to_json(self) -> dict[str, Any]:
        """The JSON form, as a trajectory's `sigmaflight.rollout.sampler` holds it."""
        return {"type": self.type, "noise_level": self.noise_level,
                "sde_steps": None if self.sde_steps is None else list(self.sde_steps), "log_prob": self.log_prob}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, ignore_unknown: bool = False) -> SamplerSpec:
        """The SamplerSpec of its JSON form (a trajectory's `traj.metadata["sampler"]`). Every field must
        be there: a partial dict would silently score with defaults. A key it does not know is refused
        too (a misspelt one), unless `ignore_unknown` (reading a newer server's recorded request)."""
        names = set(cls.__dataclass_fields__)
        missing, unknown = sorted(names - set(data)), [] if ignore_unknown else sorted(set(data) - names)
        if missing or unknown:
            raise TypeError(
                f"not a sampler's JSON form (missing {missing or 'nothing'}, unknown {unknown or 'nothing'}): pass the "
                "trajectory's own traj.metadata['sampler'], or a SamplerSpec(type=..., noise_level=..., ...)")
        sde = data["sde_steps"]
        return cls(type=data["type"], noise_level=float(data["noise_level"]),
                   sde_steps=None if sde is None else tuple(int(i) for i in sde), log_prob=data["log_prob"])

    @classmethod
    def of(cls, sampler: SamplerSpec | Mapping[str, Any]) -> SamplerSpec:
        """`sampler` itself, or the SamplerSpec of its JSON form; TypeError saying what to pass otherwise."""
        if isinstance(sampler, SamplerSpec):
            return sampler
        if isinstance(sampler, Mapping):
            return cls.from_json(sampler)
        raise TypeError(f"sampler must be a SamplerSpec or a trajectory's sampler metadata dict "
                        f"(traj.metadata['sampler']), got {type(sampler).__name__}")


@dataclass(frozen=True, kw_only=True)
class BranchStart:
    """Start a rollout at step k from a parent's x_k (TempFlow-GRPO / BranchGRPO branches).

    Each of the P parent rows is repeated `RolloutSpec.num_outputs_per_prompt` times,
    parent-major: branch sample = p * num_outputs_per_prompt + b. The loop runs steps k..T on
    the parent's schedule, bit for bit; noise comes from the branch's own seeds.
    """

    step: int
    """k: the absolute latent index the branch starts from, in 0..T-1."""
    latents: torch.Tensor
    """[P, *latent_shape]: the parent's x_k for the chosen samples, in the dtype it was captured
    in (the model's dtype for a bit-exact continuation)."""
    sigmas: torch.Tensor
    """float32 [T+1]: the parent's `ScheduleSnapshot.sigmas`, as recorded."""
    timesteps: torch.Tensor
    """float32 [T]: the parent's `ScheduleSnapshot.timesteps`, as recorded."""
    set_timesteps_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The parent's `set_timesteps` keyword arguments (reported again in the branch's metadata)."""
    samples: tuple[int, ...]
    """The parent sample index of each of the P rows (`parent_sample` of the branch rows)."""
    prompt_index: tuple[int, ...]
    """Index into `RolloutSpec.prompts` (the parent's prompts) of each of the P rows."""
    rollout: str = ""
    """The parent's rollout id (metadata `sigmaflight.parent.rollout`); control/ fills it."""
    parent_digest: str = ""
    """The weights digest the parent ran with; control/ fills it, and a branch that would start on
    other weights fails ("" when unknown: a replay's spec)."""
    conditioning: Mapping[str, torch.Tensor] | None = None
    """Optional: the parent's conditioning rows for the P samples (`RolloutResult.conditioning`
    rows `samples`). Given, the branch uses them instead of encoding the prompts again, so its
    transformer sees the parent's tensors bit for bit; None: the prompts are encoded again."""

    def ref(self) -> dict[str, Any]:
        """The contract's parent reference {"rollout", "step", "samples"} (`sigmaflight.parent`)."""
        return {"rollout": self.rollout, "step": self.step, "samples": [int(j) for j in self.samples]}


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    model: str
    """Registry id of the model to run."""
    prompts: tuple[str, ...]
    negative_prompt: str | None = None
    num_outputs_per_prompt: int = 1
    num_inference_steps: int = 4
    guidance_scale: float | None = None
    """None = the model's default."""
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    """Video models only."""
    seed: int | None = None
    """Per-sample seeds are derived from it deterministically (see `derive_seeds`)."""
    seeds: tuple[int, ...] | None = None
    """Exactly one per sample; wins over `seed`."""
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    return_steps: tuple[int, ...] | None = None
    """Absolute latent indices 0..T to capture, ascending, unique; None = all T+1."""
    return_log_probs: bool = True
    latent_dtype: LatentDType = "native"
    capture: bool = True
    """False: run the loop and capture nothing (pays nothing for capture)."""
    return_velocities: bool = False
    """REST `return.velocities`: each captured step i < T carries the CFG-combined velocity."""
    return_conditioning: bool = False
    """REST `return.conditioning`: the result carries the tensors the transformer consumed."""
    branch_from: BranchStart | None = None
    """REST `branch_from`: start at a parent's x_k (see `BranchStart`); None = from x_0."""
    return_outputs: bool = False
    """Decode x_T after the last step and publish the "outputs/v1" stream (control/ does it)."""
    expected_digest: str | None = None
    """The weights digest the request expects; a rollout that starts with other weights fails."""

    # ---- the one JSON form --------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON: every field by name, tuples as lists, `sampler` as an object and
        `branch_from` as its parent reference {"rollout", "step", "samples"} (`BranchStart.ref`).

        This is the trajectory's `sigmaflight.rollout.request`, the job journal's record and the
        Ray hand-off (with the BranchStart's tensors beside it); `from_json` reads it back."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sampler":
                value = value.to_json()
            elif f.name == "branch_from":
                value = None if value is None else value.ref()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, branch_from: BranchStart | None = None) -> RolloutSpec:
        """The spec `to_json` wrote. Keys this version does not know are ignored (a newer
        server's trajectory), missing ones take their defaults. A branch's JSON holds only its
        parent reference: pass the resolved `branch_from` (x_k, schedule) beside it; ValueError
        when it is missing or refers to another parent step."""
        ref = data.get("branch_from")
        if ref is not None:
            if branch_from is None:
                raise ValueError(f"a branch rollout's spec needs its BranchStart (parent {ref.get('rollout')!r}, "
                                 f"step {ref.get('step')}): the parent's x_k and schedule")
            if int(ref["step"]) != branch_from.step:
                raise ValueError(f"branch_from is step {branch_from.step}, the spec's parent reference step {ref['step']}")
        return cls(**cls.json_fields(data), branch_from=branch_from if ref is not None else None)

    @classmethod
    def json_fields(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """The typed fields of a spec's JSON (tuples, a SamplerSpec), `branch_from` left out: what
        `from_json` builds from, and what a branch reads of its parent's request."""
        known = {f.name for f in fields(cls)} - {"branch_from"}
        out = {k: v for k, v in data.items() if k in known}
        for key in ("prompts", "seeds", "return_steps"):
            if out.get(key) is not None:
                out[key] = tuple(out[key])
        if isinstance(out.get("sampler"), Mapping):
            out["sampler"] = SamplerSpec.from_json(out["sampler"], ignore_unknown=True)
        return out

    @property
    def num_samples(self) -> int:
        """B: prompts x outputs, or for a branch parent rows x branches per parent row."""
        if self.branch_from is not None:
            return len(self.branch_from.samples) * self.num_outputs_per_prompt
        return len(self.prompts) * self.num_outputs_per_prompt

    @property
    def start_step(self) -> int:
        """The first absolute latent index the loop runs from: k for a branch, else 0."""
        return 0 if self.branch_from is None else self.branch_from.step

    def prompt_indices(self) -> tuple[int, ...]:
        """Index into `prompts` of each sample (B entries): prompt-major, or the parent row's."""
        n = self.num_outputs_per_prompt
        if self.branch_from is not None:
            return tuple(p for p in self.branch_from.prompt_index for _ in range(n))
        return tuple(j for j in range(len(self.prompts)) for _ in range(n))

    def parent_samples(self) -> tuple[int, ...] | None:
        """The parent sample of each sample (B entries) for a branch; None otherwise."""
        if self.branch_from is None:
            return None
        return tuple(s for s in self.branch_from.samples for _ in range(self.num_outputs_per_prompt))


@dataclass(frozen=True, kw_only=True)
class BatchInfo:
    """The contract's `sigmaflight.rollout.batch`: the model call's id, its samples, a member's rows
    [first, end) among them, and how many rollouts shared it. Alone: samples B, rows [0, B), 1.
    `per_sample_model_calls`: the model ran one row at a time (`--batch-invariant`), as a replay
    must run it to give the log-probs bit for bit (a batched call differs in the last bits)."""

    id: str
    samples: int
    rows: tuple[int, int]
    requests: int
    per_sample_model_calls: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "samples": self.samples, "rows": list(self.rows), "requests": self.requests,
                "per_sample_model_calls": self.per_sample_model_calls}


@dataclass(frozen=True, kw_only=True)
class ScheduleSnapshot:
    """The schedule that ran, reported once before the first StepCapture."""

    sigmas: torch.Tensor
    """float32 [T+1], cloned from scheduler.sigmas right after the last set_timesteps; last entry 0."""
    timesteps: torch.Tensor
    """float32 [T], cloned the same way."""
    set_timesteps_kwargs: Mapping[str, Any]
    """The keyword arguments set_timesteps was called with (JSON-able: lists, floats, ints)."""
    scheduler_class: str
    scheduler_config: Mapping[str, Any]
    sde_steps: tuple[int, ...]
    """Absolute indices of the stochastic transitions, ascending."""
    steps: tuple[int, ...]
    """Absolute latent indices that will be captured, ascending."""
    seeds: tuple[int, ...]
    """One per sample, prompt-major."""
    num_outputs_per_prompt: int
    latent_shape: tuple[int, ...]
    """Per-sample latent shape, as the model consumes it."""
    latent_dtype: torch.dtype
    """dtype of the captured latents (the loop's own unless a lossy conversion was requested)."""
    native_dtype: torch.dtype
    """dtype the loop consumed."""
    model_digest: str = ""
    """Weights digest of the model that ran (the trajectory's policy)."""
    model_weights_version: int = 0
    """weights_version of the model that ran, read with the digest and the weights (contract "Policy version")."""
    model_components: Mapping[str, str] | None = None
    """Per-component weights digests of the model that ran (`sigmaflight.pipeline.models.component_digests`)."""
    start_step: int = 0
    """k for a branch rollout (steps k..T ran), else 0."""
    prompt_index: tuple[int, ...] = ()
    """Index into the request's prompts of each sample (B entries; the parent row's for a branch)."""
    parent_sample: tuple[int, ...] | None = None
    """Branch rollouts: the parent sample of each sample (B entries); None otherwise."""
    conditioning: Mapping[str, torch.Tensor] | None = None
    """With `return_conditioning`: the tensors the transformer consumed (see `RolloutResult.conditioning`)."""
    batch: BatchInfo | None = None
    """The model call this rollout's rows were part of (pipeline/batch.py)."""


@dataclass(frozen=True, kw_only=True)
class StepCapture:
    """One absolute step i, all samples: x_i and log p(x_{i+1} | x_i)."""

    step: int
    latent: torch.Tensor
    """[B, *latent_shape] on CPU, contiguous: x_i exactly as the loop consumed it (or converted)."""
    log_prob: torch.Tensor | None
    """float32 [B]; None at i = T, on deterministic transitions, or when not requested."""
    velocity: torch.Tensor | None = None
    """float32 [B, *latent_shape] on CPU with `return_velocities`: the CFG-combined velocity the
    kernel used at step i; None at i = T or when not requested."""
