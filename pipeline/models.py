"""Model registry: built-in tiny diffusers pipelines and local flow-match pipelines, and their policy.

Built-in models (pipeline/builtins.py) are assembled from the real diffusers / transformers
classes with tiny configs and seeded random weights, created inside `torch.random.fork_rng` so
that the same id gives the same weights bit for bit on every build and the caller's RNG is
untouched. Every module is put in eval mode. Nothing is downloaded.

Policy version (contract, "Policy version"): each model has a `digest` of the weights a
rollout runs with and a `weights_version`, 0 at load and +1 per accepted change of weights
(`replace_weights` / `load_weights`, `load_lora`, `unload_lora`). A change never touches a
pipeline in use: it builds a new pipeline object around a new transformer whose unchanged
tensors are the old ones (shared, not copied) and swaps it in under the model's lock, so a
rollout that read `LoadedModel.policy()` keeps its weights to the end and the next one sees
the new. Changes of one model are serialised (`LoadedModel.push_lock`).

The digest is made of one digest per component (`component_digests`: the transformer, each
text encoder, the VAE), so a trainer that holds only some of them (no text encoders, replaying on
the conditioning stream) can still check the ones it has against a trajectory's
`model.components`, and a push hashes only the transformer.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import torch
from sigmaflight.pipeline.builtins import _BUILTINS, _CLIP_LEN, _T5_LEN, ModelDefaults
from sigmaflight.pipeline.families import family_of_pipeline
from sigmaflight.pipeline.lora import LoraAdapter, attach_adapter, share_tensors_copy
from sigmaflight.pipeline.spec import RolloutInputError

__all__ = [
    "LoadedModel",
    "LoraNotLoaded",
    "ModelDefaults",
    "ModelLoadError",
    "ModelRegistry",
    "Policy",
    "HubSnapshot",
    "check_hub_id",
    "StaleWeights",
    "WeightsFailed",
    "check_hub_model",
    "combine_digests",
    "component_digest",
    "component_digests",
    "hub_model_dir",
    "max_image_size",
    "missing_pipeline_file",
    "parse_hub_id",
    "resolve_hub_model",
    "revision_problem",
    "state_digest",
    "tensor_crc",
    "weights_digest",
]

_ = _BUILTINS  # re-exported: control/plot.py reads sigmaflight.pipeline.models._BUILTINS


class ModelLoadError(ValueError):
    """A local model directory sigmaflight cannot serve (the message names the directory and why)."""


class StaleWeights(ValueError):
    """A change made against other base weights than the model serves now."""

    def __init__(self, expected: str, digest: str) -> None:
        super().__init__(f"the push was made against weights {expected[:12]}..., the model serves {digest[:12]}... "
                         "now; fetch the manifest again and push what differs from it")
        self.expected, self.digest = expected, digest


class WeightsFailed(RuntimeError):
    """A rollout of a model whose weights an in-place push left half written (`--weights-swap
    in-place`): refused until a full push commits or the server restarts. control/ reports it as
    `error.type` "weights_failed"; `reason` is why the push failed (checksum, non_finite, expired, ...)."""

    error_type = "weights_failed"

    def __init__(self, model_id: str, reason: str) -> None:
        super().__init__(f"model {model_id!r} is closed: an in-place weights push failed ({reason}) after writing "
                         "into the served weights; push every tensor again (a full push) or restart the server")
        self.model_id, self.reason = model_id, reason


class LoraNotLoaded(LookupError):
    """`unload_lora` on a model that has no adapter: nothing changed, the version did not move."""


@dataclass(frozen=True, kw_only=True)
class Policy:
    """What one rollout runs with, read at once: the pipeline and the (digest, version) of its weights."""

    pipeline: Any
    digest: str
    """weights_digest of the base weights, or the adapter digest (base + adapter) while a LoRA is loaded."""
    weights_version: int
    """0 at load, +1 per accepted change of weights (full push, LoRA put, LoRA delete)."""
    base_digest: str
    """The digest of the weights without the adapter (== digest when no LoRA is loaded)."""
    lora: LoraAdapter | None = None
    components: Mapping[str, str] = field(default_factory=dict)
    """component name -> its digest (`digest` == combine_digests(components)); with a LoRA the
    transformer's is the adapter digest over the base transformer's."""


@dataclass(kw_only=True)
class LoadedModel:
    """A ready pipeline plus what a rollout needs to know about it.

    `pipeline`, `digest`, `weights_version` (and the base and adapter behind them) change together
    under `lock` when the registry changes the weights; a rollout reads them once with `policy()`
    (or `snapshot()`, the older (pipeline, digest) pair).
    """

    id: str
    family: str
    """The name of its row in `sigmaflight.pipeline.families` ("sd3", "flux", "wan", or "other")."""
    pipeline: Any
    device: torch.device
    dtype: torch.dtype
    digest: str
    defaults: ModelDefaults
    weights_version: int = 0
    base_pipeline: Any = None
    """The pipeline without the adapter while a LoRA is loaded; None otherwise (then `pipeline` is the base)."""
    base_digest: str = ""
    """Digest of the base weights ("" until set: then `digest`)."""
    lora: LoraAdapter | None = None
    components: dict[str, str] = field(default_factory=dict)
    """Per-component digests of the weights a rollout runs with (see Policy.components)."""
    base_components: dict[str, str] = field(default_factory=dict)
    """Per-component digests of the base weights (without the adapter)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    push_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held for the whole of a change of weights: changes of one model run one at a time."""
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    """Fast tokenizers mutate their padding/truncation state per call: one call at a time."""

    failed: str | None = None
    """Why an in-place push left the weights half written (the model refuses rollouts); None when sound."""
    _gate: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _running: int = 0
    _held: bool = False

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Held around one model call: waits while an in-place push holds the model, raises
        WeightsFailed while the model is failed closed."""
        with self._gate:
            self._gate.wait_for(lambda: not self._held)
            if self.failed is not None:
                raise WeightsFailed(self.id, self.failed)
            self._running += 1
        try:
            yield
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()

    def hold(self) -> None:
        """For an in-place push: hold new model calls and wait for the running ones to end."""
        with self._gate:
            self._gate.wait_for(lambda: not self._held)
            self._held = True
            self._gate.wait_for(lambda: self._running == 0)

    def unhold(self, failed: str | None) -> None:
        """End an in-place push: `failed` None (committed, or nothing was written) reopens the
        model, a reason fails it closed."""
        with self._gate:
            self._held, self.failed = False, failed
            self._gate.notify_all()

    def __post_init__(self) -> None:
        if not self.base_digest:
            self.base_digest = self.digest
        if not self.base_components:
            self.base_components = dict(self.components)

    def policy(self) -> Policy:
        with self.lock:
            return Policy(pipeline=self.pipeline, digest=self.digest, weights_version=self.weights_version,
                          base_digest=self.base_digest, lora=self.lora, components=dict(self.components))

    def snapshot(self) -> tuple[Any, str]:
        with self.lock:
            return self.pipeline, self.digest

    def base_transformer(self) -> Any:
        """The transformer without the adapter (what a full weights push replaces)."""
        with self.lock:
            return (self.base_pipeline if self.base_pipeline is not None else self.pipeline).transformer


def component_digest(name: str, module: torch.nn.Module) -> str:
    """sha256 over one component's state dict (`state_digest` of it)."""
    return state_digest(name, module.state_dict())


def tensor_crc(tensor: torch.Tensor) -> str:
    """A tensor's checksum: CRC32C (Castagnoli) of its raw C-order bytes on the CPU, 8 hex digits
    (the weights manifest's per-tensor value; hardware CRC32C, about 7x sha256's speed here)."""
    t = tensor.detach().to("cpu").contiguous()
    return f"{crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b''):08x}"


def state_digest(name: str, state: Mapping[str, torch.Tensor], known: Mapping[str, str] | None = None) -> str:
    """sha256 over "sigmaflight/tensors/v1\n" and, for each tensor sorted by key,
    "<name>.<key>:<dtype>:<shape>:<tensor_crc>\n": a component's digest derives from its per-tensor
    checksums (the weights manifest's), so a change of weights costs a CRC32C pass, not a sha256
    over every byte. `known`: tensor_crc of some keys, already computed (tensors a change kept)."""
    known = known or {}
    h = hashlib.sha256(b"sigmaflight/tensors/v1\n")
    for key, tensor in sorted(state.items()):
        crc = known.get(key) or tensor_crc(tensor)
        h.update(f"{name}.{key}:{tensor.dtype}:{tuple(tensor.shape)}:{crc}\n".encode())
    return h.hexdigest()


def component_digests(pipeline: Any) -> dict[str, str]:
    """{component name: component_digest} for every torch module of a pipeline (None ones skipped)."""
    return {name: component_digest(name, module) for name, module in sorted(pipeline.components.items())
            if isinstance(module, torch.nn.Module)}


def combine_digests(components: Mapping[str, str]) -> str:
    """The weights digest from the per-component ones: sha256 over "sigmaflight/weights/v3\\n" and
    "<name>:<digest>\\n" per component, sorted by name."""
    h = hashlib.sha256(b"sigmaflight/weights/v3\n")
    for name in sorted(components):
        h.update(f"{name}:{components[name]}\n".encode())
    return h.hexdigest()


def weights_digest(pipeline: Any) -> str:
    """The digest of all the torch modules of a pipeline: combine_digests(component_digests(pipeline))."""
    return combine_digests(component_digests(pipeline))


def _with_transformer(pipeline: Any, transformer: Any) -> Any:
    new = type(pipeline)(**{**pipeline.components, "transformer": transformer})
    new.set_progress_bar_config(disable=True)
    return new


def check_state_dict(current: Mapping[str, torch.Tensor], new: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, why) of the first tensor that cannot replace `current`; None when all fit."""
    for key in sorted(set(current) - set(new)):
        return key, "missing from the upload (the whole transformer state dict is required)"
    for key in sorted(set(new) - set(current)):
        return key, "not a parameter or buffer of this model's transformer"
    for key in sorted(new):
        have, got = current[key], new[key]
        if not isinstance(got, torch.Tensor):
            return key, f"not a tensor ({type(got).__name__})"
        if tuple(got.shape) != tuple(have.shape):
            return key, f"shape {list(got.shape)} does not match the model's {list(have.shape)}"
        if got.dtype != have.dtype:
            return key, f"dtype {str(got.dtype).removeprefix('torch.')} does not match the model's " \
                        f"{str(have.dtype).removeprefix('torch.')}"
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            return key, "holds NaN or infinite values"
    return None


def check_flow_match(path: str, *, label: str | None = None) -> None:
    """Refuse a local pipeline directory whose scheduler is not flow-match (before loading it).

    sigmaflight's rollout scheduler is a FlowMatchEulerDiscreteScheduler; a DDIM/PNDM/... pipeline
    would load and then fail on every request. The message starts with `label` (default
    "model directory <path>").
    """
    import diffusers

    label = f"model directory {path}" if label is None else label
    index_path = Path(path) / "model_index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{label}: cannot read model_index.json ({exc})") from None
    entry = index.get("scheduler") if isinstance(index, dict) else None
    name = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.FlowMatchEulerDiscreteScheduler)):
        raise ModelLoadError(
            f"{label}: scheduler {name or entry!r} is not a flow-match scheduler "
            f"(sigmaflight serves pipelines whose scheduler is FlowMatchEulerDiscreteScheduler)"
        )


HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?")
"""A Hugging Face hub model id, `org/name` or `org/name@revision` (branch, tag or commit). What
looks like one is then checked as huggingface_hub checks it (`check_hub_id`)."""


def parse_hub_id(model_id: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a hub id; None for anything else (built-in and local ids
    have no "/")."""
    m = HUB_ID.fullmatch(model_id)
    return (m["repo"], m["revision"]) if m else None


def _shown(model_id: str, limit: int = 100) -> str:
    return model_id if len(model_id) <= limit else model_id[:limit] + "..."


_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def revision_problem(revision: str) -> str | None:
    """Why `revision` is not a git ref name (a branch or tag, e.g. `main`, `v1.0`, `refs/pr/1`) or
    a commit; None when it is one. The rules of `git check-ref-format`: a revision becomes a path
    under the cache's refs/ (huggingface_hub joins them), so one that is absolute, climbs out with
    "..", or is otherwise no ref name must never reach it."""
    if len(revision) > 255:
        return "longer than 255 characters"
    if revision.startswith("/") or revision.endswith("/") or "//" in revision:
        return "a ref name neither starts nor ends with '/' nor holds '//'"
    if ".." in revision or "@{" in revision or revision == "@":
        return "a ref name holds no '..' and no '@{'"
    if _REF_FORBIDDEN.search(revision):
        return "a ref name holds no space, control character or any of ~^:?*[\\"
    if any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")) \
            or revision.endswith("."):
        return "no part of a ref name starts with '.' or ends with '.lock', nor does it end with '.'"
    return None


def check_hub_id(model_id: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of a hub id that huggingface_hub accepts (its own
    `validate_repo_id`) with a revision that is a ref name or commit (`revision_problem`).
    Raises ModelLoadError naming the id and why; nothing is read."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    parts = parse_hub_id(model_id)
    if parts is None:
        raise ModelLoadError(f"{_shown(model_id)}: not a hub model id (org/name or org/name@revision)")
    repo, revision = parts
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        reason = str(exc).split(": '", 1)[0]  # its message ends with the id, which may be 5000 characters
        raise ModelLoadError(f"{_shown(model_id)}: not a valid Hugging Face hub id ({_shown(reason, 300)})") from None
    if revision is not None and (why := revision_problem(revision)) is not None:
        raise ModelLoadError(f"{_shown(model_id)}: revision {_shown(revision)!r} is not a branch, tag or commit "
                             f"name ({why})")
    return repo, revision


@dataclass(frozen=True)
class HubSnapshot:
    """Where a hub model's model_index.json is, and whether the whole pipeline is in the cache."""

    directory: str
    """The snapshot directory that holds model_index.json."""
    cached: bool
    """Every component the index names is in the cache: load it from there, ask the hub nothing."""


def missing_pipeline_file(directory: str | Path) -> str | None:
    """The first file a pipeline's model_index.json asks for that `directory` lacks ("vae/: missing",
    "transformer/: no weights file", "vae/config.json: a link to a blob that is not there"); None
    when each component's folder is there, none of its links dangles, and a model's has weights."""
    root = Path(directory)
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError) as exc:
        return f"model_index.json: cannot be read ({exc})"
    if not isinstance(index, dict):
        return "model_index.json: not a JSON object"
    for name in sorted(index):
        entry = index[name]
        if name.startswith("_") or not (isinstance(entry, list) and len(entry) == 2 and entry[0] and entry[1]):
            continue  # metadata, or a component the pipeline goes without ([null, null])
        sub = root / name
        if not sub.is_dir():
            return f"{name}/: missing"
        files = list(sub.iterdir())
        for f in files:
            if f.is_symlink() and not f.exists():
                return f"{name}/{f.name}: a link to a blob that is not there"
        if not any(f.is_file() for f in files):
            return f"{name}/: empty"
        if (sub / "config.json").is_file() and not any(f.suffix in (".safetensors", ".bin") for f in files):
            return f"{name}/: no weights file (*.safetensors or *.bin)"
    return None


def _cached_ref(storage: Path, revision: str) -> str:
    try:
        return (storage / "refs" / revision).read_text()
    except OSError:
        return revision


def resolve_hub_model(model_id: str) -> HubSnapshot:
    """Find a hub model's model_index.json: in the Hugging Face cache (HF_HOME / HF_HUB_CACHE)
    first, asking the hub nothing; where the cache lacks it, or lacks any of the pipeline's files,
    on the hub, with one request (no retries: an unreachable hub is an answer at once), unless
    HF_HUB_OFFLINE is set. Fetches model_index.json only. Raises ModelLoadError naming the model
    and why: an id or revision huggingface_hub would refuse or that names a path, a cache entry
    whose ref names no snapshot in it, a model neither complete in the cache nor on the hub."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import repo_folder_name

    repo, revision = check_hub_id(model_id)
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    missing: str | None = None
    try:
        index = hf_hub_download(repo, "model_index.json", revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except ValueError:  # huggingface_hub: "Invalid pointer path", the ref names a place outside snapshots/
        ref = revision or "main"
        raise ModelLoadError(f"{model_id}: the Hugging Face cache entry {storage} is broken: refs/{ref} names "
                             f"{_shown(_cached_ref(storage, ref))!r}, not a snapshot in it") from None
    else:
        directory = str(Path(index).parent)
        missing = missing_pipeline_file(directory)
        if missing is None:
            return HubSnapshot(directory, cached=True)
    if missing is None:
        why = f"no model_index.json of it in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    else:
        why = f"the Hugging Face cache holds its model_index.json but not all of its pipeline's files ({missing})"
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{model_id}: {why} and HF_HUB_OFFLINE is set")
    try:  # one HEAD request, no retries: huggingface_hub's download retries with backoff for ~30 s
        get_hf_file_metadata(hf_hub_url(repo, "model_index.json", revision=revision))
        index = hf_hub_download(repo, "model_index.json", revision=revision)
    except RevisionNotFoundError:
        raise ModelLoadError(f"{model_id}: the hub has no revision {revision!r} of {repo}") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{model_id}: no such repository on the hub (a private or gated one needs HF_TOKEN)") \
            from None
    except RemoteEntryNotFoundError:
        raise ModelLoadError(f"{model_id}: the repository has no model_index.json (not a diffusers pipeline)") \
            from None
    except HfHubHTTPError as exc:
        raise ModelLoadError(f"{model_id}: {why} and the hub answered {_shown(str(exc).splitlines()[0], 300)}") \
            from None
    except Exception as exc:  # the HTTP client's own errors (refused, timed out, no DNS): the hub is not there
        raise ModelLoadError(f"{model_id}: {why} and the hub cannot be reached ({type(exc).__name__}: "
                             f"{_shown(str(exc).splitlines()[0] if str(exc) else '', 300)})") from None
    return HubSnapshot(str(Path(index).parent), cached=False)


def hub_model_dir(model_id: str) -> str:
    """The directory that holds the hub model's model_index.json (`resolve_hub_model`)."""
    return resolve_hub_model(model_id).directory


def check_hub_model(model_id: str) -> HubSnapshot:
    """Refuse a hub model that is not there or not a flow-match pipeline (reads model_index.json
    only); returns where it is (`resolve_hub_model`)."""
    snapshot = resolve_hub_model(model_id)
    check_flow_match(snapshot.directory, label=model_id)
    return snapshot


def max_image_size(pipeline: Any) -> int | None:
    """Largest height/width the transformer can place (SD3's learned position embedding covers
    pos_embed_max_size patches a side); None where positions are unbounded (RoPE: FLUX, Wan)."""
    cfg = getattr(getattr(pipeline, "transformer", None), "config", None)
    pos = getattr(cfg, "pos_embed_max_size", None)
    if cfg is None or pos is None:
        return None
    return int(pos) * int(getattr(cfg, "patch_size", 1)) * int(getattr(pipeline, "vae_scale_factor", 8))


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


class ModelRegistry:
    """Models by id. Built-ins are built lazily on first `get` and cached."""

    def __init__(self, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self._device = torch.device(device)
        self._dtype = dtype
        self._loaded: dict[str, LoadedModel] = {}
        self._local: dict[str, tuple[str, torch.device, torch.dtype]] = {}
        self._lock = threading.Lock()

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

    # ------------------------------------------------------------------ changes of weights

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
            base = model.base_transformer()
            bad = check_state_dict(base.state_dict(), state_dict)
            if bad is not None:
                raise RolloutInputError(*bad)
            return self._swap_transformer(model, base, state_dict)

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
            if expected_base is not None and model.base_digest != expected_base:
                raise StaleWeights(expected_base, model.base_digest)
            base = model.base_transformer()
            current = base.state_dict()
            bad = next(((k, "not a parameter or buffer of this model's transformer") for k in sorted(tensors)
                        if k not in current), None)
            if bad is not None:
                raise RolloutInputError(*bad)
            kept = None
            if known_crcs is not None and known_crcs[0] == model.base_digest:
                kept = {k: c for k, c in known_crcs[1].items() if k not in tensors}
            return self._swap_transformer(model, base, {**current, **tensors}, kept)

    @staticmethod
    def _swap_transformer(model: LoadedModel, base: Any, state_dict: Mapping[str, torch.Tensor],
                          known_crcs: Mapping[str, str] | None = None) -> Policy:
        """The one swap point of a change of the transformer's weights (model.push_lock held): a
        copy of `base` sharing its modules takes `state_dict` (assigned, no copy on the model's
        device), then pipeline, digest and version change together under model.lock."""
        new = {k: v.detach().to(model.device) for k, v in state_dict.items()}
        transformer = share_tensors_copy(base)
        transformer.load_state_dict(new, strict=True, assign=True)
        transformer.eval()
        transformer.requires_grad_(False)
        del new
        current = model.base_pipeline if model.base_pipeline is not None else model.pipeline
        pipeline = _with_transformer(current, transformer)
        components = {**model.base_components,
                      "transformer": state_digest("transformer", transformer.state_dict(), known_crcs)}
        digest = combine_digests(components)
        with model.lock:
            model.pipeline, model.base_pipeline, model.lora = pipeline, None, None
            model.digest = model.base_digest = digest
            model.components, model.base_components = components, dict(components)
            model.weights_version += 1
        return model.policy()

    def load_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor]) -> str:
        """`replace_weights(...).digest` (the older API)."""
        return self.replace_weights(model_id, state_dict).digest

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
            base_pipeline = model.base_pipeline if model.base_pipeline is not None else model.pipeline
            transformer, adapter = attach_adapter(base_pipeline.transformer, model.base_components["transformer"],
                                                  tensors, lora_config, dtype=model.dtype)
            pipeline = _with_transformer(base_pipeline, transformer)
            components = {**model.base_components, "transformer": adapter.digest}
            with model.lock:
                model.pipeline, model.base_pipeline, model.lora = pipeline, base_pipeline, adapter
                model.components, model.digest = components, combine_digests(components)
                model.weights_version += 1
            return model.policy()

    def unload_lora(self, model_id: str) -> Policy:
        """Remove the adapter: the base pipeline (the same modules as before `load_lora`) runs again,
        the digest is the base digest, weights_version + 1. Raises LoraNotLoaded when there is none."""
        model = self.get(model_id)
        with model.push_lock:
            with model.lock:
                if model.base_pipeline is None:
                    raise LoraNotLoaded(f"model {model_id!r} has no LoRA adapter")
                model.pipeline, model.base_pipeline, model.lora = model.base_pipeline, None, None
                model.digest, model.components = model.base_digest, dict(model.base_components)
                model.weights_version += 1
            return model.policy()

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
        with torch.random.fork_rng(devices=[]):
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
