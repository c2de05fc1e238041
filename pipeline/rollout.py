"""The rollout loop: run a diffusers flow-match pipeline and capture its trajectory.

The pipeline's own `__call__` runs (encoding, CFG, latent preparation); a per-call
`RolloutScheduler` hands every step to `_Driver`, which applies the kernel, captures x_i
and scores log p(x_{i+1} | x_i) with `kernels.step_log_prob`.

Seeds: `derive_seeds(seed, n)[k]` = first 8 bytes (big-endian) of
sha256(b"sigmaflight/sample/<seed>/<k>") masked to 63 bits. Initial latents: the pipeline
gets one CPU `torch.Generator` per sample seeded with that sample's seed (diffusers draws
each sample separately). SDE noise of sample k at transition i: float32, drawn on CPU from a
generator seeded with `noise_seed(seed_k, i)` (same construction with b"sigmaflight/noise/"),
so it depends on neither the batch nor on which other transitions are stochastic.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.kernels import kernel_mean_std, step_log_prob, stochastic_transitions
from pipeline.models import LoadedModel, max_image_size
from pipeline.schedules import RolloutScheduler, make_rollout_scheduler, per_call_pipeline
from pipeline.spec import (
    RolloutCancelled,
    RolloutInputError,
    RolloutSpec,
    ScheduleSnapshot,
    StepCapture,
)

__all__ = [
    "RolloutResult",
    "derive_seeds",
    "noise_seed",
    "sample_seeds",
    "validate_spec",
    "latent_shape",
    "estimate_latent_bytes",
    "run_rollout",
    "rollout_metadata",
]

_SEED_MASK = (1 << 63) - 1
_LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Batch arguments of each family's transformer call (sliced row by row with per_sample_model_calls).
_TRANSFORMER_BATCH_ARGS: dict[str, tuple[str, ...]] = {
    "sd3": ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections"),
    "flux": ("hidden_states", "timestep", "guidance", "pooled_projections", "encoder_hidden_states"),
    "wan": ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
}
# Text encoders of each family; all are called as encoder(input_ids, ...) with batch-first positional tensors.
_TEXT_ENCODERS: dict[str, tuple[str, ...]] = {
    "sd3": ("text_encoder", "text_encoder_2", "text_encoder_3"),
    "flux": ("text_encoder", "text_encoder_2"),
    "wan": ("text_encoder",),
}


def _hash63(tag: str, *parts: int) -> int:
    digest = hashlib.sha256(("sigmaflight/" + tag + "/" + "/".join(str(p) for p in parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


def derive_seeds(seed: int, n: int) -> tuple[int, ...]:
    """Per-sample seeds from one request seed: sha256(b"sigmaflight/sample/<seed>/<k>")[:8] & (2**63-1)."""
    return tuple(_hash63("sample", seed, k) for k in range(n))


def noise_seed(sample_seed: int, transition: int) -> int:
    """Seed of the CPU generator that draws sample `sample_seed`'s noise at transition i."""
    return _hash63("noise", sample_seed, transition)


def sample_seeds(spec: RolloutSpec) -> tuple[int, ...]:
    """`spec.seeds` if given, else `derive_seeds(spec.seed or 0, B)`."""
    if spec.seeds is not None:
        return tuple(int(s) for s in spec.seeds)
    return derive_seeds(0 if spec.seed is None else int(spec.seed), spec.num_samples)


# --------------------------------------------------------------------------- validation


def _steps_of(spec: RolloutSpec) -> tuple[int, ...]:
    t = spec.num_inference_steps
    return tuple(range(t + 1)) if spec.return_steps is None else tuple(spec.return_steps)


def _sde_steps_of(spec: RolloutSpec) -> tuple[int, ...]:
    if spec.sampler.type == "ode":
        return ()
    t = spec.num_inference_steps
    return tuple(range(t)) if spec.sampler.sde_steps is None else tuple(sorted(spec.sampler.sde_steps))


def _indices_ok(values: Sequence[int], hi: int) -> str | None:
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        return "must be integers"
    if any(v < 0 or v > hi for v in values):
        return f"each must be in 0..{hi}"
    if len(set(values)) != len(values):
        return "each index at most once"
    return None


def validate_spec(model: LoadedModel, spec: RolloutSpec) -> None:
    """Raise RolloutInputError naming the first bad field; None when the request can run.

    `return_steps` must be ascending and unique (the stream holds them ascending);
    `sampler.sde_steps` must be unique, any order.
    """
    d = model.defaults
    if not spec.prompts:
        raise RolloutInputError("prompts", "at least one prompt is required")
    if not all(isinstance(p, str) for p in spec.prompts):
        raise RolloutInputError("prompts", "prompts must be strings")
    if spec.num_outputs_per_prompt < 1:
        raise RolloutInputError("num_outputs_per_prompt", "must be >= 1")
    t = spec.num_inference_steps
    if not isinstance(t, int) or t < 1:
        raise RolloutInputError("num_inference_steps", "must be an integer >= 1")
    s = spec.sampler
    if s.type not in ("sde", "cps", "ode"):
        raise RolloutInputError("sampler.type", f"unknown kernel {s.type!r}; use 'sde', 'cps' or 'ode'")
    if not isinstance(s.noise_level, (int, float)) or not math.isfinite(s.noise_level) or s.noise_level < 0:
        raise RolloutInputError("sampler.noise_level", "must be a finite number >= 0")
    if s.log_prob not in ("density", "no_const"):
        raise RolloutInputError("sampler.log_prob", f"unknown log_prob {s.log_prob!r}; use 'density' or 'no_const'")
    if s.sde_steps is not None:
        why = _indices_ok(s.sde_steps, t - 1)
        if why:
            raise RolloutInputError("sampler.sde_steps", f"{why} (absolute transition indices, T={t})")
    if spec.return_steps is not None:
        why = _indices_ok(spec.return_steps, t)
        if why:
            raise RolloutInputError("return.steps", f"{why} (absolute latent indices, T={t})")
        if list(spec.return_steps) != sorted(spec.return_steps):
            raise RolloutInputError("return.steps", "must be ascending")
    if spec.latent_dtype not in ("native", *_LATENT_DTYPES):
        raise RolloutInputError("latent_dtype", f"unknown latent dtype {spec.latent_dtype!r}")
    for name in ("height", "width"):
        value = getattr(spec, name)
        if value is None:
            continue
        if not isinstance(value, int) or value <= 0 or value % d.size_multiple:
            raise RolloutInputError(name, f"must be a positive multiple of {d.size_multiple} for {model.id}")
        limit = max_image_size(model.pipeline)
        if limit is not None and value > limit:
            raise RolloutInputError(name, f"{value} exceeds {limit}, the largest size {model.id}'s position embedding covers")
    if spec.num_frames is not None:
        if not d.is_video:
            raise RolloutInputError("num_frames", f"{model.id} is an image model")
        if spec.num_frames < 1 or (spec.num_frames - 1) % 4:
            raise RolloutInputError("num_frames", "must be 4k + 1")
    if spec.guidance_scale is not None and (
        not isinstance(spec.guidance_scale, (int, float)) or not math.isfinite(spec.guidance_scale)
    ):
        raise RolloutInputError("guidance_scale", "must be a finite number")
    if spec.seeds is not None:
        if len(spec.seeds) != spec.num_samples:
            raise RolloutInputError("seeds", f"need exactly one seed per sample ({spec.num_samples}), got {len(spec.seeds)}")
        if any(not isinstance(x, int) or x < 0 or x > _SEED_MASK for x in spec.seeds):
            raise RolloutInputError("seeds", "each seed must be an integer in 0..2**63-1")
    if spec.seed is not None and not isinstance(spec.seed, int):
        raise RolloutInputError("seed", "must be an integer")


def latent_shape(model: LoadedModel, spec: RolloutSpec) -> tuple[int, ...]:
    """Per-sample latent shape as the model consumes it, computed from the request."""
    pipe = model.pipeline
    d = model.defaults
    h = spec.height or d.height
    w = spec.width or d.width
    vae = int(getattr(pipe, "vae_scale_factor", 8))
    cin = int(pipe.transformer.config.in_channels)
    if model.family == "flux":
        lh, lw = 2 * (h // (vae * 2)), 2 * (w // (vae * 2))
        return ((lh // 2) * (lw // 2), cin)
    if model.family == "wan":
        frames = spec.num_frames or d.num_frames or 1
        sv = int(getattr(pipe, "vae_scale_factor_spatial", 8))
        st = int(getattr(pipe, "vae_scale_factor_temporal", 4))
        return (cin, (frames - 1) // st + 1, h // sv, w // sv)
    return (cin, h // vae, w // vae)


def _capture_dtype(model: LoadedModel, spec: RolloutSpec) -> torch.dtype:
    return model.dtype if spec.latent_dtype == "native" else _LATENT_DTYPES[spec.latent_dtype]


def estimate_latent_bytes(model: LoadedModel, spec: RolloutSpec) -> int:
    """Bytes of the captured latents (all requested steps, all samples), before running."""
    if not spec.capture:
        return 0
    per = math.prod(latent_shape(model, spec)) * _capture_dtype(model, spec).itemsize
    return len(_steps_of(spec)) * spec.num_samples * per


# --------------------------------------------------------------------------- per-row model calls


def _cat_outputs(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=0)
    if isinstance(first, tuple) and not hasattr(first, "keys"):
        return tuple(_cat_outputs([o[j] for o in outs]) for j in range(len(first)))
    if hasattr(first, "keys"):  # transformers / diffusers ModelOutput
        return type(first)(**{k: _cat_outputs([o[k] for o in outs]) for k in first.keys()})
    if first is None:
        return None
    raise TypeError(f"cannot concatenate outputs of type {type(first).__name__}")


class _PerRow:
    """Calls a module one batch row at a time (named batch arguments only) and concatenates."""

    def __init__(self, module: torch.nn.Module, batch_args: tuple[str, ...], positional_batch: bool) -> None:
        self._module = module
        self._batch_args = batch_args
        self._positional_batch = positional_batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._positional_batch:
            n = args[0].shape[0]
        else:
            n = kwargs["hidden_states"].shape[0]
        outs = []
        for r in range(n):
            # Text encoders: every positional tensor is batch-first (Wan passes the mask positionally:
            # text_encoder(input_ids, mask)).
            a = tuple(x[r : r + 1] if self._positional_batch and isinstance(x, torch.Tensor) else x for x in args)
            kw = {
                k: (v[r : r + 1] if k in self._batch_args and isinstance(v, torch.Tensor) else v)
                for k, v in kwargs.items()
            }
            outs.append(self._module(*a, **kw))
        return _cat_outputs(outs)


class _Locked:
    """A tokenizer whose calls hold the model's tokenizer lock (shared across worker threads)."""

    def __init__(self, tokenizer: Any, lock: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tokenizer, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return locked

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)


def _call_overrides(model: LoadedModel, pipeline: Any, per_sample_model_calls: bool) -> dict[str, Any]:
    out = {
        name: _Locked(comp, model.tokenizer_lock)
        for name, comp in pipeline.components.items()
        if name.startswith("tokenizer") and comp is not None
    }
    if per_sample_model_calls:
        out.update(_per_row_overrides(model, pipeline))
    return out


def _per_row_overrides(model: LoadedModel, pipeline: Any) -> dict[str, Any]:
    if model.family not in _TRANSFORMER_BATCH_ARGS:
        raise RolloutInputError("model", f"per-sample model calls are not available for family {model.family!r}")
    out: dict[str, Any] = {"transformer": _PerRow(pipeline.transformer, _TRANSFORMER_BATCH_ARGS[model.family], False)}
    for name in _TEXT_ENCODERS[model.family]:
        enc = getattr(pipeline, name, None)
        if enc is not None:
            out[name] = _PerRow(enc, ("attention_mask",), True)
    return out


# --------------------------------------------------------------------------- the loop


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


def _call_kwargs(model: LoadedModel, spec: RolloutSpec, seeds: Sequence[int]) -> dict[str, Any]:
    d = model.defaults
    kw: dict[str, Any] = {
        "prompt": list(spec.prompts),
        "num_inference_steps": spec.num_inference_steps,
        "height": spec.height or d.height,
        "width": spec.width or d.width,
        "guidance_scale": d.guidance_scale if spec.guidance_scale is None else float(spec.guidance_scale),
        "generator": [torch.Generator("cpu").manual_seed(int(s)) for s in seeds],
        "output_type": "latent",
        **d.call_kwargs,
    }
    kw["num_videos_per_prompt" if d.is_video else "num_images_per_prompt"] = spec.num_outputs_per_prompt
    if d.is_video:
        kw["num_frames"] = spec.num_frames or d.num_frames
    if spec.negative_prompt is not None:
        kw["negative_prompt"] = spec.negative_prompt
    return kw


def _draw_noise(seeds: Sequence[int], transition: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [B, *shape] on CPU, one generator per (sample seed, transition)."""
    out = torch.empty((len(seeds), *shape), dtype=torch.float32)
    for k, s in enumerate(seeds):
        g = torch.Generator("cpu").manual_seed(noise_seed(s, transition))
        out[k] = torch.randn(shape, generator=g, dtype=torch.float32)
    return out


class _Driver:
    """Applies the kernel at every step, captures x_i and scores log-probs."""

    def __init__(
        self,
        model: LoadedModel,
        spec: RolloutSpec,
        seeds: tuple[int, ...],
        digest: str,
        *,
        on_schedule: Callable[[ScheduleSnapshot], None] | None,
        on_step: Callable[[StepCapture], None] | None,
        on_progress: Callable[[int, int], None] | None,
        should_stop: Callable[[], bool] | None,
        keep: bool,
        original_scheduler: Any,
    ) -> None:
        self.model = model
        self.spec = spec
        self.sampler = spec.sampler
        self.seeds = seeds
        self.digest = digest
        self.T = spec.num_inference_steps
        self.steps = frozenset(_steps_of(spec)) if spec.capture else frozenset()
        self.sde_steps = frozenset(_sde_steps_of(spec))
        self.on_schedule = on_schedule
        self.on_step = on_step
        self.on_progress = on_progress
        self.should_stop = should_stop
        self.keep = keep
        self.original_scheduler = original_scheduler
        self.capture_dtype = _capture_dtype(model, spec)
        self.captures: list[StepCapture] = []
        self.log_probs = torch.full((len(seeds), self.T), float("nan"), dtype=torch.float32)
        self.snapshot: ScheduleSnapshot | None = None
        self.sigmas: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None  # captured x_i awaiting its log-prob

    def on_set_timesteps(self, scheduler: RolloutScheduler) -> None:
        self.snapshot = None  # the last schedule wins; reported at the first step

    def _report_schedule(self, scheduler: RolloutScheduler, sample: torch.Tensor) -> None:
        assert scheduler.sigmas_snapshot is not None and scheduler.timesteps_snapshot is not None
        sigmas = scheduler.sigmas_snapshot
        if sigmas.shape[0] != self.T + 1:
            raise RuntimeError(f"the pipeline ran {sigmas.shape[0] - 1} steps, the request asked for {self.T}")
        self.sigmas = sigmas
        self.sde_steps = stochastic_transitions(self.sde_steps, sigmas, sampler=self.sampler)
        self.snapshot = ScheduleSnapshot(
            sigmas=sigmas,
            timesteps=scheduler.timesteps_snapshot,
            set_timesteps_kwargs=dict(scheduler.set_timesteps_kwargs or {}),
            scheduler_class=type(self.original_scheduler).__name__,
            scheduler_config=_json_config(self.original_scheduler.config),
            sde_steps=tuple(sorted(self.sde_steps)),
            steps=tuple(sorted(self.steps)),
            seeds=self.seeds,
            num_outputs_per_prompt=self.spec.num_outputs_per_prompt,
            latent_shape=tuple(sample.shape[1:]),
            latent_dtype=self.capture_dtype,
            native_dtype=sample.dtype,
            model_digest=self.digest,
        )
        if self.on_schedule is not None:
            self.on_schedule(self.snapshot)

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """x on CPU in the capture dtype: a reference on CPU/native, one copy otherwise."""
        return x.to("cpu", self.capture_dtype).contiguous()

    def _emit(self, step: int, latent: torch.Tensor, log_prob: torch.Tensor | None) -> None:
        cap = StepCapture(step=step, latent=latent, log_prob=log_prob)
        if self.keep:
            self.captures.append(cap)
        if self.on_step is not None:
            self.on_step(cap)

    def step(self, scheduler: RolloutScheduler, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        if i == 0 or self.snapshot is None:
            self._report_schedule(scheduler, sample)
        assert self.sigmas is not None
        stored_i = self._store(sample) if i in self.steps else None  # [B, ...]
        if i in self.sde_steps:
            mean, std = kernel_mean_std(sample, velocity, self.sigmas, i, sampler=self.sampler)
            eps = _draw_noise(self.seeds, i, tuple(sample.shape[1:])).to(mean.device)  # [B, ...] float32
            x_next = (mean + std * eps).to(velocity.dtype)  # cast back to the model dtype, as the scheduler
        else:
            x_next = scheduler.euler_step(i, sample, velocity)
        lp: torch.Tensor | None = None
        if i in self.sde_steps and self.spec.return_log_probs:
            # Score the stored values with the public replay function (same code path as replay).
            lp = step_log_prob(sample, x_next, velocity, self.sigmas, i, sampler=self.sampler).to("cpu")
            self.log_probs[:, i] = lp
        if stored_i is not None:
            self._emit(i, stored_i, lp)
        if i == self.T - 1 and self.T in self.steps:
            self._emit(self.T, self._store(x_next), None)
        if self.on_progress is not None:
            self.on_progress(i + 1, self.T)
        if i + 1 < self.T and self.should_stop is not None and self.should_stop():
            raise RolloutCancelled(f"cancelled after step {i + 1} of {self.T}")
        return x_next


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
    """Run one rollout; see the module docstring and docs/pipeline.md for semantics.

    Thread-safe: each call builds its own scheduler and pipeline copy over the shared modules.
    """
    validate_spec(model, spec)
    seeds = sample_seeds(spec)
    pipeline, digest = model.snapshot()
    if should_stop is not None and should_stop():
        raise RolloutCancelled("cancelled before the first step")
    driver = _Driver(
        model,
        spec,
        seeds,
        digest,
        on_schedule=on_schedule,
        on_step=on_step,
        on_progress=on_progress,
        should_stop=should_stop,
        keep=keep,
        original_scheduler=pipeline.scheduler,
    )
    scheduler = make_rollout_scheduler(pipeline.scheduler, driver)
    overrides = _call_overrides(model, pipeline, per_sample_model_calls)
    pipe = per_call_pipeline(pipeline, scheduler, overrides)
    with torch.inference_mode():
        out = pipe(**_call_kwargs(model, spec, seeds))
    final = out.frames if model.defaults.is_video else out.images
    assert driver.snapshot is not None
    return RolloutResult(
        snapshot=driver.snapshot,
        captures=tuple(driver.captures),
        log_probs=driver.log_probs,
        seeds=seeds,
        final_latents=final,
        digest=digest,
    )


def rollout_metadata(model: LoadedModel, spec: RolloutSpec, snapshot: ScheduleSnapshot) -> dict[str, Any]:
    """The contract's `sigmaflight.rollout` object (without `id`, which control/ assigns)."""
    request = asdict(spec)
    request["sampler"] = asdict(spec.sampler)
    for key in ("prompts", "seeds", "return_steps"):
        if request[key] is not None:
            request[key] = list(request[key])
    if request["sampler"]["sde_steps"] is not None:
        request["sampler"]["sde_steps"] = list(request["sampler"]["sde_steps"])
    return {
        "model": {
            "id": model.id,
            "dtype": str(model.dtype).removeprefix("torch."),
            "digest": snapshot.model_digest or model.digest,
        },
        "scheduler": {
            "class": snapshot.scheduler_class,
            "config": dict(snapshot.scheduler_config),
            "set_timesteps": dict(snapshot.set_timesteps_kwargs),
        },
        "sampler": request["sampler"],
        "request": request,
        "seeds": list(snapshot.seeds),
        "num_samples": len(snapshot.seeds),
        "num_outputs_per_prompt": snapshot.num_outputs_per_prompt,
        "latent_dtype": str(snapshot.latent_dtype).removeprefix("torch."),
        "native_dtype": str(snapshot.native_dtype).removeprefix("torch."),
    }
