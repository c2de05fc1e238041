"""How far a co-batched rollout's log-probs move from a solo run (without --batch-invariant).

For each model: one request R (2 prompts, sde at every step, its default size and steps, CPU
fp32) runs alone, then co-batched behind two other requests (3 + 1 samples of other prompts and
seeds) in one `run_batch` call, then co-batched with per-row model calls (--batch-invariant).
Printed, each as max |d log p| over R's samples and steps:

- replay: R's co-batched trajectory (its x_i, x_{i+1}) replayed alone with `Replayer`, against
  the log-probs it recorded: what a trainer that recomputes R in another batch sees; Flow-GRPO
  clips the ratio exp(d log p) at 1 +- 1e-4, so d log p of that order would matter;
- rollout: R co-batched against R alone (same seeds, same noise, so the difference is the batched
  forward's last bits and what they grow into over the steps);
- latents: max |d x| of the final latent, co-batched against alone;
- invariant: per-row model calls (--batch-invariant), co-batched against alone: every latent and
  log-prob `torch.equal`.

    .venv/bin/python ops/measure_batch_drift.py --models tiny-sd3 small-sd3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sigmaflight.pipeline.models import ModelRegistry  # noqa: E402
from sigmaflight.pipeline.replay import Replayer  # noqa: E402
from sigmaflight.pipeline.rollout import BatchMember, RolloutResult, run_batch, run_rollout  # noqa: E402
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec  # noqa: E402


def _ok(out: object) -> RolloutResult:
    if isinstance(out, BaseException):
        raise out
    assert isinstance(out, RolloutResult)
    return out


def _stack(res: RolloutResult) -> tuple[torch.Tensor, list[int]]:
    steps = [c.step for c in res.captures]
    return torch.stack([c.latent for c in res.captures], dim=1), steps


def measure(registry: ModelRegistry, model_id: str) -> dict[str, float]:
    model = registry.get(model_id)
    sampler = SamplerSpec(type="sde", noise_level=0.7)
    mine = RolloutSpec(model=model_id, prompts=("a red cube", "a blue ball"), seed=7, sampler=sampler)
    others = [RolloutSpec(model=model_id, prompts=("a dog", "a cat", "a tree"), seed=8, sampler=sampler),
              RolloutSpec(model=model_id, prompts=("a house",), seed=9, sampler=sampler)]
    alone = run_rollout(model, mine)
    batched = _ok(run_batch(model, [BatchMember(spec=s) for s in (*others, mine)])[-1])
    invariant = _ok(run_batch(model, [BatchMember(spec=s) for s in (*others, mine)], per_sample_model_calls=True)[-1])
    alone_invariant = run_rollout(model, mine, per_sample_model_calls=True)
    latents, steps = _stack(batched)
    replayed = Replayer(model).log_probs(mine, latents=latents, steps=steps, sigmas=batched.snapshot.sigmas,
                                         timesteps=batched.snapshot.timesteps, seeds=batched.seeds)
    last = max(steps)

    def final(res: RolloutResult) -> torch.Tensor:
        return next(c.latent for c in res.captures if c.step == last)

    return {
        "replay": (replayed - batched.log_probs).abs().nan_to_num(0.0).max().item(),
        "rollout": (batched.log_probs - alone.log_probs).abs().nan_to_num(0.0).max().item(),
        "latents": (final(batched) - final(alone)).abs().max().item(),
        "invariant_equal": float(all(torch.equal(a.latent, b.latent) for a, b in
                                     zip(invariant.captures, alone_invariant.captures, strict=True))
                                 and torch.equal(invariant.log_probs.nan_to_num(-7.0),
                                                 alone_invariant.log_probs.nan_to_num(-7.0))),
        "log_p_scale": alone.log_probs.abs().nan_to_num(0.0).max().item(),
        "steps": float(len(steps) - 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-sd3", "small-sd3"])
    a = ap.parse_args()
    torch.manual_seed(0)
    registry = ModelRegistry()
    print(f"{'model':<10} {'T':>3} {'|log p| max':>12} {'replay d log p':>15} {'rollout d log p':>16} "
          f"{'final |d x|':>12} {'--batch-invariant':>18}")
    for model_id in a.models:
        m = measure(registry, model_id)
        print(f"{model_id:<10} {m['steps']:>3.0f} {m['log_p_scale']:>12.4g} {m['replay']:>15.3g} {m['rollout']:>16.3g} "
              f"{m['latents']:>12.3g} {'torch.equal' if m['invariant_equal'] else 'DIFFERS':>18}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
