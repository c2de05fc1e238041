"""Rollout overhead: run_rollout (full capture, SDE log-probs) vs the pipeline's plain __call__.

Both run on the same model, steps, batch and seeds in one process, interleaved (which runs
first alternates); prints the median wall times, their ratio and the median of the per-round
ratios (target <= 1.05). Both skip the VAE decode (`output_type="latent"`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small-sd3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--outputs-per-prompt", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sigmaflight.pipeline.calls import call_kwargs
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.rollout import run_rollout, sample_seeds
    from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

    model = ModelRegistry().get(args.model)
    prompts = tuple(f"prompt {k}" for k in range(args.prompts))
    spec = RolloutSpec(model=args.model, prompts=prompts, num_outputs_per_prompt=args.outputs_per_prompt,
                       num_inference_steps=args.steps, seed=args.seed, sampler=SamplerSpec(type="sde"))
    seeds = sample_seeds(spec)

    def plain() -> None:
        with torch.inference_mode():
            model.pipeline(**call_kwargs(model, spec, seeds))

    def rollout() -> None:
        res = run_rollout(model, spec)
        assert len(res.captures) == args.steps + 1 and torch.isfinite(res.log_probs).all()

    plain()
    rollout()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "rollout": []}
    order = (("plain", plain), ("rollout", rollout))
    for k in range(args.repeats):
        for name, fn in order if k % 2 == 0 else order[::-1]:  # which runs first alternates
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    p, r = statistics.median(times["plain"]), statistics.median(times["rollout"])
    paired = sorted(b / a for a, b in zip(times["plain"], times["rollout"], strict=True))
    print(f"model={args.model} B={spec.num_samples} T={args.steps} repeats={args.repeats} threads={torch.get_num_threads()}")
    print(f"plain __call__ median {p * 1000:.1f} ms ({p * 1000 / args.steps:.1f} ms/step)")
    print(f"run_rollout    median {r * 1000:.1f} ms")
    print(f"ratio {r / p:.3f} (of the medians); {statistics.median(paired):.3f} median of the {len(paired)} "
          f"back-to-back pairs (range {paired[0]:.3f}-{paired[-1]:.3f})")


if __name__ == "__main__":
    main()
