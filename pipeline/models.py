"""Model registry: built-in tiny diffusers pipelines, local and hub flow-match pipelines, by id.

Built-in models (pipeline/builtins.py) are assembled from the real diffusers / transformers
classes with tiny configs and seeded random weights, created inside `torch.random.fork_rng` so
that the same id gives the same weights bit for bit on every build and the caller's RNG is
untouched. Every module is put in eval mode. Nothing is downloaded.

This module is also the import path of the model API: what a served model is
(pipeline/loaded.py), its digests (pipeline/hashing.py), where a model comes from
(pipeline/sources.py) and the changes of its weights (pipeline/swaps.py) are re-exported here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from sigmaflight.pipeline.builtins import _BUILTINS, _CLIP_LEN, _T5_LEN, ModelDefaults
from sigmaflight.pipeline.families import family_of_pipeline
from sigmaflight.pipeline.hashing import (
    combine_digests,
    component_digest,
    component_digests,
    state_digest,
    tensor_crc,
    weights_digest,
)
from sigmaflight.pipeline.loaded import LoadedModel, LoraNotLoaded, Policy, StaleWeights, WeightsFailed
from sigmaflight.pipeline.sources import (
    HubSnapshot,
    ModelLoadError,
    check_flow_match,
    check_hub_id,
    check_hub_model,
    hub_model_dir,
    missing_pipeline_file,
    parse_hub_id,
    resolve_hub_model,
    revision_problem,
)
from sigmaflight.pipeline.spec import RolloutInputError
from sigmaflight.pipeline.swaps import (
    StagedWeights,
    check_state_dict,
    drop_lora,
    install,
    put_lora,
    stage_tensors,
    stage_weights,
)

__all__ = [
    "HubSnapshot",
    "LoadedModel",
    "LoraNotLoaded",
    "ModelDefaults",
    "ModelLoadError",
    "ModelRegistry",
    "Policy",
    "StagedWeights",
    "StaleWeights",
    "WeightsFailed",
    "check_flow_match",
    "check_hub_id",
    "check_hub_model",
    "check_state_dict",
    "combine_digests",
    "component_digest",
    "component_digests",
    "hub_model_dir",
    "max_image_size",
    "max_num_frames",
    "missing_pipeline_file",
    "parse_hub_id",
    "resolve_hub_model",
    "revision_problem",
    "state_digest",
    "tensor_crc",
    "weights_digest",
]


def max_image_size(pipeline: Any) -> int | None:
    """Largest height/width the transformer can place: SD3's learned position embedding covers
    pos_embed_max_size patches a side, Wan's RoPE table rope_max_seq_len; None where positions are
    unbounded (FLUX computes its RoPE for any size)."""
    cfg = getattr(getattr(pipeline, "transformer", None), "config", None)
    if cfg is None:
        return None
    pos = getattr(cfg, "pos_embed_max_size", None)
    if pos is not None:
        return int(pos) * int(getattr(cfg, "patch_size", 1)) * int(getattr(pipeline, "vae_scale_factor", 8))
    rope = getattr(cfg, "rope_max_seq_len", None)
    spatial = getattr(pipeline, "vae_scale_factor_spatial", None)
    if rope is None or spatial is None:
        return None
    patch = cfg.patch_size  # (frames, height, width)
    return int(rope) * int(patch[1]) * int(spatial)


def max_num_frames(pipeline: Any) -> int | None:
    """Most frames a video transformer can place (Wan: rope_max_seq_len latent frames of its RoPE
    table, each patch_size[0] of them from vae_scale_factor_temporal frames); None for no bound."""
    cfg = getattr(getattr(pipeline, "transformer", None), "config", None)
    rope = getattr(cfg, "rope_max_seq_len", None)
    temporal = getattr(pipeline, "vae_scale_factor_temporal", None)
    if cfg is None or rope is None or temporal is None:
        return None
    return (int(rope) * int(cfg.patch_size[0]) - 1) * int(temporal) + 1


def _prepare(pipeline: Any, device: torch.device, dtype: torch.dtype) -> Any:
    pipeline.to(device)
    if dtype != torch.float32:
        pipeline.to(dtype=dtype)
    for module in pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
            module.requires_grad_(False)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Build on one torch thread. Built with two, SD3's sin/cos position embedding (float64 ops
    over 4096 elements, computed in the constructor) came out one float32 ulp off in 16 elements
    in about 1 server start in 5; never on one thread. Which op and why is not pinned down (the
    part an OpenMP worker runs, it seems). The built-in's weights, and so its digest, must be the
    same in every process: a restart must not make every trainer's expected_digest stale. A thread
    whose first parallel torch op runs meanwhile keeps one thread (torch sets a thread's count at
    its first use): at start-up nothing else runs torch yet."""
    with _ONE_THREAD_BUILDS:  # one at a time, process-wide: two interleaved would restore each other's 1
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


_ONE_THREAD_BUILDS = threading.Lock()


class ModelRegistry:
    """Models by id. Built-ins are built lazily on first `get` and cached."""

    def __init__(self, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self._device = torch.device(device)
        self._dtype = dtype
        self._loaded: dict[str, LoadedModel] = {}
        self._local: dict[str, tuple[str, torch.device, torch.dtype]] = {}
        self._lock = threading.Lock()

    def loaded(self, model_id: str) -> LoadedModel | None:
        """The model when it is loaded already, else None; never waits (a dict read, no lock)."""
        return self._loaded.get(model_id)

    def ids(self) -> list[str]:
        return sorted(set(_BUILTINS) | set(self._local) | set(self._loaded))

    def get(self, model_id: str) -> LoadedModel:
        with self._lock:
            if model_id in self._loaded:
                return self._loaded[model_id]
            if model_id in _BUILTINS:
                model = self._build_builtin(model_id)
            elif model_id in self._local:
                path, device, dtype = self._local[model_id]
                model = self._load_local(model_id, path, device, dtype)
            else:
                raise RolloutInputError("model", f"unknown model {model_id!r}; known: {self.ids()}")
            self._loaded[model_id] = model
            return model

    def register_local(
        self,
        model_id: str,
        path: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LoadedModel:
        """Load a diffusers flow-match pipeline from a local directory (no network) under `model_id`.

        Raises ModelLoadError (naming the directory and the scheduler class) when the pipeline's
        scheduler is not a FlowMatchEulerDiscreteScheduler: it could not run a rollout.
        """
        model = self._load_local(model_id, str(path), torch.device(device), dtype)
        with self._lock:
            self._local[model_id] = (str(path), torch.device(device), dtype)
            self._loaded[model_id] = model
        return model

    def register_hub(
        self,
        model_id: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LoadedModel:
        """Load a Hugging Face hub model, `org/name[@revision]`, under that id with diffusers'
        `DiffusionPipeline.from_pretrained`: from the Hugging Face cache when the whole pipeline is
        there (the hub is not asked), else from the hub where a network is (HF_HUB_OFFLINE=1: the
        cache only).

        Raises ModelLoadError (naming the model and why) for an id that is not there or whose
        scheduler is not a FlowMatchEulerDiscreteScheduler, before loading any weights.
        """
        repo, revision = check_hub_id(model_id)
        snapshot = check_hub_model(model_id)
        from huggingface_hub import constants

        # In the cache (or offline): straight from it, asking the hub nothing (no retries, no warnings).
        model = self._from_pretrained(model_id, repo, torch.device(device), dtype, revision=revision,
                                      local_files_only=snapshot.cached or constants.HF_HUB_OFFLINE)
        with self._lock:
            self._loaded[model_id] = model
        return model

    def add(self, model: LoadedModel) -> LoadedModel:
        """Serve a model built in memory (a `LoadedModel` over any flow-match pipeline) under its
        `id`; raises ValueError when that id is taken."""
        with self._lock:
            if model.id in self._loaded or model.id in _BUILTINS or model.id in self._local:
                raise ValueError(f"model id {model.id!r} is taken")
            self._loaded[model.id] = model
        return model

    # ------------------------------------------------------------------ changes of weights (pipeline/swaps.py)

    def replace_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor]) -> Policy:
        """Replace the transformer's weights with `state_dict` (the whole state dict); drops any LoRA.

        Raises RolloutInputError(key, why) for a missing or unknown key, another shape or dtype,
        or NaN/Inf values, before anything changes. The new transformer takes the given tensors
        as they are when they are already on the model's device (no copy): the caller hands them
        over and must not change them afterwards. Running rollouts keep the old weights; the
        next rollout sees the new ones. Returns the new Policy (digest, weights_version + 1).
        """
        model = self.get(model_id)
        with model.push_lock:
            return install(stage_weights(model, state_dict))

    def replace_tensors(self, model_id: str, tensors: Mapping[str, torch.Tensor], *,
                        expected_base: str | None = None,
                        known_crcs: tuple[str, Mapping[str, str]] | None = None) -> Policy:
        """Replace some of the transformer's tensors (the others stay as served), as one swap like
        `replace_weights`; drops any LoRA. The caller has checked each tensor (key, shape, dtype,
        finite values) as it arrived (a streamed push, dataplane/weights.py) and hands them over.
        `expected_base`: the base digest the kept tensors must come from (StaleWeights otherwise,
        before anything changes). `known_crcs`: (a base digest, the tensor_crc of its tensors), used
        for the kept tensors when that digest is still the served one, so only the new tensors are
        checksummed. Returns the new Policy (weights_version + 1)."""
        model = self.get(model_id)
        with model.push_lock:
            return install(stage_tensors(model, tensors, expected_base=expected_base, known_crcs=known_crcs))

    def stage_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor]) -> StagedWeights:
        """`replace_weights`' first step: checked and built, nothing served changes; `install` serves it."""
        model = self.get(model_id)
        with model.push_lock:
            return stage_weights(model, state_dict)

    def stage_tensors(self, model_id: str, tensors: Mapping[str, torch.Tensor], *,
                      expected_base: str | None = None,
                      known_crcs: tuple[str, Mapping[str, str]] | None = None) -> StagedWeights:
        """`replace_tensors`' first step: built, nothing served changes; `install` serves it."""
        model = self.get(model_id)
        with model.push_lock:
            return stage_tensors(model, tensors, expected_base=expected_base, known_crcs=known_crcs)

    @staticmethod
    def install(staged: StagedWeights) -> Policy:
        """Serve a staged change (StaleWeights when another change came since it was staged)."""
        with staged.model.push_lock:
            return install(staged)

    def load_lora(self, model_id: str, tensors: Mapping[str, torch.Tensor], lora_config: object) -> Policy:
        """Put a peft LoRA adapter on the transformer, unfused, replacing any adapter.

        tensors: keyed as `peft.get_peft_model_state_dict(transformer)` gives them, with or without
        peft's `base_model.model.` prefix. lora_config: a peft LoraConfig as a dict (`to_dict()`,
        JSON-decoded). Raises RolloutInputError naming the key or `lora_config[.field]`: unknown
        target module, wrong rank or shape, NaN/Inf, missing or invalid lora_config, a key that is
        not a LoRA tensor, a missing factor. The base tensors are shared, not copied. Returns the
        new Policy: the transformer's component digest is the adapter digest of (the base
        transformer's digest, config, tensors), the others stay; weights_version + 1.
        """
        model = self.get(model_id)
        with model.push_lock:
            return put_lora(model, tensors, lora_config)

    def unload_lora(self, model_id: str) -> Policy:
        """Remove the adapter: the base pipeline (the same modules as before `load_lora`) runs again,
        the digest is the base digest, weights_version + 1. Raises LoraNotLoaded when there is none."""
        model = self.get(model_id)
        with model.push_lock:
            return drop_lora(model)

    def failed(self) -> dict[str, str]:
        """{model id: why} of the loaded models an in-place push failed closed."""
        with self._lock:
            models = list(self._loaded.values())
        return {m.id: m.failed for m in models if m.failed is not None}

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for model_id in self.ids():
            m = self.get(model_id)
            d = m.defaults
            policy = m.policy()
            out.append(
                {
                    "id": m.id,
                    "family": m.family,
                    "dtype": str(m.dtype).removeprefix("torch."),
                    "device": str(m.device),
                    "digest": policy.digest,
                    "weights_version": policy.weights_version,
                    "lora": policy.lora.describe() if policy.lora is not None else None,
                    "defaults": {
                        "height": d.height,
                        "width": d.width,
                        "num_inference_steps": d.num_inference_steps,
                        "guidance_scale": d.guidance_scale,
                        "num_frames": d.num_frames,
                    },
                    "size_multiple": d.size_multiple,
                    "is_video": d.is_video,
                }
            )
        return out

    # ------------------------------------------------------------------ internals

    def _build_builtin(self, model_id: str) -> LoadedModel:
        spec = _BUILTINS[model_id]
        with torch.random.fork_rng(devices=[]), _one_torch_thread():
            torch.manual_seed(spec.seed)
            pipeline = spec.build()
            _prepare(pipeline, self._device, self._dtype)
        components = component_digests(pipeline)
        return LoadedModel(
            id=model_id,
            family=spec.family,
            pipeline=pipeline,
            device=self._device,
            dtype=self._dtype,
            digest=combine_digests(components),
            defaults=spec.defaults,
            components=components,
        )

    def _load_local(self, model_id: str, path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
        check_flow_match(path)
        return self._from_pretrained(model_id, path, device, dtype, local_files_only=True)

    def _from_pretrained(self, model_id: str, source: str, device: torch.device, dtype: torch.dtype,
                         **kwargs: Any) -> LoadedModel:
        """A LoadedModel from `DiffusionPipeline.from_pretrained(source, dtype=dtype, **kwargs)`
        (a directory or a hub repo id), with the generic defaults of its family."""
        from diffusers import DiffusionPipeline

        pipeline = DiffusionPipeline.from_pretrained(source, dtype=dtype, **kwargs)
        _prepare(pipeline, device, dtype)
        family = family_of_pipeline(pipeline)
        local = family.local_defaults(pipeline)
        builtin_kwargs = {"max_sequence_length": _T5_LEN} if _is_builtin_sized(pipeline) else {}
        defaults = ModelDefaults(
            height=local.size,
            width=local.size,
            num_inference_steps=28,
            guidance_scale=local.guidance_scale,
            size_multiple=family.size_multiple(pipeline),
            is_video=family.is_video,
            num_frames=local.num_frames,
            call_kwargs=builtin_kwargs,
        )
        components = component_digests(pipeline)
        return LoadedModel(
            id=model_id,
            family=family.name,
            pipeline=pipeline,
            device=device,
            dtype=dtype,
            digest=combine_digests(components),
            defaults=defaults,
            components=components,
        )


def _is_builtin_sized(pipeline: Any) -> bool:
    tok = getattr(pipeline, "tokenizer", None)
    return tok is not None and getattr(tok, "model_max_length", 0) == _CLIP_LEN
