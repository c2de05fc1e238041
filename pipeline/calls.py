"""How sigmaflight calls the stock diffusers pipeline: its `__call__` arguments, the
per-call attribute overrides (tokenizer locks; per-row model calls), and the record of the
call a rollout made (`rollout_metadata`, the contract's `sigmaflight.rollout` object).

`call_kwargs` is also what a benchmark or a test passes to the stock pipeline to compare
a rollout with a plain `__call__`. The per-row calls take each family's batch arguments and
text encoders from `sigmaflight.pipeline.families`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from sigmaflight.pipeline.conditioning import conditioning_call_kwargs
from sigmaflight.pipeline.families import family_named
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.seeds import sample_generators
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec, ScheduleSnapshot

__all__ = ["batch_call_kwargs", "call_kwargs", "call_overrides", "parent_metadata", "recorded_call",
           "rollout_metadata"]


def call_kwargs(
    model: LoadedModel,
    spec: RolloutSpec,
    seeds: Sequence[int],
    *,
    conditioning: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of the stock pipeline `__call__` for `spec` (`output_type="latent"`).

    x_0 is drawn by the pipeline from one CPU generator per sample seed. A branch
    (`spec.branch_from`) passes `latents=` its parent rows' x_k, each repeated
    num_outputs_per_prompt times, and one prompt per parent row (the pipeline repeats it,
    parent-major; `run_rollout` and the replay pass a branch its `branch_conditioning` instead,
    which is bit-exact). `conditioning` (B rows, `sigmaflight.pipeline.conditioning` names) replaces the
    prompts: one output per row, no text encoder.
    """
    d = model.defaults
    n = spec.num_outputs_per_prompt
    kw: dict[str, Any] = {
        "num_inference_steps": spec.num_inference_steps,
        "height": spec.height or d.height,
        "width": spec.width or d.width,
        "guidance_scale": d.guidance_scale if spec.guidance_scale is None else float(spec.guidance_scale),
        "generator": sample_generators(seeds),
        "output_type": "latent",
        **d.call_kwargs,
    }
    per_prompt = "num_videos_per_prompt" if d.is_video else "num_images_per_prompt"
    branch = spec.branch_from
    if conditioning is not None:
        kw.update(conditioning_call_kwargs(conditioning, model.device))
        kw[per_prompt] = 1
    else:
        kw["prompt"] = list(spec.prompts) if branch is None else [spec.prompts[j] for j in branch.prompt_index]
        kw[per_prompt] = n
        if spec.negative_prompt is not None:
            kw["negative_prompt"] = spec.negative_prompt
    if d.is_video:
        kw["num_frames"] = spec.num_frames or d.num_frames
    if branch is not None:
        kw["latents"] = branch.latents.repeat_interleave(n, dim=0).to(model.device)  # [B, ...] parent-major
    return kw


def recorded_call(model: LoadedModel, spec: RolloutSpec) -> dict[str, Any]:
    """The `__call__` keywords of a rollout that the request does not give and that change its
    result, as the server resolved them: height, width, guidance_scale, num_frames (video), and
    the model's fixed ones (`ModelDefaults.call_kwargs`, e.g. a built-in's short
    max_sequence_length). Recorded as the trajectory's `call`, so a stock pipeline replays a
    rollout with the request and these alone (JSON values)."""
    d = model.defaults
    out: dict[str, Any] = {
        "height": spec.height or d.height,
        "width": spec.width or d.width,
        "guidance_scale": d.guidance_scale if spec.guidance_scale is None else float(spec.guidance_scale),
    }
    if d.is_video:
        out["num_frames"] = spec.num_frames or d.num_frames
    out.update(d.call_kwargs)
    return out


def _row_prompts(spec: RolloutSpec) -> list[str]:
    """One prompt per sample: each prompt (a branch: each parent row's) num_outputs_per_prompt times."""
    n = spec.num_outputs_per_prompt
    rows = spec.prompts if spec.branch_from is None else [spec.prompts[j] for j in spec.branch_from.prompt_index]
    return [p for p in rows for _ in range(n)]


def batch_call_kwargs(
    model: LoadedModel,
    specs: Sequence[RolloutSpec],
    seeds: Sequence[Sequence[int]],
    *,
    conditioning: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """One `__call__` for several specs that share a batch key (pipeline/batch.py): their samples
    one after another, in order, each exactly as its own `call_kwargs` lays it out.

    One spec gives `call_kwargs` itself. Several: one generator per sample (each row of x_0 is
    drawn from its own seed, as alone); prompts concatenated with their num_outputs_per_prompt when
    all specs share it, else one prompt per sample (a count of 1); negative prompts as one string
    when all are the same, else one per prompt ("" for a spec without, as the pipeline itself
    takes None); branches' x_k rows concatenated; `conditioning` (one mapping of B_m rows per spec)
    concatenated row-wise instead of prompts."""
    if len(specs) == 1:
        return call_kwargs(model, specs[0], seeds[0], conditioning=None if conditioning is None else conditioning[0])
    first = specs[0]
    cond: dict[str, torch.Tensor] | None = None
    if conditioning is not None:
        names = set(conditioning[0])
        if any(set(c) != names for c in conditioning):
            raise ValueError("co-batched conditioning must name the same tensors for every member")
        cond = {k: torch.cat([c[k] for c in conditioning], dim=0) for k in conditioning[0]}
    kw = call_kwargs(model, first, [int(s) for member in seeds for s in member], conditioning=cond)
    per_prompt = "num_videos_per_prompt" if model.defaults.is_video else "num_images_per_prompt"
    if cond is None:
        counts = {s.num_outputs_per_prompt for s in specs}
        if len(counts) == 1:
            groups = [list(s.prompts) if s.branch_from is None else [s.prompts[j] for j in s.branch_from.prompt_index]
                      for s in specs]
            kw[per_prompt] = counts.pop()
        else:
            groups = [_row_prompts(s) for s in specs]
            kw[per_prompt] = 1
        kw["prompt"] = [p for g in groups for p in g]
        negatives = {s.negative_prompt for s in specs}
        kw.pop("negative_prompt", None)
        if len(negatives) == 1:
            (negative,) = negatives
            if negative is not None:
                kw["negative_prompt"] = negative
        else:
            kw["negative_prompt"] = [s.negative_prompt or "" for s, g in zip(specs, groups, strict=True) for _ in g]
    if first.branch_from is not None:
        kw["latents"] = torch.cat([s.branch_from.latents.repeat_interleave(s.num_outputs_per_prompt, dim=0)
                                   for s in specs if s.branch_from is not None]).to(model.device)
    return kw


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


def call_overrides(model: LoadedModel, pipeline: Any, per_sample_model_calls: bool) -> dict[str, Any]:
    """Pipeline attributes replaced for one call: tokenizers behind the model's lock, and with
    `per_sample_model_calls` the transformer and text encoders called one batch row at a time."""
    out = {
        name: _Locked(comp, model.tokenizer_lock)
        for name, comp in pipeline.components.items()
        if name.startswith("tokenizer") and comp is not None
    }
    if per_sample_model_calls:
        out.update(_per_row_overrides(model, pipeline))
    return out


def _per_row_overrides(model: LoadedModel, pipeline: Any) -> dict[str, Any]:
    family = family_named(model.family)
    if not family.transformer_batch_args:
        raise RolloutInputError("model", f"per-sample model calls are not available for family {model.family!r}")
    out: dict[str, Any] = {"transformer": _PerRow(pipeline.transformer, family.transformer_batch_args, False)}
    for name in family.text_encoders:
        enc = getattr(pipeline, name, None)
        if enc is not None:
            out[name] = _PerRow(enc, ("attention_mask",), True)
    return out


def json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A scheduler config as JSON values, the same in every process."""
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
