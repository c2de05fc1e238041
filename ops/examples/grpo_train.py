"""A complete, small GRPO loop against a running sigmaflight server (built-in tiny-sd3, CPU).

    sigmaflight serve &                         # or: ops/serve.sh
    python ops/examples/grpo_train.py --url http://127.0.0.1:8000 --iterations 4

Each iteration:
  1. submit one rollout: P prompts x G outputs (a GRPO group per prompt), SDE sampler;
  2. pull the trajectory (torch tensors) and check its weights digest is the trainer's;
  3. reward: decode x_T with the model's VAE, r = -|mean brightness - target|;
  4. advantages normalised within each prompt's group;
  5. recompute log p(x_{i+1} | x_i) of every stochastic transition with the trainer's own
     copy of the model (Replayer, grad=True): on-policy the ratio exp(logp_new - logp_old)
     is exactly 1 (torch.equal with ones), because the trainer's weights are the server's;
  6. clipped policy loss, backward through the trainer's transformer, optimizer step
     (--inner-steps updates per batch; the ones after the first are off-policy);
  7. push the new transformer weights to the server (PUT /v1/models/tiny-sd3/weights); the
     digest it answers equals the trainer's local digest and shows up in the next
     trajectory's `sigmaflight.rollout.model.digest`.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.decode import decode_latents
from pipeline.models import ModelRegistry, weights_digest
from sigmaflight.client import Client, replay_log_probs

MODEL = "tiny-sd3"


@dataclass
class IterationStats:
    iteration: int
    digest: str
    """The weights digest in this iteration's trajectory metadata."""
    reward_mean: float
    reward_std: float
    loss: float
    ratio_on_policy_is_one: bool
    """torch.equal(exp(logp_new - logp_old), ones) before this iteration's first update."""
    ratio_min: float
    ratio_max: float
    clip_fraction: float
    new_digest: str
    seconds: float


def reward_fn(images: torch.Tensor, target: float) -> torch.Tensor:
    """[B] toy reward: closeness of the mean brightness of each image to `target` (images in [0, 1])."""
    return -(images.mean(dim=(1, 2, 3)) - target).abs()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """[B] (r - mean) / (std + 1e-4) within each prompt's group of `group` consecutive samples."""
    r = rewards.view(-1, group)  # [P, G]
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def policy_loss(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO clipped surrogate over [B, S] stochastic transitions; returns (loss, ratio)."""
    ratio = torch.exp(logp_new - logp_old)  # [B, S]
    a = adv[:, None]  # [B, 1]
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.maximum(unclipped, clipped).mean(), ratio


def train(
    url: str,
    *,
    token: str | None = None,
    iterations: int = 4,
    prompts: tuple[str, ...] = ("a red cube", "a blue ball"),
    group: int = 4,
    steps: int = 4,
    lr: float = 3e-3,
    clip: float = 1e-2,
    inner_steps: int = 2,
    target: float = 0.8,
    seed: int = 0,
    log: Any = print,
) -> list[IterationStats]:
    model = ModelRegistry().get(MODEL)  # the server's weights, bit for bit (seeded build)
    transformer = model.pipeline.transformer
    transformer.requires_grad_(True)
    optimizer = torch.optim.Adam(transformer.parameters(), lr=lr)
    history: list[IterationStats] = []
    with Client(url, token=token) as client:
        server_digest = next(m["digest"] for m in client.models() if m["id"] == MODEL)
        if server_digest != weights_digest(model.pipeline):
            raise SystemExit(f"the server's {MODEL} has other weights ({server_digest[:12]}); restart it")
        for it in range(iterations):
            t0 = time.perf_counter()
            ticket = client.submit(
                model=MODEL, prompts=list(prompts), num_outputs_per_prompt=group, num_inference_steps=steps,
                seed=seed + it, sampler={"type": "sde", "noise_level": 0.7},
            )
            client.wait(ticket, timeout=120)
            traj = client.pull(ticket)
            digest = traj.metadata["model"]["digest"]
            assert digest == weights_digest(model.pipeline), "trajectory was not produced by the trainer's weights"
            sde = list(traj.sde_steps)  # absolute transition indices
            logp_old = traj.log_probs[:, sde]  # [B, S], recorded by the server
            images = decode_latents(model, traj.latent(traj.num_steps), height=32, width=32)  # [B, 3, H, W]
            rewards = reward_fn(images, target)  # [B]
            adv = group_advantages(rewards, group)  # [B]
            on_policy_one = False
            loss_v = 0.0
            ratio = torch.ones_like(logp_old)
            for k in range(inner_steps):
                # [B, S], graph to the transformer; the steps after the first are off-policy on purpose.
                logp_new = replay_log_probs(model, traj, grad=True, strict=k == 0, check_weights=k == 0)[:, sde]
                loss, ratio = policy_loss(logp_new, logp_old, adv, clip)
                if k == 0:
                    on_policy_one = torch.equal(ratio.detach(), torch.ones_like(ratio))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_v = float(loss.detach())
            new_digest = client.push_weights(MODEL, transformer.state_dict())
            local = weights_digest(model.pipeline)
            assert new_digest == local, f"server digest {new_digest[:12]} != trainer digest {local[:12]}"
            r = ratio.detach()
            stats = IterationStats(
                iteration=it, digest=digest, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                loss=loss_v, ratio_on_policy_is_one=on_policy_one, ratio_min=float(r.min()), ratio_max=float(r.max()),
                clip_fraction=float(((r - 1).abs() > clip).float().mean()), new_digest=new_digest,
                seconds=time.perf_counter() - t0,
            )
            history.append(stats)
            log(
                f"iter {it}: reward {stats.reward_mean:+.4f} +- {stats.reward_std:.4f}  loss {stats.loss:+.5f}  "
                f"on-policy ratio == 1: {on_policy_one}  last ratio [{stats.ratio_min:.4f}, {stats.ratio_max:.4f}] "
                f"clipped {stats.clip_fraction:.0%}  digest {digest[:12]} -> {new_digest[:12]}  ({stats.seconds:.1f} s)"
            )
        # The next trajectory runs on the last pushed weights.
        ticket = client.submit(model=MODEL, prompts=list(prompts[:1]), num_inference_steps=steps, seed=seed)
        client.wait(ticket, timeout=120)
        final = client.pull(ticket).metadata["model"]["digest"]
        log(f"next trajectory's sigmaflight.rollout.model.digest: {final[:12]} "
            f"({'the last pushed weights' if history and final == history[-1].new_digest else 'MISMATCH'})")
    return history


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="REST URL of a running sigmaflight server")
    p.add_argument("--token", default=None, help="bearer token, if the server needs one")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="outputs per prompt (GRPO group size)")
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    p.add_argument("--inner-steps", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1e-2)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    history = train(args.url, token=args.token, iterations=args.iterations, group=args.group, steps=args.steps,
                    inner_steps=args.inner_steps, lr=args.lr, clip=args.clip)
    print(f"{len(history)} iterations in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if all(h.ratio_on_policy_is_one for h in history) else 1


if __name__ == "__main__":
    raise SystemExit(main())
