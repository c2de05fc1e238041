"""Pull the same float32 trajectory into torch tensors over loopback, many ways.

    .venv/bin/python ops/bench_transport.py                  # 64 MiB and 1 GiB
    .venv/bin/python ops/bench_transport.py --sizes 64M --repeats 5
    .venv/bin/python ops/bench_transport.py --paths memcpy,tcp,flight,bare,shm-pull,shm-chunks --sizes 1G
    .venv/bin/python ops/bench_transport.py --paths vs-bare --sizes 16M,25M,256M,1G --repeats 31
    .venv/bin/python ops/bench_transport.py --paths pulls --sizes 1M,3M,13M,64M,256M --repeats 21

Paths (each server and each client in its own subprocess, so peak RSS is measured
separately for both):
  pulls         what a trainer's pull costs, five ways interleaved in one client process against
                one --shm-dir server (each round runs each way once, the order rotating):
                memcpy into a fresh tensor (torch.empty + copy_, no server), bare
                do_get(...).read_all() (plain pyarrow), pull over Flight (transport="flight"),
                pull from the same-host file, pull(out=) into one warm buffer; medians, and the
                ratios as medians of the per-round ratios
  read-threads  in this process: pull(out=) from the same-host file with one thread against
                samehost's threads (THREADS_MIN_BYTES forced), interleaved: where threads pay
  doget-file    in this process: a --shm-dir (file-backed) rollout: the store's check before each
                do_get (ResultStore.check_served) and a whole do_get().read_all(), medians
  memcpy        copy the payload into a warm (pre-faulted) torch tensor: the limit (no server)
  shm-pull      sigmaflight with --shm-dir (a temp dir in /dev/shm) + TrajectoryClient.pull:
                reads the file, one copy into a fresh aligned tensor
  shm-pull-into the same with pull(ticket, out=buffer): one warm buffer reused across pulls
  shm-chunks    the same with iter_chunks: zero-copy views over the mapped file (us per GiB)
  bare          a bare pyarrow FlightServerBase: RecordBatchStream over the same record
                batches in memory; client as for flight
  vs-bare       sigmaflight and bare servers side by side, one client alternating pulls
                (interleaved, --repeats rounds of one pull each, which goes first alternates):
                the do_get ratio sigmaflight / bare as the median of the per-round ratios
  doget-py      in this process: Python time inside do_get per call, sigmaflight and bare
                (what a pull pays beyond the shared C++ stream), against a whole pull
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
import shutil
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


def serve(kind: str, size: int, batch_bytes: int = 8 * MiB, sizes: list[int] | None = None) -> None:
    """Build the payload, print the port, serve until stdin closes, print RSS JSON."""
    import torch

    lat = make_latents(size) if kind != "pulls" else None
    rss = RssSampler()
    stop_serving: Any = None
    if kind == "pulls":  # one --shm-dir store holding rollout "bench-<bytes>" of each size
        import tempfile

        from sigmaflight.dataplane.server import FlightDataServer
        from sigmaflight.dataplane.store import ResultStore

        shm_dir = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm"))
        store = ResultStore(memory_budget_bytes=8 << 30, max_batch_bytes=batch_bytes, shm_dir=shm_dir)
        for n in sizes or [size]:
            _fill(store, f"bench-{n}", make_latents(n), log_probs=True)
        srv: Any = FlightDataServer(store).start()
        port = srv.port

        def stop_pulls() -> None:
            srv.stop()
            store.close()
            shutil.rmtree(shm_dir)

        stop_serving = stop_pulls
    elif kind in ("flight", "shm", "bare"):
        import tempfile

        from sigmaflight.dataplane.server import FlightDataServer

        shm_dir = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm")) if kind == "shm" else None
        store = _filled_store(lat, batch_bytes, shm_dir)
        del lat  # the store holds the data now (heap, or the shm file)
        srv = FlightDataServer(store) if kind != "bare" else _bare_server(store)
        srv.start()
        port = srv.port

        def stop_flight() -> None:
            srv.stop()
            store.close()
            if shm_dir is not None:
                shutil.rmtree(shm_dir)  # the lock file stays in a closed store's directory

        stop_serving = stop_flight
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
    print(json.dumps({"rss_base": base, "rss_peak": peak}), flush=True)
    os._exit(0)


def _filled_store(lat: Any, batch_bytes: int, shm_dir: Path | None = None) -> Any:
    """A ResultStore holding the finished rollout "bench" of `lat` [K, B, C, H, W]."""
    from sigmaflight.dataplane.store import ResultStore

    store = ResultStore(memory_budget_bytes=4 << 30, max_batch_bytes=batch_bytes, shm_dir=shm_dir)
    _fill(store, "bench", lat)
    return store


def _fill(store: Any, rollout_id: str, lat: Any, log_probs: bool = False) -> None:
    """The finished rollout `rollout_id` of `lat` [K, B, C, H, W] (with log-probs on its
    stochastic steps if asked, as a trainer's rollout has them)."""
    import torch
    from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader

    sig = torch.linspace(1, 0, K, dtype=torch.float32)
    header = TrajectoryHeader(
        rollout_id=rollout_id, sigmas=sig, timesteps=sig[:-1] * 1000, steps=tuple(range(K)),
        sde_steps=tuple(range(K - 1)), seeds=tuple(range(B)), num_outputs_per_prompt=1,
        latent_shape=tuple(lat.shape[2:]), latent_dtype=torch.float32, log_probs=log_probs, rollout={},
    )
    w = store.create(header)
    for k in range(K):
        lp = -torch.arange(B, dtype=torch.float32) / (k + 1) if log_probs else None
        w.append(StepBatch(step=k, latent=lat[k], log_prob=lp))
    w.finish()


def _bare_server(store: Any) -> Any:
    """A bare FlightServerBase streaming the store's record batches from memory (the same
    batches sigmaflight serves), nothing else: the reference for sigmaflight's do_get."""
    import pyarrow as pa
    import pyarrow.flight as flight

    entry = store.get("bench")
    table = pa.Table.from_batches(list(entry.batches), schema=entry.schema)

    class Bare(flight.FlightServerBase):
        def do_get(self, context: Any, ticket: Any) -> Any:
            return flight.RecordBatchStream(table)

        def start(self) -> None:
            threading.Thread(target=self.wait, daemon=True).start()

        def stop(self) -> None:
            self.shutdown()

    return Bare("grpc+tcp://127.0.0.1:0")


# -- clients (subprocess) --------------------------------------------------------------------


def pull(kind: str, port: int, size: int, repeats: int, streams: int, warmup: int = 0, port2: int = 0,
         sizes: list[int] | None = None) -> None:
    """`warmup` extra pulls run first and are not timed (their memory still counts in RSS)."""
    import httpx
    import numpy as np
    import torch

    nbytes = int(make_latents_shape_numel(size) * 4)
    rss = RssSampler()
    times: list[float] = []
    if kind == "memcpy":
        src = make_latents(size)
        out = torch.empty_like(src)
        out.zero_()  # warm: faulted in outside the clock
        base = rss.reset()
        for _ in range(warmup + repeats):
            t0 = time.perf_counter()
            out.copy_(src)
            times.append(time.perf_counter() - t0)
    elif kind in ("shm-pull", "shm-pull-into", "shm-chunks"):
        from sigmaflight.dataplane.client import TrajectoryClient

        client = TrajectoryClient(f"grpc+tcp://127.0.0.1:{port}")
        ticket = client.info("bench")["ticket"]
        assert client.local_file(ticket) is not None, "the shm file is not readable here"
        buffer = None
        if kind == "shm-pull-into":  # one warm buffer (huge pages, faulted in outside the clock)
            from sigmaflight.dataplane.client import empty_hugepages

            shape = client.pull(ticket).latents.shape
            buffer = empty_hugepages(tuple(shape), torch.float32).zero_()
        base = rss.reset()
        for _ in range(warmup + repeats):
            t0 = time.perf_counter()
            if buffer is not None:
                got = client.pull(ticket, out=buffer).latents.numel() * 4
            elif kind == "shm-pull":
                traj = client.pull(ticket)
                got = traj.latents.numel() * 4
                del traj
            else:
                got = sum(st.latent.numel() * 4 for st in client.iter_chunks(ticket))
            times.append(time.perf_counter() - t0)
            assert got == nbytes, (got, nbytes)
    elif kind == "pulls":
        by_size: dict[int, dict[str, Any]] = {}
        for n in sizes or [size]:
            ways, base, peak = _pulls(port, n, repeats, warmup, rss)
            by_size[n] = {"ways": ways, "bytes": int(make_latents_shape_numel(n) * 4), "rss_base": base,
                          "rss_peak": peak}
        print(json.dumps({"by_size": by_size}), flush=True)
        return
    elif kind == "vs-bare":
        from sigmaflight.dataplane.client import TrajectoryClient

        ports = [port, port2]
        clients = [TrajectoryClient(f"grpc+tcp://127.0.0.1:{p}", transport="flight") for p in ports]
        ticket = clients[0].info("bench")["ticket"]
        pair: list[list[float]] = [[], []]
        base = rss.reset()
        for r in range(warmup + repeats):
            for j in (r % 2, 1 - r % 2):  # alternate which goes first
                t0 = time.perf_counter()
                got = sum(st.latent.numel() * 4 for st in clients[j].iter_chunks(ticket))
                if r >= warmup:
                    pair[j].append(time.perf_counter() - t0)
                assert got == nbytes
        peak = rss.stop()
        print(json.dumps({"times": pair[0], "bare_times": pair[1], "bytes": nbytes, "rss_base": base,
                          "rss_peak": peak}), flush=True)
        return
    elif kind.startswith("flight") or kind == "bare":
        from sigmaflight.dataplane.client import TrajectoryClient

        client = TrajectoryClient(f"grpc+tcp://127.0.0.1:{port}", transport="flight")
        ticket = "bench" if kind == "bare" else client.info("bench")["ticket"]  # bare ignores the ticket
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


PULL_WAYS = ("memcpy-fresh", "read-all", "pull-flight", "pull-file", "pull-file-into")


def _pulls(port: int, size: int, repeats: int, warmup: int, rss: RssSampler) -> tuple[dict[str, list[float]], int, int]:
    """The five ways of `pulls` for rollout "bench-<size>", interleaved: round r runs them
    starting at way r % 5. Returns each way's times and the RSS base and peak (MiB: bytes)."""
    import pyarrow.flight as flight
    import torch
    from sigmaflight.dataplane.client import TrajectoryClient, empty_hugepages

    same_host = TrajectoryClient(f"grpc+tcp://127.0.0.1:{port}")
    grpc = TrajectoryClient(f"grpc+tcp://127.0.0.1:{port}", transport="flight")
    plain = flight.FlightClient(f"grpc+tcp://127.0.0.1:{port}")
    ticket = same_host.info(f"bench-{size}")["ticket"]
    local = same_host.local_file(ticket)
    assert local is not None, "the shm file is not readable here"
    local.source.close()
    src = make_latents(size)
    shape = tuple(same_host.pull(ticket).latents.shape)
    warm = empty_hugepages(shape, torch.float32).zero_()  # faulted in outside the clock
    ways: dict[str, Any] = {
        "memcpy-fresh": lambda: torch.empty_like(src).copy_(src),
        "read-all": lambda: plain.do_get(flight.Ticket(ticket.encode())).read_all(),
        "pull-flight": lambda: grpc.pull(ticket),
        "pull-file": lambda: same_host.pull(ticket),
        "pull-file-into": lambda: same_host.pull(ticket, out=warm),
    }
    times: dict[str, list[float]] = {w: [] for w in PULL_WAYS}
    base = rss.reset()
    for r in range(warmup + repeats):
        for j in range(len(PULL_WAYS)):
            way = PULL_WAYS[(r + j) % len(PULL_WAYS)]
            t0 = time.perf_counter()
            got = ways[way]()
            dt = time.perf_counter() - t0
            del got  # freed outside the clock, for every way alike
            if r >= warmup:
                times[way].append(dt)
    peak = rss.peak
    rss.reset()
    return times, base, peak


def read_threads(size: int, repeats: int) -> dict[str, float]:
    """pull(out=) from the same-host file (the file read alone: open, map, preadv, assemble) with
    one thread and with samehost's threads, interleaved in this process."""
    import tempfile

    from sigmaflight.dataplane import samehost
    from sigmaflight.dataplane.files import map_ipc, open_regular
    from sigmaflight.dataplane.trajectory import Trajectory

    shm = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm"))
    store = _filled_store(make_latents(size), 8 * MiB, shm)
    path = store.shm.file_path("bench")  # <shm>/sigmaflight-<uid>/bench.arrow

    def pull_into(out: Any) -> None:
        fd, _ = open_regular(path)
        m = map_ipc(path, fd=fd)
        with samehost.FileSource(fd, path, m.base_address, m.size, m.crcs) as source:
            Trajectory.from_batches(m.schema, m.batches, source=source, out=out)

    try:
        out = empty_hugepages_like(store)
        times: dict[str, list[float]] = {"1": [], "n": []}
        keep = samehost.THREADS_MIN_BYTES
        for r in range(repeats):
            for mode in ("1", "n") if r % 2 else ("n", "1"):
                samehost.THREADS_MIN_BYTES = 1 << 62 if mode == "1" else 0
                t0 = time.perf_counter()
                pull_into(out)
                times[mode].append(time.perf_counter() - t0)
        samehost.THREADS_MIN_BYTES = keep
    finally:
        store.close()
        shutil.rmtree(shm)
    return {"one_ms": statistics.median(times["1"]) * 1e3, "n_ms": statistics.median(times["n"]) * 1e3,
            "threads": samehost._read_threads(),
            "paired": statistics.median(a / b for a, b in zip(times["1"], times["n"], strict=True))}


def doget_file(size: int, repeats: int) -> dict[str, float]:
    """What a do_get of a file-backed trajectory pays for the store's check of its file, and
    the whole do_get, in this process (plain pyarrow client)."""
    import tempfile

    import pyarrow.flight as flight
    from sigmaflight.dataplane.server import FlightDataServer

    shm = Path(tempfile.mkdtemp(prefix="sf-bench-", dir="/dev/shm"))
    store = _filled_store(make_latents(size), 8 * MiB, shm)
    try:
        entry = store.get("bench")
        checks, pulls = [], []
        with FlightDataServer(store) as srv, flight.FlightClient(srv.locations[0]) as c:
            ticket = flight.Ticket(store.ticket_for("bench").encode())
            c.do_get(ticket).read_all()  # the first serve (verifies a freshly adopted file)
            for _ in range(repeats):
                t0 = time.perf_counter()
                store.check_served(entry)
                checks.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.do_get(ticket).read_all()
                pulls.append(time.perf_counter() - t0)
    finally:
        store.close()
        shutil.rmtree(shm)
    return {"check_ms": statistics.median(checks) * 1e3, "doget_ms": statistics.median(pulls) * 1e3}


def empty_hugepages_like(store: Any) -> Any:
    """A warm [B, K, *shape] float32 buffer for the store's rollout "bench"."""
    import torch
    from sigmaflight.dataplane.client import empty_hugepages

    h = store.get("bench").header
    return empty_hugepages((h.num_samples, len(h.steps), *h.latent_shape), torch.float32).zero_()


def doget_python(size: int, repeats: int) -> dict[str, float]:
    """In one process: the Python time spent inside do_get per call (the part of a pull that
    holds the GIL) for sigmaflight's FlightDataServer and the bare server over the same store,
    against the time of a whole pull. Precise where vs-bare's pull-to-pull noise is not."""
    import pyarrow.flight as flight
    from sigmaflight.dataplane.server import FlightDataServer

    inside: dict[str, list[float]] = {"sigmaflight": [], "bare": []}
    pulls: list[float] = []
    bare_pulls: list[float] = []

    def timed(name: str, cls: type) -> type:
        class Timed(cls):  # type: ignore[misc, valid-type]
            def do_get(self, context: Any, ticket: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return super().do_get(context, ticket)
                finally:
                    inside[name].append(time.perf_counter() - t0)

        return Timed

    with _filled_store(make_latents(size), 8 * MiB) as store:
        bare_cls = type(_bare_server(store))
        servers = {"sigmaflight": timed("sigmaflight", FlightDataServer)(store).start(),
                   "bare": timed("bare", bare_cls)("grpc+tcp://127.0.0.1:0")}
        servers["bare"].start()
        try:
            sf = flight.FlightClient(f"grpc+tcp://127.0.0.1:{servers['sigmaflight'].port}")
            ticket = sf.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "bench")).endpoints[0].ticket
            bare = flight.FlightClient(f"grpc+tcp://127.0.0.1:{servers['bare'].port}")
            for _ in range(repeats):
                t0 = time.perf_counter()
                sf.do_get(ticket).read_all()
                pulls.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                bare.do_get(ticket).read_all()
                bare_pulls.append(time.perf_counter() - t0)
        finally:
            for srv in servers.values():
                srv.stop()
    return {"sigmaflight_us": statistics.median(inside["sigmaflight"]) * 1e6,
            "bare_us": statistics.median(inside["bare"]) * 1e6, "pull_ms": statistics.median(pulls) * 1e3,
            "bare_pull_ms": statistics.median(bare_pulls) * 1e3}


def make_latents_shape_numel(size: int) -> int:
    c, h, w = layout(size)
    return K * B * c * h * w


# -- orchestration ---------------------------------------------------------------------------


SERVER_OF = {"memcpy": None, "shm-pull": "shm", "shm-pull-into": "shm", "shm-chunks": "shm", "bare": "bare", "vs-bare": "flight"}


def _start_server(kind: str, size: int, batch_bytes: int) -> tuple[subprocess.Popen[str], int]:
    me = [sys.executable, str(Path(__file__).resolve())]
    srv = subprocess.Popen(
        [*me, "--_serve", kind, "--_size", str(size), "--batch-mib", str(batch_bytes / MiB)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert srv.stdout is not None
    return srv, int(json.loads(srv.stdout.readline())["port"])


def _stop_server(srv: subprocess.Popen[str]) -> dict[str, Any]:
    assert srv.stdout is not None and srv.stdin is not None
    srv.stdin.close()
    line = srv.stdout.readline()
    srv.wait(timeout=60)
    return dict(json.loads(line))


def run_pulls(sizes: list[int], repeats: int, batch_bytes: int, warmup: int) -> dict[int, dict[str, Any]]:
    """`pulls` at every size: one server process holding a rollout of each size, one client
    process measuring the sizes in turn (each size's five ways interleaved)."""
    listed = ",".join(str(n) for n in sizes)
    me = [sys.executable, str(Path(__file__).resolve())]
    srv = subprocess.Popen(
        [*me, "--_serve", "pulls", "--_size", str(sizes[0]), "--_sizes", listed, "--batch-mib", str(batch_bytes / MiB)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert srv.stdout is not None
    port = int(json.loads(srv.stdout.readline())["port"])
    try:
        cli = subprocess.run(
            [*me, "--_pull", "pulls", "--_port", str(port), "--_size", str(sizes[0]), "--_sizes", listed,
             "--repeats", str(repeats), "--warmup", str(warmup)],
            capture_output=True, text=True, cwd=ROOT, timeout=3600,
        )
        if cli.returncode:
            raise RuntimeError(f"pulls client failed:\n{cli.stderr[-3000:]}")
        by_size = json.loads(cli.stdout.strip().splitlines()[-1])["by_size"]
    finally:
        server = _stop_server(srv)
    return {int(n): {**r, "server_rss_mib": (server["rss_peak"] - server["rss_base"]) / MiB,
                     "client_rss_mib": (r["rss_peak"] - r["rss_base"]) / MiB} for n, r in by_size.items()}


def run_path(path: str, size: int, repeats: int, batch_bytes: int = 8 * MiB, warmup: int = 0) -> dict[str, Any]:
    """One path at one size: its own server subprocess(es) and one client subprocess."""
    kind = path if path in ("flight", "flight-steps") else "flight" if path.startswith("flight-") else path
    streams = int(path.split("-")[1]) if path.startswith("flight-") and path[7:].isdigit() else 1
    server_kind = SERVER_OF.get(kind, "flight" if kind.startswith("flight") else kind)
    servers = []
    if server_kind is not None:
        servers.append(_start_server(server_kind, size, batch_bytes))
    if kind == "vs-bare":
        servers.append(_start_server("bare", size, batch_bytes))
    ports = [p for _, p in servers] + [0, 0]
    me = [sys.executable, str(Path(__file__).resolve())]
    try:
        cli = subprocess.run(
            [*me, "--_pull", kind, "--_port", str(ports[0]), "--_port2", str(ports[1]), "--_size", str(size),
             "--repeats", str(repeats), "--warmup", str(warmup), "--_streams", str(streams)],
            capture_output=True, text=True, cwd=ROOT, timeout=1800,
        )
        if cli.returncode:
            raise RuntimeError(f"{path} client failed:\n{cli.stderr[-3000:]}")
        c = json.loads(cli.stdout.strip().splitlines()[-1])
    finally:
        stats = [_stop_server(srv) for srv, _ in servers]
    med = statistics.median(c["times"])
    out = {
        "path": path, "size": size, "gbps": c["bytes"] / med / 1e9, "best_gbps": c["bytes"] / min(c["times"]) / 1e9,
        "sec_per_gib": med * (1 << 30) / c["bytes"],
        "client_rss_mib": (c["rss_peak"] - c["rss_base"]) / MiB,
        "server_rss_mib": (stats[0]["rss_peak"] - stats[0]["rss_base"]) / MiB if stats else 0.0,
        "server_peak_mib": stats[0]["rss_peak"] / MiB if stats else 0.0,
    }
    if kind == "vs-bare":
        out["bare_best_gbps"] = c["bytes"] / min(c["bare_times"]) / 1e9
        out["bare_gbps"] = c["bytes"] / statistics.median(c["bare_times"]) / 1e9
        # one ratio per round (the two pulls ran back to back): robust to the box's drift
        out["paired"] = sorted(b / a for a, b in zip(c["times"], c["bare_times"], strict=True))
    return out


def _report(rows: list[dict[str, Any]], size: int) -> None:
    """Ratios to memcpy (the limit), raw TCP and sigmaflight's Flight, for the rows of one size."""
    mine = [r for r in rows if r["size"] == size]
    for ref in ("memcpy", "tcp", "flight"):
        base = next((r for r in mine if r["path"] == ref), None)
        if base is None:
            continue
        for r in mine:
            if r["path"] != ref and "gbps" in r and r["path"] not in ("vs-bare", "pulls"):
                print(f"  ratio {r['path']:10s} / {ref:6s} = {r['gbps'] / base['gbps']:.2f}x")
    for r in mine:
        if r["path"] == "vs-bare":
            q = statistics.quantiles(r["paired"], n=4)
            print(f"  ratio sigmaflight / bare Flight = {statistics.median(r['paired']):.3f}x median of "
                  f"{len(r['paired'])} back-to-back pairs (quartiles {q[0]:.3f}-{q[2]:.3f}); "
                  f"{r['best_gbps'] / r['bare_best_gbps']:.3f}x best-of "
                  f"({r['best_gbps']:.2f} vs {r['bare_best_gbps']:.2f} GB/s), "
                  f"{r['gbps'] / r['bare_gbps']:.3f}x of the medians")


def _report_pulls(r: dict[str, Any]) -> None:
    """Each way's median (ms, GB/s) and the ratios between ways: per-round pairs, and of the medians."""
    ways, nbytes = r["ways"], r["bytes"]
    med = {w: statistics.median(ts) for w, ts in ways.items()}
    for w in PULL_WAYS:
        print(f"  {w:15s} {med[w] * 1e3:9.3f} ms  {nbytes / med[w] / 1e9:6.2f} GB/s (median of {len(ways[w])})",
              flush=True)
    for fast, slow in (("pull-flight", "read-all"), ("pull-file", "pull-flight"), ("pull-file", "memcpy-fresh"),
                       ("pull-file-into", "memcpy-fresh")):
        pairs = statistics.median(b / a for a, b in zip(ways[fast], ways[slow], strict=True))
        print(f"  ratio {fast} / {slow} = {pairs:.2f}x (median of per-round ratios; {med[slow] / med[fast]:.2f}x "
              "of the medians)", flush=True)
    print(f"  client RSS +{r['client_rss_mib']:.0f} MiB over its start (peak while pulling this size); server RSS "
          f"+{r['server_rss_mib']:.0f} MiB while serving (every size)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64M,1G", help="comma-separated payload sizes (default: 64M,1G)")
    p.add_argument("--paths", default="memcpy,tcp,flight,bare,shm-pull,shm-chunks,flight-steps,flight-2,msgpack,json", help="which transports, comma-separated")
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
    p.add_argument("--_port2", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_sizes", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    listed = [int(n) for n in a._sizes.split(",") if n]
    if a._serve:
        serve(a._serve, a._size, int(a.batch_mib * MiB), listed)
        return 0
    if a._pull:
        pull(a._pull, a._port, a._size, a.repeats, a._streams, a.warmup, a._port2, listed)
        return 0
    json_max = parse_size(a.json_max)
    rows = []
    all_sizes = [parse_size(s) for s in a.sizes.split(",")]
    pulls: dict[int, dict[str, Any]] | None = None
    for size in all_sizes:
        c, h, w = layout(size)
        actual = B * K * c * h * w * 4
        print(f"# {size / MiB:.0f} MiB: B={B} x K={K} x [{c},{h},{w}] float32 ({actual / MiB:.2f} MiB of latents)",
              flush=True)
        for path in a.paths.split(","):
            if path == "json" and size > json_max:
                print(f"  {path:10s} skipped (size > --json-max {a.json_max})", flush=True)
                continue
            if path == "doget-py":
                d = doget_python(size, max(a.repeats, 31))
                extra_us = d["sigmaflight_us"] - d["bare_us"]
                print(f"  doget-py   Python inside do_get per call: sigmaflight {d['sigmaflight_us']:.0f} us, bare "
                      f"{d['bare_us']:.0f} us; a pull takes {d['pull_ms']:.3f} ms (bare {d['bare_pull_ms']:.3f} ms), so "
                      f"the difference bounds the ratio at {1 / (1 + extra_us / 1e3 / d['pull_ms']):.3f}x; measured "
                      f"{d['bare_pull_ms'] / d['pull_ms']:.3f}x (medians, pulls in turn in one process)", flush=True)
                continue
            if path == "doget-file":
                d = doget_file(size, max(a.repeats, 2))
                print(f"  doget-file check before a do_get of a file-backed rollout {d['check_ms']:.3f} ms; whole "
                      f"do_get().read_all() {d['doget_ms']:.1f} ms ({size / d['doget_ms'] / 1e6:.2f} GB/s) (medians)",
                      flush=True)
                continue
            if path == "read-threads":
                d = read_threads(size, max(a.repeats, 2))
                print(f"  read-threads pull(out=) from the file: 1 thread {d['one_ms']:.3f} ms, {d['threads']} threads "
                      f"{d['n_ms']:.3f} ms (medians); ratio 1 thread / {d['threads']} threads = {d['paired']:.2f}x "
                      "(median of interleaved pairs; above 1: threads pay)", flush=True)
                continue
            if path == "pulls":
                if pulls is None:
                    pulls = run_pulls(all_sizes, a.repeats, int(a.batch_mib * MiB), a.warmup)
                _report_pulls(pulls[size])
                continue
            r = run_path(path, size, a.repeats, int(a.batch_mib * MiB), a.warmup)
            rows.append(r)
            extra = f"  ({r['sec_per_gib'] * 1e6:.0f} us per GiB)" if path == "shm-chunks" else ""
            print(
                f"  {path:10s} {r['gbps']:6.2f} GB/s (best {r['best_gbps']:.2f}){extra}  "
                f"client RSS +{r['client_rss_mib']:.0f} MiB  server RSS +{r['server_rss_mib']:.0f} MiB "
                f"(peak {r['server_peak_mib']:.0f} MiB)",
                flush=True,
            )
        _report(rows, size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
