"""What storing one step of a co-batched call costs the worker: each member encoded on its own
against the call encoded once (`CallWriters`), in one process, interleaved rounds.

For a call of N single-sample members (and, with --samples, members of S samples each), every
round writes the call's T+1 steps into a real in-memory `ResultStore` both ways:

  each     every member's rows copied (`clone`) and appended alone (`TrajectoryWriter.append`,
           `encode_step_sized`): how the local backend wrote a co-batched step before
  call     `CallWriters.append`: one record batch of the whole call a step, each member a copy
           of its own rows (`encode_call_step`)

and prints the median milliseconds of a call's steps each way and the median of the per-round
ratios (call / each; below 1 is cheaper). The model does not run: this is the writes alone.

  .venv/bin/python ops/bench_writes.py
  .venv/bin/python ops/bench_writes.py --members 16 64 --samples 1 4 --rounds 30
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from sigmaflight.dataplane.cobatch import CallWriters
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.store import ResultStore

_ids = itertools.count()


def header(samples: int, steps: int, shape: tuple[int, ...]) -> TrajectoryHeader:
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    rid = f"bench-{next(_ids)}"
    return TrajectoryHeader(
        rollout_id=rid, sigmas=sigmas, timesteps=sigmas[:-1] * 1000, steps=tuple(range(steps + 1)),
        sde_steps=tuple(range(steps)), seeds=tuple(range(samples)), num_outputs_per_prompt=1, latent_shape=shape,
        latent_dtype=torch.float32, log_probs=True, rollout={"id": rid, "model": {"id": "bench"}})


def one_round(store: ResultStore, how: str, members: int, samples: int, steps: int, shape: tuple[int, ...]) -> float:
    """Seconds to write a call's steps `how` ("each" or "call"); the trajectories are dropped after."""
    rows = members * samples
    writers = [store.create(header(samples, steps, shape)) for _ in range(members)]
    calls = [StepBatch(step=i, latent=torch.randn(rows, *shape), log_prob=torch.randn(rows) if i < steps else None)
             for i in range(steps + 1)]
    t0 = time.perf_counter()
    if how == "each":
        for step in calls:
            for k, w in enumerate(writers):
                rs = slice(k * samples, (k + 1) * samples)
                lp = None if step.log_prob is None else step.log_prob[rs].clone()
                w.append(StepBatch(step=step.step, latent=step.latent[rs].clone(), log_prob=lp))
    else:
        call = CallWriters([(w, k * samples, (k + 1) * samples) for k, w in enumerate(writers)], rows,
                           max_batch_bytes=store.max_batch_bytes)
        for step in calls:
            if call.append(step, writers):
                raise SystemExit("a member refused a step")
    took = time.perf_counter() - t0
    for w in writers:
        w.fail("cancelled", "benchmark round over")
        store.release(w.rollout_id)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, nargs="+", default=[4, 16, 64], help="rollouts in the call (default 4 16 64)")
    ap.add_argument("--samples", type=int, nargs="+", default=[1], help="samples of each member (default 1)")
    ap.add_argument("--steps", type=int, default=8, help="T: the call writes T+1 steps (default 8)")
    ap.add_argument("--shape", type=int, nargs="+", default=[16, 8, 8],
                    help="one sample's latent shape (default 16 8 8: tiny-sd3's 64x64 latents)")
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds (+2 warm-up; default 20)")
    a = ap.parse_args()
    shape = tuple(a.shape)
    store = ResultStore(memory_budget_bytes=64 << 30)
    print(f"steps={a.steps} latent={list(shape)} float32 rounds={a.rounds}: ms to store one call's {a.steps + 1} steps")
    print(f"{'members':>8} {'samples':>8} {'each ms':>9} {'call ms':>9} {'call/each':>10}")
    for members, samples in itertools.product(a.members, a.samples):
        took: dict[str, list[float]] = {"each": [], "call": []}
        for r in range(a.rounds + 2):
            order = ("each", "call") if r % 2 == 0 else ("call", "each")
            for how in order:
                s = one_round(store, how, members, samples, a.steps, shape)
                if r >= 2:
                    took[how].append(s)
        ratio = statistics.median(c / e for c, e in zip(took["call"], took["each"], strict=True))
        print(f"{members:>8} {samples:>8} {statistics.median(took['each']) * 1e3:>9.2f} "
              f"{statistics.median(took['call']) * 1e3:>9.2f} {ratio:>10.2f}")
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
