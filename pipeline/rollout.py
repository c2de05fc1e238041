"""The rollout engine: run a diffusers flow-match pipeline and report its trajectory, a step at a time.

The pipeline's own `__call__` runs (encoding, CFG, latent preparation); a per-call
`RolloutScheduler` hands every step to `_Driver`, which advances it with `stepping.advance` (the
function the replay uses too), scores log p(x_{i+1} | x_i) as `kernels.step_log_prob` does (the
transition's kernel, computed once for the step and the score) and fails a rollout
(`RolloutNonFinite`) at its first non-finite latent or log-prob.

Co-batching: `run_batch` runs several rollouts that share a batch key (pipeline/batch.py) as one
`__call__`, their samples one after another (`calls.batch_call_kwargs`). A rollout is whatever
the caller queues (`Rollout`: a spec and a stop flag); the engine's view of it is `Rows`, its rows
[first, end) of the call and what stays its own (seeds, sde window, captured steps, schedule).
The engine reports to one `Sink` per call, never per member: `schedule` once the schedule is
known, `step` once per step with a `CallStep` (x_i, the velocity, x_T and the log-probs of the
whole call, one host copy each; `CallStep.captures` gives a member its rows as views), `end` per
member as soon as its outcome is known. The transition runs once over the call (one noise tensor
from every row's own seed, one kernel, one log-prob, one finite check; a failing check is then
attributed to the members whose rows fail), or member by member on its rows when the members
differ at that step (sde window) or with per-row model calls (--batch-invariant). Both give a
member's rows the values it gets alone: the kernel and the noise are per row. A member that fails
or is cancelled ends at once while the others run on; `run_rollout` is a batch of one.

Seeds and noise: pipeline/seeds.py; validation and sizes: pipeline/validation.py; the pipeline
call and its metadata: pipeline/calls.py (names re-exported here for the engine's callers).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic

import torch
from sigmaflight.pipeline.batch import batch_key
from sigmaflight.pipeline.calls import (
    batch_call_kwargs,
    call_overrides,
    json_config,
    parent_metadata,
    rollout_metadata,
)
from sigmaflight.pipeline.conditioning import (
    TransformerRecorder,
    branch_conditioning,
    conditioning_from_calls,
)
from sigmaflight.pipeline.kernels import gaussian_log_prob, kernel_mean_std, stochastic_transitions
from sigmaflight.pipeline.models import LoadedModel, Policy, WeightsFailed
from sigmaflight.pipeline.schedules import RolloutScheduler, make_rollout_scheduler, per_call_pipeline
from sigmaflight.pipeline.seeds import derive_seeds, noise_seed, sample_seeds
from sigmaflight.pipeline.sink import (
    BatchMember,
    Callbacks,
    CallStep,
    Failures,
    Quiet,
    R,
    Rollout,
    RolloutResult,
    Rows,
    Sink,
)
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
    loop_latent_bytes,
    requested_sde_steps,
    validate_spec,
)

__all__ = [
    "BatchMember", "CallStep", "Rollout", "RolloutResult", "Rows", "Sink", "derive_seeds", "noise_seed",
    "sample_seeds", "validate_spec", "latent_shape", "estimate_latent_bytes", "loop_latent_bytes", "run_batch", "run_rollout",
    "rollout_metadata", "parent_metadata",
]


class _BatchOver(Exception):
    """Every member of the call has ended: stop the pipeline's loop."""


class _Driver(Generic[R]):
    """The scheduler's step driver for one call: the transition over the call, one report a step."""

    def __init__(self, model: LoadedModel, policy: Policy, members: list[Rows[R]], sink: Sink[R], *,
                 keep: bool, per_row: bool, batch_id: str) -> None:
        self.model, self.policy, self.sink = model, policy, sink
        self.keep, self.per_row, self.batch_id = keep, per_row, batch_id
        self.rows = [r for r in members if not r.ended]
        self.samples = self.rows[-1].end
        self.seeds = tuple(s for r in self.rows for s in r.seeds)
        spec = self.rows[0].spec  # what the call shares (batch_key): steps, sampler, latent dtype, start
        self.T, self.sampler = spec.num_inference_steps, spec.sampler
        self.capture_dtype = capture_dtype(model, spec)
        self.log_probs = torch.full((self.samples, self.T), float("nan"), dtype=torch.float32)  # [B, T]
        self.sigmas: torch.Tensor | None = None
        self.original_scheduler = policy.pipeline.scheduler
        self.recorder: TransformerRecorder | None = None
        self.started = False

    def close(self, rows: Rows[R], outcome: RolloutResult | BaseException) -> None:
        _end(self.sink, rows, outcome)

    def fail(self, failures: Failures[R]) -> None:
        for rows, exc in failures:
            if not rows.ended:
                self.close(rows, exc)

    def running(self) -> list[Rows[R]]:
        return [r for r in self.rows if not r.ended]

    def on_set_timesteps(self, scheduler: RolloutScheduler) -> None:
        self.started = False  # the last schedule wins; reported at the first step
        b = self.rows[0].spec.branch_from  # members share it (batch_key)
        if b is not None:  # the parent's schedule, bit for bit, from step k
            scheduler.start_at(b.step, b.sigmas, b.timesteps, dict(b.set_timesteps_kwargs))

    def _start(self, scheduler: RolloutScheduler, sample: torch.Tensor) -> None:
        self.started = True
        assert scheduler.sigmas_snapshot is not None and scheduler.timesteps_snapshot is not None
        sigmas = self.sigmas = scheduler.sigmas_snapshot
        if sigmas.shape[0] != self.T + 1:
            self.fail([(r, RuntimeError(f"the pipeline ran {sigmas.shape[0] - 1} steps, the request asked for "
                                        f"{self.T}")) for r in self.rows])
            return
        conditioning = None
        if self.recorder is not None:
            conditioning = conditioning_from_calls(self.model.family, self.recorder.stop(), self.samples)
        common: dict[str, Any] = dict(sigmas=sigmas, timesteps=scheduler.timesteps_snapshot,
                      set_timesteps_kwargs=dict(scheduler.set_timesteps_kwargs or {}),
                      scheduler_class=type(self.original_scheduler).__name__,
                      scheduler_config=json_config(self.original_scheduler.config),
                      latent_shape=tuple(sample.shape[1:]), latent_dtype=self.capture_dtype, native_dtype=sample.dtype,
                      model_digest=self.policy.digest, model_weights_version=self.policy.weights_version,
                      model_components=dict(self.policy.components) if self.policy.components else None)
        running = self.running()
        stochastic: dict[frozenset[int], frozenset[int]] = {}  # members mostly share a window: one check each
        for r in running:
            spec = r.spec
            if conditioning is not None:
                r.conditioning = {k: v[r.first:r.end].clone() for k, v in conditioning.items()}
            if r.sde_steps not in stochastic:
                stochastic[r.sde_steps] = stochastic_transitions(r.sde_steps, sigmas, sampler=self.sampler)
            r.sde_steps = stochastic[r.sde_steps]
            batch = BatchInfo(id=self.batch_id, samples=self.samples, rows=(r.first, r.end), requests=len(self.rows),
                              per_sample_model_calls=self.per_row)
            r.snapshot = ScheduleSnapshot(
                **common, sde_steps=tuple(sorted(r.sde_steps)), steps=tuple(sorted(r.steps)), seeds=r.seeds,
                num_outputs_per_prompt=spec.num_outputs_per_prompt, start_step=spec.start_step,
                prompt_index=spec.prompt_indices(), parent_sample=spec.parent_samples(),
                conditioning=r.conditioning, batch=batch)
            r.metadata = rollout_metadata(self.model, spec, r.snapshot)
        self.fail(self.sink.schedule(running))

    def _transition(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor,
                    seeds: Sequence[int], stochastic: bool, score: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x_{i+1} of these rows (sample, velocity [b, ...]) and, when `score`, their log-probs
        (float32 [b], CPU; None on a deterministic transition)."""
        assert self.sigmas is not None
        kernel = kernel_mean_std(sample, velocity, self.sigmas, i, sampler=self.sampler) if stochastic else None
        x_next = advance(scheduler, i, sample, velocity, self.sigmas, sampler=self.sampler, seeds=seeds,
                         stochastic=stochastic, kernel=kernel)
        if kernel is None or not score:
            return x_next, None
        # Scored as `step_log_prob` (the public replay function) scores the stored values: the
        # kernel of (sample, velocity), then the Gaussian of x_next; the kernel made once.
        return x_next, gaussian_log_prob(x_next, *kernel, self.sampler.log_prob).to("cpu")  # [b]

    def _advance(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor,
                 running: list[Rows[R]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x_{i+1} of the call [B, ...] and its log-probs [B] (None when no member scores i)."""
        scoring = [r for r in running if i in r.sde_steps and r.spec.return_log_probs]
        kinds = {i in r.sde_steps for r in running}
        if not self.per_row and len(kinds) == 1:
            return self._transition(scheduler, i, sample, velocity, self.seeds, kinds.pop(), bool(scoring))
        out, lp = [], torch.full((self.samples,), float("nan")) if scoring else None
        for r in self.rows:  # member by member, as alone
            rs = slice(r.first, r.end)
            if r.ended:
                out.append(torch.zeros_like(sample[rs]))
                continue
            x, own = self._transition(scheduler, i, sample[rs], velocity[rs], r.seeds, i in r.sde_steps, r in scoring)
            out.append(x)
            if own is not None and lp is not None:
                lp[rs] = own
        return out[0] if len(out) == 1 else torch.cat(out, dim=0), lp  # [B, ...]

    def _check(self, i: int, x_next: torch.Tensor, lp: torch.Tensor | None, running: list[Rows[R]]) -> None:
        """Once over the call: non-finite log-probs or x_{i+1}; on failure, each member whose rows fail ends."""
        bad: Failures[R] = []
        if lp is not None and not bool(torch.isfinite(lp).all()):
            bad += [(r, RolloutNonFinite(i, "log_prob")) for r in running if r.spec.return_log_probs
                    and i in r.sde_steps and not bool(torch.isfinite(lp[r.first:r.end]).all())]
        overflowed: list[Rows[R]] = []  # members whose x_{i+1} is not finite as computed
        if not bool(torch.isfinite(x_next).all()):
            overflowed = [r for r in running if not bool(torch.isfinite(x_next[r.first:r.end]).all())]
            bad += [(r, RolloutNonFinite(i + 1, "latent")) for r in overflowed]
        if self.capture_dtype != x_next.dtype:  # the others' x_{i+1} may still not fit the narrower stored dtype
            stored = [r for r in running if i + 1 in r.steps and all(r is not o for o in overflowed)]
            if stored and not bool(torch.isfinite(x_next.to(self.capture_dtype)).all()):
                what = f"latent as {str(self.capture_dtype).removeprefix('torch.')} (return.latent_dtype)"
                bad += [(r, RolloutNonFinite(i + 1, what)) for r in stored
                        if not bool(torch.isfinite(x_next[r.first:r.end].to(self.capture_dtype)).all())]
        self.fail(bad)

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self._start(scheduler, sample)
        running = self.running()
        if not running:
            raise _BatchOver
        x_next, lp = self._advance(scheduler, i, sample, velocity, running)
        self._check(i, x_next, lp, running)
        for r in self.rows:
            if r.ended:  # its rows are zeros from now on (a non-finite row must not reach the model)
                x_next[r.first:r.end] = 0
        if lp is not None:
            self.log_probs[:, i] = lp
        running = self.running()
        report = CallStep(i, self.T, tuple(running), *self._host(i, sample, velocity, x_next, running), log_prob=lp)
        self.fail(self.sink.step(report))
        for r in self.running():
            if self.keep:
                r.captures += report.captures(r, own=True)
            if r.rollout.should_stop() if i + 1 < self.T else r.rollout.last_stop_check():
                self.close(r, RolloutCancelled(f"cancelled after step {i + 1} of {self.T}"))
        if not self.running():
            raise _BatchOver
        return x_next

    def _host(self, i: int, sample: torch.Tensor, velocity: torch.Tensor, x_next: torch.Tensor,
              running: list[Rows[R]]) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The step's host copies (x_i, velocity, x_T), each made once for the whole call and only
        when a running member captures it. Explicit and blocking (`.to("cpu")`); none on a CPU
        model whose capture dtype is its own (then the tensors themselves)."""
        capturing = [r for r in running if i in r.steps]
        latent = sample.to("cpu", self.capture_dtype).contiguous() if capturing else None  # [B, ...]
        v = None
        if any(r.spec.return_velocities for r in capturing):
            v = velocity.to("cpu", torch.float32).contiguous()  # [B, ...]
        last = i == self.T - 1 and any(self.T in r.steps for r in running)
        next_latent = x_next.to("cpu", self.capture_dtype).contiguous() if last else None  # [B, ...]
        return latent, v, next_latent

    def result(self, rows: Rows[R], final: torch.Tensor) -> RolloutResult:
        assert rows.snapshot is not None
        requested = rows.spec.return_log_probs
        return RolloutResult(
            snapshot=rows.snapshot, captures=tuple(rows.captures), seeds=rows.seeds,
            log_probs=rows.own(self.log_probs) if requested else torch.full((len(rows.seeds), self.T), float("nan")),
            final_latents=final if rows.end - rows.first == final.shape[0] else final[rows.first:rows.end],
            digest=self.policy.digest, conditioning=rows.conditioning, prompt_index=rows.snapshot.prompt_index,
            parent_sample=rows.snapshot.parent_sample)


def run_batch(
    model: LoadedModel,
    rollouts: Sequence[R],
    sink: Sink[R] | None = None,
    *,
    keep: bool = True,
    per_sample_model_calls: bool = False,
    batch_id: str | None = None,
) -> list[RolloutResult | BaseException]:
    """Run `rollouts` (sharing one `batch_key`) as one pipeline call, reporting to `sink`; each
    one's result or error, in order (each also given to `sink.end` as soon as it is known).
    `keep`: keep each rollout's captures in its result (False: only the sink sees them).

    A rollout that is invalid, refused by `sink.start` or stopped before the first step ends at
    once and takes no rows. Thread-safe: each call builds its own scheduler and pipeline copy over
    the shared modules; the weights (`model.policy()`) are read once, so a push during the call
    leaves every rollout on the weights it started with."""
    if not rollouts:
        return []
    if len({batch_key(model, r.spec) for r in rollouts}) != 1:
        raise ValueError("co-batched rollouts must share one batch_key (pipeline/batch.py)")
    out: Sink[R] = sink if sink is not None else Quiet()
    members = [Rows(rollout=r) for r in rollouts]

    def end_cancelled() -> bool:
        """Asked while an in-place weights push holds the call: a member cancelled meanwhile ends
        at once, the others wait on; True (the wait given up) once every member has ended."""
        for rows in members:
            if not rows.ended and rows.rollout.should_stop():
                _end(out, rows, RolloutCancelled("cancelled while an in-place weights push held the model"))
        return all(r.ended for r in members)

    try:
        with model.in_use(end_cancelled):  # an in-place weights push holds this call; a failed one refuses it
            _run_batch(model, members, out, keep, per_sample_model_calls, batch_id or uuid.uuid4().hex)
    except (WeightsFailed, RolloutCancelled) as closed:
        end_cancelled()  # a member cancelled meanwhile ends cancelled, not on the push's failure
        for rows in members:
            if not rows.ended:
                _end(out, rows, closed)
    return [r.outcome if r.outcome is not None else RuntimeError("the rollout never ended") for r in members]


def _end(sink: Sink[R], rows: Rows[R], outcome: RolloutResult | BaseException) -> None:
    """The one way a member ends: its outcome set, then its sink told at once."""
    rows.outcome = outcome
    sink.end(rows, outcome)


def _run_batch(model: LoadedModel, members: list[Rows[R]], sink: Sink[R], keep: bool, per_row: bool,
               batch_id: str) -> None:
    policy = model.policy()  # pipeline, digest and weights_version read together
    first, refused = 0, []
    for rows in members:
        if rows.ended:  # cancelled while a weights push held the call
            continue
        try:
            validate_spec(model, rows.spec)
            sink.start(rows.rollout, policy)
            if rows.rollout.should_stop():
                raise RolloutCancelled("cancelled before the first step")
        except Exception as exc:
            refused.append((rows, exc))
            continue
        spec = rows.spec
        rows.seeds = sample_seeds(spec)
        rows.first, rows.end, first = first, first + len(rows.seeds), first + len(rows.seeds)
        rows.steps = frozenset(captured_steps(spec)) if spec.capture else frozenset()
        rows.sde_steps = frozenset(requested_sde_steps(spec))
    for rows, error in refused:
        _end(sink, rows, error)
    if all(r.ended for r in members):
        return
    driver = _Driver(model, policy, members, sink, keep=keep, per_row=per_row, batch_id=batch_id)
    _call(model, policy, driver)


def _call(model: LoadedModel, policy: Policy, driver: _Driver[R]) -> None:
    """The one pipeline call of a batch; ends every member that is still running."""
    pipeline = policy.pipeline
    scheduler = make_rollout_scheduler(pipeline.scheduler, driver)
    first, d = driver.rows[0].spec, model.defaults  # members share their size (batch_key)
    scheduler.size = (first.height or d.height, first.width or d.width)
    overrides = call_overrides(model, pipeline, driver.per_row)
    if any(r.spec.return_conditioning for r in driver.rows):  # captured once, kept by who asked
        driver.recorder = TransformerRecorder(overrides.get("transformer", pipeline.transformer))
        overrides["transformer"] = driver.recorder
    pipe = per_call_pipeline(pipeline, scheduler, overrides)
    specs = [r.spec for r in driver.rows]
    try:
        with torch.inference_mode():
            cond = ([branch_conditioning(model, pipe, s) for s in specs] if specs[0].branch_from is not None
                    else None)
            out = pipe(**batch_call_kwargs(model, specs, [r.seeds for r in driver.rows], conditioning=cond))
    except _BatchOver:
        return  # every member has ended
    except Exception as exc:  # the call itself failed: every member still running fails with it
        driver.fail([(r, exc) for r in driver.running()])
        return
    final = out.frames if model.defaults.is_video else out.images  # [B, ...]
    for rows in driver.running():
        driver.close(rows, driver.result(rows, final))


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
    A callback that raises ends the rollout with its error.

    Raises its error (RolloutInputError before anything runs, RolloutCancelled, RolloutNonFinite,
    an error of a callback). Thread-safe: each call builds its own scheduler and pipeline copy."""
    (outcome,) = run_batch(model, [BatchMember(spec, should_stop)], Callbacks(on_schedule, on_step, on_progress),
                           keep=keep, per_sample_model_calls=per_sample_model_calls)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
