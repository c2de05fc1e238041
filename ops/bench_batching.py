"""Co-batching benchmark: many small concurrent requests against one big one, through real servers.

Starts three `sigmaflight serve` processes on loopback (one worker each, same model):
  on-0   co-batching with the defaults (--max-batch-samples 64, --batch-wait-ms 0)
  on-W   co-batching with --batch-wait-ms W (default 25)
  off    --max-batch-samples 1: every request runs alone (the behaviour before co-batching)
and, in rounds whose order rotates (the box is noisy: every ratio is taken within a round, then
the median over rounds is printed), runs these workloads; a request's latency is from its POST
to the end of its Flight stream (a plain `do_get(...).read_all()` that follows it live):

  one-B=N      one request of N prompts (the baseline every ratio is against, on the same server)
  N x B=1      N concurrent clients, one prompt each
  N/2 x B=2    N/2 concurrent clients, one prompt x num_outputs_per_prompt 2
  lone B=1     one request of one prompt, nothing else running (latency)
  mixed        N concurrent B=1 requests of two sizes and two step counts

Then, in this process once the servers have stopped: the stock diffusers `__call__` with N
prompts (output_type "latent") and `run_rollout` of the same B=N request with full capture,
interleaved, for the service's samples/s against both.

  .venv/bin/python ops/bench_batching.py --model tiny-sd3 --n 16 --steps 8
  .venv/bin/python ops/bench_batching.py --model small-sd3 --n 8 --steps 4 --rounds 3

`--server-cpu` measures instead what co-batching costs the server itself: one server with
--batch-wait-ms W per checkout (this one, "after", and with `--before PYTHON` another checkout's
interpreter, "before"), the same workloads on each in rotating
rounds, every client polling its rollout's status every 20 ms until it ends (no Flight pull): the
server process tree's user+sys CPU (on Linux each process's CPU-time clock, in ns; psutil's
clock ticks elsewhere) and the wall-clock samples/s of each workload, and
of the CPU what the event loop (the main thread, which serves every HTTP request) took, how
many status reads the clients made, and how many model calls the requests ran as (N x B=1 is one
call when the whole burst joins one batch; more when the batch window closed before the burst's
last POST arrived, and then the rest waits for the first call to end). The clients run in this
process, beside the server: `client ms` is their own CPU and `cores` the server's and theirs over
the round's wall time; `--clients httpx stdlib` polls this checkout's server ("after") with each
library in turn, a row each ("after/stdlib"; http.client costs about a quarter of httpx's CPU a
request), for how much the clients themselves move the figures on a small box. `--clients httpx httpx+held`
adds a row ("after/httpx+held") whose clients read the same way, every 20 ms after each answer, but
each read asks the server to hold it until the rollout ends (`?wait_s=10`, as `Client.wait` reads):

  .venv/bin/python ops/bench_batching.py --server-cpu --before ../sigmaflight-main/.venv/bin/python --rounds 8
  .venv/bin/python ops/bench_batching.py --server-cpu --clients httpx httpx+held stdlib+held --rounds 8

`--poll-probe` times one B=N request's model call (its own status: started_at to finished_at)
while N client threads poll a finished rollout's status every 20 ms: on no server, on the same one
(whose event loop shares the call's GIL and the cores) or on a second server (another process:
only the cores are shared), in rotating rounds:

  .venv/bin/python ops/bench_batching.py --poll-probe --rounds 8

`--variant LABEL=FLAGS` adds a server of this checkout with extra serve flags to the same rounds
(e.g. --variant 'threads-1=--torch-threads 1').
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import os
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from json import dumps, loads
from typing import Any

import httpx
import pyarrow.flight as flight

from sigmaflight import Client
from sigmaflight.launcher import ServerProcess

MODES = ("on-0", "on-W", "off")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class StdlibClient:
    """The two calls the status polling makes (`post(path, json=...)`, `get(path)`), over one kept-alive
    http.client connection: a client that costs about a quarter of httpx's CPU a request, so the
    clients running beside the server on a small box take less of its cores (--clients)."""

    class Response:
        def __init__(self, status_code: int, text: str) -> None:
            self.status_code, self.text = status_code, text

        def json(self) -> Any:
            return loads(self.text)

    def __init__(self, base_url: str, timeout: float) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)

    def __enter__(self) -> StdlibClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Response:
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        return self.Response(r.status, r.read().decode())

    def post(self, path: str, json: dict[str, Any]) -> Response:  # `json=`, as httpx names it
        return self._send("POST", path, dumps(json).encode(), {"Content-Type": "application/json"})

    def get(self, path: str) -> Response:
        return self._send("GET", path, None, {})


CLIENTS: dict[str, Callable[[str], Any]] = {
    "httpx": lambda url: httpx.Client(base_url=url, timeout=600),
    "stdlib": lambda url: StdlibClient(url, timeout=600),
}
HELD = "+held"
"""A client kind's suffix (`--clients httpx+held`): each status read asks the server to hold it
until the rollout ends, 10 s at most (`?wait_s=10`, GET /v1/rollouts/{id}), as `Client.wait` reads."""
KINDS = [*CLIENTS, *(library + HELD for library in CLIENTS)]


def all_at_once(url: str, bodies: list[dict[str, Any]], one: Callable[[Any, dict[str, Any], float], tuple[float, str | None]],
                client: str = "httpx") -> tuple[float, list[float], float]:
    """`one(client, body, t0)` for every body at once, one client thread each (an httpx.Client, or
    with client="stdlib" or "stdlib+held" a StdlibClient), started together: (wall seconds, each one's latency, the
    user+sys seconds this process took meanwhile: the clients' own CPU, their set-up before the start
    left out). `one` returns (its latency, an error or None)."""
    latencies: list[float] = [0.0] * len(bodies)
    errors: list[str] = []
    go = threading.Barrier(len(bodies) + 1)

    def run(k: int, body: dict[str, Any]) -> None:
        with CLIENTS[client.removesuffix(HELD)](url) as c:
            go.wait()
            latencies[k], error = one(c, body, time.perf_counter())
            if error is not None:
                errors.append(error)

    threads = [threading.Thread(target=run, args=(k, b)) for k, b in enumerate(bodies)]
    for th in threads:
        th.start()
    go.wait()
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for th in threads:
        th.join()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")
    return wall, latencies, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def run_requests(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[float], int]:
    """All `bodies` posted at once, each pulled over Flight: (wall seconds, per-request latency to
    the pull's end, samples)."""
    def one(c: httpx.Client, body: dict[str, Any], t0: float) -> tuple[float, str | None]:
        r = c.post("/v1/rollouts", json=body)
        if r.status_code != 202:
            return 0.0, r.text
        t = r.json()
        with flight.FlightClient(t["flight"]["locations"][0]) as fc:
            fc.do_get(flight.Ticket(t["flight"]["ticket"].encode())).read_all()
        latency = time.perf_counter() - t0
        status = c.get(f"/v1/rollouts/{t['id']}").json()["status"]
        return latency, None if status == "succeeded" else f"rollout {t['id']} {status}"

    wall, latencies, _ = all_at_once(url, bodies, one)
    return wall, latencies, sum(len(b["prompts"]) * b.get("num_outputs_per_prompt", 1) for b in bodies)


def batch_counts(url: str) -> tuple[float, float]:
    """(batches, rollouts) the server has run as model calls, from its /metrics histogram
    `sigmaflight_batch_requests` (its _count and _sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    got = {s.name: s.value for f in text_string_to_metric_families(text) if f.name == "sigmaflight_batch_requests"
           for s in f.samples}
    return got.get("sigmaflight_batch_requests_count", 0.0), got.get("sigmaflight_batch_requests_sum", 0.0)


def workloads(a: argparse.Namespace, size: int, small: int) -> dict[str, list[dict[str, Any]]]:
    """Each workload's request bodies (main gives every request its own seed, per round)."""
    n, t = a.n, a.steps
    half = max(1, t // 2)
    return {
        "one-B=N": [{"prompts": [f"prompt {k}" for k in range(n)], "num_inference_steps": t}],
        "N x B=1": [{"prompts": [f"prompt {k}"], "num_inference_steps": t} for k in range(n)],
        "N/2 x B=2": [{"prompts": [f"prompt {k}"], "num_outputs_per_prompt": 2, "num_inference_steps": t}
                      for k in range(max(1, n // 2))],
        "lone B=1": [{"prompts": ["prompt 0"], "num_inference_steps": t}],
        "mixed": [{"prompts": [f"prompt {k}"], "num_inference_steps": (t, half)[k % 2],
                   "height": (size, small)[(k // 2) % 2], "width": (size, small)[(k // 2) % 2]} for k in range(n)],
    }


def in_process(model_id: str, n: int, steps: int, repeats: int) -> dict[str, float]:
    """samples/s of the stock diffusers call and of run_rollout (full capture) for N prompts, medians."""
    import torch
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.rollout import run_rollout
    from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

    model = ModelRegistry().get(model_id)
    d = model.defaults
    prompts = [f"prompt {k}" for k in range(n)]
    spec = RolloutSpec(model=model_id, prompts=tuple(prompts), num_inference_steps=steps, seed=1, sampler=SamplerSpec())
    times: dict[str, list[float]] = {"stock": [], "run_rollout": []}
    for r in range(repeats + 1):
        for way in ("stock", "run_rollout") if r % 2 else ("run_rollout", "stock"):
            t0 = time.perf_counter()
            if way == "stock":
                model.pipeline(prompt=prompts, num_inference_steps=steps, guidance_scale=d.guidance_scale,
                               height=d.height, width=d.width, output_type="latent",
                               generator=torch.Generator().manual_seed(r), **dict(d.call_kwargs))
            else:
                run_rollout(model, spec, on_step=lambda cap: None, keep=False)
            if r:  # the first round warms up
                times[way].append(time.perf_counter() - t0)
    return {w: n / statistics.median(v) for w, v in times.items()}


CPU_LOADS = ("N x B=1", "one-B=N", "lone B=1")


class Server:
    """`sigmaflight serve` run by `python` (any checkout's interpreter; bytecode not written there)."""

    def __init__(self, python: str, *flags: str) -> None:
        # OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep between ops instead of spinning, so
        # the CPU counted is work (on a loaded box the spin-wait inflated one server or the other
        # several-fold at random); both servers run with it.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen([os.path.abspath(python), "-m", "sigmaflight.cli", "serve", "--port", "0", "--flight-port", "0",
                                      "--log-format", "json", *flags], cwd="/", env=env, stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True)
        assert self.proc.stderr is not None
        self.rest_url = ""
        for line in self.proc.stderr:
            if '"sigmaflight ready"' in line:
                import json

                self.rest_url = json.loads(line)["rest_url"]
                break
        if not self.rest_url:
            self.proc.kill()
            raise SystemExit(f"{python}: the server did not start")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # drain its log

    def cpu_s(self) -> float:
        """user+sys seconds of the server and every process under it so far."""
        import psutil

        root = psutil.Process(self.proc.pid)
        total = 0.0
        for p in (root, *root.children(recursive=True)):
            try:
                total += process_cpu_s(p)
            except psutil.NoSuchProcess:
                continue
        return total

    def model_calls(self) -> float:
        """The model calls the server has made so far (its /metrics: `sigmaflight_batch_requests_count`)."""
        for line in httpx.get(f"{self.rest_url}/metrics", timeout=30).text.splitlines():
            if line.startswith("sigmaflight_batch_requests_count"):
                return float(line.split()[-1])
        raise SystemExit(f"{self.rest_url}/metrics has no sigmaflight_batch_requests_count")

    def loop_cpu_s(self) -> float:
        """user+sys seconds of the server's main thread so far: the event loop (uvicorn runs it
        there), which serves every HTTP request; the worker threads and torch's are the rest.
        Linux: the thread's schedstat (nanoseconds on a CPU); else psutil's (clock ticks)."""
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        import psutil

        for t in psutil.Process(pid).threads():
            if t.id == pid:
                return t.user_time + t.system_time
        raise SystemExit(f"server {pid}: no main thread in psutil's list")  # not a silent 0 ms

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def process_cpu_s(p: Any) -> float:
    """user+sys seconds of psutil process `p` so far, its exited threads included. Linux: its
    CPU-time clock (`clock_gettime` of the clock id the kernel makes from a pid: nanoseconds);
    elsewhere psutil's times, in clock ticks (10 ms: a tenth of a 100 ms round)."""
    try:
        return time.clock_gettime(((~p.pid) << 3) | 2)  # CPUCLOCK_SCHED of the process (linux/posix-timers.h)
    except (OSError, AttributeError):
        t = p.cpu_times()
        return float(t.user + t.system)


def poll_requests(url: str, bodies: list[dict[str, Any]], every_s: float = 0.02,
                  client: str = "httpx") -> tuple[float, list[float], int, int, float]:
    """All `bodies` posted at once, each polling its status every `every_s` until it ends (a `client`
    kind ending in +held: each read held by the server until the rollout ends, then `every_s`): (wall
    seconds, per-request latency to the status that says succeeded, samples, status reads in all,
    the user+sys seconds this process (the clients) took meanwhile)."""
    reads: list[int] = []  # one entry a GET (list.append is atomic across the client threads)

    def one(c: Any, body: dict[str, Any], t0: float) -> tuple[float, str | None]:
        r = c.post("/v1/rollouts", json=body)
        if r.status_code != 202:
            return 0.0, r.text
        path = f"/v1/rollouts/{r.json()['id']}" + ("?wait_s=10" if client.endswith(HELD) else "")
        while True:
            time.sleep(every_s)
            status = c.get(path).json()["status"]
            reads.append(1)
            if status not in ("queued", "running"):
                break
        return time.perf_counter() - t0, None if status == "succeeded" else f"{path} {status}"

    wall, latencies, clients = all_at_once(url, bodies, one, client)
    return wall, latencies, sum(len(b["prompts"]) for b in bodies), len(reads), clients


@dataclass
class Tally:
    """One workload on one server and client kind, a value a counted round."""

    cpu: list[float] = field(default_factory=list)  # the server tree's user+sys seconds
    loop: list[float] = field(default_factory=list)  # of which its event loop's
    sps: list[float] = field(default_factory=list)  # samples/s over the round's wall time
    lat: list[float] = field(default_factory=list)  # every request's latency
    reads: list[int] = field(default_factory=list)  # status GETs
    calls: list[float] = field(default_factory=list)  # model calls
    clients: list[float] = field(default_factory=list)  # the clients' own user+sys seconds
    cores: list[float] = field(default_factory=list)  # (server + clients) CPU / wall: the cores busy


def server_cpu(a: argparse.Namespace) -> int:
    """The --server-cpu measure (module docstring); the ratios are taken within a round, medians printed."""
    flags = ("--model", a.model, "--workers", "1", "--log-level", "warning", "--queue-size", str(4 * a.n + 8),
             "--batch-wait-ms", str(a.wait_ms))
    runs: dict[str, tuple[str, tuple[str, ...]]] = {"after": (sys.executable, ()), **({"before": (a.before, ())} if a.before else {})}
    for variant in a.variant:
        label, _, extra = variant.partition("=")
        runs[label] = (sys.executable, tuple(shlex.split(extra)))
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        starting = {k: pool.submit(Server, py, *flags, *extra) for k, (py, extra) in runs.items()}
    servers = {k: f.result() for k, f in starting.items()}
    # a row per server with the first client library; each other library, a row of "after" ("after/stdlib")
    rows = {k: (s, a.clients[0]) for k, s in servers.items()} | {
        f"after/{kind}": (servers["after"], kind) for kind in a.clients[1:]}
    loads = {w: b for w, b in workloads(a, 0, 0).items() if w in CPU_LOADS}
    tally = {(w, k): Tally() for w in loads for k in rows}
    try:
        pairs = list(tally)
        for r in range(a.rounds + 1):
            for w, k in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
                server, kind = rows[k]
                bodies = [{**b, "model": a.model, "seed": 1000 * r + j} for j, b in enumerate(loads[w])]
                time.sleep(0.2)  # the previous workload's last polls and the reaper settle
                m0 = server.model_calls()  # read outside the CPU window: a scrape costs the server too
                c0, l0 = server.cpu_s(), server.loop_cpu_s()
                wall, lats, samples, n_reads, client_s = poll_requests(server.rest_url, bodies, client=kind)
                c1, l1 = server.cpu_s(), server.loop_cpu_s()
                m1 = server.model_calls()
                if r:
                    t = tally[(w, k)]
                    t.calls.append(m1 - m0)
                    t.cpu.append(c1 - c0)
                    t.loop.append(l1 - l0)
                    t.reads.append(n_reads)
                    t.clients.append(client_s)
                    t.cores.append((c1 - c0 + client_s) / wall)
                    t.sps.append(samples / wall)
                    t.lat.extend(lats)
    finally:
        for s in servers.values():
            s.stop()

    def wall_ratio(k: str) -> float:
        return statistics.median(x / y for x, y in zip(tally[("N x B=1", k)].sps, tally[("one-B=N", k)].sps, strict=True))

    def cpu_ratio(k: str) -> float:  # totals over the rounds: the OS counts CPU time in 10 ms ticks
        return sum(tally[("N x B=1", k)].cpu) / max(sum(tally[("one-B=N", k)].cpu), 1e-9)

    print(f"server CPU: model={a.model} N={a.n} T={a.steps} --batch-wait-ms {a.wait_ms:g} rounds={a.rounds} "
          f"(+1 warm-up), status polled every 20 ms")
    width = max(7, *map(len, rows))
    print(f"{'workload':<9} {'server':<{width}} {'cpu ms':>8} {'samples/s':>10} {'p50 ms':>8} {'loop ms':>8} "
          f"{'reads':>6} {'calls':>6} {'client ms':>9} {'cores':>5}   (cpu, loop, reads, calls, client: mean a round)")
    for (w, k), t in tally.items():
        print(f"{w:<9} {k:<{width}} {statistics.mean(t.cpu) * 1e3:>8.1f} {statistics.median(t.sps):>10.2f} "
              f"{percentile(t.lat, 50) * 1e3:>8.1f} {statistics.mean(t.loop) * 1e3:>8.1f} {statistics.mean(t.reads):>6.1f} "
              f"{statistics.mean(t.calls):>6.2f} {statistics.mean(t.clients) * 1e3:>9.1f} {statistics.median(t.cores):>5.2f}")
    for k in rows:
        print(f"{k}: N x B=1 / one-B=N server CPU {cpu_ratio(k):.2f}x (target <= 1.4), "
              f"wall samples/s {wall_ratio(k):.2f}x (target >= 0.8)")
    if "before" in servers:
        lone = [statistics.median(tally[("lone B=1", k)].lat) for k in ("after", "before")]
        big = [statistics.median(tally[("one-B=N", k)].sps) for k in ("after", "before")]
        print(f"after / before: lone B=1 latency {lone[0] / lone[1]:.2f} (target <= 1), "
              f"one-B=N samples/s {big[0] / big[1]:.2f} (target >= 1)")
    return 0


def timed_call(url: str, body: dict[str, Any]) -> float:
    """Submit `body` and wait for it (`Client.wait`: its reads held until it ends): its model call's
    seconds, from its own status (started_at to finished_at, stamped by the server). RolloutFailed
    when it did not succeed."""
    with Client(url) as client:
        status = client.wait(client.submit(**body), timeout=600, poll_s=0.02, max_poll_s=0.02)
    assert status.started_at is not None and status.finished_at is not None  # a succeeded rollout has both
    return datetime.fromisoformat(status.finished_at).timestamp() - datetime.fromisoformat(status.started_at).timestamp()


PROBE_PLACES = ("none", "same server", "other server")


def poll_probe(a: argparse.Namespace) -> int:
    """--poll-probe: what status polling does to a model call that runs meanwhile. Two servers of
    this checkout; in rotating rounds one B=N request runs on the first while N client threads poll
    a finished rollout's status every 20 ms on no server, on the same one (its event loop shares
    the call's GIL and the cores) or on the other (another process: only the cores are shared)."""
    flags = ("--model", a.model, "--workers", "1", "--log-level", "warning")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(Server, sys.executable, *flags) for _ in range(2)]
    servers = [f.result() for f in starting]
    body = {"prompts": [f"prompt {k}" for k in range(a.n)], "num_inference_steps": a.steps, "model": a.model}
    calls: dict[str, list[float]] = {p: [] for p in PROBE_PLACES}
    reads: dict[str, list[int]] = {p: [] for p in PROBE_PLACES}  # the pollers' GETs, a round
    try:
        done = {}  # a finished rollout on each server, for the pollers to read; and its model is warm
        for s in servers:
            with Client(s.rest_url) as client:
                done[s.rest_url] = client.wait(client.submit(prompts=["p"], num_inference_steps=1), timeout=600).id

        def poll(url: str, stop: threading.Event, made: list[int]) -> None:
            with CLIENTS[a.clients[0].removesuffix(HELD)](url) as c:
                while not stop.wait(0.02):
                    c.get(f"/v1/rollouts/{done[url]}")
                    made.append(1)  # atomic across the poller threads

        for r in range(a.rounds + 1):
            for place in PROBE_PLACES[r % 3:] + PROBE_PLACES[:r % 3]:
                target = {"none": None, "same server": servers[0], "other server": servers[1]}[place]
                stop, made = threading.Event(), list[int]()
                pollers = [] if target is None else [threading.Thread(target=poll, args=(target.rest_url, stop, made))
                                                     for _ in range(a.n)]
                for th in pollers:
                    th.start()
                time.sleep(0.3)  # the pollers are under way
                seconds = timed_call(servers[0].rest_url, {**body, "seed": r})
                stop.set()
                for th in pollers:
                    th.join()
                if r:  # the first round warms up
                    calls[place].append(seconds)
                    reads[place].append(len(made))
    finally:
        for s in servers:
            s.stop()
    base = statistics.median(calls["none"])
    print(f"poll probe: model={a.model} N={a.n} T={a.steps} rounds={a.rounds} (+1 warm-up), {a.n} {a.clients[0]} "
          f"clients polling a finished rollout every 20 ms")
    print("one B=N request's model call, median ms: " + ", ".join(
        f"pollers on {p} {statistics.median(v) * 1e3:.0f} ({statistics.median(v) / base:.2f}x)" if p != "none"
        else f"no pollers {base * 1e3:.0f}" for p, v in calls.items()))
    print("status reads a round: " + ", ".join(f"{p} {statistics.mean(v):.1f}" for p, v in reads.items()))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-sd3", help="built-in model id (default tiny-sd3)")
    ap.add_argument("--n", type=int, default=16, help="samples of the big request = concurrent clients (default 16)")
    ap.add_argument("--steps", type=int, default=8, help="num_inference_steps (default 8; mixed also runs half)")
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds, after one warm-up round (default 5)")
    ap.add_argument("--wait-ms", type=float, default=25.0, help="--batch-wait-ms of the on-W server (default 25)")
    ap.add_argument("--in-process-repeats", type=int, default=3, help="stock/run_rollout runs each (0 skips them)")
    ap.add_argument("--server-cpu", action="store_true", help="measure the server's CPU per workload instead")
    ap.add_argument("--before", metavar="PYTHON", help="--server-cpu: also a server run by this interpreter "
                    "(another checkout's .venv/bin/python; its sigmaflight is that checkout's)")
    ap.add_argument("--variant", metavar="LABEL=FLAGS", action="append", default=[],
                    help="--server-cpu: also a server of this checkout with these extra serve flags, shown as "
                    "LABEL (repeatable), e.g. --variant 'threads-1=--torch-threads 1'")
    ap.add_argument("--clients", nargs="+", choices=KINDS, default=["httpx"],
                    help="--server-cpu: the polling clients' HTTP library, the first for every server, each other one "
                    "a row of this checkout's server, e.g. after/stdlib (default httpx; stdlib: http.client, about a "
                    "quarter of httpx's CPU a request, for how much the clients' own CPU beside the server moves the "
                    "figures; LIBRARY+held: each read held by the server until the rollout ends, ?wait_s=10, as "
                    "Client.wait reads); --poll-probe: the pollers', the first one given")
    ap.add_argument("--poll-probe", action="store_true", help="time one B=N request's model call while N clients "
                    "poll a finished rollout every 20 ms on no server, on the same one or on another (module docstring)")
    a = ap.parse_args()
    if a.server_cpu:
        return server_cpu(a)
    if a.poll_probe:
        return poll_probe(a)

    common = ("--model", a.model, "--workers", "1", "--log-level", "warning", "--queue-size", str(4 * a.n + 8))
    flags = {"on-0": (), "on-W": ("--batch-wait-ms", str(a.wait_ms)), "off": ("--max-batch-samples", "1")}
    with concurrent.futures.ThreadPoolExecutor(len(MODES)) as pool:  # the three start side by side
        starting = {m: pool.submit(ServerProcess, *common, *flags[m], timeout=300) for m in MODES}
    servers = {m: f.result() for m, f in starting.items()}
    try:
        info = httpx.get(f"{servers['off'].rest_url}/v1/models", timeout=30).json()
        described = next(m for m in info["models"] if m["id"] == a.model)
        size = int(described["defaults"]["height"])
        multiple = int(described["size_multiple"])
        small = max(multiple, (size // 2) // multiple * multiple)
        loads = workloads(a, size, small)
        # per round, per (workload, mode): (samples/s, latencies)
        sps: dict[tuple[str, str], list[float]] = {(w, m): [] for w in loads for m in MODES}
        lat: dict[tuple[str, str], list[float]] = {(w, m): [] for w in loads for m in MODES}
        calls_before = {m: batch_counts(s.rest_url) for m, s in servers.items()}
        pairs = [(w, m) for w in loads for m in MODES]
        for r in range(a.rounds + 1):
            order = pairs[r % len(pairs):] + pairs[:r % len(pairs)]
            for w, m in order:
                bodies = [{**b, "model": a.model, "seed": 1000 * r + k} for k, b in enumerate(loads[w])]
                wall, lats, samples = run_requests(servers[m].rest_url, bodies)
                if r:
                    sps[(w, m)].append(samples / wall)
                    lat[(w, m)].extend(lats)
        calls_after = {m: batch_counts(s.rest_url) for m, s in servers.items()}
    finally:
        for s in servers.values():
            s.terminate()
    local = in_process(a.model, a.n, a.steps, a.in_process_repeats) if a.in_process_repeats else {}

    def ratio(w: str, m: str, base_w: str = "one-B=N", base_m: str | None = None) -> float:
        return statistics.median(x / y for x, y in zip(sps[(w, m)], sps[(base_w, base_m or m)], strict=True))

    print(f"model={a.model} N={a.n} T={a.steps} rounds={a.rounds} (+1 warm-up) on-W: --batch-wait-ms {a.wait_ms:g}; "
          f"mixed: sizes {size},{small} x steps {a.steps},{max(1, a.steps // 2)}")
    print(f"{'workload':<11} {'server':<5} {'samples/s':>10} {'vs one-B=N':>10} {'p50 ms':>9} {'p99 ms':>9}")
    for w in loads:
        for m in MODES:
            med = statistics.median(sps[(w, m)])
            print(f"{w:<11} {m:<5} {med:>10.2f} {ratio(w, m):>10.3f} {percentile(lat[(w, m)], 50) * 1e3:>9.1f} "
                  f"{percentile(lat[(w, m)], 99) * 1e3:>9.1f}")
    for m in MODES:
        (c0, n0), (c1, n1) = calls_before[m], calls_after[m]
        print(f"{m}: {c1 - c0:.0f} model calls for {n1 - n0:.0f} rollouts ({(n1 - n0) / max(1.0, c1 - c0):.2f} a call)")
    print("targets:")
    print(f"  N x B=1 on-W / one-B=N: {ratio('N x B=1', 'on-W'):.3f} (off: {ratio('N x B=1', 'off'):.3f}; "
          f"on-0: {ratio('N x B=1', 'on-0'):.3f})")
    lone = [statistics.median(lat[('lone B=1', m)]) for m in ("on-0", "off")]
    print(f"  lone B=1 latency, defaults / co-batching off: {lone[0] / lone[1]:.3f} (target <= 1.03)")
    print(f"  mixed samples/s, on-0 / off: {ratio('mixed', 'on-0', 'mixed', 'off'):.3f}, "
          f"on-W / off: {ratio('mixed', 'on-W', 'mixed', 'off'):.3f} (target >= 1)")
    if local:
        service = statistics.median(sps[("one-B=N", "on-0")])
        print(f"in process, B=N: stock diffusers __call__ {local['stock']:.2f} samples/s, run_rollout "
              f"{local['run_rollout']:.2f} samples/s; the service's one-B=N / run_rollout: "
              f"{service / local['run_rollout']:.3f}, / stock: {service / local['stock']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
