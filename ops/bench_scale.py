"""Scale-out cost: rollouts/s through JobManager with the Ray backend vs the local backend.

Same requests, same model, same torch threads per worker, one process, one local Ray
cluster (`ray.init(num_cpus=<cpus>)`); for each worker count k (1, 2 by default) it runs:
local backend with k worker threads, Ray backend with k worker actors. Rounds interleave
the configurations (machines here are shared: noise moves every configuration alike).
Prints rollouts/s per configuration (median of rounds), the Ray/local ratio, and the Ray
path's overhead per rollout at the same worker count (target <= 10%).

    .venv/bin/python ops/bench_scale.py            # small-sd3, 16 rollouts of 2x2 samples x 8 steps, 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-sd3")
    ap.add_argument("--rollouts", type=int, default=16, help="rollouts per measurement")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--outputs-per-prompt", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (local process and each actor)")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    args = ap.parse_args()

    import ray
    from sigmaflight.control.backends.local import LocalBackend
    from sigmaflight.control.backends.ray import RayBackend
    from sigmaflight.control.backends.worker import WorkerConfig
    from sigmaflight.control.jobs.manager import JobManager
    from sigmaflight.dataplane.store import ResultStore
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

    torch.set_num_threads(args.threads)
    prompts = tuple(f"prompt {k}" for k in range(args.prompts))

    def spec(seed: int) -> RolloutSpec:
        return RolloutSpec(model=args.model, prompts=prompts, num_outputs_per_prompt=args.outputs_per_prompt,
                           num_inference_steps=args.steps, seed=seed, sampler=SamplerSpec(type="sde"))

    def drive(jobs: JobManager, n: int, release: Any, latencies: list[float] | None = None) -> float:
        """Submit n rollouts at once, wait for all; wall seconds from first submit to last finish.
        Appends each rollout's run latency (JobManager started -> finished) to `latencies`."""
        t0 = time.perf_counter()
        ids = [jobs.submit(spec(seed))[0].id for seed in range(n)]
        submitted = []
        for job_id in ids:  # a JobView is a snapshot: ask for the latest
            while (job := jobs.get(job_id)) is not None and job.status not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.002)
            assert job is not None and job.status == "succeeded", job
            submitted.append(job)
        wall = time.perf_counter() - t0
        for job in submitted:
            if latencies is not None:
                latencies.append((job.finished_at or 0.0) - (job.started_at or 0.0))
            release(job.id)
        return wall

    t0 = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    t_init = time.perf_counter() - t0
    registry = ModelRegistry()
    registry.get(args.model)
    store = ResultStore(memory_budget_bytes=8 << 30)
    local_backend = LocalBackend(registry, store, locations=lambda: [])
    config = WorkerConfig(index=0, model=args.model, torch_threads=args.threads)

    results: dict[tuple[str, int], list[float]] = {}
    latency: dict[tuple[str, int], list[float]] = {}
    startup: dict[int, float] = {}
    for k in args.workers:
        t0 = time.perf_counter()
        ray_backend = RayBackend(config, workers=k, num_cpus=args.cpus / max(args.workers))
        startup[k] = time.perf_counter() - t0
        setups = {
            "local": (JobManager(local_backend, workers=k), local_backend.release),
            "ray": (JobManager(ray_backend, workers=k), ray_backend.release),
        }
        for jobs, release in setups.values():
            jobs.start()
            drive(jobs, 2 * k, release)  # warm-up: first calls, allocator, actor threads
        for _ in range(args.rounds):
            for name, (jobs, release) in setups.items():
                wall = drive(jobs, args.rollouts, release, latency.setdefault((name, k), []))
                results.setdefault((name, k), []).append(args.rollouts / wall)
        for jobs, _ in setups.values():
            jobs.stop()
        ray_backend.close()

    samples = args.prompts * args.outputs_per_prompt
    print(f"model {args.model}, {args.rollouts} rollouts x {samples} samples x {args.steps} steps, "
          f"torch threads/worker {args.threads}, Ray cluster {args.cpus} CPUs, median of {args.rounds} rounds")
    print(f"ray.init {t_init:.1f} s; actors ready: " + ", ".join(f"{k} worker(s) {s:.1f} s" for k, s in startup.items()))
    print(f"{'workers':>7} {'local r/s':>10} {'ray r/s':>9} {'ray/local':>9} {'local ms/r':>10} {'ray ms/r':>9} {'overhead':>8}")
    for k in args.workers:
        loc = statistics.median(results[("local", k)])
        ry = statistics.median(results[("ray", k)])
        print(f"{k:>7} {loc:>10.2f} {ry:>9.2f} {ry / loc:>9.3f} {1000 / loc:>10.1f} {1000 / ry:>9.1f} "
              f"{(loc / ry - 1) * 100:>7.1f}%")
    print("run latency per rollout (JobManager started -> finished, median over all rollouts): " + "; ".join(
        f"{n}x{k} {statistics.median(v) * 1000:.1f} ms" for (n, k), v in latency.items()))
    for k in args.workers:
        extra = statistics.median(latency[("ray", k)]) - statistics.median(latency[("local", k)])
        print(f"  {k} worker(s): Ray adds {extra * 1000:+.1f} ms per rollout "
              f"({extra / statistics.median(latency[('local', k)]) * 100:+.1f}%)")
    print("rounds (rollouts/s): " + "; ".join(
        f"{n}x{k}: " + " ".join(f"{v:.2f}" for v in vs) for (n, k), vs in results.items()))
    store.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
