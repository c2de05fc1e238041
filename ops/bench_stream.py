"""Client.stream against submitting by hand: the same single-prompt requests through one real
co-batching server, in one run.

  stream   `Client.stream(requests, in_flight=K)`, every rollout's trajectory pulled as it comes
  bursts   the same requests by hand in bursts of M: submit M, pull each (Client.pull follows a
           running rollout), then the next burst

Both pull every trajectory. Rounds alternate which goes first (the box is noisy: each round
gives one stream / bursts ratio, the median over rounds is printed) after one warm-up round of
each. The server: `sigmaflight serve` with co-batching on (the defaults) and one worker.

  .venv/bin/python ops/bench_stream.py                      # 64 requests, in_flight 32, bursts of 16
  .venv/bin/python ops/bench_stream.py --n 8 --in-flight 4 --burst 2 --rounds 1 --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from sigmaflight.client import Client
from sigmaflight.launcher import ServerProcess


def requests(n: int, steps: int, round_: int) -> list[dict[str, Any]]:
    return [{"prompts": [f"prompt {k}"], "num_inference_steps": steps, "seed": 1000 * round_ + k} for k in range(n)]


def by_stream(c: Client, reqs: list[dict[str, Any]], in_flight: int) -> float:
    t0 = time.perf_counter()
    got = 0
    for r in c.stream(reqs, in_flight=in_flight, progress=False):
        if r.error is not None:
            raise SystemExit(f"stream: {r.error}")
        got += 1
    assert got == len(reqs)
    return time.perf_counter() - t0


def by_bursts(c: Client, reqs: list[dict[str, Any]], burst: int) -> float:
    t0 = time.perf_counter()
    for first in range(0, len(reqs), burst):
        tickets = [c.submit(**r) for r in reqs[first:first + burst]]
        for t in tickets:
            c.pull(t)
    return time.perf_counter() - t0


def batch_counts(c: Client) -> tuple[float, float]:
    """(model calls, rollouts) so far, from the server's /metrics histogram sigmaflight_batch_requests."""
    from prometheus_client.parser import text_string_to_metric_families

    got = {s.name: s.value for f in text_string_to_metric_families(c._http.get("/metrics").text)
           if f.name == "sigmaflight_batch_requests" for s in f.samples}
    return got.get("sigmaflight_batch_requests_count", 0.0), got.get("sigmaflight_batch_requests_sum", 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-sd3", help="built-in model id (default tiny-sd3)")
    ap.add_argument("--n", type=int, default=64, help="single-prompt requests per run (default 64)")
    ap.add_argument("--in-flight", type=int, default=32, help="the stream's in_flight (default 32)")
    ap.add_argument("--burst", type=int, default=16, help="requests per burst by hand (default 16)")
    ap.add_argument("--steps", type=int, default=8, help="num_inference_steps (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds after one warm-up round (default 3)")
    a = ap.parse_args()

    ways = ("stream", "bursts")
    walls: dict[str, list[float]] = {w: [] for w in ways}
    calls: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    with ServerProcess("--model", a.model, "--workers", "1", "--log-level", "warning",
                       "--queue-size", str(max(64, 2 * a.n)), timeout=300) as server, Client(server.rest_url) as c:
        for r in range(a.rounds + 1):
            for w in ways if r % 2 else ways[::-1]:
                reqs = [{**q, "model": a.model} for q in requests(a.n, a.steps, 2 * r + (w == "stream"))]
                before = batch_counts(c)
                wall = by_stream(c, reqs, a.in_flight) if w == "stream" else by_bursts(c, reqs, a.burst)
                after = batch_counts(c)
                if r:
                    walls[w].append(wall)
                    calls[w].append((after[0] - before[0], after[1] - before[1]))

    print(f"model={a.model} requests={a.n} (one prompt each) T={a.steps} rounds={a.rounds} (+1 warm-up); "
          f"stream in_flight={a.in_flight}, bursts of {a.burst}")
    print(f"{'way':<7} {'samples/s':>10} {'wall s':>8} {'rollouts a model call':>22}")
    for w in ways:
        wall = statistics.median(walls[w])
        per_call = sum(n for _, n in calls[w]) / max(1.0, sum(k for k, _ in calls[w]))
        print(f"{w:<7} {a.n / wall:>10.2f} {wall:>8.2f} {per_call:>22.2f}")
    ratio = statistics.median(b / s for s, b in zip(walls["stream"], walls["bursts"], strict=True))
    print(f"stream / bursts samples/s: {ratio:.3f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
