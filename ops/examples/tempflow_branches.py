"""TempFlow-GRPO style per-step credit with branch rollouts: one deterministic ("ode") parent
rollout streaming step k, one branch rollout with K branches per parent sample that is
stochastic only at transition k, then the advantage of transition k from the branches' rewards.

Because the parent is deterministic and the branches are stochastic only at k, the spread of the
K rewards of one parent sample is due to transition k alone: the group-normalized reward of each
branch is the advantage of its step-k transition (a process-reward signal, no critic).
The reward here is a toy one: the JPEG size of the decoded output (`return.outputs`).

    python ops/examples/tempflow_branches.py --url http://127.0.0.1:8000 --step 2 --branches 4
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from sigmaflight import Client


@dataclass(frozen=True)
class StepAdvantages:
    parent: str
    branch: str
    step: int
    rewards: torch.Tensor
    """float32 [P, K]: reward of branch b of parent sample j."""
    advantages: torch.Tensor
    """float32 [P, K]: (reward - group mean) / (group std + eps), the advantage of transition `step`."""
    log_probs: torch.Tensor
    """float32 [P, K]: log p(x_{k+1} | x_k) of each branch (the only stochastic transition)."""


def jpeg_size(image: np.ndarray) -> float:
    """The toy reward: bytes of the image saved as JPEG (quality 90)."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=90)
    return float(len(buf.getvalue()))


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """[P, K] rewards -> per-group normalized advantages (a constant group gives 0, not NaN)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def step_advantages(
    url: str,
    *,
    step: int = 2,
    branches: int = 4,
    steps: int = 4,
    prompts: tuple[str, ...] = ("a red cube", "a dog on the beach"),
    seed: int = 7,
    token: str | None = None,
    log: Callable[[str], None] = print,
) -> StepAdvantages:
    with Client(url, token=token) as client:
        parent = client.submit(prompts=list(prompts), num_inference_steps=steps, seed=seed,
                               sampler={"type": "ode"}, return_={"steps": [step], "log_probs": False})
        client.wait(parent, timeout=120)
        branch = client.branch(parent.id, step, branches=branches, seed=seed + 1,
                               sampler={"type": "sde", "noise_level": 0.9, "sde_steps": [step]},
                               return_={"steps": [step, step + 1], "outputs": True})
        client.wait(branch, timeout=120)
        traj = client.pull(branch)
        images = client.pull_outputs(branch)
    p = len(prompts)
    rewards = torch.tensor([jpeg_size(im) for im in images], dtype=torch.float32).reshape(p, branches)
    advantages = group_advantages(rewards)
    log_probs = traj.log_probs[:, step].reshape(p, branches)
    log(f"parent {parent.id} (ode, T={steps}), branch {branch.id}: {branches} branches at step {step}")
    for j in range(p):
        log(f"  parent sample {j} ({prompts[j]!r}): rewards {rewards[j].tolist()} "
            f"advantages {[round(a, 3) for a in advantages[j].tolist()]}")
    return StepAdvantages(parent.id, branch.id, step, rewards, advantages, log_probs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--token", default=None)
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    step_advantages(args.url, step=args.step, branches=args.branches, steps=args.steps, token=args.token)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
