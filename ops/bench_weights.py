"""A LoRA push against a full weights push of the same model: wall time and peak RSS, one run.

Each push starts from safetensors bytes (what `PUT /v1/models/{id}/weights` or `.../lora`
receives) and ends with the new weights swapped in: parse (`sigmaflight.pipeline.safetensors_io.read_safetensors`,
zero-copy; a third line shows `safetensors.torch.load`, which copies), check,
build the new transformer, digest. Full push: the whole transformer state dict, perturbed.
LoRA push: a peft adapter with Flow-GRPO's SD3 target modules (rank --rank). Peak RSS is the
kernel's high-water mark (VmHWM), reset to the current RSS before each push
(`/proc/self/clear_refs` = 5), so it is the push's own peak above what was resident.

    .venv/bin/python ops/bench_weights.py                    # small-sd3, rank 32, 3 pushes each
    .venv/bin/python ops/bench_weights.py --model tiny-sd3 --rank 4

`--stream`: the streamed push (Client.push_weights over Flight do_put) of an SD3 transformer of
about --size-mib MiB (random weights, saved as a local diffusers dir, served with --model-dir):
full push time and GB/s against a bare Flight do_put of the same chunks to a sink server and
against memcpy; the server's peak RSS during each push over its RSS before, as a multiple of the
model's bytes; a push after changing tensors holding about 1% of the bytes, the same tensors with
partial=True, and a push where nothing changed, each against the full push; and a full push
cut at about half (its client, a subprocess, SIGKILLed once the server holds half the bytes)
and resumed with the same push id: the bytes sent after the resume over the bytes that remained.

    .venv/bin/python ops/bench_weights.py --stream --size-mib 1024
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
_libc = ctypes.CDLL("libc.so.6")
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(push: object, body: bytes, repeats: int) -> tuple[float, float]:
    """(median wall seconds, max peak RSS above the resident size before, MiB) over `repeats` pushes."""
    times, peaks = [], []
    for _ in range(repeats):
        gc.collect()
        _libc.malloc_trim(0)  # hand freed heap pages back, so the old weights' pages do not absorb the push
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        t0 = time.perf_counter()
        push(body)  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
        peaks.append((_status_kib("VmHWM") - before) / 1024)
    return statistics.median(times), max(peaks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-sd3")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="the streamed push against a served --model-dir model")
    ap.add_argument("--size-mib", type=int, default=1024, help="--stream: the transformer's size")
    ap.add_argument("--weights-swap", choices=("staged", "in-place", "both"), default="staged",
                    help="--stream: the server's --weights-swap; both: the same pushes on one server of each")
    ap.add_argument("--arrow-pool", default=None, help="--stream: the server's ARROW_DEFAULT_MEMORY_POOL")
    args = ap.parse_args()
    if args.stream:
        return stream_main(args)

    import json

    import torch
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import load, save
    from sigmaflight.pipeline.lora import share_tensors_copy
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.safetensors_io import lora_config_from_metadata, read_safetensors

    torch.set_num_threads(1)
    reg = ModelRegistry()
    model = reg.get(args.model)
    g = torch.Generator().manual_seed(0)
    full_state = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                  for k, v in model.base_transformer().state_dict().items()}
    full_body = save(full_state)
    del full_state
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights="gaussian", target_modules=TARGETS)
    trainer = share_tensors_copy(model.base_transformer())
    trainer.add_adapter(config)
    lora_state = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(trainer).items()}
    lora_body = save(lora_state, metadata={"lora_config": json.dumps(config.to_dict(), default=sorted)})
    del trainer, lora_state

    def full_push(body: bytes) -> None:
        reg.replace_weights(args.model, read_safetensors(body)[0])

    def full_push_copying(body: bytes) -> None:
        reg.replace_weights(args.model, load(body))

    def lora_push(body: bytes) -> None:
        tensors, metadata = read_safetensors(body)
        reg.load_lora(args.model, tensors, lora_config_from_metadata(metadata))

    full_push(full_body)  # warm both paths once (imports, allocator)
    lora_push(lora_body)
    full_t, full_peak = _measure(full_push, full_body, args.repeats)
    copy_t, copy_peak = _measure(full_push_copying, full_body, args.repeats)
    lora_t, lora_peak = _measure(lora_push, lora_body, args.repeats)
    print(f"{args.model}: transformer {len(full_body) / MiB:.1f} MiB; LoRA rank {args.rank} on {len(TARGETS)} "
          f"target modules: {len(lora_body) / MiB:.2f} MiB ({len(lora_body) / len(full_body):.1%} of the full push)")
    print(f"full weights push: {full_t * 1e3:.1f} ms, peak RSS +{full_peak:.1f} MiB")
    print(f"full weights push parsed with safetensors.torch.load (a copy of the body): {copy_t * 1e3:.1f} ms, "
          f"peak RSS +{copy_peak:.1f} MiB")
    print(f"LoRA push:         {lora_t * 1e3:.1f} ms, peak RSS +{lora_peak:.1f} MiB")
    print(f"LoRA / full: wall time {lora_t / full_t:.3f}, peak RSS {lora_peak / max(full_peak, 1e-9):.3f}")
    print(f"weights_version after the run: {model.weights_version}")
    return 0


# ------------------------------------------------------------------ streamed push (Flight do_put)

_SINK = """
import sys, pyarrow.flight as flight
class Sink(flight.FlightServerBase):
    def do_put(self, context, descriptor, reader, writer):
        n = 0
        for chunk in reader:
            n += chunk.data.nbytes
        writer.write(str(n).encode())
s = Sink("grpc+tcp://127.0.0.1:0")
print(s.port, flush=True)
s.wait()
"""


def _proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _big_model_dir(root: Path, mib: int) -> tuple[Path, int]:
    """A local diffusers SD3 pipeline whose transformer holds about `mib` MiB (fp32, random
    weights; the tiny built-in's text encoders and VAE), saved under root/big-sd3."""
    import torch
    from sigmaflight.pipeline.builtins import _build_sd3

    per_layer = 36 * 1024 * 1024 * 4  # about 36 D^2 parameters per joint block at D = 1024, fp32
    layers = max(1, round(mib * MiB / per_layer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = _build_sd3(dim_heads=64, heads=16, layers=layers)
    path = root / "big-sd3"
    pipe.save_pretrained(path)
    return path, sum(v.nbytes for v in pipe.transformer.state_dict().values())


def stream_main(args: argparse.Namespace) -> int:
    import subprocess
    import tempfile

    import pyarrow.flight as flight
    import torch
    from safetensors.torch import load_file, save_file
    from sigmaflight.dataplane.weights import SCHEMA, chunk_batch

    from sigmaflight.weights import DEFAULT_CHUNK_BYTES

    tmp = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    t0 = time.perf_counter()
    model_dir, nbytes = _big_model_dir(tmp, args.size_mib)
    state = load_file(str(model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    print(f"SD3 transformer: {len(state)} tensors, {nbytes / MiB:.0f} MiB fp32 (built and saved in "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
           for k, v in state.items()}

    # memcpy of the same bytes
    flat = [v.reshape(-1) for v in new.values()]
    dst = [torch.zeros_like(v) for v in flat]  # touched: the copy below pays no page faults
    t = time.perf_counter()
    for d, s in zip(dst, flat, strict=True):
        d.copy_(s)
    memcpy_s = time.perf_counter() - t
    del dst

    # a bare Flight do_put of the same chunks to a sink server (its own process, like the server)
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        with flight.FlightClient(f"grpc+tcp://127.0.0.1:{port}") as fc:
            t = time.perf_counter()
            writer, reader = fc.do_put(flight.FlightDescriptor.for_command(b"sink"), SCHEMA)
            for name, v in new.items():
                b = v.reshape(-1).view(torch.uint8).numpy()
                for off in range(0, b.size, DEFAULT_CHUNK_BYTES):
                    writer.write_batch(chunk_batch(name, off, b[off:off + DEFAULT_CHUNK_BYTES]))
            writer.done_writing()
            reader.read()
            writer.close()
            bare_s = time.perf_counter() - t
    finally:
        sink.kill()
        sink.wait()

    changed = {}
    for k in sorted(new, key=lambda k: new[k].nbytes):  # the smallest tensors until about 1% of the bytes
        if sum(v.nbytes for v in changed.values()) >= nbytes // 100:
            break
        if new[k].is_floating_point():
            changed[k] = new[k] + 0.01
    one_pct = {**new, **changed}

    cut_file = tmp / "cut.safetensors"  # what the cut client pushes (every tensor differs from `new`)
    save_file({k: v + 0.02 if v.is_floating_point() else v for k, v in new.items()}, str(cut_file))

    env = {"ARROW_DEFAULT_MEMORY_POOL": args.arrow_pool} if args.arrow_pool else None
    rows: list = []
    cuts: list = []
    for swap in ("staged", "in-place") if args.weights_swap == "both" else (args.weights_swap,):
        full_s, pct_s, part_s, same_s = _stream_pushes(tmp, env, swap, new, one_pct, changed, nbytes, rows)
        cuts.append(_cut_and_resume(tmp, env, swap, cut_file, nbytes))

    gbs = nbytes / 1e9
    print(f"memcpy of the same bytes: {memcpy_s:.2f} s ({gbs / memcpy_s:.2f} GB/s)")
    print(f"bare Flight do_put to a sink server, {DEFAULT_CHUNK_BYTES >> 20} MiB chunks: {bare_s:.2f} s "
          f"({gbs / bare_s:.2f} GB/s)")
    print("| push | seconds | server: header to commit (of which the commit) | GB/s | bytes sent | server peak RSS "
          "over before (x model bytes) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, s, sent, peak, server_s, commit_s in rows:
        print(f"| {label} | {s:.3f} | {server_s:.3f} ({commit_s:.3f}) | {sent / 1e9 / s:.2f} | {sent / MiB:.1f} MiB | "
              f"{peak / nbytes:.2f}x |")
    print(f"full push / bare do_put: {bare_s / full_s:.2f}x the throughput; full push / memcpy: "
          f"{memcpy_s / full_s:.2f}x")
    print(f"1%-changed / full: {pct_s / full_s:.3f}; partial / full: {part_s / full_s:.3f}; nothing changed / full: "
          f"{same_s / full_s:.3f}")
    for swap, held, resent, resume_s in cuts:
        remained = nbytes - held
        print(f"{swap}: cut at {held / nbytes:.0%} and resumed: {remained / MiB:.1f} MiB remained, "
              f"{resent / MiB:.1f} MiB sent after the resume ({resume_s:.2f} s): {resent / remained:.3f}x "
              "the bytes that remained")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _stream_pushes(tmp: Path, env: dict[str, str] | None, swap: str, new: dict, one_pct: dict, changed: dict,
                   nbytes: int, rows: list) -> tuple[float, float, float, float]:
    """The four pushes on one server started with `--weights-swap swap`; their rows appended."""
    from sigmaflight import Client
    from sigmaflight.launcher import ServerProcess

    with ServerProcess("--model-dir", str(tmp), "--model", "big-sd3", "--workers", "1", "--weights-swap", swap,
                       env=env, timeout=600) as server, \
            Client(server.rest_url) as client:
        pid = server.proc.pid
        client.weights_manifest("big-sd3")  # the manifest is made once per served digest

        def push(label: str, sd: dict, **kw: object) -> float:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = _proc_kib(pid, "VmRSS")
            t = time.perf_counter()
            r = client.push_weights("big-sd3", sd, **kw)
            s = time.perf_counter() - t
            peak = (_proc_kib(pid, "VmHWM") - before) * 1024
            rows.append((f"{swap}: {label}", s, r.bytes_sent, peak, r.seconds, float(r.answer.get("commit_seconds", 0.0))))
            return s

        full_s = push("full push (only_changed=False)", new, only_changed=False)
        pct_s = push(f"{len(changed)} tensors changed ({sum(v.nbytes for v in changed.values()) / nbytes:.1%} "
                     "of the bytes), only_changed", one_pct)
        part_s = push("the same tensors, partial=True", {k: v + 0.01 for k, v in changed.items()}, partial=True)
        same_s = push("nothing changed", {**one_pct, **{k: v + 0.01 for k, v in changed.items()}})
    return full_s, pct_s, part_s, same_s


_CUT_CLIENT = """
import sys
from safetensors.torch import load_file
from sigmaflight import Client
url, push_id, path = sys.argv[1:]
with Client(url) as c:
    c.push_weights("big-sd3", load_file(path), only_changed=False, push_id=push_id, progress=False)
"""


def _pushed_bytes(client: object) -> int:
    import re

    text = client._send("GET", "/metrics").text  # type: ignore[attr-defined]
    m = re.search(r"^sigmaflight_weights_pushed_bytes_total ([0-9.e+]+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def _cut_and_resume(tmp: Path, env: dict[str, str] | None, swap: str, cut_file: Path,
                    nbytes: int) -> tuple[str, int, int, float]:
    """A full push whose client (a subprocess) is SIGKILLed once the server holds about half its
    bytes, then resumed here with the same push id: (swap, bytes the server held at the cut, bytes
    that landed after the resume, seconds of the resume)."""
    import subprocess
    import uuid

    from safetensors.torch import load_file

    from sigmaflight import Client
    from sigmaflight.launcher import ServerProcess

    with ServerProcess("--model-dir", str(tmp), "--model", "big-sd3", "--workers", "1", "--weights-swap", swap,
                       env=env, timeout=600) as server, \
            Client(server.rest_url) as client:
        push_id = uuid.uuid4().hex
        start = _pushed_bytes(client)
        child = subprocess.Popen([sys.executable, "-c", _CUT_CLIENT, server.rest_url, push_id, str(cut_file)])
        try:
            while _pushed_bytes(client) - start < nbytes // 2:
                if child.poll() is not None:
                    raise RuntimeError("the cut client ended before half the push landed")
                time.sleep(0.005)
        finally:
            child.kill()
            child.wait()
        held = -1
        while held != (now := _pushed_bytes(client) - start):  # what landed before the cut, settled
            held = now
            time.sleep(0.5)
        state = load_file(str(cut_file))
        t = time.perf_counter()
        client.push_weights("big-sd3", state, only_changed=False, push_id=push_id, progress=False)
        resume_s = time.perf_counter() - t
        resent = _pushed_bytes(client) - start - held
    return swap, held, resent, resume_s


if __name__ == "__main__":
    raise SystemExit(main())
