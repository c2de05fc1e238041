"""A small Flow-GRPO loop with LoRA against a running sigmaflight server (built-in tiny-sd3, CPU).

    sigmaflight serve &                         # or: ops/serve.sh
    python ops/examples/grpo_train.py --url http://127.0.0.1:8000 --iterations 4

The trainer holds its own copy of the model with a peft LoRA on Flow-GRPO's SD3 target modules
(`get_peft_model`, `init_lora_weights="gaussian"`: lora_B starts at zero) and pushes the adapter
to the server first, so both run the same policy. Each iteration:
  1. submit one rollout: P prompts x G outputs (a GRPO group per prompt), SDE sampler, the decoded
     images (`return.outputs`), the conditioning the transformer consumed (`return.conditioning`),
     and `expected_digest` = the digest the last push answered (a
     rollout on any other weights is refused: no off-policy batch reaches the update);
  2. pull the trajectory (torch tensors), the images (`Client.pull_outputs`, uint8 [B, H, W, 3])
     and the conditioning (`Client.pull_conditioning`: prompt embeddings, per sample);
  3. reward (--reward): "jpeg", DDPO's JPEG compressibility as Flow-GRPO computes it (each image saved
     as JPEG at quality 95, size in kB = bytes / 1000, reward = -size_kB / 500); or "brightness" /
     "darkness", the images' mean pixel value / 255 (or its negative): the tiny built-in model's
     images barely differ in JPEG size, so its JPEG curve hardly moves, while brightness moves in a
     few iterations, up or down as asked;
  4. advantages normalised within each prompt's group;
  5. recompute log p(x_{i+1} | x_i) of every stochastic transition with the trainer's
     peft-wrapped transformer (`replay_log_probs`, grad=True): on-policy the ratio
     exp(logp_new - logp_old) is exactly 1 (torch.equal with ones);
  6. clipped policy loss, backward into the LoRA factors only, optimizer step
     (--inner-steps updates per batch; the ones after the first are off-policy);
  7. push the adapter (`peft.get_peft_model_state_dict` -> safetensors with the LoraConfig as
     JSON under the header metadata key `lora_config`: `Client.push_lora`); its digest is the
     next iteration's `expected_digest`.
At the end it prints the reward curve (mean reward per iteration) and, with --eval-seed, the reward
of one fixed-seed rollout before the first update and after the last (the same noise both times, so
the difference is the policy's). The trainer holds no text encoders: its replay runs the
transformer on the server's conditioning stream.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from PIL import Image
from sigmaflight.pipeline.models import LoadedModel, ModelRegistry

from sigmaflight.client import Client, replay_log_probs

MODEL = "tiny-sd3"
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
"""Flow-GRPO's LoRA target modules for SD3 (all present in tiny-sd3's joint attention blocks)."""


@dataclass
class IterationStats:
    iteration: int
    digest: str
    """The weights digest in this iteration's trajectory metadata (= the expected_digest sent)."""
    reward_mean: float
    reward_std: float
    loss: float
    ratio_on_policy_is_one: bool
    """torch.equal(exp(logp_new - logp_old), ones) before this iteration's first update."""
    ratio_min: float
    ratio_max: float
    clip_fraction: float
    new_digest: str
    """The digest the LoRA push after this iteration's update answered."""
    seconds: float


def jpeg_compressibility(images: np.ndarray) -> torch.Tensor:
    """[B] -size_kB / 500 of each uint8 [H, W, 3] image saved as JPEG, quality 95 (Flow-GRPO's
    `jpeg_compressibility`: the negated `jpeg_incompressibility`, sizes in kB = bytes / 1000)."""
    sizes = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return -torch.tensor(sizes, dtype=torch.float32) / 500


def mean_brightness(images: np.ndarray) -> torch.Tensor:
    """[B] mean pixel value / 255 of each uint8 [H, W, 3] image (all pixels and channels)."""
    return torch.from_numpy(images.reshape(len(images), -1).astype(np.float64).mean(axis=1) / 255).float()


REWARDS: dict[str, Any] = {
    "jpeg": jpeg_compressibility,
    "brightness": mean_brightness,
    "darkness": lambda images: -mean_brightness(images),
}
"""--reward: name -> images uint8 [B, H, W, 3] -> rewards float32 [B]."""


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


def lora_trainer(rank: int, seed: int) -> tuple[LoadedModel, Any, LoraConfig]:
    """The trainer's model: the built-in weights (seeded: the server's, bit for bit) with a peft LoRA."""
    base = ModelRegistry().get(MODEL)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian", target_modules=TARGETS)
    torch.manual_seed(seed)  # lora_A's init
    transformer = get_peft_model(base.pipeline.transformer, config)  # only the LoRA factors train
    # No text encoders: the trainer replays from the server's conditioning stream (return.conditioning).
    components = {k: (None if k.startswith(("text_encoder", "tokenizer")) else v)
                  for k, v in base.pipeline.components.items()}
    pipe = type(base.pipeline)(**{**components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    model = LoadedModel(id=MODEL, family=base.family, pipeline=pipe, device=base.device, dtype=base.dtype,
                        digest="trainer", defaults=base.defaults)
    return model, transformer, config


def train(
    url: str,
    *,
    token: str | None = None,
    iterations: int = 4,
    prompts: tuple[str, ...] = ("a red cube", "a blue ball"),
    group: int = 4,
    steps: int = 4,
    rank: int = 4,
    lr: float = 3e-3,
    clip: float = 1e-2,
    inner_steps: int = 2,
    seed: int = 0,
    reward: str = "jpeg",
    eval_seed: int | None = None,
    evaluations: list[float] | None = None,
    log: Any = print,
) -> list[IterationStats]:
    """The loop; returns one IterationStats per iteration. With `eval_seed` it also logs the mean reward
    of a rollout with that seed before the first update and after the last, and appends both to
    `evaluations` when given."""
    score = REWARDS[reward]
    model, transformer, config = lora_trainer(rank, seed)
    optimizer = torch.optim.Adam([p for p in transformer.parameters() if p.requires_grad], lr=lr)
    history: list[IterationStats] = []
    with Client(url, token=token) as client:
        digest = client.push_lora(MODEL, get_peft_model_state_dict(transformer), config)["digest"]

        def evaluate(expected: str) -> float:
            """Mean reward of one rollout with the fixed `eval_seed` on the current adapter."""
            assert eval_seed is not None
            ticket = client.submit(model=MODEL, prompts=list(prompts), num_outputs_per_prompt=group,
                                   num_inference_steps=steps, seed=eval_seed, expected_digest=expected,
                                   sampler={"type": "sde", "noise_level": 0.7}, return_={"outputs": True})
            client.wait(ticket, timeout=120)
            return float(score(client.pull_outputs(ticket)).mean())

        before = evaluate(digest) if eval_seed is not None else None
        for it in range(iterations):
            t0 = time.perf_counter()
            ticket = client.submit(
                model=MODEL, prompts=list(prompts), num_outputs_per_prompt=group, num_inference_steps=steps,
                seed=seed + it, sampler={"type": "sde", "noise_level": 0.7}, expected_digest=digest,
                return_={"outputs": True, "conditioning": True},
            )
            client.wait(ticket, timeout=120)
            traj = client.pull(ticket)
            assert traj.metadata["model"]["digest"] == digest, "trajectory was not produced by the pushed adapter"
            images = client.pull_outputs(ticket)  # uint8 [B, H, W, 3]
            cond = client.pull_conditioning(ticket)  # the tensors the server's transformer consumed
            rewards = score(images)  # [B]
            adv = group_advantages(rewards, group)  # [B]
            sde = list(traj.sde_steps)  # absolute transition indices
            logp_old = traj.log_probs[:, sde]  # [B, S], recorded by the server
            on_policy_one = False
            loss_v = 0.0
            ratio = torch.ones_like(logp_old)
            transformer.train(False)  # dropout off: the server's forward, bit for bit
            for k in range(inner_steps):
                # [B, S], graph to the LoRA factors. The first step must be on-policy: the weights check
                # (the transformer's adapter digest against the rollout's) raises otherwise; the steps
                # after it are off-policy on purpose.
                logp_new = replay_log_probs(model, traj, grad=True, check_weights=k == 0, strict=True,
                                            conditioning=cond)[:, sde]
                loss, ratio = policy_loss(logp_new, logp_old, adv, clip)
                if k == 0:
                    on_policy_one = torch.equal(ratio.detach(), torch.ones_like(ratio))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_v = float(loss.detach())
            new_digest = client.push_lora(MODEL, get_peft_model_state_dict(transformer), config)["digest"]
            r = ratio.detach()
            stats = IterationStats(
                iteration=it, digest=digest, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                loss=loss_v, ratio_on_policy_is_one=on_policy_one, ratio_min=float(r.min()), ratio_max=float(r.max()),
                clip_fraction=float(((r - 1).abs() > clip).float().mean()), new_digest=new_digest,
                seconds=time.perf_counter() - t0,
            )
            history.append(stats)
            log(
                f"iter {it}: reward {stats.reward_mean:+.6f} +- {stats.reward_std:.6f}  loss {stats.loss:+.5f}  "
                f"on-policy ratio == 1: {on_policy_one}  last ratio [{stats.ratio_min:.4f}, {stats.ratio_max:.4f}] "
                f"clipped {stats.clip_fraction:.0%}  digest {digest[:12]} -> {new_digest[:12]}  ({stats.seconds:.1f} s)"
            )
            digest = new_digest
        log(f"reward curve ({reward}): " + "  ".join(f"{h.iteration}:{h.reward_mean:+.6f}" for h in history))
        if before is not None:
            after = evaluate(digest)
            log(f"eval reward ({reward}, seed {eval_seed}): before {before:+.6f}  after {after:+.6f}  "
                f"change {after - before:+.6f}")
            if evaluations is not None:
                evaluations += [before, after]
        # The next trajectory runs on the last pushed adapter.
        ticket = client.submit(model=MODEL, prompts=list(prompts[:1]), num_inference_steps=steps, seed=seed,
                               expected_digest=digest)
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
    p.add_argument("--rank", type=int, default=4, help="LoRA rank (lora_alpha = 2 * rank)")
    p.add_argument("--inner-steps", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1e-2)
    p.add_argument("--reward", choices=sorted(REWARDS), default="jpeg",
                   help="jpeg: Flow-GRPO's JPEG compressibility; brightness / darkness: mean pixel value "
                   "(or its negative), which the tiny built-in model can move")
    p.add_argument("--eval-seed", type=int, default=None,
                   help="also print the reward of one rollout with this seed before and after training")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    history = train(args.url, token=args.token, iterations=args.iterations, group=args.group, steps=args.steps,
                    rank=args.rank, inner_steps=args.inner_steps, lr=args.lr, clip=args.clip, reward=args.reward,
                    eval_seed=args.eval_seed)
    print(f"{len(history)} iterations in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if all(h.ratio_on_policy_is_one for h in history) else 1


if __name__ == "__main__":
    raise SystemExit(main())
