"""The REST control plane, built from data: routes, middleware, lifespan.

The lifespan builds the `Service` (models, store, Flight, job queue) and hands it to the
routes as lifespan state; every error leaves as the contract's JSON error body.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from sigmaflight.control.backends.local import LocalBackend
from sigmaflight.control.branches import Parent, StaleParent, branch_spec, check_inherited, find_parent
from sigmaflight.control.http import metrics
from sigmaflight.control.http.checks import (
    check_query,
    check_request,
    check_spec,
    idempotency_key,
    limit_flag,
    parse_request,
    query_int,
    query_seconds,
    require_json,
)
from sigmaflight.control.http.docs_page import docs_routes
from sigmaflight.control.http.errors import EXCEPTION_HANDLERS, HttpError, invalid
from sigmaflight.control.http.holds import HeldReads
from sigmaflight.control.http.middleware import BearerAuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from sigmaflight.control.http.openapi import openapi_document
from sigmaflight.control.http.status import StatusBodies, flight_ticket, status_of
from sigmaflight.control.http.weights import (
    FILE_PATH,
    LORA_PATH,
    MANIFEST_PATH,
    WEIGHTS_PATH,
    WEIGHTS_PATH_REGEX,
    PushSlots,
    delete_lora,
    get_manifest,
    post_weights_file,
    put_lora,
    put_weights,
)
from sigmaflight.control.policy import policy
from sigmaflight.control.service import Service
from sigmaflight.control.settings import Settings
from sigmaflight.control.streams import stream_names
from sigmaflight.dataplane.auth import TokenSet
from sigmaflight.pipeline.batch import batch_key
from sigmaflight.pipeline.models import WeightsFailed
from sigmaflight.pipeline.spec import RolloutSpec
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from sigmaflight.wire import (
    MAX_STATUS_WAIT_S,
    STATES,
    ModelInfo,
    ModelList,
    RolloutList,
    RolloutRequest,
    Ticket,
    to_spec,
)

log = logging.getLogger("sigmaflight.http")



def unknown_rollout(rollout_id: str) -> HttpError:
    return HttpError(404, "not_found", f"no rollout {rollout_id!r}")


def _model(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", by_alias=True), status_code=status, headers=headers)


def _service(request: Request) -> Service:
    return request.state.service  # type: ignore[no-any-return]


# ---- routes -------------------------------------------------------------------------------


async def create_rollout(request: Request) -> Response:
    """POST /v1/rollouts: the contract's checks in its order (body, validation, limits,
    idempotency, queue), each answering its own status; every check of the request is in
    `parse_request`, `check_request` and `check_spec`, made once here."""
    service = _service(request)
    settings = service.settings
    require_json(request)
    key = idempotency_key(request)
    req = parse_request(await request.body())
    check_request(req, settings)
    digest = None  # what a repeated Idempotency-Key's body is compared by; without a key, nothing is
    if key is not None:
        canonical = req.model_dump(mode="json", by_alias=True)
        digest = hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()
        prior = service.jobs.repeated(key, digest)  # before the checks the server's state may now fail
        if prior is not None:
            return _ticket_of(request, service, prior, created=False)
    model_id = req.model or settings.model
    parent: Parent | None = None
    if req.branch_from is not None:
        found: Parent = await run_in_threadpool(find_parent, service.backend, req.branch_from.rollout)
        parent, model_id = found, found.model
    # a loaded model without a thread hop; a first use loads it off the event loop
    model = service.registry.loaded(model_id)
    if model is None:
        model = await run_in_threadpool(service.registry.get, model_id)
    if model.failed is not None:
        raise WeightsFailed(model.id, model.failed)
    seed = secrets.randbits(63)
    spec = to_spec(req, model_id=model_id, default_steps=model.defaults.num_inference_steps, seed=seed)
    if parent is not None and req.branch_from is not None:
        spec = await _branch(req, parent, model, spec)
    check_spec(settings, req, model, spec, branch=parent is not None)
    submit = functools.partial(service.jobs.submit, spec, streams=tuple(stream_names(spec)),
                               batch_key=batch_key(model, spec), idempotency_key=key, body_digest=digest)
    # off the event loop when it may wait: a journal write (sqlite, synchronous=FULL) or a remote
    # placement (Ray); else only the table's short lock, taken here without a thread hop.
    # QueueFull, IdempotencyConflict, NotAccepting and Unavailable have their handlers (errors.py)
    local = isinstance(service.backend, LocalBackend) and not service.jobs.journaled
    job, created = submit() if local else await run_in_threadpool(submit)
    return _ticket_of(request, service, job, created=created)


def _ticket_of(request: Request, service: Any, job: Any, *, created: bool) -> Response:
    """The 202 ticket of a rollout: a new one reports the status it was accepted with (queued),
    a repeated Idempotency-Key's first rollout its status now."""
    status_url = str(STATUS_ROUTE.url_path_for("get_rollout", rollout_id=job.id).make_absolute_url(request.base_url))
    status = "queued" if created else job.status
    ticket = Ticket(id=job.id, status=status, status_url=status_url, flight=flight_ticket(service, job))  # type: ignore[arg-type]
    return _model(ticket, 202, headers={"Location": status_url})


async def _branch(req: RolloutRequest, parent: Parent, model: Any, spec: RolloutSpec) -> RolloutSpec:
    """The branch's spec on its parent (422 naming the field, 409 stale_parent)."""
    assert req.branch_from is not None
    given = {name: getattr(req, name) for name in req.model_fields_set}
    check_inherited(given, parent, model.defaults)
    spec = await run_in_threadpool(branch_spec, parent, spec, step=req.branch_from.step,
                                   samples=req.branch_from.samples)
    digest, version = policy(model)
    if parent.digest != digest:
        raise StaleParent(parent.rollout_id, parent.digest, digest, version)
    return spec


async def get_rollout(request: Request) -> Response:
    service = _service(request)
    rollout_id = request.path_params["rollout_id"]
    if request.query_params:
        check_query(request, "get_rollout")
        wait_s = query_seconds(request, "wait_s", MAX_STATUS_WAIT_S)
    else:
        wait_s = None
    job = service.jobs.get(rollout_id)  # a dict read: no thread hop
    if job is None:
        raise unknown_rollout(rollout_id)
    if wait_s is not None and job.status.active:
        await request.state.held_reads.until_ended(service.jobs, rollout_id, wait_s, request.receive)  # holds.py
        job = service.jobs.get(rollout_id)
        if job is None:  # released, or its record dropped, while held
            raise unknown_rollout(rollout_id)
    return Response(request.state.status_bodies.body(job), media_type="application/json")


async def list_rollouts(request: Request) -> Response:
    service = _service(request)
    check_query(request, "list_rollouts")
    status = request.query_params.get("status")
    if status is not None and status not in STATES:
        raise invalid(["query", "status"], f"must be one of {', '.join(STATES)}", "enum")
    limit = query_int(request, "limit", 100, 1, 1000)
    ticket = request.query_params.get("ticket")
    if ticket is not None and not 0 < len(ticket) <= 1024:
        raise invalid(["query", "ticket"], "must be a Flight ticket of 1 to 1024 characters",
                      "string_too_short" if not ticket else "string_too_long")
    after = request.query_params.get("after")
    try:
        jobs, more = await run_in_threadpool(service.jobs.list, status, limit, ticket, after)
    except KeyError:
        raise invalid(["query", "after"], f"no rollout {after!r} on this server to list after (never made, or its "
                      "record dropped past --max-records)", "value_error") from None
    return _model(RolloutList(rollouts=[status_of(service, j) for j in jobs], next=jobs[-1].id if more else None))


async def delete_rollout(request: Request) -> Response:
    service = _service(request)
    if request.query_params:
        check_query(request, "delete_rollout")
    # off the event loop: releasing a result unlinks its file and trims the heap; the journal writes
    job = await run_in_threadpool(service.jobs.cancel, request.path_params["rollout_id"])
    if job is None:
        raise unknown_rollout(request.path_params["rollout_id"])
    return _model(status_of(service, job))


async def list_models(request: Request) -> Response:
    service = _service(request)
    def describe() -> list[dict[str, Any]]:
        out = []
        for d in service.registry.describe():
            digest, version = policy(service.registry.get(d["id"]))
            out.append({**d, "digest": digest, "weights_version": version})
        return out

    described = await run_in_threadpool(describe)
    infos = [ModelInfo(**{**d, "default": d["id"] == service.settings.model}) for d in described]
    return _model(ModelList(models=infos))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok", "checks": {}})


async def readyz(request: Request) -> Response:
    service = _service(request)
    checks = {"models_loaded": service.ready, "flight_serving": service.ready and service.flight.port > 0,
              "journal_writable": service.jobs.journal_error() is None, "workers_live": service.backend.can_place()}
    failed = service.registry.failed()
    checks["weights_sound"] = not failed
    ok = all(checks.values())
    body: dict[str, Any] = {"status": "ready" if ok else "not ready", "checks": checks}
    if failed:  # an in-place weights push failed: these models refuse rollouts (weights_failed)
        body["weights_failed"] = failed
    return JSONResponse(body, status_code=200 if ok else 503)


async def get_metrics(request: Request) -> Response:
    text = await run_in_threadpool(request.app.state.metrics.render)
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)


async def get_openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


STATUS_ROUTE = Route("/v1/rollouts/{rollout_id}", get_rollout, methods=["GET"], name="get_rollout")
"""Its URL is each 202's status_url (`request.url_for` would try the routes before it, by name)."""

ROUTES = [
    Route("/v1/rollouts", create_rollout, methods=["POST"], name="create_rollout"),
    Route("/v1/rollouts", list_rollouts, methods=["GET"], name="list_rollouts"),
    STATUS_ROUTE,
    Route("/v1/rollouts/{rollout_id}", delete_rollout, methods=["DELETE"], name="delete_rollout"),
    Route("/v1/models", list_models, methods=["GET"], name="list_models"),
    Route(WEIGHTS_PATH, put_weights, methods=["PUT"], name="put_weights"),
    Route(MANIFEST_PATH, get_manifest, methods=["GET"], name="get_weights_manifest"),
    Route(FILE_PATH, post_weights_file, methods=["POST"], name="post_weights_file"),
    Route(LORA_PATH, put_lora, methods=["PUT"], name="put_lora"),
    Route(LORA_PATH, delete_lora, methods=["DELETE"], name="delete_lora"),
    Route("/healthz", healthz, methods=["GET"], name="healthz"),
    Route("/readyz", readyz, methods=["GET"], name="readyz"),
    Route("/metrics", get_metrics, methods=["GET"], name="metrics"),
    Route("/openapi.json", get_openapi, methods=["GET"], name="openapi"),
    *docs_routes(),  # GET /docs: Swagger UI from the packaged copy
]


# ---- app ----------------------------------------------------------------------------------


def create_app(settings: Settings, service: Service | None = None) -> Starlette:
    """The ASGI app. `service` may be given (tests); otherwise the lifespan builds it from `settings`."""
    service_metrics = metrics.ServiceMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        svc: Service = service if service is not None else await run_in_threadpool(Service, settings)
        await run_in_threadpool(svc.start)
        service_metrics.bind(svc)
        app.state.service = svc
        try:
            yield {"service": svc, "status_bodies": StatusBodies(svc), "held_reads": app.state.held_reads}
        finally:
            await run_in_threadpool(svc.stop)

    tokens = TokenSet(settings.tokens())  # the REST plane's; Service.reload_tokens swaps it with Flight's
    app = Starlette(
        routes=ROUTES,
        middleware=[
            Middleware(RequestIdMiddleware, responses=service_metrics.http_responses),
            Middleware(BearerAuthMiddleware, tokens=tokens),
            Middleware(
                BodyLimitMiddleware,
                max_bytes=settings.max_body_bytes,
                path_limits=[("PUT", WEIGHTS_PATH_REGEX, settings.max_weights_bytes, limit_flag("max_weights_bytes"))],
                flag=limit_flag("max_body_bytes"),
                timeout_s=settings.body_timeout_s,
            ),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.metrics = service_metrics
    app.state.tokens = tokens
    app.state.push_slots = PushSlots(settings.max_weights_pushes)
    app.state.held_reads = HeldReads(settings.max_held_reads)
    service_metrics.held_reads.set_function(app.state.held_reads.__len__)
    app.state.openapi = openapi_document(auth=bool(tokens))
    return app
