"""Replay a pulled trajectory with the trainer's own model: `replay_log_probs` and `rollout_spec`.

The trainer's side of `sigmaflight.pipeline.replay.Replayer` (the engine's replay): it takes a
stock diffusers pipeline as the trainer loaded it (or its transformer and scheduler), calls it
as the server did from the trajectory's recorded `request` and `call`, and checks that its
weights are the ones the rollout ran on.

    from sigmaflight import replay_log_probs
    logp = replay_log_probs(pipe, traj, grad=True, strict=True)   # [B, T], the rollout's own bit for bit
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sigmaflight.errors import WeightsMismatch

if TYPE_CHECKING:  # torch and diffusers load on first use
    import torch

    from sigmaflight.dataplane.client import Trajectory
    from sigmaflight.pipeline.spec import RolloutSpec

__all__ = ["replay_log_probs", "rollout_spec"]


def rollout_spec(traj: Trajectory, *, parent: Trajectory | None = None) -> RolloutSpec:
    """The RolloutSpec the server ran, from the trajectory's `sigmaflight.rollout.request`
    (`RolloutSpec.from_json`); for a branch rollout with `branch_from` rebuilt from the trajectory
    (its x_k, schedule, prompt indices).

    A branch starts from its parent's x_k: taken from the branch's own stream when its
    `return.steps` kept step k, else from `parent`, the parent rollout's pulled trajectory
    (`client.pull(parent_id)`, whose rows `branch_from.samples` at step k the server started the
    branch from). Neither: ValueError naming both ways."""
    from sigmaflight.pipeline.spec import BranchStart, RolloutSpec

    req = traj.metadata["request"]
    branch_from = req.get("branch_from")
    if branch_from is None:
        return RolloutSpec.from_json(req)
    # A branch rollout: it replays from its own x_k (the parent's, repeated per branch) on the
    # recorded schedule; one BranchStart row per parent sample.
    n, k = int(req.get("num_outputs_per_prompt", 1)), int(branch_from["step"])
    chosen = branch_from.get("samples")
    if chosen is None and traj.parent_sample is not None:  # None: all of the parent's samples, parent-major
        chosen = traj.parent_sample[::n].tolist()
    samples = tuple(int(j) for j in chosen or ())
    branch = BranchStart(
        step=k,
        latents=_branch_start(traj, k, n, samples, str(branch_from.get("rollout", "")), parent),
        sigmas=traj.sigmas,
        timesteps=traj.timesteps,
        set_timesteps_kwargs=dict((traj.metadata.get("scheduler") or {}).get("set_timesteps") or {}),
        samples=samples,
        prompt_index=tuple(int(p) for p in traj.prompt_index[::n]),
        rollout=str(branch_from.get("rollout", "")),
    )
    return RolloutSpec.from_json(req, branch_from=branch)


def _branch_start(traj: Trajectory, k: int, n: int, samples: tuple[int, ...], parent_id: str,
                  parent: Trajectory | None) -> torch.Tensor:
    """A branch's x_k rows, one per parent sample [P, *latent_shape]: its own stream's, else `parent`'s."""
    if traj.has_step(k):
        return traj.latent(k)[::n].clone()
    where = (f"branch {traj.rollout_id} did not stream its start step {k} (its return.steps: "
             f"{list(traj.header.steps)}), so its x_{k} must come from its parent {parent_id}")
    if parent is None:
        raise ValueError(f"{where}: pass the parent's trajectory as parent= (client.pull({parent_id!r})), or "
                         f"post the branch with {k} among return.steps (branch_from.step)")
    if parent.rollout_id != parent_id:
        raise ValueError(f"{where}, but parent= is rollout {parent.rollout_id}")
    if not parent.has_step(k):
        raise ValueError(f"{where}, but parent= holds no step {k} (its steps: {list(parent.header.steps)}): pull "
                         "the parent's whole trajectory")
    if not parent.sigmas.equal(traj.sigmas):
        raise ValueError(f"{where}, but parent= {parent.rollout_id} has another schedule (sigmas)")
    return parent.latent(k)[list(samples)].clone()


def replay_log_probs(
    pipeline: Any,
    traj: Trajectory,
    *,
    grad: bool = False,
    per_sample_model_calls: bool | None = None,
    strict: bool = False,
    check_weights: bool = True,
    conditioning: Mapping[str, torch.Tensor] | None = None,
    with_means: bool = False,
    scheduler: Any = None,
    parent: Trajectory | None = None,
) -> Any:
    """log p(x_{i+1} | x_i) [B, T] recomputed with `pipeline` on `traj`.

    `pipeline`: the trainer's own stock diffusers pipeline, as it loaded it (`from_pretrained`,
    on its device and dtype; its transformer may be peft-wrapped, `get_peft_model` or
    `add_adapter`), or a `sigmaflight.pipeline.models.LoadedModel`. The pipeline is called as the
    server called it: the request and the call's other keywords (height, width, guidance_scale,
    max_sequence_length, ...) come from the trajectory's metadata (`request`, `call`), so the
    pipeline needs nothing else. With the server's weights this gives the trajectory's own
    `log_probs` bit for bit; with `grad=True` the result carries a graph to the pipeline's
    trainable parameters.

    The trajectory's `model.components` (a weights digest per component) are compared with
    `current_components(model)`, the components `model` holds as they are now (None ones, such as
    text encoders a trainer leaves out, are skipped; a trajectory without `components` is compared
    on its whole `model.digest`): when one differs (the trajectory was made with other weights,
    e.g. before a weights push, or this is an off-policy inner step) it warns `WeightsMismatch`
    naming it, or raises ValueError with `strict=True`. `check_weights=False` skips the check (an
    off-policy step on purpose).

    `conditioning`: the rollout's "conditioning/v1" tensors (`Client.pull_conditioning`): the
    prompts are not encoded, so the pipeline's text encoders may be None.

    Instead of a pipeline, its transformer (peft-wrapped or not) with `scheduler=` its scheduler: the
    family's stock pipeline is built around the two (no VAE, no text encoders), so `conditioning`
    is required. Without a VAE the pipeline takes the usual scale factor 8 (every SD3, FLUX and Wan
    checkpoint); the built-in tiny models' VAEs scale by 2, so tiny-flux replays from its pipeline.

    `with_means=True` returns `(log_probs, means, stds)`: for each scored transition i, the mean
    (float32 [B, *latent_shape], with the graph under `grad=True`) and std (0-d) of the Gaussian
    kernel p(x_{i+1} | x_i), as dicts keyed by i: what a KL term against a reference policy needs
    (`((means[i] - ref_means[i]) ** 2 / (2 * stds[i] ** 2))`, the two kernels sharing the std).

    `per_sample_model_calls`: call the transformer and text encoders one row at a time; None (the
    default): as the rollout's server did (its `batch` metadata; a `--batch-invariant` server runs
    rows one at a time, and a batched replay of such a rollout differs in the last bits).

    `parent`: a branch rollout's parent trajectory (`client.pull(parent_id)`), needed when the branch
    did not stream its start step k (`return.steps` without k): its x_k rows are the branch's start
    (`rollout_spec`). A branch that streamed k, or a rollout from x_0, needs none.

    It runs a diffusers model: diffusers must be installed (the trainer's own, or the `train`
    extra). Scoring transitions from velocities you computed needs only torch: `step_log_prob`."""
    try:
        from sigmaflight.pipeline.replay import Replayer
    except ModuleNotFoundError as exc:
        if exc.name != "diffusers":
            raise
        raise ModuleNotFoundError("replay_log_probs runs a diffusers model and diffusers is not installed: "
                                  "pip install 'sigmaflight[train]' (or your own diffusers)", name=exc.name) from exc

    if scheduler is not None:
        if conditioning is None:
            raise ValueError("conditioning: a transformer and scheduler replay on the rollout's conditioning stream "
                             "(Client.pull_conditioning); pass conditioning=, or pass the whole pipeline")
        pipeline = _pipeline_around(pipeline, scheduler)
    model = _replay_model(pipeline, traj)
    if check_weights:
        _check_weights(model, traj, strict=strict)
    spec = rollout_spec(traj, parent=parent)
    _check_latent_shape(model, spec, traj)
    result = Replayer(model).replay(
        spec,
        latents=traj.latents,
        steps=[int(s) for s in traj.steps],
        sigmas=traj.sigmas,
        timesteps=traj.timesteps,
        seeds=[int(s) for s in traj.seeds],
        per_sample_model_calls=(bool((traj.metadata.get("batch") or {}).get("per_sample_model_calls", False))
                                if per_sample_model_calls is None else per_sample_model_calls),
        grad=grad,
        conditioning=conditioning,
    )
    return (result.log_probs, result.means, result.stds) if with_means else result.log_probs


def _check_latent_shape(model: Any, spec: Any, traj: Trajectory) -> None:
    """ValueError when `model` would make latents of another shape than the trajectory holds for
    its request: a pipeline of another family or configuration, which would fail deep in torch."""
    from sigmaflight.pipeline.validation import latent_shape

    if getattr(model.pipeline, "vae", None) is None:  # sized by a scale factor it cannot know (scheduler=)
        return
    try:
        expected = tuple(latent_shape(model, spec))
    except Exception:  # noqa: BLE001 (a pipeline the check cannot size: the replay says what is wrong)
        return
    held = tuple(traj.latents.shape[2:])
    if held != expected:
        made = (traj.metadata.get("model") or {}).get("id")
        raise ValueError(f"the trajectory's latents are {list(held)} a sample, and this "
                         f"{type(model.pipeline).__name__} ({model.family}) makes {list(expected)} for its request: "
                         f"another model family or configuration than the rollout's ({made!r})")


_RESOLVED = ("height", "width", "guidance_scale", "num_frames")
"""The `call` keys that are ModelDefaults fields; the others are the model's fixed call keywords."""


_PIPELINE_OF = {
    "SD3Transformer2DModel": "StableDiffusion3Pipeline",
    "FluxTransformer2DModel": "FluxPipeline",
    "WanTransformer3DModel": "WanPipeline",
}
"""The stock pipeline class around a transformer class (the families sigmaflight serves)."""


def _pipeline_around(transformer: Any, scheduler: Any) -> Any:
    """The family's stock diffusers pipeline holding `transformer` and `scheduler` and nothing else."""
    import inspect

    import diffusers

    base = transformer.get_base_model() if hasattr(transformer, "get_base_model") else transformer  # a PeftModel
    name = _PIPELINE_OF.get(type(base).__name__)
    if name is None:
        raise TypeError(f"a transformer with scheduler= must be one of {', '.join(sorted(_PIPELINE_OF))}, got "
                        f"{type(base).__name__}; pass the whole pipeline instead")
    cls = getattr(diffusers, name)
    params = inspect.signature(cls.__init__).parameters
    missing = {k: None for k, p in params.items() if k not in ("self", "transformer", "scheduler")
               and p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
    pipe = cls(transformer=transformer, scheduler=scheduler, **missing)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _replay_model(pipeline: Any, traj: Trajectory) -> Any:
    """A LoadedModel as is; a stock diffusers pipeline wrapped in one whose defaults are the
    trajectory's recorded `call` (what the server resolved), so the replay calls it as the server did."""
    import torch

    from sigmaflight.pipeline.families import family_of_pipeline
    from sigmaflight.pipeline.models import LoadedModel, ModelDefaults

    if isinstance(pipeline, LoadedModel):
        return pipeline
    transformer = getattr(pipeline, "transformer", None)
    if not isinstance(getattr(pipeline, "components", None), Mapping) or not isinstance(transformer, torch.nn.Module):
        raise TypeError("pipeline must be a diffusers pipeline with a transformer (e.g. "
                        f"StableDiffusion3Pipeline.from_pretrained(...)) or a LoadedModel, got {type(pipeline).__name__}")
    call = traj.metadata.get("call")
    if not isinstance(call, Mapping) or any(k not in call for k in ("height", "width", "guidance_scale")):
        raise ValueError(f"trajectory {traj.header.rollout_id} records no `call` (height, width, guidance_scale, ...) "
                         "in its metadata: a server older than this client made it; replay it with a LoadedModel")
    base = [p for n, p in transformer.named_parameters() if "lora_" not in n] or list(transformer.parameters())
    family = family_of_pipeline(pipeline)
    defaults = ModelDefaults(
        height=int(call["height"]),
        width=int(call["width"]),
        num_inference_steps=int(traj.metadata["request"]["num_inference_steps"]),
        guidance_scale=float(call["guidance_scale"]),
        num_frames=None if call.get("num_frames") is None else int(call["num_frames"]),
        is_video=family.is_video,
        call_kwargs={k: v for k, v in call.items() if k not in _RESOLVED},
    )
    made = traj.metadata.get("model") or {}
    return LoadedModel(id=str(made.get("id", "")), family=family.name, pipeline=pipeline, device=base[0].device,
                       dtype=base[0].dtype, digest="", defaults=defaults)


def _check_weights(model: Any, traj: Trajectory, *, strict: bool) -> None:
    made = traj.metadata.get("model") or {}
    made_with, recorded = made.get("digest"), made.get("components")
    if made_with is None:
        return
    from sigmaflight.pipeline.digests import current_components

    have = current_components(model)
    if isinstance(recorded, Mapping) and "transformer" in recorded and "transformer" in have:
        # Compare the components this model holds (a trainer without text encoders holds fewer).
        differ = sorted(n for n in have if have[n] != recorded.get(n))
        if not differ:
            return
        detail = ", ".join(
            f"{n} ({_short(have[n])}, the rollout's {_short(recorded[n])})" if n in recorded
            else f"{n} (the rollout's model has none)" for n in differ)
        message = (f"trajectory {traj.header.rollout_id} was made with other weights than the model replaying it "
                   f"has: {detail}")
    else:
        from sigmaflight.pipeline.models import combine_digests

        have_digest = combine_digests(have)
        if have_digest == made_with:
            return
        message = (f"trajectory {traj.header.rollout_id} was made with weights {made_with[:12]}, but the model "
                   f"replaying it has weights {have_digest[:12]}")
    message += ": the log-probs are not the rollout's own (pass check_weights=False for an intended off-policy replay)"
    if strict:
        raise ValueError(message)
    warnings.warn(WeightsMismatch(message), stacklevel=3)


def _short(digest: str) -> str:
    return digest[:12] + "..."


def __getattr__(name: str) -> Any:
    """`current_components` and `current_digest` (the trainer's side of the weights check) live in
    sigmaflight.pipeline.digests and need torch: imported on first use (PEP 562)."""
    if name in ("current_components", "current_digest"):
        from sigmaflight.pipeline import digests

        return getattr(digests, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
