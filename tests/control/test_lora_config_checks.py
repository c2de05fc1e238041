"""LoRA configs that were taken or answered with a 500 after the change was made, and a push over
a loaded adapter, through the real server and the real Client: a non-finite
`lora_alpha` and a bad `rank_pattern` / `alpha_pattern` are a 422 naming `lora_config.<field>`
with nothing changed; a push that changes the base says in its answer that the adapter is gone."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from sigmaflight import Client
from sigmaflight.errors import ApiError
from tests.servers import InProcessServer

MODEL = "tiny-sd3"
CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["attn.to_q", "attn.to_v"]}


def _base_state() -> dict[str, torch.Tensor]:
    from sigmaflight.pipeline.models import ModelRegistry  # the same seeded weights as the server's

    return {k: v.clone() for k, v in ModelRegistry().get(MODEL).pipeline.transformer.state_dict().items()}


@pytest.fixture(scope="module")
def adapter() -> dict[str, torch.Tensor]:
    from sigmaflight.pipeline.models import ModelRegistry

    wrapped = get_peft_model(copy.deepcopy(ModelRegistry().get(MODEL).pipeline.transformer),
                             LoraConfig(**CONFIG))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    return get_peft_model_state_dict(wrapped)


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with InProcessServer("--workers", "1") as s:
        yield s


@pytest.fixture
def client(server: InProcessServer) -> Iterator[Client]:
    with Client(server.rest_url) as c:
        yield c
        try:
            c.delete_lora(MODEL)
        except ApiError:
            pass


def _served(client: Client) -> tuple[str, int, Any]:
    (m,) = [m for m in client.models() if m["id"] == MODEL]
    return m["digest"], m["weights_version"], m["lora"]


def _refused(client: Client, adapter: dict, config: dict, field: str, *words: str) -> None:
    before = _served(client)
    with pytest.raises(ApiError) as caught:
        client.push_lora(MODEL, adapter, config)
    err = caught.value
    assert (err.status, err.type) == (422, "validation_error"), (err.status, err.type, str(err))
    assert err.details[0]["loc"] == ["body", field], err.details
    for w in words:
        assert w in err.details[0]["msg"], err.details
    assert _served(client) == before  # nothing changed: digest, version, no adapter


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alpha", [float("-inf"), float("inf"), float("nan"), 10 ** 400])
def test_a_non_finite_lora_alpha_is_422_naming_it_and_changes_nothing(client: Client, adapter: dict,
                                                                      alpha: float) -> None:
    """-inf passed the check (only +inf and NaN were refused): the adapter was installed, then the
    answer (JSON of -inf) failed, a 500 for a change that happened."""
    _refused(client, adapter, {**CONFIG, "lora_alpha": alpha}, "lora_config.lora_alpha", "finite")
    assert client.push_lora(MODEL, adapter, CONFIG)["lora"]["lora_alpha"] == 8  # the server still takes a good one


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("field", "value", "words"), [
    ("rank_pattern", {"attn.to_q": "x"}, ["'attn.to_q'", "integer"]),
    ("rank_pattern", {"attn.to_q": 0}, ["'attn.to_q'", ">= 1"]),
    ("rank_pattern", {"attn.to_q": 2.0}, ["'attn.to_q'"]),
    ("rank_pattern", {"attn.to_q": True}, ["'attn.to_q'"]),
    ("rank_pattern", [1], ["list"]),
    ("rank_pattern", "attn.to_q", ["str"]),
    ("alpha_pattern", {"attn.to_q": "x"}, ["'attn.to_q'", "finite number"]),
    ("alpha_pattern", {"attn.to_q": float("nan")}, ["'attn.to_q'", "finite number"]),
    ("alpha_pattern", {"attn.to_q": float("-inf")}, ["'attn.to_q'"]),
    ("alpha_pattern", {"": 2}, ["non-empty"]),
    ("alpha_pattern", 3, ["int"]),
    # a key that matches none of the adapter's modules: peft only warns, and the rank or alpha meant is never used
    ("rank_pattern", {"attn.to_qq": 2}, ["'attn.to_qq'", "matches none", "attn.to_q"]),
    ("alpha_pattern", {"to_k": 2.0}, ["'to_k'", "matches none"]),
])
def test_a_bad_rank_or_alpha_pattern_is_422_naming_it_and_changes_nothing(
        client: Client, adapter: dict, field: str, value: Any, words: list[str]) -> None:
    """Were 500s with the Python exception, or (a NaN alpha_pattern) taken, every later rollout
    failing non_finite."""
    _refused(client, adapter, {**CONFIG, field: value}, f"lora_config.{field}", *words)


@pytest.mark.timeout(120)
def test_good_patterns_are_still_taken(client: Client, adapter: dict) -> None:
    put = client.push_lora(MODEL, adapter, {**CONFIG, "rank_pattern": {"attn.to_v": 4},
                                            "alpha_pattern": {"attn.to_q": 2.5}})
    assert put["lora"]["r"] == 4 and _served(client)[:2] == (put["digest"], put["weights_version"])


@pytest.mark.timeout(120)
def test_a_push_that_changes_the_base_says_the_adapter_was_dropped(server: InProcessServer, client: Client,
                                                                   adapter: dict) -> None:
    """A partial push dropped the adapter and its answer did not say so. Any push
    that changes the base drops it (docs/trainers.md); the answer's lora_dropped says so, and a
    push that changes nothing keeps it."""
    base = _base_state()
    put = client.push_lora(MODEL, adapter, CONFIG)
    same = client.push_weights(MODEL, base)  # only_changed, nothing differs: nothing changes, the adapter stays
    assert (same, same.weights_version, same.lora_dropped) == (put["digest"], put["weights_version"], False)
    assert _served(client)[2] is not None
    bias = {"proj_out.bias": base["proj_out.bias"] + 0.1}
    pushed = client.push_weights(MODEL, bias, partial=True)
    assert pushed.lora_dropped is True and pushed.answer["lora_dropped"] is True
    assert _served(client) == (pushed, put["weights_version"] + 1, None)
    again = client.push_weights(MODEL, {"proj_out.bias": base["proj_out.bias"]}, partial=True)
    assert again.lora_dropped is False  # no adapter was on
    client.push_lora(MODEL, adapter, CONFIG)  # the REST PUT of the whole state dict says it too
    with server.client() as http:
        r = http.put(f"/v1/models/{MODEL}/weights", content=_safetensors({**base, **bias}),
                     headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["lora_dropped"] is True, r.text
    assert _served(client)[2] is None


def _safetensors(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in state.items()})
