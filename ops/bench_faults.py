"""A weights push's memory and the REST latency under load, each with a baseline taken in the same run.

push: peak RSS of the server process while `PUT /v1/models/{id}/weights` loads a
      full transformer state dict, against the RSS just before, the pushed tensors' bytes and
      the whole pipeline's bytes. A push does not deep-copy the transformer (the registry
      assigns the parsed tensors); the request holds the body and its parsed copy.
load: POST /v1/rollouts latency (p50/p99) and GET/DELETE p99 while small rollouts
      are submitted (and finish) at --rate per second, on a memory-only server (baseline) and
      on a server with --data-dir (sqlite synchronous=FULL journal + fsync'd trajectory files).

    .venv/bin/python ops/bench_faults.py                 # both, small-sd3 push, 4 rollouts/s
    .venv/bin/python ops/bench_faults.py --only load --seconds 20

Starts its own servers (sigmaflight/launcher.py: `sigmaflight serve` on free loopback ports).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sigmaflight.launcher import ServerProcess  # noqa: E402

MiB = 1 << 20


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Sampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.proc, self.every, self.peak = psutil.Process(pid), every, 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.halt.wait(self.every)


def bench_push(model_id: str, pushes: int) -> None:
    import torch
    from safetensors.torch import save
    from sigmaflight.pipeline.models import ModelRegistry

    pipe = ModelRegistry().get(model_id).pipeline
    state = pipe.transformer.state_dict()
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v.clone()
           for k, v in state.items()}
    body = save(new)
    tensor_bytes = sum(v.numel() * v.element_size() for v in new.values())
    pipeline_bytes = sum(
        t.numel() * t.element_size()
        for part in pipe.components.values()
        if isinstance(part, torch.nn.Module)
        for t in part.state_dict().values()
    )
    del pipe, state
    with ServerProcess("--model", model_id, "--max-weights-bytes", str(len(body) + MiB)) as server:
        with server.client() as c:
            assert c.get("/v1/models").status_code == 200
            r0 = c.post("/v1/rollouts", json={"prompts": ["warm"], "num_inference_steps": 2, "seed": 1})
            assert r0.status_code == 202, r0.text
            time.sleep(2.0)
            for i in range(pushes):
                before = psutil.Process(server.proc.pid).memory_info().rss
                s = Sampler(server.proc.pid)
                s.start()
                t0 = time.perf_counter()
                r = c.put(f"/v1/models/{model_id}/weights", content=body,
                          headers={"content-type": "application/octet-stream"}, timeout=600)
                took = time.perf_counter() - t0
                time.sleep(0.2)
                s.halt.set()
                s.join()
                assert r.status_code == 200, r.text
                after = psutil.Process(server.proc.pid).memory_info().rss
                print(f"push {i + 1} of {model_id}: peak RSS +{(s.peak - before) / MiB:.1f} MiB over "
                      f"{before / MiB:.1f} MiB (after: +{(after - before) / MiB:.1f} MiB), {took:.2f} s")
    print(f"baseline: pushed tensors {tensor_bytes / MiB:.1f} MiB (body {len(body) / MiB:.1f} MiB), "
          f"whole pipeline {pipeline_bytes / MiB:.1f} MiB")


SMALL = {"prompts": ["a red cube"], "num_inference_steps": 2}


def load_run(flags: tuple[str, ...], rate: float, seconds: float) -> dict[str, list[float]]:
    lat: dict[str, list[float]] = {"POST": [], "GET": [], "DELETE": []}
    with ServerProcess("--workers", "1", "--queue-size", "1024", *flags) as server:
        stop = threading.Event()
        ids: list[str] = []
        lock = threading.Lock()

        def submitter() -> None:
            with httpx.Client(base_url=server.rest_url, timeout=30) as c:
                n = 0
                t_next = time.perf_counter()
                while not stop.is_set():
                    t0 = time.perf_counter()
                    r = c.post("/v1/rollouts", json={**SMALL, "seed": n})
                    lat["POST"].append(time.perf_counter() - t0)
                    assert r.status_code == 202, r.text
                    with lock:
                        ids.append(r.json()["id"])
                    n += 1
                    t_next += 1.0 / rate
                    stop.wait(max(0.0, t_next - time.perf_counter()))

        def poller() -> None:
            with httpx.Client(base_url=server.rest_url, timeout=30) as c:
                while not stop.is_set():
                    with lock:
                        rid = ids[-1] if ids else None
                    if rid is not None:
                        t0 = time.perf_counter()
                        c.get(f"/v1/rollouts/{rid}")
                        lat["GET"].append(time.perf_counter() - t0)
                    stop.wait(0.05)

        def deleter() -> None:  # releases finished rollouts (unlink + malloc_trim on the server)
            with httpx.Client(base_url=server.rest_url, timeout=30) as c:
                while not stop.is_set():
                    with lock:
                        old = ids[:-8]
                        del ids[:-8]
                    for rid in old:
                        t0 = time.perf_counter()
                        c.delete(f"/v1/rollouts/{rid}")
                        lat["DELETE"].append(time.perf_counter() - t0)
                    stop.wait(0.5)

        threads = [threading.Thread(target=f, daemon=True) for f in (submitter, poller, deleter)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(30)
        with server.client() as c:
            finished = sum(1 for r in c.get("/v1/rollouts", params={"limit": 1000}).json()["rollouts"]
                           if r["status"] in ("succeeded", "expired"))
        print(f"  {len(lat['POST'])} POSTs, {finished} finished or released of the last 1000")
    return lat


def bench_load(rate: float, seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        for label, flags in (("memory only (baseline)", ()), ("--data-dir", ("--data-dir", str(Path(tmp) / "data")))):
            print(f"{label}: {rate:g} rollouts/s submitted for {seconds:g} s")
            lat = load_run(flags, rate, seconds)
            for kind, values in lat.items():
                if values:
                    print(f"  {kind:6s} p50 {statistics.median(values) * 1e3:7.2f} ms  "
                          f"p99 {percentile(values, 99) * 1e3:7.2f} ms  max {max(values) * 1e3:7.2f} ms  (n={len(values)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["push", "load"], default=None)
    ap.add_argument("--model", default="small-sd3")
    ap.add_argument("--pushes", type=int, default=2)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args()
    if args.only in (None, "push"):
        bench_push(args.model, args.pushes)
    if args.only in (None, "load"):
        bench_load(args.rate, args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
