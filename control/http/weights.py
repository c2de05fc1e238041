"""Changes of a model's weights over REST: a full push and a LoRA adapter.

`PUT /v1/models/{model_id}/weights`: the body is a safetensors file
(`safetensors.torch.save(transformer.state_dict())`), sent as `application/octet-stream`, with a
Content-Length or chunked. It is streamed (`_stream_weights`): the header is read and checked against the
base transformer (same keys, shapes and dtypes), then each tensor's bytes go straight into a
staging copy as they arrive, checked for finite values (the streamed push's staging,
dataplane/weights.py), and the push commits with the same swap; no buffer holds the body. A bad
tensor is a 422 naming the key and nothing changes; a PUT while a Flight push to the model is
under way (or cut and waiting for its resume) is a 409 `push_in_progress`: every PUT is a push
of the push registry (`WeightsPushes.begin`), whatever its framing. Rollouts already running
finish on the old weights, the next ones run on the new. The answer's `lora_dropped` says a LoRA
adapter that was on is gone (a new base drops it).

`PUT /v1/models/{model_id}/lora`: the body is a safetensors file of the adapter, keyed as
`peft.get_peft_model_state_dict` gives them (with or without `base_model.model.`), with the
LoraConfig as JSON (`json.dumps(config.to_dict())`) under the header metadata key `lora_config`.
It replaces any adapter (`ModelRegistry.load_lora`). `DELETE /v1/models/{model_id}/lora` removes
it (404, type "lora_not_loaded", when there is none). Both answer
`{"id", "digest", "weights_version", ...}`; with --backend ray every worker has the change
before the route answers. The body limit of both PUTs is `--max-weights-bytes` (the other
routes keep `--max-body-bytes`); at most `--max-weights-pushes` of them are taken at once (429
`too_many_pushes` beyond, before the body is read), and each body must arrive within
`--body-timeout-s` (408, BodyLimitMiddleware).
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic_core import from_json
from sigmaflight.control.http.errors import HttpError
from sigmaflight.dataplane.weights import PushRefused, dtype_name
from sigmaflight.pipeline.safetensors_io import (
    MAX_HEADER_BYTES,
    lora_config_from_metadata,
    parse_header,
    read_safetensors,
    trailing_bytes,
)
from sigmaflight.pipeline.spec import RolloutInputError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

WEIGHTS_PATH = "/v1/models/{model_id:path}/weights"
MANIFEST_PATH = "/v1/models/{model_id:path}/weights/manifest"
FILE_PATH = "/v1/models/{model_id:path}/weights/file"
LORA_PATH = "/v1/models/{model_id:path}/lora"
"""`:path`: a hub model's id has a "/" (org/name)."""
WEIGHTS_PATH_REGEX = r"/v1/models/.+/(?:weights|lora)"
"""For BodyLimitMiddleware's per-route limit (PUT of either)."""


def _body_key(exc: RolloutInputError) -> RolloutInputError:
    """The error with its field as one key of the body: tensor keys and LoraConfig names are
    taken whole (a key holds dots), so the 422 says ["body", key]; "body" is the body itself."""
    return RolloutInputError(exc.field, exc.reason, loc=() if exc.field == "body" else (exc.field,))


def _known_model(service: Any, model_id: str) -> None:
    """404 for a model this server does not have."""
    try:
        service.registry.get(model_id)
    except RolloutInputError:
        raise HttpError(404, "not_found", f"no model {model_id!r}; known: {service.registry.ids()}") from None


def _answer(model_id: str, policy: Any, **extra: Any) -> JSONResponse:
    return JSONResponse({"id": model_id, "digest": policy.digest, "weights_version": policy.weights_version,
                         **extra})


def _committed(model_id: str, answer: dict[str, Any], **extra: Any) -> JSONResponse:
    """The answer of a push that committed (`WeightsPushes.commit`'s dict), as a REST body."""
    return JSONResponse({"id": model_id, "digest": answer["digest"], "weights_version": answer["weights_version"],
                         **extra, "lora_dropped": answer.get("lora_dropped", False)})


def _load_lora(service: Any, model_id: str, body: bytearray) -> JSONResponse:
    _known_model(service, model_id)
    try:
        tensors, metadata = read_safetensors(body)
        config = lora_config_from_metadata(metadata)
        new = service.push_lora(model_id, tensors, config)
    except RolloutInputError as exc:
        raise _body_key(exc) from None
    lora = service.registry.get(model_id).lora
    return _answer(model_id, new, tensors=len(tensors), lora=lora.describe() if lora is not None else None)


def _unload_lora(service: Any, model_id: str) -> JSONResponse:
    _known_model(service, model_id)
    new = service.remove_lora(model_id)  # LoraNotLoaded: 404 "lora_not_loaded" (control/http/errors.py)
    return _answer(model_id, new, lora=None)


class PushSlots:
    """At most `limit` weights/LoRA bodies taken at once (each up to --max-weights-bytes): what a
    few clients can make the server hold is `limit` bodies, not one per connection. Used from the
    event loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0

    def try_take(self) -> bool:
        if self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def give_back(self) -> None:
        self.taken -= 1


def too_many_pushes(slots: PushSlots) -> HttpError:
    return HttpError(429, "too_many_pushes",
                     f"the limit of --max-weights-pushes={slots.limit} weights pushes are already being "
                     "received or applied; retry later", headers={"Retry-After": "1"})


async def read_body(request: Request) -> bytearray:
    """The body in one buffer that grows as the bytes arrive (`request.body()` holds the chunks and
    their join at once: 2x the body at its peak). Nothing is allocated for bytes that a
    Content-Length only promises: a client declaring 512 MiB and sending one byte costs one byte.
    Growing a large bytearray is a realloc that glibc serves with mremap (no copy)."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
    return buf


async def _push(request: Request, load: Callable[[Any, str, bytearray], JSONResponse]) -> Response:
    slots: PushSlots = request.app.state.push_slots
    if not slots.try_take():
        raise too_many_pushes(slots)
    try:
        body = await read_body(request)
        return await run_in_threadpool(load, request.state.service, request.path_params["model_id"], body)
    finally:
        slots.give_back()


class _BodyFeeder:
    """Splits a safetensors body's data section, as it arrives, into whole-element pieces of each
    tensor and stages them (WeightsPushes.write): bytes between tensors are skipped, an element
    split across two network chunks waits in `carry` (less than one element)."""

    def __init__(self, pushes: Any, staging: Any, entries: dict[str, tuple[Any, list[int], int, int]]) -> None:
        self.pushes, self.staging = pushes, staging
        self.spans = sorted((start, end, key, dtype.itemsize) for key, (dtype, _, start, end) in entries.items()
                            if end > start)
        self.i = 0
        self.pos = 0
        self.carry = bytearray()
        self.carry_off = 0

    def feed(self, data: bytes | bytearray) -> None:
        mv = memoryview(data)
        while len(mv):
            while self.i < len(self.spans) and self.spans[self.i][1] <= self.pos:
                self.i += 1
            if self.i == len(self.spans):
                self.pos += len(mv)
                return
            start, end, key, item = self.spans[self.i]
            if self.pos < start:
                skip = min(start - self.pos, len(mv))
                self.pos, mv = self.pos + skip, mv[skip:]
                continue
            take = min(end - self.pos, len(mv))
            piece, off = mv[:take], self.pos - start
            self.pos, mv = self.pos + take, mv[take:]
            if self.carry:
                add = piece[: item - len(self.carry)]
                self.carry += add
                piece, off = piece[len(add):], off + len(add)
                if len(self.carry) == item:
                    self.pushes.write(self.staging, key, self.carry_off, memoryview(bytes(self.carry)))
                    self.carry.clear()
            whole = len(piece) - len(piece) % item
            if whole:
                self.pushes.write(self.staging, key, off, piece[:whole])
            if whole < len(piece):
                self.carry, self.carry_off = bytearray(piece[whole:]), off + whole


_INLINE_BYTES = 1 << 20
"""A network chunk up to this size is staged on the event loop (uvicorn hands over about 64 KiB
at a time: tens of microseconds each); a larger one in a worker thread."""


def _refused(exc: PushRefused) -> Exception:
    if exc.reason in ("push_in_progress", "stale_base"):
        return HttpError(409, exc.reason, exc.message)
    return _body_key(RolloutInputError(exc.tensor or "body", exc.message))


def _push_header(model_id: str, kind: str, entries: Mapping[str, Any], *, partial: bool) -> dict[str, Any]:
    """The streamed push's header (dataplane/weights.py) for a body or file holding `entries`
    (parse_header's: key -> (dtype, shape, start, end))."""
    return {"sigmaflight.weights": 1, "model": model_id, "push_id": f"{kind}-{uuid.uuid4().hex}", "partial": partial,
            "base_digest": None, "tensors": {k: {"dtype": dtype_name(d), "shape": list(shape)}
                                              for k, (d, shape, _, _) in entries.items()}}


@contextlib.contextmanager
def _aborted_on_error(pushes: Any, staging: Any, reason: str) -> Iterator[None]:
    """Frees `staging` when the block fails: a refusal with its own reason (answered as _refused
    says), anything else (a cut body, a failed commit) with `reason`."""
    try:
        yield
    except PushRefused as exc:
        pushes.abort(staging, exc.reason)
        raise _refused(exc) from None
    except BaseException:
        pushes.abort(staging, reason)
        raise


async def _stream_weights(request: Request, length: int | None) -> Response:
    """PUT .../weights: the header first (checked against the model), then each tensor's bytes
    straight into a staging copy as they arrive (the streamed push's staging, dataplane/weights.py),
    committed by the same swap; no buffer holds the body. `length`: the Content-Length, or None for
    a chunked body (the same push, so the same checks and the same one-push-per-model registry)."""
    service, model_id = request.state.service, request.path_params["model_id"]
    await run_in_threadpool(_known_model, service, model_id)
    chunks = request.stream().__aiter__()
    buf = bytearray()

    async def fill(n: int) -> None:
        while len(buf) < n:
            try:
                buf.extend(await chunks.__anext__())
            except StopAsyncIteration:
                raise _body_key(RolloutInputError("body", f"not a safetensors file: the body ended after {len(buf)} "
                                                  "bytes, inside its header")) from None

    await fill(8)
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER_BYTES or (length is not None and 8 + n > length):
        raise _body_key(RolloutInputError("body", f"not a safetensors file: header size {n} does not fit the body "
                                          f"of {length if length is not None else 'at most --max-weights-bytes'} "
                                          "bytes"))
    await fill(8 + n)
    try:
        # a chunked body's length is not known yet: one that ends before its tensors is refused at the
        # end ("incomplete"), one with bytes after them below
        entries, _ = parse_header(bytes(buf[8:8 + n]), length - 8 - n if length is not None else None)
    except RolloutInputError as exc:
        raise _body_key(exc) from None
    header = _push_header(model_id, "put", entries, partial=False)
    pushes = service.weights_pushes
    try:
        staging = await run_in_threadpool(pushes.begin, header)
    except PushRefused as exc:
        raise _refused(exc) from None
    feeder = _BodyFeeder(pushes, staging, entries)
    with _aborted_on_error(pushes, staging, "cut"):
        feeder.feed(buf[8 + n:])
        buf.clear()
        async for chunk in chunks:
            if len(chunk) > _INLINE_BYTES:
                await run_in_threadpool(feeder.feed, chunk)
            else:
                feeder.feed(chunk)
        end = max((end for *_, end in entries.values()), default=0)
        if feeder.pos > end:
            raise _body_key(RolloutInputError("body", trailing_bytes(feeder.pos - end)))
        answer = await run_in_threadpool(pushes.commit, staging)
    return _committed(model_id, answer, tensors=len(entries))


_FILE_PIECE = 8 << 20
"""Bytes of a pushed file staged at a time (whole elements)."""


def _allowed_dirs(settings: Any) -> list[str]:
    return [os.path.realpath(d) for d in (settings.weights_file_dir, settings.shm_dir) if d is not None]


def _inside(path: str, roots: list[str]) -> bool:
    return any(path.startswith(r + os.sep) for r in roots)


def _open_allowed(settings: Any, path: object) -> int:
    """An fd of `path`, a regular file inside --weights-file-dir or --shm-dir; 422 otherwise.
    The name is judged (symlinks resolved) before anything is opened, so nothing outside is
    opened or said to exist; the open never blocks (O_NONBLOCK: a FIFO there is refused, not
    waited on) and follows no symlink swapped in since; what was opened is checked again."""
    roots = _allowed_dirs(settings)
    if not roots:
        raise HttpError(422, "validation_error", "this server takes no weights files: start it with "
                        "--weights-file-dir (or --shm-dir)", [{"loc": ["body", "path"], "msg": "not allowed",
                                                             "type": "value_error"}])
    if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
        raise RolloutInputError("path", "must be an absolute path to a safetensors file", loc=("path",))
    outside = RolloutInputError("path", f"{path!r} is not a regular file inside {' or '.join(roots)} "
                                "(--weights-file-dir, --shm-dir)", loc=("path",))
    resolved = os.path.realpath(path)
    if not _inside(resolved, roots):
        raise outside
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise RolloutInputError("path", f"cannot open {path!r}: {exc.strerror}", loc=("path",)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode) or not _inside(os.path.realpath(f"/proc/self/fd/{fd}"), roots):
        os.close(fd)
        raise outside
    return fd


def _read_at(fd: int, view: memoryview, offset: int) -> memoryview:
    """`view` filled from the file at `offset` (pread: a file cut short meanwhile is a 422, where
    a memory map of it would kill the process with SIGBUS)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise _body_key(RolloutInputError("body", f"the file ended at byte {offset + done} while it was read, "
                                              f"short of the {offset + len(view)} its header needs (was it rewritten "
                                              "meanwhile? push a file nobody writes to)"))
        done += got
    return view


def _push_file(service: Any, model_id: str, path: object, partial: bool) -> JSONResponse:
    """The file read and staged piece by piece with the stream's checks, then one swap."""
    _known_model(service, model_id)
    fd = _open_allowed(service.settings, path)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise _body_key(RolloutInputError("body", f"not a safetensors file: {size} bytes"))
        n = int.from_bytes(_read_at(fd, memoryview(bytearray(8)), 0), "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _body_key(RolloutInputError("body", f"not a safetensors file: header size {n} does not fit "
                                              f"the file of {size} bytes"))
        try:
            entries, _ = parse_header(bytes(_read_at(fd, memoryview(bytearray(n)), 8)), size - 8 - n)
        except RolloutInputError as exc:
            raise _body_key(exc) from None
        header = _push_header(model_id, "file", entries, partial=partial)
        pushes = service.weights_pushes
        try:
            staging = pushes.begin(header)
        except PushRefused as exc:
            raise _refused(exc) from None
        buffer = memoryview(bytearray(min(_FILE_PIECE, max((end - start for _, _, start, end in entries.values()),
                                                             default=0))))
        with _aborted_on_error(pushes, staging, "commit_failed"):
            for key, (dtype, _, start, end) in entries.items():
                step = max(dtype.itemsize, len(buffer) - len(buffer) % dtype.itemsize)
                for off in range(0, end - start, step):
                    piece = buffer[:min(step, end - start - off)]
                    pushes.write(staging, key, off, _read_at(fd, piece, 8 + n + start + off))
            answer = pushes.commit(staging)
    finally:
        os.close(fd)
    return _committed(model_id, answer, tensors=len(entries), bytes_sent=answer["bytes_sent"])


async def post_weights_file(request: Request) -> Response:
    """POST .../weights/file {"path": "/abs/file.safetensors", "partial": false}: a same-host push
    without a socket; the file is read piece by piece and checked as a stream's chunks are."""
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise HttpError(415, "unsupported_media_type", "the body must be JSON sent with Content-Type: "
                        "application/json")
    try:  # pydantic-core's parser, as a POST's: a nesting too deep for Python is refused, not a 500
        body = from_json(await request.body())
    except ValueError:
        raise RolloutInputError("body", "must be a JSON object {\"path\": ..., \"partial\": false}") from None
    if not isinstance(body, dict) or set(body) - {"path", "partial"}:
        raise RolloutInputError("body", "must be a JSON object with path (and partial) only")
    partial = body.get("partial", False)
    if not isinstance(partial, bool):
        raise RolloutInputError("partial", "must be true or false", loc=("partial",))
    slots: PushSlots = request.app.state.push_slots
    if not slots.try_take():  # a file push holds a thread and staging as a streamed one does
        raise too_many_pushes(slots)
    try:
        return await run_in_threadpool(_push_file, request.state.service, request.path_params["model_id"],
                                       body.get("path"), partial)
    finally:
        slots.give_back()


async def put_weights(request: Request) -> Response:
    length = request.headers.get("content-length", "")
    slots: PushSlots = request.app.state.push_slots
    if not slots.try_take():
        raise too_many_pushes(slots)
    try:  # chunked (no Content-Length): streamed the same way, within --max-weights-bytes
        return await _stream_weights(request, int(length) if length.isdigit() else None)
    finally:
        slots.give_back()


async def put_lora(request: Request) -> Response:
    return await _push(request, _load_lora)


def _manifest(service: Any, model_id: str) -> JSONResponse:
    _known_model(service, model_id)
    body = service.weights_sink.manifest(model_id)
    return JSONResponse({**body, "flight": {"locations": service.flight.locations}})


async def get_manifest(request: Request) -> Response:
    """GET .../weights/manifest: {"id", "digest", "weights_version", "base_digest", "algorithm":
    "crc32c", "tensors": {key: crc32c hex}, "specs": {key: {"dtype", "shape"}}, "failed", "flight":
    {"locations"}}: the served base transformer's per-tensor checksums, dtypes and shapes, and where
    to stream a push (control/weights_sink.py)."""
    return await run_in_threadpool(_manifest, request.state.service, request.path_params["model_id"])


async def delete_lora(request: Request) -> Response:
    return await run_in_threadpool(_unload_lora, request.state.service, request.path_params["model_id"])
