"""Service benchmark: N concurrent clients submit small rollouts to a real server.

Prints, from one run on this machine:
- p50/p99 latency of POST /v1/rollouts while rollouts run (target p99 < 50 ms);
- rollouts/s and steps/s through the service (submit -> succeeded -> trajectory pulled over Flight);
- the same rollouts called in-process (pipeline.run_rollout with full capture, one after the
  other, as one service worker runs them), measured before and after the service run;
- the ratio service steps/s / in-process steps/s (target >= 0.9).

The server is started here (`sigmaflight serve --port 0 --flight-port 0 --workers 1`) unless
--url is given.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx
import pyarrow.flight as flight


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def in_process(model_id: str, bodies: list[dict]) -> float:
    """Seconds to run every body's rollout in-process, one after the other, with full capture."""
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.rollout import run_rollout
    from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

    model = ModelRegistry().get(model_id)
    specs = [
        RolloutSpec(model=model_id, prompts=tuple(b["prompts"]), num_inference_steps=b["num_inference_steps"],
                    num_outputs_per_prompt=b["num_outputs_per_prompt"], seed=b["seed"], sampler=SamplerSpec())
        for b in bodies
    ]
    run_rollout(model, specs[0], keep=False)  # warm-up
    t0 = time.perf_counter()
    for spec in specs:
        run_rollout(model, spec, on_step=lambda cap: None, keep=False)
    return time.perf_counter() - t0


def through_service(url: str, bodies: list[dict], clients: int) -> tuple[float, list[float], int]:
    """(seconds, POST latencies, rows pulled) for all bodies over `clients` concurrent clients."""
    latencies: list[float] = []
    rows = 0
    lock = threading.Lock()
    errors: list[str] = []

    def client(mine: list[dict]) -> None:
        nonlocal rows
        with httpx.Client(base_url=url, timeout=60) as c:
            tickets = []
            for body in mine:
                t0 = time.perf_counter()
                r = c.post("/v1/rollouts", json=body)
                dt = time.perf_counter() - t0
                if r.status_code != 202:
                    errors.append(r.text)
                    continue
                with lock:
                    latencies.append(dt)
                tickets.append(r.json())
            for t in tickets:  # do_get follows a rollout live and ends after x_T
                with flight.FlightClient(t["flight"]["locations"][0]) as fc:
                    table = fc.do_get(flight.Ticket(t["flight"]["ticket"].encode())).read_all()
                with lock:
                    rows += table.num_rows

    shares = [bodies[k::clients] for k in range(clients)]
    threads = [threading.Thread(target=client, args=(s,)) for s in shares]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} submissions failed, first: {errors[0]}")
    return elapsed, latencies, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one here)")
    ap.add_argument("--model", default="tiny-sd3")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients")
    ap.add_argument("--rollouts", type=int, default=64, help="rollouts in all")
    ap.add_argument("--steps", type=int, default=8, help="num_inference_steps per rollout")
    ap.add_argument("--samples", type=int, default=2, help="num_outputs_per_prompt (one prompt)")
    ap.add_argument("--workers", type=int, default=1, help="server rollout worker threads")
    ap.add_argument("--server-threads", type=int, default=0, help="OMP_NUM_THREADS for the server (0 = default)")
    args = ap.parse_args()

    bodies = [
        {"model": args.model, "prompts": [f"prompt {k % 7}"], "num_outputs_per_prompt": args.samples,
         "num_inference_steps": args.steps, "seed": k}
        for k in range(args.rollouts)
    ]
    steps_total = args.rollouts * args.steps
    base_before = in_process(args.model, bodies)

    server = None
    url = args.url
    if url is None:
        from sigmaflight.launcher import ServerProcess

        env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
        server = ServerProcess("--workers", str(args.workers), "--queue-size", str(args.rollouts + 8),
                               "--model", args.model, "--log-level", "warning", env=env)
        url = server.rest_url
    try:
        # warm-up rollout through the service
        through_service(url, bodies[:1], 1)
        elapsed, lat, rows = through_service(url, bodies, args.clients)
    finally:
        if server is not None:
            server.terminate()
    base_after = in_process(args.model, bodies)
    base = (base_before + base_after) / 2

    service_sps = steps_total / elapsed
    local_sps = steps_total / base
    print(f"model={args.model} rollouts={args.rollouts} clients={args.clients} T={args.steps} "
          f"B={args.samples} rows pulled={rows}")
    print(f"POST latency while rollouts run: p50 {statistics.median(lat) * 1000:.1f} ms, "
          f"p99 {percentile(lat, 99) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms (target p99 < 50 ms)")
    print(f"service:    {args.rollouts / elapsed:.2f} rollouts/s, {service_sps:.1f} steps/s ({elapsed:.2f} s)")
    print(f"in-process: {args.rollouts / base:.2f} rollouts/s, {local_sps:.1f} steps/s "
          f"(before {base_before:.2f} s, after {base_after:.2f} s)")
    print(f"ratio service / in-process steps/s: {service_sps / local_sps:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
