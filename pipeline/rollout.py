"""The rollout loop: run a diffusers flow-match pipeline and capture its trajectory.

The pipeline's own `__call__` runs (encoding, CFG, latent preparation); a per-call
`RolloutScheduler` hands every step to `_Driver`, which advances the step with
`stepping.advance` (the function the replay uses too), captures x_i, scores
log p(x_{i+1} | x_i) as `kernels.step_log_prob` does (the transition's kernel, computed once for
the step and the score) and fails the rollout (`RolloutNonFinite`)
at the first non-finite latent or log-prob. `rollout_metadata` is the contract's
`sigmaflight.rollout` object for the run.

Co-batching: `run_batch` runs several rollouts that share a batch key (pipeline/batch.py) as
one `__call__`, their samples one after another (`calls.batch_call_kwargs`). The model sees
all rows at once; everything else is done per member on its own rows, exactly as for the member
alone: its own seeds and noise, sde window, kernel step (`advance` on its rows), log-probs,
captures, callbacks, cancel and failure. The one thing shared is arithmetic: a step's kernel
(mean, std) is computed once over the call when two or more members are stochastic there, and
each member takes its rows (elementwise, so the same values as alone; not with per-row calls).
A member that fails or is cancelled ends at once (its `on_end` is called then) while the others
run on; `run_rollout` is a batch of one.

Seeds and noise: see pipeline/seeds.py; validation and sizes: pipeline/validation.py; the
pipeline call: pipeline/calls.py. Their public names are re-exported here, as before the split.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sigmaflight.pipeline.batch import batch_key
from sigmaflight.pipeline.calls import batch_call_kwargs, call_overrides, recorded_call
from sigmaflight.pipeline.conditioning import (
    TransformerRecorder,
    branch_conditioning,
    conditioning_from_calls,
)
from sigmaflight.pipeline.kernels import gaussian_log_prob, kernel_mean_std, stochastic_transitions
from sigmaflight.pipeline.models import LoadedModel, Policy, WeightsFailed
from sigmaflight.pipeline.schedules import RolloutScheduler, make_rollout_scheduler, per_call_pipeline
from sigmaflight.pipeline.seeds import derive_seeds, noise_seed, sample_seeds
from sigmaflight.pipeline.spec import (
    BatchInfo,
    RolloutCancelled,
    RolloutNonFinite,
    RolloutSpec,
    ScheduleSnapshot,
    StepCapture,
)
from sigmaflight.pipeline.stepping import advance
from sigmaflight.pipeline.validation import (
    capture_dtype,
    captured_steps,
    estimate_latent_bytes,
    latent_shape,
    requested_sde_steps,
    validate_spec,
)

__all__ = [
    "BatchMember",
    "RolloutResult",
    "derive_seeds",
    "noise_seed",
    "sample_seeds",
    "validate_spec",
    "latent_shape",
    "estimate_latent_bytes",
    "run_batch",
    "run_rollout",
    "rollout_metadata",
    "parent_metadata",
]


@dataclass(frozen=True, kw_only=True)
class RolloutResult:
    snapshot: ScheduleSnapshot
    captures: tuple[StepCapture, ...]
    """The StepCaptures in ascending step order (empty with keep=False or capture=False)."""
    log_probs: torch.Tensor
    """float32 [B, T] on CPU; NaN on deterministic transitions or when not requested."""
    seeds: tuple[int, ...]
    final_latents: torch.Tensor
    """x_T [B, *latent_shape] in the model's dtype, on the model's device."""
    digest: str
    """Weights digest of the model that ran."""
    conditioning: Mapping[str, torch.Tensor] | None = None
    """With `return_conditioning`: the tensors the transformer consumed, keyed by the stock
    `__call__` keyword (`sigmaflight.pipeline.conditioning.CONDITIONING_NAMES`), B rows prompt-major, on CPU."""
    prompt_index: tuple[int, ...] = ()
    """Index into the prompts of each sample (the parent row's for a branch)."""
    parent_sample: tuple[int, ...] | None = None
    """Branch rollouts: the parent sample of each sample; None otherwise."""


@dataclass(eq=False, kw_only=True)
class BatchMember:
    """One rollout of a co-batched call, and what it reports to. A callback that raises ends this
    member with that error, alone; `on_end` gets the member's RolloutResult or its error as soon
    as it is known (a cancel or a failure at step i: at step i, while the others run on)."""

    spec: RolloutSpec
    on_start: Callable[[Policy], None] | None = None
    """Called with the weights the call will run on, before anything runs (raise to refuse them)."""
    on_schedule: Callable[[ScheduleSnapshot], None] | None = None
    on_step: Callable[[StepCapture], None] | None = None
    on_progress: Callable[[int, int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_end: Callable[[RolloutResult | BaseException], None] | None = None
    keep: bool = True
    """Keep the captures in the result (False: only `on_step` sees them)."""


@dataclass(frozen=True)
class _HostStep:
    """One step's tensors of the whole call on the host, each copied once (`_Driver._host`); None
    where no member still running needs it."""

    latent: torch.Tensor | None = None
    """x_i [B, ...] in the capture dtype."""
    velocity: torch.Tensor | None = None
    """float32 [B, ...]: the CFG-combined velocity of step i."""
    next_latent: torch.Tensor | None = None
    """x_T [B, ...] after the last transition."""


class _BatchOver(Exception):
    """Every member of the call has ended: stop the pipeline's loop."""


@dataclass(eq=False)
class _Run:
    """One member inside the call: its rows [first, end) and everything that is its own."""

    member: BatchMember
    seeds: tuple[int, ...]
    first: int
    end: int
    model: LoadedModel
    policy: Policy
    steps: frozenset[int] = frozenset()
    sde_steps: frozenset[int] = frozenset()
    captures: list[StepCapture] = field(default_factory=list)
    snapshot: ScheduleSnapshot | None = None
    conditioning: dict[str, torch.Tensor] | None = None
    outcome: RolloutResult | BaseException | None = None

    def __post_init__(self) -> None:
        spec = self.member.spec
        self.T = spec.num_inference_steps
        self.steps = frozenset(captured_steps(spec)) if spec.capture else frozenset()
        self.sde_steps = frozenset(requested_sde_steps(spec))
        self.capture_dtype = capture_dtype(self.model, spec)
        self.log_probs = torch.full((len(self.seeds), self.T), float("nan"), dtype=torch.float32)
        self.sigmas: torch.Tensor | None = None
        self.whole = False
        """This member's rows are the whole call (a batch of one): stored tensors need no copy."""
        self.lp: torch.Tensor | None = None
        """The log-prob of the transition `step` just made (float32 [B_m], CPU), for `record`."""

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def close(self, outcome: RolloutResult | BaseException) -> None:
        self.outcome = outcome
        if self.member.on_end is not None:
            self.member.on_end(outcome)

    def report_schedule(self, scheduler: RolloutScheduler, sample: torch.Tensor, batch: BatchInfo,
                        original_scheduler: Any) -> None:
        spec = self.member.spec
        assert scheduler.sigmas_snapshot is not None and scheduler.timesteps_snapshot is not None
        sigmas = scheduler.sigmas_snapshot
        if sigmas.shape[0] != self.T + 1:
            raise RuntimeError(f"the pipeline ran {sigmas.shape[0] - 1} steps, the request asked for {self.T}")
        self.sigmas = sigmas
        self.sde_steps = frozenset(stochastic_transitions(self.sde_steps, sigmas, sampler=spec.sampler))
        self.snapshot = ScheduleSnapshot(
            sigmas=sigmas,
            timesteps=scheduler.timesteps_snapshot,
            set_timesteps_kwargs=dict(scheduler.set_timesteps_kwargs or {}),
            scheduler_class=type(original_scheduler).__name__,
            scheduler_config=_json_config(original_scheduler.config),
            sde_steps=tuple(sorted(self.sde_steps)),
            steps=tuple(sorted(self.steps)),
            seeds=self.seeds,
            num_outputs_per_prompt=spec.num_outputs_per_prompt,
            latent_shape=tuple(sample.shape[1:]),
            latent_dtype=self.capture_dtype,
            native_dtype=sample.dtype,
            model_digest=self.policy.digest,
            model_weights_version=self.policy.weights_version,
            model_components=dict(self.policy.components) if self.policy.components else None,
            start_step=spec.start_step,
            prompt_index=spec.prompt_indices(),
            parent_sample=spec.parent_samples(),
            conditioning=self.conditioning,
            batch=batch,
        )
        if self.member.on_schedule is not None:
            self.member.on_schedule(self.snapshot)

    def _own(self, host: torch.Tensor) -> torch.Tensor:
        """This member's rows of `host`, a tensor of the whole call on the host (`_Driver._host`):
        `host` itself when the rows are the whole call, else a copy of the rows on the host (a
        member keeps its own rows, not a view that would keep the whole call's tensor alive)."""
        return host if self.whole else host[self.first:self.end].clone()  # [B_m, ...]

    def _emit(self, step: int, latent: torch.Tensor, log_prob: torch.Tensor | None,
              velocity: torch.Tensor | None = None) -> None:
        cap = StepCapture(step=step, latent=latent, log_prob=log_prob, velocity=velocity)
        if self.member.keep:
            self.captures.append(cap)
        if self.member.on_step is not None:
            self.member.on_step(cap)

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor,
             kernel: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """This member's transition i on its own rows (on the model's device): sample, velocity
        [B_m, ...]; returns x_{i+1} [B_m, ...] and records the log-prob. `kernel`: the transition's
        (mean [B_m, ...], std) when the driver computed it for the whole call. `record` follows."""
        spec = self.member.spec
        assert self.sigmas is not None
        stochastic = i in self.sde_steps
        if stochastic and kernel is None:
            kernel = kernel_mean_std(sample, velocity, self.sigmas, i, sampler=spec.sampler)
        x_next = advance(scheduler, i, sample, velocity, self.sigmas, sampler=spec.sampler, seeds=self.seeds,
                         stochastic=stochastic, kernel=kernel)
        self.lp = None
        if stochastic and spec.return_log_probs:
            assert kernel is not None
            # Score the stored values as `step_log_prob` (the public replay function) does: its
            # kernel of (sample, velocity), then the Gaussian of x_next; the kernel made once.
            lp = gaussian_log_prob(x_next, *kernel, spec.sampler.log_prob).to("cpu")  # [B_m], B_m floats
            if not bool(torch.isfinite(lp).all()):
                raise RolloutNonFinite(i, "log_prob")
            self.log_probs[:, i] = lp
            self.lp = lp
        if not bool(torch.isfinite(x_next).all()):
            raise RolloutNonFinite(i + 1, "latent")
        return x_next

    def record(self, i: int, host: _HostStep) -> None:
        """After transition i of every member: emit x_i (and x_T after the last transition) from the
        call's host copies, report progress, honour a stop."""
        if i in self.steps:
            assert host.latent is not None
            v = None
            if self.member.spec.return_velocities:
                assert host.velocity is not None
                v = self._own(host.velocity)
            self._emit(i, self._own(host.latent), self.lp, v)
        if i == self.T - 1 and self.T in self.steps:
            assert host.next_latent is not None
            self._emit(self.T, self._own(host.next_latent), None)
        if self.member.on_progress is not None:
            self.member.on_progress(i + 1, self.T)
        if i + 1 < self.T and self.member.should_stop is not None and self.member.should_stop():
            raise RolloutCancelled(f"cancelled after step {i + 1} of {self.T}")

    def result(self, final: torch.Tensor) -> RolloutResult:
        assert self.snapshot is not None
        return RolloutResult(
            snapshot=self.snapshot,
            captures=tuple(self.captures),
            log_probs=self.log_probs,
            seeds=self.seeds,
            final_latents=final,
            digest=self.policy.digest,
            conditioning=self.conditioning,
            prompt_index=self.snapshot.prompt_index,
            parent_sample=self.snapshot.parent_sample,
        )


class _Driver:
    """The scheduler's step driver for one call: hands each member its rows, joins their x_{i+1}."""

    def __init__(self, runs: list[_Run], batch_id: str, original_scheduler: Any, family: str,
                 per_row: bool = False) -> None:
        self.runs = runs
        self.per_row = per_row
        self.batch_id = batch_id
        self.original_scheduler = original_scheduler
        self.family = family
        self.samples = runs[-1].end
        self.recorder: TransformerRecorder | None = None
        self.started = False

    def on_set_timesteps(self, scheduler: RolloutScheduler) -> None:
        self.started = False  # the last schedule wins; reported at the first step
        b = self.runs[0].member.spec.branch_from  # members share it (batch_key)
        if b is not None:  # the parent's schedule, bit for bit, from step k
            scheduler.start_at(b.step, b.sigmas, b.timesteps, dict(b.set_timesteps_kwargs))

    def _start(self, scheduler: RolloutScheduler, sample: torch.Tensor) -> None:
        self.started = True
        conditioning = None
        if self.recorder is not None:
            conditioning = conditioning_from_calls(self.family, self.recorder.stop(), self.samples)
        for run in self.runs:
            if run.ended:
                continue
            if conditioning is not None:
                run.conditioning = {k: v[run.first:run.end].clone() for k, v in conditioning.items()}
            batch = BatchInfo(id=self.batch_id, samples=self.samples, rows=(run.first, run.end),
                              requests=len(self.runs))
            try:
                run.report_schedule(scheduler, sample[run.first:run.end], batch, self.original_scheduler)
            except Exception as exc:
                run.close(exc)

    def _kernel(self, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Transition i's (mean, std) over the whole call, once, when two or more members are
        stochastic at i (members share sampler, noise level and schedule: `batch_key`); each takes
        its rows. The kernel is elementwise, so a row's values do not depend on the others; with
        per-row model calls (--batch-invariant) every member computes its own, as alone."""
        live = [r for r in self.runs if not r.ended and i in r.sde_steps]
        if self.per_row or len(live) < 2:
            return None
        run = live[0]
        assert run.sigmas is not None
        return kernel_mean_std(sample, velocity, run.sigmas, i, sampler=run.member.spec.sampler)

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self._start(scheduler, sample)
        kernel = self._kernel(i, sample, velocity)
        out = []
        for run in self.runs:
            rows = slice(run.first, run.end)
            if not run.ended:
                try:
                    mine = (kernel[0][rows], kernel[1]) if kernel is not None and i in run.sde_steps else None
                    out.append(run.step(scheduler, i, sample[rows], velocity[rows], mine))
                    continue
                except Exception as exc:
                    run.close(exc)
            out.append(torch.zeros_like(sample[rows]))  # an ended member's rows: ignored from now on
        x_next = out[0] if len(out) == 1 else torch.cat(out, dim=0)  # [B, ...]
        host = self._host(i, sample, velocity, x_next)
        for run in self.runs:
            if not run.ended:
                try:
                    run.record(i, host)
                except Exception as exc:
                    run.close(exc)
        if all(run.ended for run in self.runs):
            raise _BatchOver
        return x_next

    def _host(self, i: int, sample: torch.Tensor, velocity: torch.Tensor, x_next: torch.Tensor) -> _HostStep:
        """The step's host copies, each made once for the whole call and only when a member still
        running captures it: x_i, the velocity, x_T. Explicit and blocking (`.to("cpu")`); none on
        a CPU model whose capture dtype is its own (then the tensors themselves)."""
        live = [r for r in self.runs if not r.ended]
        if not live:
            return _HostStep()
        dtype = live[0].capture_dtype  # members share latent_dtype (batch_key)
        capturing = [r for r in live if i in r.steps]
        latent = sample.to("cpu", dtype).contiguous() if capturing else None  # [B, ...]
        velocity_h = None
        if any(r.member.spec.return_velocities for r in capturing):
            velocity_h = velocity.to("cpu", torch.float32).contiguous()  # [B, ...]
        last = i == live[0].T - 1 and any(r.T in r.steps for r in live)
        next_latent = x_next.to("cpu", dtype).contiguous() if last else None  # [B, ...]
        return _HostStep(latent=latent, velocity=velocity_h, next_latent=next_latent)


def _json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)):
            # diffusers builds _use_default_values from a set: sort it so metadata is the same in every process
            out[k] = sorted(v) if k == "_use_default_values" else list(v)
        else:
            out[k] = str(v)
    return out


def run_batch(
    model: LoadedModel,
    members: Sequence[BatchMember],
    *,
    per_sample_model_calls: bool = False,
    batch_id: str | None = None,
) -> list[RolloutResult | BaseException]:
    """Run `members` (sharing one `batch_key`) as one pipeline call; each member's result or error,
    in order (each also given to its `on_end` as soon as it is known).

    A member that is invalid, refuses the weights (`on_start`) or is stopped before the first step
    ends at once and takes no rows. Thread-safe: each call builds its own scheduler and pipeline
    copy over the shared modules; the weights (`model.policy()`) are read once, so a push during
    the call leaves every member on the weights it started with."""
    if not members:
        return []
    keys = {batch_key(model, m.spec) for m in members}
    if len(keys) != 1:
        raise ValueError("co-batched rollouts must share one batch_key (pipeline/batch.py)")

    def all_stopped() -> bool:  # a held call is given up once every member is cancelled
        return all(m.should_stop is not None and m.should_stop() for m in members)

    try:
        with model.in_use(all_stopped):  # an in-place weights push holds this call; a failed one refuses it
            return _run_batch(model, members, per_sample_model_calls, batch_id)
    except (WeightsFailed, RolloutCancelled) as closed:
        ends: list[RolloutResult | BaseException] = []
        for member in members:  # a member cancelled meanwhile ends cancelled, not on the push's failure
            stopped = member.should_stop is not None and member.should_stop()
            end = RolloutCancelled("cancelled while an in-place weights push held the model") if stopped else closed
            if member.on_end is not None:
                member.on_end(end)
            ends.append(end)
        return ends


def _run_batch(model: LoadedModel, members: Sequence[BatchMember], per_sample_model_calls: bool,
               batch_id: str | None) -> list[RolloutResult | BaseException]:
    policy = model.policy()  # pipeline, digest and weights_version read together
    runs: list[_Run] = []
    ended: list[tuple[BatchMember, BaseException]] = []
    first = 0
    for member in members:
        try:
            validate_spec(model, member.spec)
            if member.on_start is not None:
                member.on_start(policy)
            if member.should_stop is not None and member.should_stop():
                raise RolloutCancelled("cancelled before the first step")
        except Exception as refused:
            ended.append((member, refused))
            continue
        seeds = sample_seeds(member.spec)
        runs.append(_Run(member, seeds, first, first + len(seeds), model, policy))
        first += len(seeds)
    for member, error in ended:
        if member.on_end is not None:
            member.on_end(error)
    if runs:
        runs[0].whole = len(runs) == 1
        _call(model, policy, runs, per_sample_model_calls, batch_id or uuid.uuid4().hex)
    outcomes: dict[int, RolloutResult | BaseException] = {id(m): error for m, error in ended}
    for run in runs:
        assert run.outcome is not None
        outcomes[id(run.member)] = run.outcome
    return [outcomes[id(m)] for m in members]


def _call(model: LoadedModel, policy: Policy, runs: list[_Run], per_sample_model_calls: bool, batch_id: str) -> None:
    """The one pipeline call of a batch; ends every member that is still running."""
    pipeline = policy.pipeline
    driver = _Driver(runs, batch_id, pipeline.scheduler, model.family, per_row=per_sample_model_calls)
    scheduler = make_rollout_scheduler(pipeline.scheduler, driver)
    overrides = call_overrides(model, pipeline, per_sample_model_calls)
    if any(r.member.spec.return_conditioning for r in runs):  # captured once, kept by who asked
        driver.recorder = TransformerRecorder(overrides.get("transformer", pipeline.transformer))
        overrides["transformer"] = driver.recorder
    pipe = per_call_pipeline(pipeline, scheduler, overrides)
    specs = [r.member.spec for r in runs]
    try:
        with torch.inference_mode():
            cond = ([branch_conditioning(model, pipe, s) for s in specs] if specs[0].branch_from is not None
                    else None)
            out = pipe(**batch_call_kwargs(model, specs, [r.seeds for r in runs], conditioning=cond))
    except _BatchOver:
        return  # every member has ended
    except Exception as exc:  # the call itself failed: every member still running fails with it
        for run in runs:
            if not run.ended:
                run.close(exc)
        return
    final = out.frames if model.defaults.is_video else out.images  # [B, ...]
    for run in runs:
        if not run.ended:
            run.close(run.result(final if run.whole else final[run.first:run.end]))


def run_rollout(
    model: LoadedModel,
    spec: RolloutSpec,
    *,
    on_schedule: Callable[[ScheduleSnapshot], None] | None = None,
    on_step: Callable[[StepCapture], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    keep: bool = True,
    per_sample_model_calls: bool = False,
) -> RolloutResult:
    """Run one rollout (a batch of one); see the module docstring and docs/pipeline.md for semantics.

    Raises its error (RolloutInputError before anything runs, RolloutCancelled, RolloutNonFinite,
    an error of a callback). Thread-safe: each call builds its own scheduler and pipeline copy."""
    member = BatchMember(spec=spec, on_schedule=on_schedule, on_step=on_step, on_progress=on_progress,
                         should_stop=should_stop, keep=keep)
    (outcome,) = run_batch(model, [member], per_sample_model_calls=per_sample_model_calls)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def parent_metadata(spec: RolloutSpec) -> dict[str, Any] | None:
    """The contract's `sigmaflight.parent` object of a branch rollout, {"rollout", "step",
    "samples"}; None for a rollout from x_0. A separate metadata entry for the data plane."""
    return None if spec.branch_from is None else spec.branch_from.ref()


def rollout_metadata(model: LoadedModel, spec: RolloutSpec, snapshot: ScheduleSnapshot) -> dict[str, Any]:
    """The contract's `sigmaflight.rollout` object (without `id`, which control/ assigns)."""
    request = spec.to_json()
    return {
        "model": {
            "id": model.id,
            "dtype": str(model.dtype).removeprefix("torch."),
            "digest": snapshot.model_digest or model.digest,
            "weights_version": snapshot.model_weights_version,
            **({"components": dict(snapshot.model_components)} if snapshot.model_components else {}),
        },
        "scheduler": {
            "class": snapshot.scheduler_class,
            "config": dict(snapshot.scheduler_config),
            "set_timesteps": dict(snapshot.set_timesteps_kwargs),
        },
        "sampler": request["sampler"],
        "request": request,
        "call": recorded_call(model, spec),
        "seeds": list(snapshot.seeds),
        "num_samples": len(snapshot.seeds),
        "num_outputs_per_prompt": snapshot.num_outputs_per_prompt,
        "latent_dtype": str(snapshot.latent_dtype).removeprefix("torch."),
        "native_dtype": str(snapshot.native_dtype).removeprefix("torch."),
        **({"batch": snapshot.batch.to_json()} if snapshot.batch is not None else {}),
    }
