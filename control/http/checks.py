"""The checks of a REST request, before anything is queued: its headers and query, the POST
body's wire model, the server's limits, and the engine's spec on its model. Each refusal names
the field and the reason (422), or answers the contract's own status (409, 413, 415)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json
from sigmaflight.control.http.errors import HttpError, invalid
from sigmaflight.control.policy import policy
from sigmaflight.control.settings import Settings
from sigmaflight.control.streams import output_bytes, validate_outputs
from sigmaflight.pipeline.rollout import estimate_latent_bytes, loop_latent_bytes, validate_spec
from sigmaflight.pipeline.spec import RolloutSpec
from starlette.requests import Request

from sigmaflight.wire import RolloutRequest

MAX_IDEMPOTENCY_KEY = 255
"""Longest accepted Idempotency-Key, in characters (printable ASCII)."""

QUERY_PARAMETERS = {"list_rollouts": ("status", "limit", "ticket", "after"), "get_rollout": ("wait_s",)}


def limit_flag(setting: str) -> str:
    """The `sigmaflight serve` flag of a Settings limit, for the refusal to name what raises it."""
    assert setting in Settings.model_fields, setting
    return "--" + setting.replace("_", "-")


def require_json(request: Request) -> None:
    """415 unless the body is declared `application/json` (parameters such as charset allowed).

    A browser can POST text/plain, form or multipart bodies cross-site without a preflight;
    refusing them keeps a page from starting rollouts on a server without tokens."""
    declared = request.headers.get("content-type")
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"Content-Type {declared!r}" if declared is not None else "no Content-Type"
        raise HttpError(
            415, "unsupported_media_type",
            f"the body must be JSON sent with Content-Type: application/json (got {got})",
            [{"loc": ["header", "content-type"], "msg": "must be application/json", "type": "media_type"}],
        )


def idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header: 1..255 printable ASCII characters, else 422 naming it."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY or not all(" " < c <= "~" for c in key):
        raise invalid(
            ["header", "idempotency-key"],
            f"must be 1..{MAX_IDEMPOTENCY_KEY} printable ASCII characters without spaces (got {len(key)} characters)",
            "string_too_long" if len(key) > MAX_IDEMPOTENCY_KEY else "value_error",
        )
    return key


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """The integer query parameter `name` in low..high (ASCII digits only), else 422 naming it."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise invalid(["query", name], f"must be an integer in {low}..{high}", "int_parsing")
    return int(raw)


def query_seconds(request: Request, name: str, high: float) -> float | None:
    """The query parameter `name`, a number of seconds in (0, high], else 422 naming it."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= high:  # NaN and inf fail too
        raise invalid(["query", name], f"must be a number of seconds greater than 0 and at most {high:g}",
                      "float_parsing" if math.isnan(seconds) else "less_than_equal" if seconds > 0 else "greater_than")
    return seconds


def check_query(request: Request, route: str) -> None:
    """422 naming the first query parameter the route does not take."""
    allowed = QUERY_PARAMETERS.get(route, ())
    for name in request.query_params:
        if name not in allowed:
            takes = f"takes only {', '.join(allowed)}" if allowed else "takes no query parameters"
            raise invalid(["query", name], f"unknown query parameter; this route {takes}", "extra_forbidden")
        if len(request.query_params.getlist(name)) > 1:  # which one was meant is not ours to guess
            raise invalid(["query", name], "given more than once; give it once", "extra_forbidden")


def parse_request(body: bytes) -> RolloutRequest:
    """The wire model of a POST body, else 422 naming every bad field under "body".

    Strict, as /openapi.json describes the body: JSON's own types only (`true` is no integer,
    "3" no number, "yes" no boolean) and the contract's names only (`return`, never the Python
    field name `return_`). Parsed by pydantic-core's JSON parser first: pydantic's JSON mode would
    silently drop a `return_` key instead of refusing it."""
    try:
        data = from_json(body or b"{}")
    except ValueError as exc:
        msg = f"Invalid JSON: {exc}"
        raise HttpError(422, "validation_error", f"body: {msg}", [{"loc": ["body"], "msg": msg, "type": "json_invalid"}]) from None
    try:
        return RolloutRequest.model_validate(data, strict=True, by_name=False)
    except ValidationError as exc:
        details = [
            {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
        first = details[0]
        where = ".".join(map(str, first["loc"][1:])) or "body"
        raise HttpError(422, "validation_error", f"{where}: {first['msg']}", details) from None


def _check_samples(n: int, how: str, settings: Settings) -> None:
    if n > settings.max_samples:
        raise invalid(["body", "num_outputs_per_prompt"], f"{n} samples ({how} x num_outputs_per_prompt) exceed "
                      f"the limit of {settings.max_samples} ({limit_flag('max_samples')})")


def check_request(req: RolloutRequest, settings: Settings) -> None:
    """The checks that need no model: prompts given (or inherited by a branch), the server's limits."""
    if req.prompts is None and req.branch_from is None:
        raise invalid(["body", "prompts"], "Field required (only a branch_from request inherits its parent's)", "missing")
    if req.prompts is not None and len(req.prompts) > settings.max_prompts:
        raise invalid(["body", "prompts"], f"{len(req.prompts)} prompts exceed the limit of {settings.max_prompts} "
                      f"({limit_flag('max_prompts')})")
    limit = settings.max_prompt_chars
    texts: list[tuple[list[str | int], str]] = [(["body", "prompts", k], text) for k, text in enumerate(req.prompts or ())]
    texts.append((["body", "negative_prompt"], req.negative_prompt or ""))
    for loc, text in texts:
        if len(text) > limit:
            raise invalid(loc, f"{len(text)} characters exceed the limit of {limit} ({limit_flag('max_prompt_chars')})")
    _check_samples(req.num_samples, "prompts", settings)
    if req.num_inference_steps is not None and req.num_inference_steps > settings.max_steps:
        raise invalid(
            ["body", "num_inference_steps"],
            f"{req.num_inference_steps} exceeds the limit of {settings.max_steps} ({limit_flag('max_steps')})",
        )


def check_spec(settings: Settings, req: RolloutRequest, model: Any, spec: RolloutSpec, *, branch: bool) -> None:
    """The checks of the engine's spec on its model, in the contract's order: a branch's samples
    limit, the fields (422), the policy (409 stale_policy), the size (413 rollout_too_large)."""
    if branch:
        _check_samples(spec.num_samples, "parent samples", settings)
    validate_spec(model, spec)
    validate_outputs(model, spec)
    if req.expected_digest is not None:
        digest, version = policy(model)
        if digest != req.expected_digest:
            raise HttpError(
                409, "stale_policy",
                f"expected_digest {req.expected_digest[:12]}... is not the model's current weights {digest[:12]}... "
                f"(weights_version {version}); pull the new weights or resubmit with the current digest",
                {"expected_digest": req.expected_digest, "digest": digest, "weights_version": version},
            )
    estimate = estimate_latent_bytes(model, spec) + output_bytes(model, spec)
    if estimate > settings.max_rollout_bytes:
        raise HttpError(
            413,
            "rollout_too_large",
            f"the trajectory would hold about {estimate} bytes of latents, over the limit of "
            f"{settings.max_rollout_bytes} ({limit_flag('max_rollout_bytes')}); request fewer samples, fewer "
            "return.steps or a smaller size",
            {"estimated_bytes": estimate, "limit_bytes": settings.max_rollout_bytes},
        )
    loop = loop_latent_bytes(model, spec)
    if loop > settings.max_rollout_bytes:  # whatever it streams (return.steps [] captures nothing)
        raise HttpError(
            413,
            "rollout_too_large",
            f"the denoising loop would hold about {loop} bytes of latents (x_i of its {spec.num_samples} samples), "
            f"over the limit of {settings.max_rollout_bytes} ({limit_flag('max_rollout_bytes')}); request fewer "
            "samples or a smaller size",
            {"estimated_bytes": loop, "limit_bytes": settings.max_rollout_bytes},
        )
