"""Safetensors bodies the weights routes must refuse with a 422 naming the
body or the tensor, on the real server (`PUT /v1/models/{id}/lora` and `/weights`), which then
keeps serving with its weights unchanged.

The bodies are built here by hand (the safetensors layout: an 8-byte little-endian header size,
a JSON header, the data) or with `safetensors.torch.save` and peft, not with sigmaflight code.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterator

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save

from tests.faults.conftest import SMALL
from tests.servers import InProcessServer, wait_for_status

OCTET = {"content-type": "application/octet-stream"}
ROUTES = ["weights", "lora"]
LORA_CONFIG = {"r": 2, "lora_alpha": 4, "target_modules": ["attn.to_q"]}


def _raw(header: object) -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _with_lora_config(header: dict) -> dict:
    return {**header, "__metadata__": {"lora_config": json.dumps(LORA_CONFIG)}}


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with InProcessServer("--workers", "1") as s:
        yield s


def _version(c: httpx.Client) -> tuple[int, str]:
    (m,) = [m for m in c.get("/v1/models").json()["models"] if m["id"] == "tiny-sd3"]
    return m["weights_version"], m["digest"]


def _assert_refused(c: httpx.Client, route: str, body: bytes, loc: list[str], words: str) -> dict:
    before = _version(c)
    r = c.put(f"/v1/models/tiny-sd3/{route}", content=body, headers=OCTET)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "validation_error"
    assert error["details"][0]["loc"] == loc, error
    assert words in error["message"], error
    assert _version(c) == before  # nothing changed
    assert c.get("/healthz").status_code == 200
    return error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ROUTES)
def test_deeply_nested_header_is_422_naming_the_body(server: InProcessServer, route: str) -> None:
    """`[` x 100000 then `]` x 100000 made json.loads raise RecursionError: a 500."""
    body = _raw("[" * 100000 + "]" * 100000)
    with server.client() as c:
        _assert_refused(c, route, body, ["body"], "header")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("shape", [[0, 9223372036854775808], [0, 1 << 62, 4], [0, 2, -1 + (1 << 63)]])
def test_header_shape_overflow_is_422_naming_the_tensor(server: InProcessServer, route: str, shape: list[int]) -> None:
    """A zero-size entry with a dimension past int64 (or whose strides overflow) went to
    torch.empty unchecked: a 500."""
    header = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    body = _raw(_with_lora_config(header) if route == "lora" else header)
    with server.client() as c:
        _assert_refused(c, route, body, ["body", "w"], "shape")


def _adapter(value: float) -> dict[str, torch.Tensor]:
    """A peft adapter for tiny-sd3 (LORA_CONFIG) as float64, every factor `value` (finite in float64)."""
    from sigmaflight.pipeline.models import ModelRegistry  # the same seeded base as the server's

    base = ModelRegistry().get("tiny-sd3").pipeline.transformer
    wrapped = get_peft_model(copy.deepcopy(base), LoraConfig(**LORA_CONFIG))  # type: ignore[arg-type]
    return {k: torch.full(v.shape, value, dtype=torch.float64) for k, v in get_peft_model_state_dict(wrapped).items()}


@pytest.mark.timeout(240)
def test_lora_factors_that_overflow_in_the_model_dtype_are_422_naming_the_tensor(server: InProcessServer) -> None:
    """F64 factors of 1e300 are finite, but float32 (the model's dtype) makes them inf; they
    were accepted (200, weights_version moved) and every later rollout failed non_finite."""
    tensors = _adapter(1e300)
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())  # finite as sent
    body = save(tensors, metadata={"lora_config": json.dumps(LORA_CONFIG)})
    with server.client() as c:
        error = _assert_refused(c, "lora", body, ["body", sorted(tensors)[0]], "float32")
        assert "infinite" in error["message"] or "NaN" in error["message"], error
        t = c.post("/v1/rollouts", json=SMALL).json()  # the server still runs rollouts on the base weights
        assert wait_for_status(c, t["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
        # the same adapter with values float32 holds is accepted (the check is on the values, not the dtype)
        ok = c.put("/v1/models/tiny-sd3/lora", headers=OCTET,
                   content=save(_adapter(1e-3), metadata={"lora_config": json.dumps(LORA_CONFIG)}))
        assert ok.status_code == 200, ok.text
        assert c.delete("/v1/models/tiny-sd3/lora").status_code == 200


@pytest.mark.timeout(240)
def test_full_weights_in_another_dtype_are_422_naming_the_tensor(server: InProcessServer) -> None:
    """Full weights are never converted: a float64 state dict for the float32 model (1e300 in one
    tensor) is refused by dtype, so no value can turn infinite after the check."""
    from sigmaflight.pipeline.models import ModelRegistry

    state = {k: v.to(torch.float64) for k, v in ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict().items()}
    first = sorted(state)[0]
    state[first] = torch.full_like(state[first], 1e300)
    with server.client() as c:
        _assert_refused(c, "weights", save(state), ["body", first], "dtype")
