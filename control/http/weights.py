"""`PUT /v1/models/{model_id}/weights`: a trainer pushes new transformer weights.

The body is a safetensors file (`safetensors.torch.save(transformer.state_dict())`), sent
as `application/octet-stream`; its size limit is `--max-weights-bytes` (the other routes
keep `--max-body-bytes`). Every tensor is checked against the model's current transformer
(same keys, shapes and dtypes, finite values) before anything changes; a bad one is a 422
naming the key. Then `ModelRegistry.load_weights` swaps the weights in copy-on-write:
rollouts already running finish on the old weights, the next ones run on the new, and their
trajectories carry the new digest in `sigmaflight.rollout.model.digest`.
"""

from __future__ import annotations

from typing import Any

import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from control.http.errors import error_response
from control.policy import policy
from pipeline.spec import RolloutInputError

WEIGHTS_PATH = "/v1/models/{model_id}/weights"
WEIGHTS_PATH_REGEX = r"/v1/models/[^/]+/weights"
"""For BodyLimitMiddleware's per-route limit."""


def _bad(key: str, msg: str) -> JSONResponse:
    return error_response(422, "validation_error", f"{key}: {msg}", [{"loc": ["body", key], "msg": msg, "type": "value_error"}])


def check_state_dict(current: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """(key, why) of the first tensor that cannot replace `current`; None when all fit."""
    for key in sorted(set(current) - set(new)):
        return key, "missing from the upload (the whole transformer state dict is required)"
    for key in sorted(set(new) - set(current)):
        return key, "not a parameter or buffer of this model's transformer"
    for key in sorted(new):
        have, got = current[key], new[key]
        if tuple(got.shape) != tuple(have.shape):
            return key, f"shape {list(got.shape)} does not match the model's {list(have.shape)}"
        if got.dtype != have.dtype:
            return key, f"dtype {str(got.dtype).removeprefix('torch.')} does not match the model's " \
                        f"{str(have.dtype).removeprefix('torch.')}"
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            return key, "holds NaN or infinite values"
    return None


def _load(service: Any, model_id: str, body: bytes) -> JSONResponse:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        model = service.registry.get(model_id)
    except RolloutInputError:
        return error_response(404, "not_found", f"no model {model_id!r}; known: {service.registry.ids()}")
    try:
        state = load(body)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        return error_response(422, "validation_error", f"body: not a safetensors file ({exc})",
                      [{"loc": ["body"], "msg": f"not a safetensors file ({exc})", "type": "value_error"}])
    current = model.base_transformer().state_dict()  # a push replaces the base (any LoRA is dropped)
    bad = check_state_dict(current, state)
    if bad is not None:
        return _bad(*bad)
    service.push_weights(model_id, state)  # with --backend ray: every worker too
    digest, version = policy(model)
    return JSONResponse({"id": model_id, "digest": digest, "weights_version": version, "tensors": len(state)})


async def put_weights(request: Request) -> Response:
    service = request.state.service
    model_id = request.path_params["model_id"]
    body = await request.body()
    return await run_in_threadpool(_load, service, model_id, body)
