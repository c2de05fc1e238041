"""Pushing a transformer's weights to the server: streamed over Flight `do_put`, checked chunk by
chunk, committed whole or not at all, resumed after a cut, and only the tensors that changed.

    from sigmaflight import Client
    with Client(url) as client:
        result = client.push_weights("tiny-sd3", transformer.state_dict())   # a str: the new digest
        result.weights_version, result.bytes_sent, result.bytes_skipped

`Client.push_weights` and `Client.weights_manifest` are thin calls into this module. The stream's
schema and the server's checks are in sigmaflight/dataplane/weights.py; docs/trainers.md has the
fine-tuning loop, docs/dataplane.md the schema.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import crc32c
from pyarrow import flight

from sigmaflight import rest
from sigmaflight.dataplane.auth import bearer_header
from sigmaflight.errors import ApiError, NotFound, ServerUnreachable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from sigmaflight.client import Client

__all__ = ["DEFAULT_CHUNK_BYTES", "PushResult", "WeightsPushError", "WeightsPushNotFound", "push_weights",
           "push_weights_file", "tensor_crc", "weights_manifest"]

DEFAULT_CHUNK_BYTES = 8 << 20
"""Bytes per chunk (one record batch) of a push."""


_STATUS = {"bad_weights": 422, "conflict": 409, "not_found": 404, "unauthenticated": 401, "bad_request": 400}


class WeightsPushError(ApiError):
    """The server refused a push, and nothing changed there. An ApiError as a REST refusal is:
    `status` (422 for bad weights, 409 for a conflict, 404, 401), `type` ("bad_weights",
    "conflict", "not_found", ...), `message` naming the tensor, `details` [{"loc": ["body", key],
    "msg", "type": reason}]; plus `reason` ("checksum", "shape", "dtype", "offset", "overlap",
    "non_finite", "unknown_tensor", "missing_tensor", "push_in_progress", "stale_base", ...),
    `tensor` (the key, when it is about one), `push_id` (this push's) and `in_progress` (with
    "push_in_progress": the id of the push that holds the model, cut and waiting for its resume or
    under way; `push_weights(..., push_id=err.in_progress)` resumes it)."""

    def __init__(self, type_: str, reason: str, message: str, *, tensor: str | None = None,
                 push_id: str | None = None, in_progress: str | None = None) -> None:
        loc = ["body", tensor] if tensor is not None else ["body"]
        super().__init__(_STATUS.get(type_, 400), type_, message, [{"loc": loc, "msg": message, "type": reason}])
        self.reason, self.tensor, self.push_id, self.in_progress = reason, tensor, push_id, in_progress


class WeightsPushNotFound(WeightsPushError, NotFound):
    """A push to a model the server does not serve (or another "not_found" refusal): a
    WeightsPushError of type "not_found" (status 404, reason "unknown_model" when the model is
    unknown) and a NotFound, as the manifest read that finds no model raises."""


class PushResult(str):
    """The server's new weights digest (a str, as push_weights always returned), with the rest of
    its answer: weights_version, tensors and bytes sent, bytes skipped (unchanged), seconds, and
    lora_dropped (True when a LoRA adapter was on the replaced base: any push that changes the base
    drops it; push it again on the new base)."""

    weights_version: int
    tensors: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    push_id: str | None
    lora_dropped: bool
    answer: dict[str, Any]

    @classmethod
    def of(cls, answer: dict[str, Any]) -> PushResult:
        out = cls(str(answer["digest"]))
        out.answer = dict(answer)
        out.weights_version = int(answer["weights_version"])
        out.tensors = int(answer.get("tensors", 0))
        out.bytes_sent = int(answer.get("bytes_sent", 0))
        out.bytes_skipped = int(answer.get("bytes_skipped", 0))
        out.seconds = float(answer.get("seconds", 0.0))
        out.push_id = answer.get("push_id")
        out.lora_dropped = bool(answer.get("lora_dropped", False))
        return out


def _flat(t: torch.Tensor) -> np.ndarray:
    """The raw C-order bytes of a CPU tensor, as a numpy uint8 view (no copy)."""
    import numpy as np
    import torch

    if not t.numel():
        return np.empty(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_crc(t: torch.Tensor) -> str:
    """CRC32C (8 hex digits) of a tensor's raw bytes: what the manifest gives per tensor."""
    return f"{crc32c.crc32c(_flat(t.detach().to('cpu').contiguous()).data):08x}"


def weights_manifest(client: Client, model_id: str) -> dict[str, Any]:
    """GET /v1/models/{id}/weights/manifest: the whole answer (tensors, digest, flight, ...)."""
    return dict(client._send("GET", rest.model_path(model_id, "weights/manifest")).json())


def _error(exc: flight.FlightError, push_id: str) -> WeightsPushError | None:
    """The typed push error in a Flight error; None for a broken connection (worth a retry)."""
    from sigmaflight.dataplane.errors import error_info

    info = error_info(exc)
    if info is None or info["type"] not in ("bad_weights", "conflict", "not_found", "bad_request",
                                            "unauthenticated"):
        return None
    message = str(exc).split("Detail:")[0].strip()
    for prefix in ("Flight returned internal error, with message: ", "with message: "):
        if prefix in message:
            message = message.split(prefix, 1)[1]
    kind = WeightsPushNotFound if info["type"] == "not_found" else WeightsPushError
    in_progress = info.get("in_progress")
    return kind(info["type"], str(info.get("reason") or info["type"]), message, tensor=info.get("tensor"),
                push_id=push_id, in_progress=str(in_progress) if in_progress is not None else None)


def push_weights(
    client: Client,
    model_id: str,
    state_dict: Mapping[str, torch.Tensor],
    *,
    only_changed: bool = True,
    partial: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool | None = None,
    retries: int = 3,
    push_id: str | None = None,
) -> PushResult:
    """Stream `state_dict` (the transformer's, keyed as its `state_dict()`) to the server.

    only_changed (default): fetch the served per-tensor checksums and send only the tensors whose
    CRC32C differs (a push where nothing changed answers the current digest and weights_version at
    once, no stream); the push names the base those kept tensors come from (refused "stale_base"
    when it changed meanwhile). partial: `state_dict` holds only some tensors; send those (with
    only_changed, those of them that differ) and keep the others as served. Without either, every
    tensor is sent. Any push that changes the weights drops a LoRA adapter that was on
    (`PushResult.lora_dropped` says so). chunk_bytes: about how many bytes each chunk carries,
    rounded down to whole elements of each tensor's dtype (at least one element), so any value
    >= 1 works. progress: a tqdm bar (bytes, bytes/s); default when
    stderr is a terminal. A cut connection is resumed from what the server acknowledges, up to
    `retries` times; `push_id` resumes a push another process started (the same tensors and
    options; chunk_bytes may differ), sending only the bytes the server has not received. Returns the new digest as a PushResult (a str with weights_version, bytes).
    Raises WeightsPushError (an ApiError: 422 naming the tensor, 409 for a push under way) when
    the push is refused (nothing changed on the server; WeightsPushNotFound, also a NotFound, for
    a model the server does not serve), ValueError for a bad argument here (chunk_bytes, retries,
    push_id), TypeError naming the key of a state_dict value that is not a torch.Tensor."""
    from sigmaflight.dataplane.weights_wire import dtype_name  # the header's dtype names (imports torch)

    tensors = _checked(state_dict, chunk_bytes=chunk_bytes, retries=retries, push_id=push_id)
    try:
        manifest = weights_manifest(client, model_id)
    except NotFound as exc:
        raise WeightsPushNotFound("not_found", "unknown_model", exc.message) from None
    served: dict[str, str] = manifest["tensors"]
    if not partial:
        missing = sorted(set(served) - set(tensors))
        if missing:  # refused here as the server refuses a full push without it
            raise WeightsPushError("bad_weights", "missing_tensor", f"tensor {missing[0]!r} is missing from a full "
                                   f"push ({len(missing)} in all); send every tensor, or partial=True to keep the "
                                   "others as served", tensor=missing[0])
    specs: dict[str, dict[str, Any]] = manifest.get("specs") or {}

    def unchanged(key: str) -> bool:
        """Its bytes, dtype and shape are the served tensor's: a tensor of another shape or dtype
        with the same bytes (a reshape) is sent, and refused as the server refuses it."""
        t, spec = tensors[key], specs.get(key)
        same_spec = spec is None or (spec["dtype"] == dtype_name(t.dtype) and list(spec["shape"]) == list(t.shape))
        return same_spec and served.get(key) == tensor_crc(t)

    send = sorted(k for k in tensors if not (only_changed and unchanged(k)))
    # the served base the unsent tensors must still be: every full only_changed push names it; a
    # partial one when it left out some of the given tensors as unchanged (their values are the base's)
    skipped = only_changed and (not partial or len(send) < len(tensors))
    total = sum(t.nbytes for t in tensors.values())
    if not send:
        if manifest.get("failed") is not None:  # what the served weights hold cannot vouch for a no-op
            raise WeightsPushError("conflict", "model_failed", f"model {model_id!r} is failed closed (an in-place "
                                   f"push failed: {manifest['failed']}); only a push of every tensor "
                                   "(only_changed=False, not partial) reopens it")
        return PushResult.of({"digest": manifest["digest"], "weights_version": manifest["weights_version"],
                              "tensors": 0, "bytes_sent": 0, "bytes_skipped": total})
    resume = push_id is not None
    push_id = push_id or uuid.uuid4().hex
    header: dict[str, Any] = {"sigmaflight.weights": 1, "model": model_id, "push_id": push_id, "partial": partial,
              "base_digest": manifest["base_digest"] if skipped else None,
              "tensors": {k: {"dtype": dtype_name(tensors[k].dtype), "shape": list(tensors[k].shape)} for k in send}}
    descriptor = flight.FlightDescriptor.for_command(json.dumps(header).encode())
    options = flight.FlightCallOptions(headers=[(k.encode(), v.encode()) for k, v in bearer_header(client.token).items()])
    location = manifest["flight"]["locations"][0]
    fc = client.flight(location).flight_client
    from tqdm import tqdm

    nbytes = sum(tensors[k].nbytes for k in send)
    bar = tqdm(total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"push {model_id}",
               disable=not (progress if progress is not None else sys.stderr.isatty()))
    received = _received(fc, options, push_id) if resume else {}
    try:
        for attempt in range(retries + 1):
            try:
                answer = _stream(fc, options, descriptor, {k: tensors[k] for k in send}, received, chunk_bytes, bar)
                answer.setdefault("bytes_skipped", total - nbytes)
                return PushResult.of(answer)
            except flight.FlightError as exc:
                err = _error(exc, push_id)
                if err is not None and err.reason != "incomplete":
                    raise err from None
                if attempt == retries:
                    raise err or _lost(location, exc) from None
            except OSError as exc:  # a connection that broke below Flight's error types
                if attempt == retries:
                    raise _lost(location, exc) from None
            time.sleep(min(0.1 * 2 ** attempt, 2.0))
            try:
                received = _received(fc, options, push_id)
            except (flight.FlightError, OSError):  # gone meanwhile: the next attempt says so, or sends it all
                received = {}
            bar.reset(total=nbytes)
            bar.update(sum(e - s for ranges in received.values() for s, e in ranges))
    finally:
        bar.close()
    raise AssertionError("unreachable")  # pragma: no cover


def _lost(location: str, exc: BaseException) -> ServerUnreachable:
    """A push whose Flight connection failed on every try (the server stopped, restarted or is
    gone): ServerUnreachable with the server's words, no gRPC debug context. The push is all or
    none: the model keeps the weights it had."""
    from sigmaflight.dataplane.errors import server_message

    return ServerUnreachable(location, f"the weights push failed on every try ({server_message(exc) or type(exc).__name__}); "
                                       "the model keeps the weights it had")


def _checked(state_dict: Mapping[str, torch.Tensor], *, chunk_bytes: int, retries: int,
             push_id: str | None) -> dict[str, torch.Tensor]:
    """The push's arguments checked (ValueError naming a bad one), and its tensors on the CPU,
    contiguous (TypeError naming a key that is not a str or a value that is not a tensor)."""
    import torch

    for name, value, least in (("chunk_bytes", chunk_bytes, 1), ("retries", retries, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if push_id is not None and (not isinstance(push_id, str) or not 0 < len(push_id) <= 200
                                or not push_id.isprintable() or not rest._utf8(push_id)):
        raise ValueError(f"push_id must be a str of 1 to 200 printable characters, got {push_id!r:.80}")
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise TypeError(f"state_dict keys must be str (the transformer's state_dict() keys), got {k!r:.80}")
        if not isinstance(v, torch.Tensor):
            kind = type(v).__name__ if type(v).__module__ == "builtins" else f"{type(v).__module__}.{type(v).__name__}"
            raise TypeError(f"state_dict[{k!r}] must be a torch.Tensor, not {kind}")
        tensors[k] = v.detach().to("cpu").contiguous()
    return tensors


def push_weights_file(client: Client, model_id: str, path: str, *, partial: bool = False) -> PushResult:
    """A same-host push without a socket: the server reads `path` (a safetensors file of the
    transformer's state dict, inside its --weights-file-dir or --shm-dir) and stages it with the
    stream's checks, then swaps it in. Refusals are ApiErrors (422 naming the key or the path; a file
    rewritten while it is read is one: save to a new name)."""
    import os

    r = client._send("POST", rest.model_path(model_id, "weights/file"), json={"path": os.path.abspath(path),
                                                                         "partial": partial})
    return PushResult.of(r.json())


def _received(fc: flight.FlightClient, options: flight.FlightCallOptions, push_id: str) -> dict[str, list[list[int]]]:
    """The byte ranges the server holds for `push_id` (weights_push_status); {} when it holds none."""
    from sigmaflight.dataplane.weights import WEIGHTS_STATUS_ACTION

    try:
        (result,) = list(fc.do_action(flight.Action(WEIGHTS_STATUS_ACTION, push_id.encode()), options))
    except flight.FlightError:
        return {}
    return dict(json.loads(result.body.to_pybytes())["received"])


def _missing(ranges: list[list[int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of bytes [start, end) no received range covers, in order. A resume may cut its
    chunks at other bytes than the cut push did (another chunk_bytes): it sends only those parts,
    as the server refuses a chunk that overlaps what it holds. The ranges end on whole elements."""
    out, at = [], start
    for s, e in sorted((s, e) for s, e in ranges if s < end and e > start):
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if at < end:
        out.append((at, end))
    return out


def _stream(fc: flight.FlightClient, options: flight.FlightCallOptions, descriptor: flight.FlightDescriptor,
            tensors: Mapping[str, torch.Tensor], received: Mapping[str, list[list[int]]], chunk_bytes: int,
            bar: Any) -> dict[str, Any]:
    """One do_put stream: every chunk the server has not acknowledged, then the commit's answer."""
    from sigmaflight.dataplane.weights import SCHEMA, chunk_batch

    writer, reader = fc.do_put(descriptor, SCHEMA, options)
    try:  # a refusal ends the call: close() raises the server's typed error
        for name, t in tensors.items():
            flat = _flat(t)
            have = received.get(name, [])
            step = max(t.element_size(), chunk_bytes - chunk_bytes % t.element_size())  # whole elements
            for off in range(0, flat.size, step):
                end = min(off + step, flat.size)
                for start, stop in _missing(have, off, end):
                    writer.write_batch(chunk_batch(name, start, flat[start:stop]))
                    bar.update(stop - start)
        writer.done_writing()
        buf = reader.read()
    except (flight.FlightError, OSError):
        writer.close()
        raise
    except BaseException:  # Ctrl-C mid-push: end the call; the server keeps what landed for a resume
        with contextlib.suppress(Exception):  # its answer to the cut ("incomplete") is not the news here
            writer.close()
        raise
    writer.close()
    if buf is None:
        raise flight.FlightUnavailableError("the server closed the push without an answer")
    return dict(json.loads(buf.to_pybytes()))
