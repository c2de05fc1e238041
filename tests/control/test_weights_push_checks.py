"""Weights pushes through the real server, the real Client and plain pyarrow Flight: a chunked
PUT .../weights while a streamed push is cut and pending is a 409 push_in_progress as a
Content-Length PUT is; any chunk_bytes works; a partial only_changed push sends only what
differs; the push header's "partial" must be a bool."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import crc32c
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from safetensors.torch import save

from sigmaflight import Client, NotFound
from sigmaflight.weights import WeightsPushError
from tests.servers import InProcessServer

MODEL = "tiny-sd3"
OCTET = {"content-type": "application/octet-stream"}
SCHEMA = pa.schema([("tensor", pa.utf8()), ("offset", pa.int64()), ("data", pa.binary()), ("crc32c", pa.uint32())])
"""The chunk schema as docs/dataplane.md gives it."""


def _base() -> dict[str, torch.Tensor]:
    from sigmaflight.pipeline.models import ModelRegistry  # the same seeded weights as the server's

    return {k: v.clone() for k, v in ModelRegistry().get(MODEL).pipeline.transformer.state_dict().items()}


def _scaled(state: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor if v.is_floating_point() else v for k, v in state.items()}


def _digest(state: dict[str, torch.Tensor]) -> str:
    from sigmaflight.pipeline.models import ModelRegistry, weights_digest

    model = ModelRegistry().get(MODEL)
    model.pipeline.transformer.load_state_dict(state)
    return weights_digest(model.pipeline)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _do_put(server: InProcessServer, header: dict, chunks: list[tuple[str, bytes]]) -> bytes | None:
    """One do_put with plain pyarrow: the header and whole-tensor chunks (offset 0); the answer."""
    cmd = {"sigmaflight.weights": 1, "model": MODEL, "push_id": uuid.uuid4().hex, "partial": False,
           "base_digest": None, **header}
    with flight.FlightClient(server.flight_url) as fc:
        writer, reader = fc.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), SCHEMA)
        try:
            for name, data in chunks:
                writer.write_batch(pa.record_batch([pa.array([name]), pa.array([0], pa.int64()),
                                                    pa.array([data], pa.binary()),
                                                    pa.array([crc32c.crc32c(data)], pa.uint32())], schema=SCHEMA))
            writer.done_writing()
            buf = reader.read()
        finally:
            writer.close()
    return None if buf is None else buf.to_pybytes()


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with InProcessServer("--workers", "1", "--weights-push-timeout-s", "60") as s:
        yield s


@pytest.fixture
def client(server: InProcessServer) -> Iterator[Client]:
    with Client(server.rest_url) as c:
        c.push_weights(MODEL, _base(), only_changed=False)  # every test starts from the built-in weights
        yield c


def _served(client: Client) -> tuple[str, int]:
    (m,) = [m for m in client.models() if m["id"] == MODEL]
    return m["digest"], m["weights_version"]


def _chunked(body: bytes) -> Iterator[bytes]:
    """A body httpx sends chunked (Transfer-Encoding, no Content-Length)."""
    for i in range(0, len(body), 4096):
        yield body[i:i + 4096]


@pytest.mark.timeout(120)
def test_a_chunked_put_is_409_while_a_streamed_push_is_cut_and_pending(server: InProcessServer,
                                                                       client: Client) -> None:
    """A chunked PUT went around the push registry: it committed, and the pending push,
    resumed, committed over it."""
    base = _base()
    pending = _scaled(base, 1.02)
    push_id = uuid.uuid4().hex
    spec = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in pending.items()}
    with pytest.raises(flight.FlightError) as cut:  # an early end: kept for a resume
        _do_put(server, {"push_id": push_id, "tensors": spec}, [(k, _bytes(pending[k])) for k in sorted(pending)[:5]])
    assert json.loads(cut.value.extra_info)["reason"] == "incomplete"
    before = _served(client)
    body = save(_scaled(base, 1.05))
    with server.client() as http:
        sized = http.put(f"/v1/models/{MODEL}/weights", content=body, headers=OCTET)
        chunked = http.put(f"/v1/models/{MODEL}/weights", content=_chunked(body), headers=OCTET)
    assert "content-length" not in chunked.request.headers
    assert (sized.status_code, sized.json()["error"]["type"]) == (409, "push_in_progress"), sized.text
    assert (chunked.status_code, chunked.json()["error"]["type"]) == (409, "push_in_progress"), chunked.text
    assert _served(client) == before
    resumed = client.push_weights(MODEL, pending, only_changed=False, push_id=push_id)
    assert resumed == _digest(pending) and resumed.weights_version == before[1] + 1


@pytest.mark.timeout(120)
def test_a_chunked_put_alone_commits_and_a_bad_one_is_422_naming_the_key(server: InProcessServer,
                                                                         client: Client) -> None:
    """The chunked PUT now goes the streamed PUT's way: the same answer and the same refusals."""
    new = _scaled(_base(), 1.05)
    digest, version = _served(client)
    with server.client() as http:
        ok = http.put(f"/v1/models/{MODEL}/weights", content=_chunked(save(new)), headers=OCTET)
        assert ok.status_code == 200, ok.text
        assert ok.json() == {"id": MODEL, "digest": _digest(new), "weights_version": version + 1,
                             "tensors": len(new), "lora_dropped": False}
        key = sorted(new)[0]
        nan = dict(new)
        nan[key] = new[key].clone()
        nan[key].view(-1)[0] = float("nan")
        short = {k: v for k, v in new.items() if k != key}
        for bad, loc in ((nan, ["body", key]), (short, ["body", key]), (None, ["body"])):
            body = save(bad) if bad is not None else b"not safetensors"
            r = http.put(f"/v1/models/{MODEL}/weights", content=_chunked(body), headers=OCTET)
            assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == loc, r.text
    assert _served(client) == (ok.json()["digest"], version + 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk_bytes", [1, 3, 6, 4097])
def test_any_chunk_bytes_pushes_whole_elements(client: Client, chunk_bytes: int) -> None:
    """A chunk_bytes that is not a multiple of the element size cut float32 tensors
    mid-element and every push was refused (422 reason "offset")."""
    base = _base()
    keys = ["proj_out.bias", "pos_embed.proj.bias"] if chunk_bytes < 8 else sorted(base)
    new = {k: base[k] + 0.25 for k in keys}
    _, version = _served(client)
    result = client.push_weights(MODEL, new, partial=True, chunk_bytes=chunk_bytes)
    assert result == _digest({**base, **new}) and result.weights_version == version + 1
    assert result.bytes_sent == sum(v.nbytes for v in new.values())
    with pytest.raises(ValueError, match="chunk_bytes"):
        client.push_weights(MODEL, new, partial=True, chunk_bytes=0)


@pytest.mark.timeout(120)
def test_a_partial_only_changed_push_sends_only_what_differs(client: Client) -> None:
    """`partial=True` sent every given tensor: an identical push bumped weights_version
    (which max_staleness counts)."""
    base = _base()
    digest, version = _served(client)
    same = client.push_weights(MODEL, {"proj_out.bias": base["proj_out.bias"]}, partial=True)
    assert (same, same.weights_version, same.bytes_sent) == (digest, version, 0)
    assert _served(client) == (digest, version)
    changed = base["proj_out.weight"] + 0.5
    one = client.push_weights(MODEL, {"proj_out.bias": base["proj_out.bias"], "proj_out.weight": changed},
                              partial=True)
    assert one == _digest({**base, "proj_out.weight": changed}) and one.weights_version == version + 1
    assert (one.tensors, one.bytes_sent) == (1, changed.nbytes)  # the bias, unchanged, was not sent
    every = client.push_weights(MODEL, {"proj_out.weight": changed}, partial=True, only_changed=False)
    assert every == one and every.weights_version == version + 2 and every.bytes_sent == changed.nbytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partial", ["no", "", 1, None, [True]])
def test_the_push_header_partial_must_be_a_bool(server: InProcessServer, client: Client, partial: object) -> None:
    """A header with "partial": "no" ran as a partial push (bool("no"))."""
    base = _base()
    before = _served(client)
    key = "proj_out.bias"
    spec = {key: {"dtype": "float32", "shape": list(base[key].shape)}}
    with pytest.raises(flight.FlightError) as caught:
        _do_put(server, {"partial": partial, "tensors": spec}, [(key, _bytes(base[key] + 1))])
    info = json.loads(caught.value.extra_info)
    assert (info["type"], info["reason"]) == ("bad_weights", "bad_header"), info
    assert "'partial'" in str(caught.value)
    assert _served(client) == before


@pytest.mark.timeout(60)
def test_the_push_header_partial_as_a_bool_still_works(server: InProcessServer, client: Client) -> None:
    base = _base()
    key = "proj_out.bias"
    spec = {key: {"dtype": "float32", "shape": list(base[key].shape)}}
    answer = json.loads(_do_put(server, {"partial": True, "tensors": spec}, [(key, _bytes(base[key] + 1))]) or b"{}")
    assert answer["digest"] == _digest({**base, key: base[key] + 1})
    with pytest.raises(flight.FlightError):  # false: a full push needs every tensor
        _do_put(server, {"partial": False, "tensors": spec}, [(key, _bytes(base[key]))])



@pytest.mark.timeout(120)
def test_bad_push_arguments_are_named_and_an_unknown_model_is_a_weights_push_error(client: Client) -> None:
    """retries=-1 raised AssertionError("unreachable") (the retry loop never ran), a numpy array
    AttributeError: 'numpy.ndarray' object has no attribute 'detach', and a push to an unknown
    model the manifest GET's NotFound, which `except WeightsPushError` missed."""
    before = _served(client)
    base = _base()
    new = _scaled(base, 0.5)
    for kwargs in ({"retries": -1}, {"retries": 1.5}, {"retries": True}, {"chunk_bytes": 0}, {"chunk_bytes": 2.0},
                   {"push_id": ""}, {"push_id": "x" * 201}, {"push_id": "a\ud800"}, {"push_id": 7}):
        with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must be"):
            client.push_weights(MODEL, new, **kwargs)
    key = sorted(base)[3]
    with pytest.raises(TypeError, match=f"state_dict\\[{key!r}\\] must be a torch.Tensor, not numpy.ndarray"):
        client.push_weights(MODEL, {**new, key: new[key].numpy()})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="state_dict keys must be str"):
        client.push_weights(MODEL, {**new, 3: new[key]}, partial=True)  # type: ignore[dict-item]
    assert _served(client) == before
    for model in ("no-such-model", "../rollouts"):
        with pytest.raises(WeightsPushError) as info:
            client.push_weights(model, new)
        assert (info.value.status, info.value.type, info.value.reason) == (404, "not_found", "unknown_model")
        assert isinstance(info.value, NotFound) and model in info.value.message


@pytest.mark.timeout(120)
def test_a_body_with_bytes_after_its_last_tensor_is_422_sized_or_chunked(server: InProcessServer,
                                                                         client: Client) -> None:
    """The safetensors format indexes its data section entirely (its own reader refuses more): a
    PUT with bytes after the last tensor's was served as if they were not there."""
    body = save(_scaled(_base(), 1.07)) + b"\0" * 16
    before = _served(client)
    with server.client() as http:
        for content in (body, _chunked(body)):
            r = http.put(f"/v1/models/{MODEL}/weights", content=content, headers=OCTET)
            assert r.status_code == 422, r.text
            assert "the 16 data bytes after the last tensor's belong to no tensor" in r.json()["error"]["message"]
    assert _served(client) == before
