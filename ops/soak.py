"""Soak the service on loopback: a few clients submit rollouts and pull them, for N minutes.

Bounded in time (--minutes) and count (--max-rollouts); loopback only. Starts its own
`sigmaflight serve` (default) or connects to one (--rest-url, loopback only; --pid to
sample its RSS). Reports rollouts done, errors, p50/p99 latencies of POST and of the pull
(POST answered -> last batch received; the pull follows the rollout live) and server RSS
over time, as text and (with --json) as one JSON object.

    .venv/bin/python ops/soak.py --minutes 1.5 --clients 4
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
import pyarrow.flight as flight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sigmaflight.launcher import ServerProcess  # noqa: E402

MiB = 1 << 20


def _loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"soak: {url} is not a loopback address; this script only talks to 127.0.0.1 / ::1")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Soak:
    def __init__(self, args: argparse.Namespace, rest_url: str, pid: int | None) -> None:
        self.args, self.rest_url, self.pid = args, rest_url, pid
        self.headers = {"authorization": f"Bearer {args.token}"} if args.token else {}
        self.options = flight.FlightCallOptions(
            headers=[(k.encode(), v.encode()) for k, v in self.headers.items()], timeout=args.pull_timeout_s)
        self.lock = threading.Lock()
        self.post_s: list[float] = []
        self.pull_s: list[float] = []
        self.bytes_pulled = 0
        self.done = 0
        self.started = 0
        self.errors: Counter[str] = Counter()
        self.rss: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def body(self, n: int) -> dict:
        a = self.args
        return {"prompts": [f"soak prompt {n} {k}" for k in range(a.prompts)], "num_outputs_per_prompt": a.outputs,
                "num_inference_steps": a.steps, "height": a.size, "width": a.size, "seed": n}

    def take(self) -> int | None:
        with self.lock:
            if self.stop.is_set() or self.started >= self.args.max_rollouts:
                return None
            self.started += 1
            return self.started

    def client(self) -> None:
        with httpx.Client(base_url=self.rest_url, headers=self.headers, timeout=60) as http:
            while (n := self.take()) is not None:
                try:
                    t0 = time.perf_counter()
                    r = http.post("/v1/rollouts", json=self.body(n))
                    t1 = time.perf_counter()
                    if r.status_code != 202:
                        with self.lock:
                            self.errors[f"POST {r.status_code} {r.json()['error']['type']}"] += 1
                        time.sleep(0.2 if r.status_code == 429 else 0)
                        continue
                    ticket = r.json()["flight"]
                    nbytes = 0
                    with flight.FlightClient(ticket["locations"][0]) as fc:
                        reader = fc.do_get(flight.Ticket(ticket["ticket"].encode()), options=self.options)
                        for chunk in reader:
                            nbytes += chunk.data.nbytes
                    t2 = time.perf_counter()
                    if self.args.release:
                        http.delete(f"/v1/rollouts/{r.json()['id']}")
                    with self.lock:
                        self.post_s.append(t1 - t0)
                        self.pull_s.append(t2 - t1)
                        self.bytes_pulled += nbytes
                        self.done += 1
                except Exception as exc:  # counted and reported; the soak goes on
                    with self.lock:
                        self.errors[type(exc).__name__] += 1

    def sample_rss(self, t0: float) -> None:
        proc = psutil.Process(self.pid) if self.pid else None
        while not self.stop.wait(self.args.rss_every_s):
            if proc is not None:
                self.rss.append((round(time.monotonic() - t0, 1), proc.memory_info().rss))

    def run(self) -> dict:
        t0 = time.monotonic()
        threads = [threading.Thread(target=self.client, daemon=True) for _ in range(self.args.clients)]
        sampler = threading.Thread(target=self.sample_rss, args=(t0,), daemon=True)
        if self.pid:
            self.rss.append((0.0, psutil.Process(self.pid).memory_info().rss))
        sampler.start()
        for t in threads:
            t.start()
        deadline = t0 + self.args.minutes * 60
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.stop.set()
        for t in threads:
            t.join(self.args.pull_timeout_s)
        sampler.join()
        elapsed = time.monotonic() - t0
        if self.pid:
            self.rss.append((round(elapsed, 1), psutil.Process(self.pid).memory_info().rss))
        return {
            "elapsed_s": round(elapsed, 1),
            "clients": self.args.clients,
            "rollouts_done": self.done,
            "rollouts_per_s": round(self.done / elapsed, 2),
            "errors": dict(self.errors),
            "mib_pulled": round(self.bytes_pulled / MiB, 1),
            "post_ms": {"p50": round(_pct(self.post_s, 50) * 1e3, 1), "p99": round(_pct(self.post_s, 99) * 1e3, 1)},
            "pull_ms": {"p50": round(_pct(self.pull_s, 50) * 1e3, 1), "p99": round(_pct(self.pull_s, 99) * 1e3, 1)},
            "server_rss_mib": [(t, round(v / MiB, 1)) for t, v in self.rss],
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0, help="wall-clock bound (default 1)")
    p.add_argument("--max-rollouts", type=int, default=100_000, help="count bound (default 100000)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per rollout (default 2)")
    p.add_argument("--outputs", type=int, default=2, help="num_outputs_per_prompt (default 2)")
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps (default 4)")
    p.add_argument("--size", type=int, default=64, help="height and width (default 64)")
    p.add_argument("--release", action=argparse.BooleanOptionalAction, default=True,
                   help="DELETE each rollout after pulling it (default on; off lets TTL and the store budget work)")
    p.add_argument("--rest-url", help="connect to this server (loopback only) instead of starting one")
    p.add_argument("--pid", type=int, help="with --rest-url: the server's pid, to sample its RSS")
    p.add_argument("--token", help="bearer token for a server started with --token-file")
    p.add_argument("--server-flags", default="", help="extra `sigmaflight serve` flags for the started server")
    p.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sampling period (default 5)")
    p.add_argument("--pull-timeout-s", type=float, default=120.0, help="per-pull timeout (default 120)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.minutes > 24 * 60 or args.clients < 1 or args.max_rollouts < 1:
        p.error("need 0 < --minutes <= 1440, --clients >= 1, --max-rollouts >= 1")

    server = None
    if args.rest_url:
        _loopback(args.rest_url)
        rest_url, pid = args.rest_url.rstrip("/"), args.pid
    else:
        server = ServerProcess("--host", "127.0.0.1", *args.server_flags.split())
        rest_url, pid = server.rest_url, server.proc.pid
    try:
        report = Soak(args, rest_url, pid).run()
    finally:
        if server is not None:
            server.terminate()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['rollouts_done']} rollouts in {report['elapsed_s']} s ({report['rollouts_per_s']}/s) "
              f"with {report['clients']} clients, {report['mib_pulled']} MiB pulled; errors: {report['errors'] or 0}")
        print(f"POST p50 {report['post_ms']['p50']} ms, p99 {report['post_ms']['p99']} ms; "
              f"pull p50 {report['pull_ms']['p50']} ms, p99 {report['pull_ms']['p99']} ms")
        print("server RSS (s, MiB): " + ", ".join(f"{t:g}: {v:g}" for t, v in report["server_rss_mib"]))
    return 1 if report["errors"] or not report["rollouts_done"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
