"""Changes of a model's weights over REST: a full push and a LoRA adapter.

`PUT /v1/models/{model_id}/weights`: the body is a safetensors file
(`safetensors.torch.save(transformer.state_dict())`), sent as `application/octet-stream`. It is
read into one buffer (`read_body`) and parsed with `read_safetensors` (tensors are views of
that buffer: no copy) and handed to
`ModelRegistry.replace_weights`, which checks every tensor against the base transformer (same
keys, shapes and dtypes, finite values) before anything changes; a bad one is a 422 naming the
key. Rollouts already running finish on the old weights, the next ones run on the new.

`PUT /v1/models/{model_id}/lora`: the body is a safetensors file of the adapter, keyed as
`peft.get_peft_model_state_dict` gives them (with or without `base_model.model.`), with the
LoraConfig as JSON (`json.dumps(config.to_dict())`) under the header metadata key `lora_config`.
It replaces any adapter (`ModelRegistry.load_lora`). `DELETE /v1/models/{model_id}/lora` removes
it (404, type "lora_not_loaded", when there is none). Both answer
`{"id", "digest", "weights_version", ...}`; with --backend ray every worker has the change
before the route answers. The body limit of both PUTs is `--max-weights-bytes` (the other
routes keep `--max-body-bytes`).
"""

from __future__ import annotations

from typing import Any

from sigmaflight.control.http.errors import error_response
from sigmaflight.pipeline.models import LoraNotLoaded
from sigmaflight.pipeline.safetensors_io import lora_config_from_metadata, read_safetensors
from sigmaflight.pipeline.spec import RolloutInputError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

WEIGHTS_PATH = "/v1/models/{model_id:path}/weights"
LORA_PATH = "/v1/models/{model_id:path}/lora"
"""`:path`: a hub model's id has a "/" (org/name)."""
WEIGHTS_PATH_REGEX = r"/v1/models/.+/(?:weights|lora)"
"""For BodyLimitMiddleware's per-route limit (PUT of either)."""


def invalid_input(exc: RolloutInputError) -> JSONResponse:
    """422 naming the key: loc ["body"] for the body as a whole, else ["body", key]."""
    loc = ["body"] if exc.field == "body" else ["body", exc.field]
    return error_response(422, "validation_error", f"{exc.field}: {exc.reason}",
                          [{"loc": loc, "msg": exc.reason, "type": "value_error"}])


def _unknown_model(service: Any, model_id: str) -> JSONResponse | None:
    try:
        service.registry.get(model_id)
    except RolloutInputError:
        return error_response(404, "not_found", f"no model {model_id!r}; known: {service.registry.ids()}")
    return None


def _answer(model_id: str, policy: Any, **extra: Any) -> JSONResponse:
    return JSONResponse({"id": model_id, "digest": policy.digest, "weights_version": policy.weights_version,
                         **extra})


def _load(service: Any, model_id: str, body: bytearray) -> JSONResponse:
    missing = _unknown_model(service, model_id)
    if missing is not None:
        return missing
    try:
        state, _ = read_safetensors(body)
        new = service.push_weights(model_id, state)  # with --backend ray: every worker too
    except RolloutInputError as exc:
        return invalid_input(exc)
    return _answer(model_id, new, tensors=len(state))


def _load_lora(service: Any, model_id: str, body: bytearray) -> JSONResponse:
    missing = _unknown_model(service, model_id)
    if missing is not None:
        return missing
    try:
        tensors, metadata = read_safetensors(body)
        config = lora_config_from_metadata(metadata)
        new = service.push_lora(model_id, tensors, config)
    except RolloutInputError as exc:
        return invalid_input(exc)
    lora = service.registry.get(model_id).lora
    return _answer(model_id, new, tensors=len(tensors), lora=lora.describe() if lora is not None else None)


def _unload_lora(service: Any, model_id: str) -> JSONResponse:
    missing = _unknown_model(service, model_id)
    if missing is not None:
        return missing
    try:
        new = service.remove_lora(model_id)
    except LoraNotLoaded as exc:
        return error_response(404, "lora_not_loaded", f"{exc.args[0] if exc.args else exc}; nothing to remove")
    return _answer(model_id, new, lora=None)


async def read_body(request: Request) -> bytearray:
    """The body in one buffer, filled chunk by chunk: `request.body()` holds the chunks and their
    join at once (2x the body at its peak); this holds the body once. With a Content-Length (the
    body limit middleware has checked it) the buffer is allocated at that size up front."""
    declared = request.headers.get("content-length")
    buf = bytearray(int(declared)) if declared is not None and declared.isdigit() else bytearray()
    n = 0
    async for chunk in request.stream():
        if n + len(chunk) <= len(buf):
            buf[n:n + len(chunk)] = chunk
        else:
            del buf[n:]
            buf += chunk
        n += len(chunk)
    del buf[n:]
    return buf


async def put_weights(request: Request) -> Response:
    body = await read_body(request)
    return await run_in_threadpool(_load, request.state.service, request.path_params["model_id"], body)


async def put_lora(request: Request) -> Response:
    body = await read_body(request)
    return await run_in_threadpool(_load_lora, request.state.service, request.path_params["model_id"], body)


async def delete_lora(request: Request) -> Response:
    return await run_in_threadpool(_unload_lora, request.state.service, request.path_params["model_id"])
