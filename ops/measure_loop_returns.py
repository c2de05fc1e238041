"""Cost of the v1 loop returns on the pipeline side: velocities, conditioning, branch rollouts.

For each model (B = 2 prompts x 2, its default steps and size, CPU fp32, sde): the median wall
time of `run_rollout` plain, with `return_velocities`, with `return_conditioning`, and of a
branch rollout from k = T // 2 of an "ode" parent (same B, sde only at k); and the bytes of the
conditioning against the captured latents (all T+1 steps) and the velocities (T steps).

    .venv/bin/python ops/measure_loop_returns.py --models tiny-sd3 small-sd3 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sigmaflight.pipeline.models import ModelRegistry  # noqa: E402
from sigmaflight.pipeline.rollout import run_rollout  # noqa: E402
from sigmaflight.pipeline.spec import BranchStart, RolloutSpec, SamplerSpec  # noqa: E402


def _interleaved_median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each fn over `repeats` rounds; every round runs each once, in an order that
    rotates from round to round (a box that slows down mid-run hits them all alike)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t0) * 1000)
    return {n: statistics.median(times[n]) for n in names}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model_id: str, repeats: int) -> None:
    model = ModelRegistry().get(model_id)
    spec = RolloutSpec(model=model_id, prompts=("a cat", "the dog"), num_outputs_per_prompt=2, seed=1,
                       num_inference_steps=model.defaults.num_inference_steps)
    t = spec.num_inference_steps
    k = t // 2
    full = run_rollout(model, dataclasses.replace(spec, return_velocities=True, return_conditioning=True))
    parent = run_rollout(model, dataclasses.replace(spec, sampler=SamplerSpec(type="ode")))
    snap = parent.snapshot
    branch = BranchStart(step=k, latents=parent.captures[k].latent, sigmas=snap.sigmas, timesteps=snap.timesteps,
                         set_timesteps_kwargs=snap.set_timesteps_kwargs, samples=(0, 1, 2, 3),
                         prompt_index=snap.prompt_index)
    bspec = dataclasses.replace(spec, branch_from=branch, num_outputs_per_prompt=1,
                                sampler=SamplerSpec(type="sde", sde_steps=(k,)))
    runs = {
        "plain": spec,
        "velocities": dataclasses.replace(spec, return_velocities=True),
        "conditioning": dataclasses.replace(spec, return_conditioning=True),
        f"branch k={k}": bspec,
    }
    run_rollout(model, spec)  # warm-up
    times = _interleaved_median_ms({name: lambda s=s: run_rollout(model, s) for name, s in runs.items()}, repeats)
    assert full.conditioning is not None
    lat = _nbytes(c.latent for c in full.captures)
    vel = _nbytes(c.velocity for c in full.captures if c.velocity is not None)
    cond = _nbytes(full.conditioning.values())
    print(f"{model_id} (B=4, T={t}, torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for name, ms in times.items():
        print(f"  {name:14s} {ms:9.1f} ms  ({ms / times['plain']:.3f} of plain)")
    print(f"  bytes: latents {lat}, velocities {vel}, conditioning {cond} "
          f"({cond / lat:.3f} of the latents; {', '.join(f'{n} {tuple(v.shape)}' for n, v in full.conditioning.items())})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-sd3", "small-sd3"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for model_id in args.models:
        measure(model_id, args.repeats)


if __name__ == "__main__":
    main()
