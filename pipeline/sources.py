"""Where a model comes from: a local diffusers directory's checks and a Hugging Face hub id's resolution.

Nothing here loads weights: a directory or hub model is refused (ModelLoadError, naming it and why)
before the registry (pipeline/models.py) calls `DiffusionPipeline.from_pretrained`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HUB_ID", "HubSnapshot", "ModelLoadError", "check_flow_match", "check_hub_id", "check_hub_model",
           "hub_model_dir", "local_model_dirs", "missing_pipeline_file", "parse_hub_id", "resolve_hub_model",
           "revision_problem"]


class ModelLoadError(ValueError):
    """A local model directory sigmaflight cannot serve (the message names the directory and why)."""


def local_model_dirs(model_dir: str | Path) -> list[Path]:
    """The pipelines under `model_dir`: each subdirectory holding a model_index.json, by name."""
    return [sub for sub in sorted(Path(model_dir).iterdir()) if (sub / "model_index.json").is_file()]


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
        # the index alone says whether it can be served: never ask for files of one refused anyway
        check_flow_match(directory, label=model_id)
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
