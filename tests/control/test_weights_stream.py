"""Streamed weights pushes (Flight do_put) through the real server: no byte cap, every bad chunk a
typed error that changes nothing, one atomic swap under concurrent rollouts, a killed client's
staging freed, a cut push resumed with only what remained, only changed tensors sent, one push
per model at a time. References: digests and rollouts made here from the same weights
(weights_digest, a stock diffusers call), plain pyarrow Flight for the bad chunks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid

import crc32c
import httpx
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from safetensors.torch import save, save_file
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.pipeline.models import ModelRegistry, weights_digest

from sigmaflight import Client
from sigmaflight.client import rollout_spec
from sigmaflight.errors import ApiError
from sigmaflight.weights import WeightsPushError
from tests.pipeline.test_loop_returns import _prompt_inputs, _stock_call
from tests.servers import InProcessServer, ServerProcess, wait_for

MODEL = "tiny-sd3"
SCHEMA = pa.schema([("tensor", pa.utf8()), ("offset", pa.int64()), ("data", pa.binary()), ("crc32c", pa.uint32())])
"""The chunk schema as docs/dataplane.md gives it, written here (not imported from the server)."""


def _base() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ModelRegistry().get(MODEL).pipeline.transformer.state_dict().items()}


def _floats(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k, v in state.items() if v.is_floating_point() and v.numel() > 1)


def _changed(state: dict[str, torch.Tensor], keys: list[str], delta: float) -> dict[str, torch.Tensor]:
    out = dict(state)
    for k in keys:
        out[k] = state[k] + delta
    return out


def _model_with(state: dict[str, torch.Tensor]):
    model = ModelRegistry().get(MODEL)
    model.pipeline.transformer.load_state_dict(state)
    return model


def _digest(state: dict[str, torch.Tensor]) -> str:
    return weights_digest(_model_with(state).pipeline)


def _metrics(client: Client) -> dict[str, float]:
    out = {}
    for line in client._send("GET", "/metrics").text.splitlines():
        m = re.match(r"^(sigmaflight_weights_\w+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _served(client: Client) -> tuple[str, int]:
    (m,) = [m for m in client.models() if m["id"] == MODEL]
    return m["digest"], m["weights_version"]


def _raw(server: InProcessServer, header: dict, chunks: list[tuple[str, int, bytes, int]]) -> bytes | None:
    """One do_put with plain pyarrow: the header and the chunks as given; the answer's bytes."""
    cmd = {"sigmaflight.weights": 1, "model": MODEL, "push_id": uuid.uuid4().hex, "partial": False,
           "base_digest": None, **header}
    with flight.FlightClient(server.flight_url) as fc:
        writer, reader = fc.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), SCHEMA)
        try:
            for name, off, data, crc in chunks:
                writer.write_batch(pa.record_batch([pa.array([name]), pa.array([off], pa.int64()),
                                                    pa.array([data], pa.binary()), pa.array([crc], pa.uint32())],
                                                   schema=SCHEMA))
            writer.done_writing()
            buf = reader.read()
        finally:
            writer.close()
    return None if buf is None else buf.to_pybytes()


def _spec(state: dict[str, torch.Tensor], keys: list[str]) -> dict:
    return {k: {"dtype": str(state[k].dtype).removeprefix("torch."), "shape": list(state[k].shape)} for k in keys}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _ok(data: bytes, off: int = 0) -> tuple[int, bytes, int]:
    return off, data, crc32c.crc32c(data)


def _latents(client: Client, seed: int) -> tuple[dict, torch.Tensor]:
    t = client.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=2, seed=seed,
                      sampler={"type": "ode"})
    client.wait(t, timeout=120)
    traj = client.pull(t)
    return traj.metadata["model"], traj.latents


@pytest.fixture(scope="module")
def server():
    # --max-weights-bytes far below the model's bytes: the streamed push has no byte cap
    with InProcessServer("--workers", "2", "--max-batch-samples", "1", "--max-weights-bytes", "1024",
                       "--weights-push-timeout-s", "5") as s:  # one rollout per model call: a stock call's batch
        yield s


@pytest.fixture
def client(server):
    with Client(server.rest_url) as c:
        c.push_weights(MODEL, _base(), only_changed=False)  # every test starts from the built-in weights
        yield c


def test_the_stream_has_no_byte_cap_and_commits_the_digest_of_the_pushed_weights(server, client):
    base = _base()
    total = sum(v.nbytes for v in base.values())
    assert total > 100 * 1024  # the model is far above --max-weights-bytes=1024
    new = _changed(base, _floats(base), 0.001)
    with pytest.raises(ApiError) as too_big:  # the REST body still has its cap
        client._send("PUT", f"/v1/models/{MODEL}/weights", content=b"x" * 2048,
                     headers={"content-type": "application/octet-stream"})
    assert too_big.value.status == 413
    _, version = _served(client)
    result = client.push_weights(MODEL, new, only_changed=False, chunk_bytes=1000)
    assert result == _digest(new) and result.weights_version == version + 1
    assert result.bytes_sent == total and result.bytes_skipped == 0
    assert _served(client) == (result, version + 1)
    manifest = client.weights_manifest(MODEL)
    assert manifest == {k: f"{crc32c.crc32c(_bytes(v)):08x}" for k, v in new.items()}


def _bad_cases(state: dict[str, torch.Tensor]) -> list[tuple[str, str, dict, list]]:
    """(reason, tensor, header, chunks) of every kind of bad push."""
    k = _floats(state)[0]
    data = _bytes(state[k])
    full = _spec(state, list(state))
    all_ok = [(n, *_ok(_bytes(v))) for n, v in state.items() if n != k]
    half = len(data) // 2
    nan = state[k].clone()
    nan.view(-1)[1] = float("nan")
    wrong_shape = {**full, k: {**full[k], "shape": [*full[k]["shape"], 1]}}
    wrong_dtype = {**full, k: {**full[k], "dtype": "float16"}}
    return [
        ("unknown_tensor", "no.such.key", {"tensors": {**full, "no.such.key": full[k]}}, []),
        ("shape", k, {"tensors": wrong_shape}, []),
        ("dtype", k, {"tensors": wrong_dtype}, []),
        ("missing_tensor", k, {"tensors": {n: s for n, s in full.items() if n != k}}, []),
        ("unknown_tensor", "other.key", {"tensors": _spec(state, [k]), "partial": True},
         [("other.key", *_ok(data))]),
        ("offset", k, {"tensors": _spec(state, [k]), "partial": True}, [(k, *_ok(data[:4], 2))]),
        ("offset", k, {"tensors": _spec(state, [k]), "partial": True}, [(k, *_ok(data, 4))]),
        ("overlap", k, {"tensors": _spec(state, [k]), "partial": True},
         [(k, *_ok(data[:half])), (k, *_ok(data[:half]))]),
        ("overlap", k, {"tensors": _spec(state, [k]), "partial": True},
         [(k, *_ok(data[:half])), (k, *_ok(data[half - 4:], half - 4))]),
        ("checksum", k, {"tensors": _spec(state, [k]), "partial": True}, [(k, 0, data, crc32c.crc32c(data) ^ 1)]),
        ("non_finite", k, {"tensors": _spec(state, [k]), "partial": True}, [(k, *_ok(_bytes(nan)))]),
        ("non_finite", k, {"tensors": full}, [*all_ok, (k, *_ok(_bytes(nan)))]),
    ]


def test_every_bad_chunk_is_a_typed_error_naming_the_tensor_and_changes_nothing(server, client):
    base = _base()
    before_meta, before = _latents(client, seed=5)
    digest, version = _served(client)
    for reason, tensor, header, chunks in _bad_cases(_changed(base, _floats(base), 0.5)):
        with pytest.raises(flight.FlightError) as caught:
            _raw(server, header, chunks)
        info = json.loads(caught.value.extra_info)
        assert (info["type"], info["reason"], info["tensor"]) == ("bad_weights", reason, tensor), (reason, info)
        assert tensor in str(caught.value)
        assert _served(client) == (digest, version), reason
    after_meta, after = _latents(client, seed=5)
    assert after_meta == before_meta and torch.equal(after, before)
    m = _metrics(client)
    assert m["sigmaflight_weights_staged_bytes"] == 0 and m["sigmaflight_weights_pushes_open"] == 0
    assert m['sigmaflight_weights_push_failures_total{reason="checksum"}'] >= 1


def test_concurrent_rollouts_run_on_the_old_or_the_new_weights_never_a_mix(server, client):
    old = _base()
    new = _changed(old, _floats(old), 0.05)
    digests = {_digest(old): old, _digest(new): new}
    results: list[tuple[dict, torch.Tensor, Trajectory]] = []

    def roll(seed: int) -> None:
        t = client.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=3, seed=seed,
                          guidance_scale=3.0, sampler={"type": "ode"})
        client.wait(t, timeout=120)
        traj = client.pull(t)
        results.append((traj.metadata["model"], traj.latents, traj))

    threads = [threading.Thread(target=roll, args=(s,)) for s in range(6)]
    for t in threads[:3]:
        t.start()
    pushed = client.push_weights(MODEL, new, only_changed=False, chunk_bytes=4096)
    for t in threads[3:]:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert pushed in digests and len(results) == 6
    assert {meta["digest"] for meta, _, _ in results} <= set(digests)
    for meta, _, traj in results:
        model = _model_with(digests[meta["digest"]])
        spec = rollout_spec(traj)
        steps, _ = _stock_call(model, spec, traj.latent(0), **_prompt_inputs(model, spec))
        for i, stock in enumerate(steps, start=1):
            assert torch.equal(traj.latent(i), stock.cpu()), f"x_{i} of a rollout on {meta['digest'][:8]}"


_HALF_PUSH = """
import json, sys, time, numpy as np, pyarrow as pa, pyarrow.flight as flight, crc32c
url, header, path = sys.argv[1], sys.argv[2], sys.argv[3]
schema = pa.schema([("tensor", pa.utf8()), ("offset", pa.int64()), ("data", pa.binary()), ("crc32c", pa.uint32())])
chunks = json.load(open(path))
fc = flight.FlightClient(url)
writer, _ = fc.do_put(flight.FlightDescriptor.for_command(header.encode()), schema)
for name, off, hexdata in chunks:
    data = bytes.fromhex(hexdata)
    writer.write_batch(pa.record_batch([pa.array([name]), pa.array([off], pa.int64()), pa.array([data]),
                                        pa.array([crc32c.crc32c(data)], pa.uint32())], schema=schema))
print("sent", flush=True)
time.sleep(600)
"""


def _start_half_push(server, tmp_path, state, push_id, chunk=1024):
    """A subprocess that streams the first half of a full push's chunks and then hangs."""
    chunks = []
    for name in sorted(state):
        data = _bytes(state[name])
        chunks += [(name, off, data[off:off + chunk].hex()) for off in range(0, len(data), chunk)]
    path = tmp_path / "chunks.json"
    path.write_text(json.dumps(chunks[: len(chunks) // 2]))
    header = {"sigmaflight.weights": 1, "model": MODEL, "push_id": push_id, "partial": False,
              "base_digest": None, "tensors": _spec(state, sorted(state))}
    proc = subprocess.Popen([sys.executable, "-c", _HALF_PUSH, server.flight_url, json.dumps(header), str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
    sent = sum(len(bytes.fromhex(h)) for _, _, h in chunks[: len(chunks) // 2])
    return proc, sent


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def test_a_killed_client_leaves_the_weights_and_a_second_push_waits_then_staging_is_freed(server, client, tmp_path):
    base = _base()
    new = _changed(base, _floats(base), 0.25)
    digest, version = _served(client)
    before = _metrics(client)
    holder = uuid.uuid4().hex
    proc, sent = _start_half_push(server, tmp_path, new, holder)
    try:
        wait_for(lambda: _metrics(client)["sigmaflight_weights_pushed_bytes_total"]
                 >= before["sigmaflight_weights_pushed_bytes_total"] + sent, "the half push's bytes at the server")
        with pytest.raises(WeightsPushError) as busy:  # a second push to the model: a typed conflict at once
            client.push_weights(MODEL, new, only_changed=False)
        assert (busy.value.status, busy.value.type, busy.value.reason) == (409, "conflict", "push_in_progress")
        # the push that holds the model, to resume (it was only in the message; .push_id is the refused one's)
        assert busy.value.in_progress == holder and busy.value.push_id != holder
    finally:
        _kill(proc)
    assert _served(client) == (digest, version)
    wait_for(lambda: _metrics(client)["sigmaflight_weights_pushes_open"] == 0, "the cut push expired", 30)
    m = _metrics(client)
    assert m["sigmaflight_weights_staged_bytes"] == 0
    assert m['sigmaflight_weights_push_failures_total{reason="expired"}'] >= 1
    assert _served(client) == (digest, version)
    assert client.push_weights(MODEL, new) == _digest(new)  # the model takes pushes again


@pytest.mark.parametrize("chunk_bytes", [1024, 1000, 8 << 20], ids=["same-chunks", "other-cuts", "default-chunks"])
def test_a_cut_push_resumes_sending_only_what_remained(server, client, tmp_path, chunk_bytes):
    """The cut push sent 1 KiB chunks. A resume with other chunk_bytes (another process with the
    default) sent whole chunks that overlapped what the server held, and the server refused the push
    ("overlap") and dropped it: only the bytes no received range covers travel now."""
    base = _base()
    new = _changed(base, _floats(base), -0.125)
    push_id = uuid.uuid4().hex
    before = _metrics(client)["sigmaflight_weights_pushed_bytes_total"]
    proc, sent = _start_half_push(server, tmp_path, new, push_id)
    wait_for(lambda: _metrics(client)["sigmaflight_weights_pushed_bytes_total"] >= before + sent,
             "the half push's bytes at the server")
    _kill(proc)  # the cut
    result = client.push_weights(MODEL, new, only_changed=False, push_id=push_id, chunk_bytes=chunk_bytes)
    total = sum(v.nbytes for v in new.values())
    assert result == _digest(new) and result.bytes_sent == total  # the server holds every byte once
    assert _metrics(client)["sigmaflight_weights_pushed_bytes_total"] - before == total  # the half + the rest


def test_only_changed_tensors_travel_and_nothing_changed_answers_at_once(server, client):
    base = _base()
    keys = _floats(base)
    one = _changed(base, keys[:1], 0.01)
    nbytes = one[keys[0]].nbytes
    before = _metrics(client)["sigmaflight_weights_pushed_bytes_total"]
    result = client.push_weights(MODEL, one)
    assert result == _digest(one) and result.bytes_sent == nbytes
    assert result.bytes_skipped == sum(v.nbytes for v in base.values()) - nbytes
    assert _metrics(client)["sigmaflight_weights_pushed_bytes_total"] - before == nbytes
    again = client.push_weights(MODEL, one)  # nothing changed: no stream, the same digest and version
    assert (again, again.weights_version, again.bytes_sent) == (result, result.weights_version, 0)
    assert _metrics(client)["sigmaflight_weights_pushed_bytes_total"] - before == nbytes
    two = _changed(one, keys[1:2], 0.02)
    part = client.push_weights(MODEL, {keys[1]: two[keys[1]]}, partial=True)  # the others kept as served
    assert part == _digest(two) and part.weights_version == result.weights_version + 1
    with pytest.raises(WeightsPushError, match="missing") as missing:
        client.push_weights(MODEL, {keys[1]: two[keys[1]]})
    assert missing.value.status == 422 and missing.value.details[0]["loc"] == ["body", sorted(set(base) - {keys[1]})[0]]
    assert np.isclose(_metrics(client)["sigmaflight_weights_pushed_bytes_total"] - before,
                      nbytes + two[keys[1]].nbytes)


@pytest.mark.parametrize(("retyped", "reason"), [(lambda t: t.reshape(-1), "shape"),
                                                 (lambda t: t.view(torch.int32), "dtype")], ids=["reshaped", "viewed"])
def test_a_tensor_of_another_shape_or_dtype_with_the_served_bytes_is_refused_not_skipped(server, client, retyped,
                                                                                          reason):
    """only_changed compared the bytes' CRC32C alone: a reshaped (or re-viewed) tensor with the served
    bytes was skipped as unchanged and the push answered success, hiding the trainer's bug. The
    manifest gives each tensor's dtype and shape; such a tensor is sent and refused, as without
    only_changed."""
    base = _base()
    client.push_weights(MODEL, base)  # the served tensors are these bytes
    served = _served(client)
    key = next(k for k in _floats(base) if base[k].dim() > 1)
    assert base[key].dtype == torch.float32
    for only_changed in (True, False):
        with pytest.raises(WeightsPushError) as refused:
            client.push_weights(MODEL, {key: retyped(base[key])}, partial=True, only_changed=only_changed)
        assert (refused.value.reason, refused.value.tensor) == (reason, key)
    assert _served(client) == served


@pytest.fixture(scope="module")
def put_server():
    """The default --max-weights-bytes (512 MiB): the PUT bodies below fit it."""
    with InProcessServer("--workers", "1") as s:
        yield s


def _put(server: InProcessServer, body, length: int) -> httpx.Response:
    with server.client() as http:
        return http.put(f"/v1/models/{MODEL}/weights", content=body,
                        headers={"content-type": "application/octet-stream", "content-length": str(length)})


def test_a_put_body_is_staged_as_it_arrives_in_pieces_that_split_elements(put_server):
    new = _changed(_base(), _floats(_base()), 0.375)
    body = save(new)
    r = _put(put_server, (body[i:i + 777] for i in range(0, len(body), 777)), len(body))
    assert r.status_code == 200, r.text
    assert r.json()["digest"] == _digest(new) and r.json()["tensors"] == len(new)


def test_a_put_body_is_checked_as_it_arrives_and_refused_before_it_ends(put_server):
    client = Client(put_server.rest_url)
    state = _base()
    body = bytearray(save(state))
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + n])
    first = min((k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32"),
                key=lambda k: header[k]["data_offsets"][0])
    start, end = header[first]["data_offsets"]
    body[8 + n + start:8 + n + start + 4] = np.array([np.nan], np.float32).tobytes()
    digest, version = _served(client)
    failures = _metrics(client).get('sigmaflight_weights_push_failures_total{reason="non_finite"}', 0)
    go = threading.Event()
    answer: list[object] = []

    def pieces():
        yield bytes(body[:8 + n + end])  # the header and the tensor holding the NaN
        go.wait(60)  # the rest only once the test has seen the refusal
        yield bytes(body[8 + n + end:])

    def send() -> None:
        try:
            answer.append(_put(put_server, pieces(), len(body)))
        except httpx.HTTPError as exc:  # the server may close the connection once it has answered
            answer.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_for(lambda: _metrics(client).get('sigmaflight_weights_push_failures_total{reason="non_finite"}', 0)
                 > failures, "the NaN refused while the body is still arriving")
        assert not go.is_set() and sender.is_alive()
    finally:
        go.set()
        sender.join(60)
    if isinstance(answer[0], httpx.Response):
        assert answer[0].status_code == 422 and answer[0].json()["error"]["details"][0]["loc"] == ["body", first]
    assert _served(client) == (digest, version)
    assert _metrics(client)["sigmaflight_weights_staged_bytes"] == 0
    client.close()


def test_the_push_stream_takes_the_bearer_token_as_pulls_do(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("push-token-0123456789\n")
    new = _changed(_base(), _floats(_base())[:1], 0.5)
    with InProcessServer("--token-file", str(tokens), "--workers", "1") as s:
        with Client(s.rest_url, token="push-token-0123456789") as ok:
            assert ok.push_weights(MODEL, new) == _digest(new)
            manifest = ok._send("GET", f"/v1/models/{MODEL}/weights/manifest").json()
        cmd = {"sigmaflight.weights": 1, "model": MODEL, "push_id": "x", "partial": True, "base_digest": None,
               "tensors": _spec(new, _floats(new)[:1])}
        with flight.FlightClient(manifest["flight"]["locations"][0]) as fc:  # no token on the stream
            with pytest.raises(flight.FlightUnauthenticatedError):
                writer, _ = fc.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), SCHEMA)
                writer.done_writing()
                writer.close()
        with Client(s.rest_url, token="push-token-0123456789") as ok:
            assert _served(ok) == (manifest["digest"], manifest["weights_version"])


@pytest.mark.e2e
def test_a_server_killed_mid_push_restarts_on_its_weights_with_nothing_stored_lost(tmp_path):
    data = tmp_path / "data"
    flags = ("--data-dir", str(data), "--workers", "1")
    new = _changed(_base(), _floats(_base()), 0.125)
    with ServerProcess(*flags) as s, Client(s.rest_url) as c:
        ticket = c.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=2, seed=3)
        c.wait(ticket, timeout=120)
        stored = c.pull(ticket).latents
        digest, version = _served(c)
        before = _metrics(c)["sigmaflight_weights_pushed_bytes_total"]
        proc, sent = _start_half_push(s, tmp_path, new, uuid.uuid4().hex)
        try:
            wait_for(lambda: _metrics(c)["sigmaflight_weights_pushed_bytes_total"] >= before + sent,
                     "the half push at the server")
            s.kill()  # kill -9, staging in its memory
        finally:
            _kill(proc)
    with InProcessServer(*flags) as restarted, Client(restarted.rest_url) as c:
        assert _served(c) == (digest, version)  # the weights it loads at start-up, never a part of the push
        assert torch.equal(c.pull(ticket.id).latents, stored)  # by id: the new Flight port
        m = _metrics(c)
        assert m["sigmaflight_weights_staged_bytes"] == 0 and m["sigmaflight_weights_pushes_open"] == 0


@pytest.mark.e2e
def test_a_push_whose_server_dies_under_it_is_server_unreachable_without_grpc_text():
    """trainers.md: errors carry no transport debug text, and a server that is gone is
    ServerUnreachable. A push cut by kill -9 raised pyarrow's FlightUnavailableError with gRPC's
    debug context, after its retries."""
    from sigmaflight.errors import ServerUnreachable

    new = _changed(_base(), _floats(_base()), 0.25)
    with ServerProcess("--workers", "1") as s, Client(s.rest_url) as c:
        got: dict[str, BaseException | None] = {}

        def push() -> None:
            try:  # 4-byte chunks: a push of some 10^5 messages, still under way when the server dies
                c.push_weights(MODEL, new, only_changed=False, chunk_bytes=4, progress=False)
                got["error"] = None
            except BaseException as exc:  # for the asserting thread
                got["error"] = exc

        pusher = threading.Thread(target=push)
        pusher.start()
        wait_for(lambda: _metrics(c)["sigmaflight_weights_pushes_open"] >= 1, "the push is open at the server")
        s.kill()
        pusher.join(timeout=120)
    error = got.get("error")
    assert isinstance(error, ServerUnreachable), repr(error)
    assert "debug context" not in str(error) and "the model keeps the weights it had" in str(error)


def test_a_same_host_file_push_is_checked_and_swapped_like_a_stream(tmp_path):
    allowed, outside = tmp_path / "pushes", tmp_path / "elsewhere"
    allowed.mkdir()
    outside.mkdir()
    base = _base()
    new = _changed(base, _floats(base), 0.0625)
    keys = _floats(base)
    nan = {**new, keys[0]: torch.full_like(new[keys[0]], float("inf"))}
    save_file(new, allowed / "new.safetensors")
    save_file(nan, allowed / "nan.safetensors")
    save_file(new, outside / "new.safetensors")
    (allowed / "link.safetensors").symlink_to(outside / "new.safetensors")
    save_file({keys[1]: new[keys[1]] + 1}, allowed / "one.safetensors")
    with InProcessServer("--weights-file-dir", str(allowed), "--workers", "1") as s, Client(s.rest_url) as c:
        digest, version = _served(c)
        for name, where in (("nan.safetensors", allowed), ("new.safetensors", outside), ("link.safetensors", allowed)):
            with pytest.raises(ApiError) as refused:
                c.push_weights_file(MODEL, str(where / name))
            assert refused.value.status == 422, name
            assert refused.value.details[0]["loc"] == (["body", keys[0]] if name == "nan.safetensors" else
                                                       ["body", "path"]), refused.value.details
        assert _served(c) == (digest, version)
        result = c.push_weights_file(MODEL, str(allowed / "new.safetensors"))
        assert result == _digest(new) and result.weights_version == version + 1
        part = c.push_weights_file(MODEL, str(allowed / "one.safetensors"), partial=True)
        assert part == _digest({**new, keys[1]: new[keys[1]] + 1})


def test_progress_shows_bytes_and_rate_when_asked(server, client, capsys):
    new = _changed(_base(), _floats(_base())[:2], 0.75)
    client.push_weights(MODEL, new, progress=True, chunk_bytes=1024)
    err = capsys.readouterr().err
    assert f"push {MODEL}" in err and "B/s" in err and "100%" in err
    client.push_weights(MODEL, _changed(new, _floats(new)[:1], 0.5), progress=False)
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def in_place_server():
    with InProcessServer("--workers", "2", "--max-batch-samples", "1", "--weights-swap", "in-place",
                       "--weights-push-timeout-s", "5") as s:
        yield s


def _stock_equal(traj: Trajectory, state: dict[str, torch.Tensor]) -> None:
    """Every latent of an ode trajectory equals a stock diffusers call on `state` (torch.equal)."""
    model = _model_with(state)
    spec = rollout_spec(traj)
    steps, _ = _stock_call(model, spec, traj.latent(0), **_prompt_inputs(model, spec))
    for i, stock in enumerate(steps, start=1):
        assert torch.equal(traj.latent(i), stock.cpu()), f"x_{i}"


def _roll(client: Client, seed: int) -> Trajectory:
    t = client.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=3, seed=seed, guidance_scale=3.0,
                      sampler={"type": "ode"})
    client.wait(t, timeout=120)
    return client.pull(t)


def test_an_in_place_push_commits_into_the_served_weights_and_rollouts_run_on_them(in_place_server):
    with Client(in_place_server.rest_url) as client:
        new = _changed(_base(), _floats(_base()), 0.03)
        pushed = client.push_weights(MODEL, new, only_changed=False, chunk_bytes=4096)
        assert pushed == _digest(new) and _served(client)[0] == pushed
        traj = _roll(client, seed=11)
        assert traj.metadata["model"]["digest"] == pushed
        _stock_equal(traj, new)
        m = _metrics(client)
        assert m["sigmaflight_weights_staged_bytes"] == 0 and m["sigmaflight_weights_pushes_open"] == 0


def test_a_bad_chunk_mid_in_place_push_fails_the_model_closed_until_a_full_push(in_place_server):
    with Client(in_place_server.rest_url) as client:
        base = _base()
        client.push_weights(MODEL, base, only_changed=False)
        new = _changed(base, _floats(base), 0.07)
        keys = sorted(new)
        bad = keys[len(keys) // 2]
        data = _bytes(new[bad])
        chunks = [(k, *_ok(_bytes(new[k]))) for k in keys[:len(keys) // 2]]  # half the tensors land...
        chunks.append((bad, 0, data, crc32c.crc32c(data) ^ 1))  # ...then a chunk whose checksum is wrong
        with pytest.raises(flight.FlightError) as caught:
            _raw(in_place_server, {"tensors": _spec(new, keys)}, chunks)
        info = json.loads(caught.value.extra_info)
        assert (info["reason"], info["tensor"]) == ("checksum", bad)
        with pytest.raises(ApiError) as refused:  # a rollout submitted now is refused, naming why
            _roll(client, seed=3)
        assert (refused.value.status, refused.value.type) == (503, "weights_failed")
        assert "checksum" in refused.value.message and refused.value.details["reason"] == "checksum"
        ready = httpx.get(f"{in_place_server.rest_url}/readyz")
        assert ready.status_code == 503 and ready.json()["weights_failed"] == {MODEL: "checksum"}
        with pytest.raises(WeightsPushError) as partial:  # a partial push cannot vouch for the rest
            client.push_weights(MODEL, {keys[0]: new[keys[0]]}, partial=True)
        assert (partial.value.type, partial.value.reason) == ("conflict", "model_failed")
        pushed = client.push_weights(MODEL, new, only_changed=False, chunk_bytes=4096)  # a full push reopens it
        assert pushed == _digest(new)
        assert httpx.get(f"{in_place_server.rest_url}/readyz").status_code == 200
        traj = _roll(client, seed=3)
        assert traj.metadata["model"]["digest"] == pushed
        _stock_equal(traj, new)


def test_a_cut_in_place_push_holds_rollouts_then_expires_and_fails_the_model_closed(in_place_server, tmp_path):
    with Client(in_place_server.rest_url) as client:
        base = _base()
        client.push_weights(MODEL, base, only_changed=False)
        new = _changed(base, _floats(base), -0.02)
        proc, _ = _start_half_push(in_place_server, tmp_path, new, uuid.uuid4().hex)
        try:
            wait_for(lambda: _metrics(client)["sigmaflight_weights_pushes_open"] == 1, "the half push open")
            held = client.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=2, seed=1,
                                 sampler={"type": "ode"})  # accepted: the model is held, not failed yet
            assert client.status(held).status == "queued" or client.status(held).status == "running"
        finally:
            _kill(proc)
        status = client.wait(held, timeout=120, raise_on_failure=False)  # the push expires (5 s) and the held
        assert status.status == "failed" and status.error is not None  # rollout is refused, naming why
        assert (status.error.type, "expired" in status.error.message) == ("weights_failed", True)
        ready = httpx.get(f"{in_place_server.rest_url}/readyz")
        assert ready.status_code == 503 and ready.json()["weights_failed"] == {MODEL: "expired"}
        assert client.push_weights(MODEL, new, only_changed=False) == _digest(new)
        _stock_equal(_roll(client, seed=1), new)


def _open_silent(fc: flight.FlightClient, state: dict[str, torch.Tensor]):
    """A do_put of a full push opened with plain pyarrow: header and schema sent, no chunk yet."""
    cmd = {"sigmaflight.weights": 1, "model": MODEL, "push_id": uuid.uuid4().hex, "partial": False,
           "base_digest": None, "tensors": _spec(state, sorted(state))}
    return fc.do_put(flight.FlightDescriptor.for_command(json.dumps(cmd).encode()), SCHEMA)


def _chunk(name: str, data: bytes) -> pa.RecordBatch:
    return pa.record_batch([pa.array([name]), pa.array([0], pa.int64()), pa.array([data], pa.binary()),
                            pa.array([crc32c.crc32c(data)], pa.uint32())], schema=SCHEMA)


def _late_chunk_is_refused_expired(writer, reader, chunk: pa.RecordBatch) -> None:
    with pytest.raises(flight.FlightError) as late:  # at the latest when the stream closes
        writer.write_batch(chunk)
        writer.done_writing()
        reader.read()
        writer.close()
    # operations.md: refused `bad_weights`, reason `expired` (it was `not_found`: the client raised
    # WeightsPushNotFound, the error of an unknown model)
    info = json.loads(late.value.extra_info)
    assert (info["type"], info["reason"]) == ("bad_weights", "expired"), info


@contextlib.contextmanager
def _silent_push(flight_url: str, client: Client, new: dict[str, torch.Tensor]):
    """A full push of `new` that writes its first tensor into the served weights and goes silent:
    (writer, reader) once the server counts it open; closed on the way out."""
    name = sorted(new)[0]
    with flight.FlightClient(flight_url) as fc:
        writer, reader = _open_silent(fc, new)
        try:
            writer.write_batch(_chunk(name, _bytes(new[name])))
            wait_for(lambda: _metrics(client)["sigmaflight_weights_pushes_open"] == 1, "the silent push open")
            yield writer, reader
        finally:
            with contextlib.suppress(pa.ArrowException):
                writer.close()


def test_a_member_cancelled_while_a_push_holds_its_batch_ends_at_once_and_the_other_waits_on():
    """Two rollouts co-batched (--batch-wait-ms) wait while a silent in-place push holds the model:
    cancelling one ends it at once (not when the push expires), the other waits on and then
    fails with the push (weights_failed)."""
    with InProcessServer("--workers", "1", "--weights-swap", "in-place", "--weights-push-timeout-s", "8",
                         "--batch-wait-ms", "300") as s, Client(s.rest_url) as client:
        with _silent_push(s.flight_url, client, _changed(_base(), _floats(_base()), 0.05)):
            a, b = (client.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=2, seed=seed,
                                  sampler={"type": "ode"}) for seed in (1, 2))
            wait_for(lambda: client.status(a).status == client.status(b).status == "running", "both held")
            client.cancel(a)
            assert client.wait(a, timeout=3, raise_on_failure=False).status == "cancelled"
            assert client.status(b).status == "running"
            failed = client.wait(b, timeout=30, raise_on_failure=False)
            assert failed.status == "failed" and failed.error is not None
            assert failed.error.type == "weights_failed", failed.error


def test_an_open_push_stream_that_sends_nothing_expires_and_the_model_takes_pushes_again(server, client):
    base = _base()
    new = _changed(base, _floats(base), 0.375)
    served = _served(client)
    expired = _metrics(client).get('sigmaflight_weights_push_failures_total{reason="expired"}', 0)
    with flight.FlightClient(server.flight_url) as fc:
        writer, reader = _open_silent(fc, new)
        try:
            wait_for(lambda: _metrics(client)["sigmaflight_weights_pushes_open"] == 1, "the silent push open")
            with pytest.raises(WeightsPushError) as busy:
                client.push_weights(MODEL, new, only_changed=False)
            assert busy.value.reason == "push_in_progress"
            wait_for(lambda: _metrics(client)["sigmaflight_weights_pushes_open"] == 0,
                     "the silent push expired (--weights-push-timeout-s 5)", 30)
            m = _metrics(client)
            assert m["sigmaflight_weights_staged_bytes"] == 0
            assert m['sigmaflight_weights_push_failures_total{reason="expired"}'] == expired + 1
            assert _served(client) == served
            assert client.push_weights(MODEL, new, only_changed=False) == _digest(new)
            name = sorted(new)[0]
            _late_chunk_is_refused_expired(writer, reader, _chunk(name, _bytes(new[name])))
        finally:
            with contextlib.suppress(pa.ArrowException):
                writer.close()
    assert _served(client)[0] == _digest(new)


def test_a_rollout_held_by_a_silent_in_place_push_is_cancelled_at_once(in_place_server):
    """The push writes one tensor into the served weights and goes silent: a rollout submitted then
    waits for it, and a cancel ends that rollout cancelled (not when the push expires, and not
    failed by the model failing closed). The push then expires and fails the model closed."""
    with Client(in_place_server.rest_url) as client:
        base = _base()
        client.push_weights(MODEL, base, only_changed=False)
        new = _changed(base, _floats(base), 0.05)
        with _silent_push(in_place_server.flight_url, client, new) as (writer, reader):
            held = client.submit(model=MODEL, prompts=["a red cube"], num_inference_steps=2, seed=5,
                                 sampler={"type": "ode"})
            wait_for(lambda: client.status(held).status == "running", "the rollout held by the push")
            client.cancel(held)
            status = client.wait(held, timeout=3, raise_on_failure=False)  # the push expires only after 5 s
            assert status.status == "cancelled", status
            wait_for(lambda: _metrics(client)["sigmaflight_weights_pushes_open"] == 0, "the push expired", 30)
            ready = httpx.get(f"{in_place_server.rest_url}/readyz")
            assert ready.status_code == 503 and ready.json()["weights_failed"] == {MODEL: "expired"}
            second = sorted(new)[1]
            _late_chunk_is_refused_expired(writer, reader, _chunk(second, _bytes(new[second])))
        assert client.push_weights(MODEL, new, only_changed=False) == _digest(new)
        assert httpx.get(f"{in_place_server.rest_url}/readyz").status_code == 200
