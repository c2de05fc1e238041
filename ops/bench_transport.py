"""Pull the same float32 trajectory into torch tensors over loopback, four ways.

    .venv/bin/python ops/bench_transport.py                  # 64 MiB and 1 GiB
    .venv/bin/python ops/bench_transport.py --sizes 64M --repeats 5

Paths (each server and each client in its own subprocess, so peak RSS is measured
separately for both):
  flight        sigmaflight FlightDataServer + TrajectoryClient.iter_chunks: per-step
                tensors, one per record batch, zero-copy views (no concatenation)
  flight-steps  the same with iter_steps: one tensor per whole step (split steps concatenated)
  flight-N      N partition endpoints pulled concurrently (iter_steps_parallel, per batch)
  tcp         raw TCP socket: sendall(tensor memory) -> recv_into(preallocated tensor)
              (the transport limit; allocation outside the clock)
  msgpack     uvicorn + starlette, msgpack body with raw (safetensors-style) blobs
  json        uvicorn + starlette, JSON body with base64 blobs (skipped above --json-max)

Layout: B=32 samples x K=8 steps (T=7), latent [16, H, W] float32 with per-sample
bytes = size / 256 (4 MiB at 1 GiB: 8 MiB record batches of 2 samples).
GB/s are decimal (1e9 bytes/s), median of --repeats pulls. RSS figures are MiB:
client = peak while pulling minus its baseline before the first pull; server = peak
while serving minus its baseline after the payload was built.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

B, K = 32, 8
MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def layout(size: int) -> tuple[int, int, int]:
    """(C, H, W) with B * K * C * H * W * 4 ~= size."""
    per_sample = size // (B * K)
    hw = int(math.sqrt(per_sample // (16 * 4)))
    return 16, hw, hw


class RssSampler:
    """Peak RSS of this process, sampled every 10 ms by a thread (RSS moves over hundreds of
    ms here; a faster sampler steals measurable CPU from the 2-core box it measures)."""

    def __init__(self) -> None:
        import psutil

        self._p = psutil.Process()
        self.peak = self.now()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def now(self) -> int:
        return int(self._p.memory_info().rss)

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def make_latents(size: int) -> Any:
    import torch

    c, h, w = layout(size)
    n = K * B * c * h * w
    return (torch.arange(n, dtype=torch.float32) % 1021).reshape(K, B, c, h, w)  # [K, B, C, H, W]


# -- servers (subprocess) --------------------------------------------------------------------


def serve(kind: str, size: int, batch_bytes: int = 8 * MiB) -> None:
    """Build the payload, print the port, serve until stdin closes, print RSS JSON."""
    import torch

    lat = make_latents(size)
    rss = RssSampler()
    stop_serving: Any = None
    if kind == "flight":
        from dataplane.record import StepBatch, TrajectoryHeader
        from dataplane.server import FlightDataServer
        from dataplane.store import ResultStore

        sig = torch.linspace(1, 0, K, dtype=torch.float32)
        header = TrajectoryHeader(
            rollout_id="bench", sigmas=sig, timesteps=sig[:-1] * 1000, steps=tuple(range(K)),
            sde_steps=tuple(range(K - 1)), seeds=tuple(range(B)), num_outputs_per_prompt=1,
            latent_shape=tuple(lat.shape[2:]), latent_dtype=torch.float32, log_probs=False, rollout={},
        )
        store = ResultStore(memory_budget_bytes=4 << 30, max_batch_bytes=batch_bytes)
        w = store.create(header)
        for k in range(K):
            w.append(StepBatch(step=k, latent=lat[k], log_prob=None))
        w.finish()
        srv = FlightDataServer(store).start()
        port = srv.port
        stop_serving = srv.stop
    elif kind == "tcp":
        payload = memoryview(lat.numpy()).cast("B")
        lsock = socket.create_server(("127.0.0.1", 0))
        port = lsock.getsockname()[1]

        def loop() -> None:
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                with conn:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
                    if conn.recv(1):
                        conn.sendall(payload)

        threading.Thread(target=loop, daemon=True).start()
        stop_serving = lsock.close
    else:
        import msgpack
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        meta = {"dtype": "float32", "shape": list(lat.shape), "sigmas": torch.linspace(1, 0, K).tolist()}

        async def get(request: Any) -> Response:
            raw = lat.numpy().tobytes() if kind == "msgpack" else None
            if kind == "msgpack":
                body = msgpack.packb({**meta, "latents": raw})
                return Response(body, media_type="application/msgpack")
            data = base64.b64encode(lat.numpy().tobytes()).decode()
            return Response(json.dumps({**meta, "latents": data}), media_type="application/json")

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        app = Starlette(routes=[Route("/rollout", get)])
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", access_log=False))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.01)

        def stop_http() -> None:
            server.should_exit = True

        stop_serving = stop_http
    base = rss.reset()
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    peak = rss.stop()
    stop_serving()
    print(json.dumps({"rss_base": base, "rss_peak": peak, "payload": int(lat.numel() * 4)}), flush=True)
    os._exit(0)


# -- clients (subprocess) --------------------------------------------------------------------


def pull(kind: str, port: int, size: int, repeats: int, streams: int, warmup: int = 0) -> None:
    """`warmup` extra pulls run first and are not timed (their memory still counts in RSS)."""
    import httpx
    import numpy as np
    import torch

    nbytes = int(make_latents_shape_numel(size) * 4)
    rss = RssSampler()
    times: list[float] = []
    if kind.startswith("flight"):
        from dataplane.client import TrajectoryClient

        client = TrajectoryClient(f"grpc+tcp://127.0.0.1:{port}")
        ticket = client.info("bench")["ticket"]
        base = rss.reset()
        for _ in range(warmup + repeats):
            t0 = time.perf_counter()
            if streams == 1:
                it = client.iter_steps(ticket) if kind == "flight-steps" else client.iter_chunks(ticket)
            else:
                it = client.iter_steps_parallel("bench", streams=streams, merge_steps=False)
            got = 0
            for st in it:
                got += st.latent.numel() * 4
            times.append(time.perf_counter() - t0)
            assert got == nbytes, (got, nbytes)
    elif kind == "tcp":
        out = torch.empty(nbytes // 4, dtype=torch.float32)
        view = memoryview(out.numpy()).cast("B")
        out.numpy()[:] = 0  # allocate and fault in outside the clock
        base = rss.reset()
        for _ in range(warmup + repeats):
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
                s.sendall(b"g")
                got = 0
                while got < nbytes:
                    n = s.recv_into(view[got:], nbytes - got)
                    if not n:
                        raise RuntimeError("short read")
                    got += n
            times.append(time.perf_counter() - t0)
    else:
        import msgpack

        http = httpx.Client(timeout=600)
        base = rss.reset()
        for _ in range(warmup + repeats):
            t0 = time.perf_counter()
            r = http.get(f"http://127.0.0.1:{port}/rollout")
            if kind == "msgpack":
                obj = msgpack.unpackb(r.content)
                lat = torch.frombuffer(bytearray(obj["latents"]), dtype=torch.float32).reshape(obj["shape"])
            else:
                obj = json.loads(r.content)
                lat = torch.from_numpy(np.frombuffer(base64.b64decode(obj["latents"]), dtype=np.float32).copy())
            times.append(time.perf_counter() - t0)
            assert lat.numel() * 4 == nbytes
            del r, obj, lat
    peak = rss.stop()
    print(json.dumps({"times": times[warmup:], "bytes": nbytes, "rss_base": base, "rss_peak": peak}), flush=True)


def make_latents_shape_numel(size: int) -> int:
    c, h, w = layout(size)
    return K * B * c * h * w


# -- orchestration ---------------------------------------------------------------------------


def run_path(path: str, size: int, repeats: int, batch_bytes: int = 8 * MiB, warmup: int = 0) -> dict[str, Any]:
    kind = path if path in ("flight", "flight-steps") else "flight" if path.startswith("flight-") else path
    streams = int(path.split("-")[1]) if path.startswith("flight-") and path[7:].isdigit() else 1
    me = [sys.executable, str(Path(__file__).resolve())]
    srv = subprocess.Popen(
        [*me, "--_serve", "flight" if kind.startswith("flight") else kind, "--_size", str(size),
         "--batch-mib", str(batch_bytes / MiB)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert srv.stdout is not None and srv.stdin is not None
    port = json.loads(srv.stdout.readline())["port"]
    try:
        cli = subprocess.run(
            [*me, "--_pull", kind, "--_port", str(port), "--_size", str(size), "--repeats", str(repeats), "--warmup", str(warmup),
             "--_streams", str(streams)],
            capture_output=True, text=True, cwd=ROOT, timeout=1800,
        )
        if cli.returncode:
            raise RuntimeError(f"{path} client failed:\n{cli.stderr[-3000:]}")
        c = json.loads(cli.stdout.strip().splitlines()[-1])
    finally:
        srv.stdin.close()
        line = srv.stdout.readline()
        srv.wait(timeout=60)
    s = json.loads(line)
    med = statistics.median(c["times"])
    return {
        "path": path, "size": size, "gbps": c["bytes"] / med / 1e9, "best_gbps": c["bytes"] / min(c["times"]) / 1e9,
        "client_rss_mib": (c["rss_peak"] - c["rss_base"]) / MiB, "server_rss_mib": (s["rss_peak"] - s["rss_base"]) / MiB,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64M,1G", help="comma-separated payload sizes (default: 64M,1G)")
    p.add_argument("--paths", default="tcp,flight,flight-steps,flight-2,msgpack,json", help="which transports, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="pulls per path (median reported)")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed pulls first, in the same client process (steady state: allocator warm, as in a "
                        "trainer that pulls many rollouts); raw TCP's buffer is always faulted in outside the clock")
    p.add_argument("--json-max", default="256M", help="skip the JSON+base64 path above this size (it needs ~5x RSS)")
    p.add_argument("--batch-mib", type=float, default=8.0, help="Flight record batch size in MiB (default 8)")
    p.add_argument("--_serve", help=argparse.SUPPRESS)
    p.add_argument("--_pull", help=argparse.SUPPRESS)
    p.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_streams", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._serve:
        serve(a._serve, a._size, int(a.batch_mib * MiB))
        return 0
    if a._pull:
        pull(a._pull, a._port, a._size, a.repeats, a._streams, a.warmup)
        return 0
    json_max = parse_size(a.json_max)
    rows = []
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        c, h, w = layout(size)
        print(f"# {size / MiB:.0f} MiB: B={B} x K={K} x [{c},{h},{w}] float32", flush=True)
        for path in a.paths.split(","):
            if path == "json" and size > json_max:
                print(f"  {path:10s} skipped (size > --json-max {a.json_max})", flush=True)
                continue
            r = run_path(path, size, a.repeats, int(a.batch_mib * MiB), a.warmup)
            rows.append(r)
            print(
                f"  {path:10s} {r['gbps']:6.2f} GB/s (best {r['best_gbps']:.2f})  "
                f"client RSS +{r['client_rss_mib']:.0f} MiB  server RSS +{r['server_rss_mib']:.0f} MiB",
                flush=True,
            )
        tcp = next((r for r in rows if r["size"] == size and r["path"] == "tcp"), None)
        if tcp:
            for r in rows:
                if r["size"] == size:
                    print(f"  ratio {r['path']:10s} / tcp = {r['gbps'] / tcp['gbps']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
