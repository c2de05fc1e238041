"""The OpenAPI 3.1 document, generated from the wire models (no hand-written schemas)."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema
from sigmaflight.control.http.timeouts import MAX_HEADER_BYTES

from sigmaflight.wire import (
    MAX_STATUS_WAIT_S,
    ErrorBody,
    Health,
    ModelList,
    RolloutList,
    RolloutRequest,
    RolloutStatus,
    Ticket,
)

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _binary(description: str) -> dict[str, Any]:
    return {"required": True, "description": description,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


def _change(description: str, *extra: str) -> dict[str, Any]:
    """A change of weights' answer: id, digest, weights_version (and `extra`)."""
    props: dict[str, Any] = {"id": {"type": "string"}, "digest": {"type": "string"},
                             "weights_version": {"type": "integer"}}
    if "tensors" in extra:
        props["tensors"] = {"type": "integer"}
    if "lora" in extra:
        props["lora"] = {"type": ["object", "null"], "description": "r, lora_alpha, target_modules, tensors"}
    return {"description": description, "content": {"application/json": {"schema": {
        "type": "object", "required": ["id", "digest", "weights_version"], "properties": props}}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        401: "Bearer token missing or wrong.",
        404: "Unknown rollout id (or model id).",
        408: "The request body did not arrive within --body-timeout-s.",
        409: "Idempotency-Key reused with another body (idempotency_conflict), expected_digest is not the model's "
             "digest (stale_policy), a branch's parent ran on other weights than the model's now (stale_parent), "
             "or a streamed weights push to the model is under way (push_in_progress).",
        413: "Request body, or the trajectory it asks for, is too large.",
        415: "The body is not sent as Content-Type: application/json.",
        422: "Validation error; details name each bad field and why.",
        429: "Queue full (rollouts), or --max-weights-pushes pushes already under way (too_many_pushes); see "
             "Retry-After.",
        503: "Not taken now: the server is shutting down (shutting_down), the model was failed closed by a "
             "weights push (weights_failed), the job journal cannot be written (journal_unavailable) or no worker "
             "can take it (no_workers); see Retry-After where given.",
    }
    return {str(c): _json("ErrorBody", text[c]) for c in codes}


def openapi_document(*, auth: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document (served at GET /openapi.json): one literal with the paths and their
    answers written out as the document has them, and the schemas generated from the wire models."""
    _, schemas = models_json_schema(
        [
            (RolloutRequest, "validation"),
            (Ticket, "serialization"),
            (RolloutStatus, "serialization"),
            (RolloutList, "serialization"),
            (ModelList, "serialization"),
            (ErrorBody, "serialization"),
            (Health, "serialization"),
        ],
        ref_template=_REF,
    )
    components = schemas["$defs"]
    rid = {"name": "rollout_id", "in": "path", "required": True, "schema": {"type": "string"}}
    mid = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    secured = [401] if auth else []
    paths: dict[str, Any] = {
        "/v1/rollouts": {
            "post": {
                "operationId": "create_rollout",
                "summary": "Validate a rollout request, enqueue it and answer at once with a ticket.",
                "parameters": [
                    {"name": "Idempotency-Key", "in": "header", "required": False,
                     "description": "Repeat a POST safely: the same key and body answer the first ticket.",
                     "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"}}
                ],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("RolloutRequest")}}},
                "responses": {"202": _json("Ticket", "Accepted; pull the trajectory with the Flight ticket."),
                              **_errors(*secured, 408, 409, 413, 415, 422, 429, 503)},
            },
            "get": {
                "operationId": "list_rollouts",
                "summary": "List rollouts, newest first.",
                "parameters": [
                    {"name": "status", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": ["queued", "running", "succeeded", "failed",
                                                           "cancelled", "expired"]}},
                    {"name": "limit", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
                    {"name": "ticket", "in": "query", "required": False,
                     "description": "Only the rollout this Flight ticket (or one of its streams' tickets) belongs to.",
                     "schema": {"type": "string", "minLength": 1, "maxLength": 1024}},
                    {"name": "after", "in": "query", "required": False,
                     "description": "The next page: the rollouts listed after this rollout id (the `next` of the "
                                    "page before); an id the server does not know is a 422.",
                     "schema": {"type": "string"}},
                ],
                "responses": {"200": _json("RolloutList", "Rollouts."), **_errors(*secured, 422)},
            },
        },
        "/v1/rollouts/{rollout_id}": {
            "get": {
                "operationId": "get_rollout",
                "summary": "Status of one rollout, with progress, error or result.",
                "parameters": [
                    rid,
                    {"name": "wait_s", "in": "query", "required": False,
                     "description": "Hold the answer until the rollout has ended (succeeded, failed, cancelled or "
                                    "expired) or for this many seconds, whichever is first; the status then. The "
                                    "server answers at once past --max-held-reads held reads and while it shuts down.",
                     "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_STATUS_WAIT_S}},
                ],
                "responses": {"200": _json("RolloutStatus", "Status."), **_errors(*secured, 404, 422)},
            },
            "delete": {
                "operationId": "delete_rollout",
                "summary": "Cancel a queued or running rollout, or release a finished one's result.",
                "parameters": [rid],
                "responses": {"200": _json("RolloutStatus", "Status after the request."), **_errors(*secured, 404, 422)},
            },
        },
        "/v1/models": {
            "get": {
                "operationId": "list_models",
                "summary": "Models this server can run, with their defaults.",
                "responses": {"200": _json("ModelList", "Models."), **_errors(*secured)},
            }
        },
        "/v1/models/{model_id}/weights": {
            "put": {
                "operationId": "put_weights",
                "summary": "Replace the model's transformer weights (safetensors of its state dict; drops any LoRA "
                           "adapter); answers the new digest and weights_version.",
                "parameters": [mid],
                "requestBody": _binary("safetensors of the transformer's whole state dict (--max-weights-bytes); "
                                       "with a Content-Length it is staged and checked as it arrives."),
                "responses": {"200": _change("Loaded; the next rollouts run on these weights.", "tensors"),
                              **_errors(*secured, 404, 408, 409, 413, 422, 429)},
            }
        },
        "/v1/models/{model_id}/weights/manifest": {
            "get": {
                "operationId": "get_weights_manifest",
                "summary": "The served base transformer's per-tensor CRC32C (hex) with its digest and weights_version, "
                           "and the Flight locations a streamed push (do_put) goes to; a trainer pushes only the "
                           "tensors whose checksum differs.",
                "parameters": [mid],
                "responses": {"200": {"description": "The manifest.", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["id", "digest", "weights_version", "tensors"],
                    "properties": {"id": {"type": "string"}, "digest": {"type": "string"},
                                   "weights_version": {"type": "integer"}, "base_digest": {"type": "string"},
                                   "algorithm": {"type": "string"},
                                   "tensors": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "flight": {"type": "object"}}}}}},
                              **_errors(*secured, 404)},
            }
        },
        "/v1/models/{model_id}/weights/file": {
            "post": {
                "operationId": "post_weights_file",
                "summary": "Same host: push the safetensors file at `path` (inside --weights-file-dir or --shm-dir), "
                           "read and checked as a streamed push; `partial` keeps the tensors it lacks.",
                "parameters": [mid],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["path"],
                    "properties": {"path": {"type": "string"}, "partial": {"type": "boolean"}}}}}},
                "responses": {"200": _change("Loaded; the next rollouts run on these weights.", "tensors"),
                              **_errors(*secured, 404, 409, 415, 422, 429)},
            }
        },
        "/v1/models/{model_id}/lora": {
            "put": {
                "operationId": "put_lora",
                "summary": "Put a LoRA adapter on the transformer (unfused), replacing any: safetensors keyed as "
                           "peft.get_peft_model_state_dict gives them (with or without base_model.model.), the "
                           "LoraConfig as JSON under the header metadata key lora_config. 422 names the key.",
                "parameters": [mid],
                "requestBody": _binary("safetensors of the adapter with __metadata__.lora_config (--max-weights-bytes)."),
                "responses": {"200": _change("Loaded; the next rollouts run with the adapter.", "tensors", "lora"),
                              **_errors(*secured, 404, 408, 413, 422, 429)},
            },
            "delete": {
                "operationId": "delete_lora",
                "summary": "Remove the adapter: the base weights and digest again (weights_version still counts up). "
                           "404 with type lora_not_loaded when there is none.",
                "parameters": [mid],
                "responses": {"200": _change("Removed; the next rollouts run on the base weights.", "lora"),
                              **_errors(*secured, 404)},
            },
        },
        "/healthz": {"get": {"operationId": "healthz", "summary": "Liveness.",
                             "responses": {"200": _json("Health", "Alive.")}}},
        "/readyz": {"get": {"operationId": "readyz", "summary": "Readiness: models loaded and Flight serving.",
                            "responses": {"200": _json("Health", "Ready."), "503": _json("Health", "Not ready."),
                                          **_errors(*secured)}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics (text format 0.0.4).",
                             "responses": {"200": {"description": "Metrics.",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors(*secured)}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document.",
                                  "responses": {"200": {"description": "OpenAPI 3.1 document.",
                                                        "content": {"application/json": {"schema": {"type": "object"}}}},
                                                **_errors(*secured)}}},
        "/docs": {"get": {"operationId": "docs", "summary": "Interactive API page (Swagger UI, served locally).",
                          "responses": {"200": {"description": "HTML page.",
                                                "content": {"text/html": {"schema": {"type": "string"}}}},
                                        **_errors(*secured)}}},
        "/": {"get": {"operationId": "index", "summary": "Index: links to /docs, /openapi.json, /v1/rollouts, "
                      "/v1/models, /healthz, /readyz, /metrics.",
                      "responses": {"200": {"description": '{"service": "sigmaflight", "links": {name: path}, "try": '
                                            "a command}.",
                                            "content": {"application/json": {"schema": {"type": "object"}}}},
                                    **_errors(*secured)}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "sigmaflight",
            "version": "1",
            "description": "Rollout service for diffusion RL. Trajectories stream over Arrow Flight "
            "(schema trajectory/v1); this API submits and manages rollouts.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
    for operations in paths.values():  # the header bound refuses before any route runs (timeouts.py)
        for operation in operations.values():
            operation["responses"]["431"] = _json(
                "ErrorBody", f"The request line and headers are over {MAX_HEADER_BYTES // 1024} KiB; details name the header "
                "(or url).")
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        doc["paths"]["/healthz"]["get"]["security"] = []
    return doc
