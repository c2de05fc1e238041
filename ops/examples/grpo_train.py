"""GRPO with a LoRA (--full: every transformer weight) against a running sigmaflight server: a first
loop that visibly learns on a CPU.

    sigmaflight serve &                                   # the built-in tiny-sd3, on the CPU
    python ops/examples/grpo_train.py                     # ... eval reward: 0.3127 -> 0.3624
    python ops/examples/grpo_train.py --sign -1           # trained on the negated reward: 0.3127 -> 0.2787
    python ops/examples/grpo_train.py --plot reward.png --kl-beta 0.01
    python ops/examples/grpo_train.py --async             # rollouts overlap training, one version behind
    python ops/examples/grpo_train.py --full              # full fine-tuning: 0.3127 -> 0.3833

The trainer holds its own stock diffusers pipeline (the server's weights) with a peft LoRA on
Flow-GRPO's SD3 target modules (`init_lora_weights="gaussian"`: lora_B starts at zero, so the
policy starts as the base) and pushes the adapter first, so both run the same policy. Each iteration:
  1. one rollout: every training prompt x --group outputs (a GRPO group per prompt), the SDE sampler,
     no classifier-free guidance (half the work), the decoded images and the conditioning the
     transformer consumed, `expected_digest` = the digest the last push answered (a rollout on
     other weights is refused);
  2. reward of each image, times --sign (--reward: "bright-pixels", the fraction of its pixels
     brighter than mid-grey, in [0, 1]: the default, because the tiny model's random VAE keeps the
     mean brightness within about 0.01 whatever the latent, while this fraction moves; "brightness",
     the mean pixel value / 255; "jpeg", DDPO's JPEG compressibility as Flow-GRPO computes it);
  3. advantages within each prompt's group (`sigmaflight.group_advantages`: Flow-GRPO's per-prompt
     mean and std);
  4. log p(x_{i+1} | x_i) of every stochastic transition recomputed by the trainer's own pipeline
     (`sigmaflight.replay_log_probs`, grad=True, on the conditioning stream: no text encoders);
     before the first update the ratio exp(logp_new - logp_old) is exactly 1 (checked: the exit
     status is 1 otherwise);
  5. the clipped surrogate loss, plus with --kl-beta Flow-GRPO's KL term against the base policy
     (the same transformer with the adapter disabled), --inner-steps Adam steps on the LoRA factors;
  6. push the adapter (`Client.push_lora`); its digest is the next iteration's `expected_digest`.
With --async the rollouts come from `Client.stream` instead: iteration k+1's rollout runs while
iteration k trains, on the weights one version behind the trainer's (the recorded log-probs are
that older policy's, as in Flow-GRPO; `max_staleness=1` reruns anything older), without
`expected_digest` and without the on-policy check.
With --full there is no adapter: every parameter of the transformer trains (Adam, --lr default
FULL_LR = 2e-3, a fifteenth of the LoRA's), step 6 pushes the whole transformer
(`Client.push_weights`, which streams only the tensors that changed) and checks that the digest it
answers is the trainer's own digest of its weights (`sigmaflight.pipeline.digests`; the run stops
with an error otherwise), and --kl-beta's base policy is a frozen copy of the initial transformer.
--async works the same way.
Before the first update and after the last it rolls out a fixed evaluation set (prompts and seeds
that training never sees) and the last line printed is `eval reward: <before> -> <after>`: the mean
reward of that set (without --sign, so it falls when --sign -1 trains the reward down). At the end
it removes its adapter from the server (with --full: pushes the initial weights back and checks the
digest is the one it started from) unless --keep-adapter, so later rollouts run the base weights
again.
"""

from __future__ import annotations

import argparse
import copy
import io
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from sigmaflight.pipeline.digests import current_components
from sigmaflight.pipeline.models import combine_digests

from sigmaflight import Client, group_advantages, replay_log_probs

MODEL = "tiny-sd3"
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
"""Flow-GRPO's LoRA target modules for SD3."""
TRAIN_PROMPTS = ("a red cube", "a blue ball")
EVAL_PROMPTS = ("a yellow star", "an old boat")
EVAL_SEED = 10_000
"""The evaluation set: EVAL_PROMPTS x --eval-group outputs from this seed (training seeds are 0, 1, ...)."""
SAMPLER = {"type": "sde", "noise_level": 0.7}
GUIDANCE = 1.0
LORA_LR = 3e-2
FULL_LR = 2e-3
"""Adam's default learning rates: for the LoRA factors, and (--full) for every transformer weight."""
"""No classifier-free guidance: one transformer row per sample instead of two, half the work."""


def mean_brightness(images: np.ndarray) -> np.ndarray:
    """[B] float64 in [0, 1]: the mean pixel value / 255 of each uint8 [H, W, 3] image."""
    return images.reshape(len(images), -1).astype(np.float64).mean(axis=1) / 255


def jpeg_compressibility(images: np.ndarray) -> np.ndarray:
    """[B] float64: -size_kB / 500 of each image saved as JPEG at quality 95 (Flow-GRPO's form)."""
    from PIL import Image

    sizes = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return -np.array(sizes) / 500


def bright_pixels(images: np.ndarray) -> np.ndarray:
    """[B] float64 in [0, 1]: the fraction of each image's pixels brighter than mid-grey (mean of the
    three channels > 127.5)."""
    return (images.astype(np.float64).mean(axis=-1) > 127.5).reshape(len(images), -1).mean(axis=1)


REWARDS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "brightness": mean_brightness, "bright-pixels": bright_pixels, "jpeg": jpeg_compressibility}


@dataclass
class Iteration:
    reward: float
    """The mean training reward of this iteration's rollout (times --sign)."""
    loss: float
    kl: float
    on_policy_ratio_is_one: bool | None
    """torch.equal(ratio, 1) before the first update; None for a rollout one version behind (--async)."""
    seconds: float


def load_pipeline() -> tuple[Any, dict[str, str]]:
    """The trainer's stock diffusers pipeline with the server's weights, and the weights digests of
    the text encoders it then drops (they never train; the server's weights digest covers them). For a
    hub model this is `StableDiffusion3Pipeline.from_pretrained("org/name", torch_dtype=...)`; the
    built-in tiny-sd3 exists only as seeded code, so its (stock StableDiffusion3Pipeline) object comes
    from the builder the server uses."""
    from sigmaflight.pipeline.models import ModelRegistry

    model = ModelRegistry().get(MODEL)
    encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    frozen = {k: v for k, v in current_components(model).items() if k in encoders}
    pipe = model.pipeline
    for name in encoders:
        setattr(pipe, name, None)  # replay runs on the server's conditioning stream
    pipe.set_progress_bar_config(disable=True)
    return pipe, frozen


def trainer_digest(pipe: Any, frozen: dict[str, str]) -> str:
    """The weights digest of the trainer's pipeline as it is now, made as the server makes its own
    (`sigmaflight.pipeline.digests.current_digest`), the dropped text encoders' digests included."""
    return combine_digests({**frozen, **current_components(SimpleNamespace(pipeline=pipe))})


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO/GRPO clipped surrogate over [B, S] transitions; (loss, ratio)."""
    ratio = torch.exp(logp - logp_old)
    a = adv[:, None]
    return torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip)).mean(), ratio


def kl_to_base(means: dict[int, torch.Tensor], ref_means: dict[int, torch.Tensor], stds: dict[int, torch.Tensor],
               steps: list[int]) -> torch.Tensor:
    """The KL term against the base policy, as Flow-GRPO forms it: the squared difference of the two
    transition kernels' means, averaged over latent elements, transitions and samples, over twice a
    variance. The kernels share their std, so with the kernel's own variance (used here) this is the
    exact Gaussian KL per element; Flow-GRPO divides by its noise coefficient squared, the kernel's
    variance without the step's |dt|, so its term is this one times |dt|."""
    terms = [((means[i] - ref_means[i]) ** 2).flatten(1).mean(dim=1) / (2 * stds[i] ** 2) for i in steps]
    return torch.stack(terms, dim=1).mean()


def train(
    url: str,
    *,
    token: str | None = None,
    iterations: int = 10,
    group: int = 8,
    steps: int = 4,
    rank: int = 8,
    lr: float | None = None,
    clip: float = 0.2,
    inner_steps: int = 2,
    kl_beta: float = 0.0,
    reward: str = "bright-pixels",
    sign: float = 1.0,
    eval_group: int = 4,
    keep_adapter: bool = False,
    seed: int = 0,
    plot: str | None = None,
    use_async: bool = False,
    full: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[float, float, list[Iteration]]:
    """The loop; returns (eval reward before, after, one Iteration per iteration). `full`: train every
    parameter of the transformer and push it whole (`Client.push_weights`) instead of a LoRA."""
    score = REWARDS[reward]
    pipe, frozen = load_pipeline()
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian", target_modules=TARGETS)
    base_pipe: Any = None
    if full:
        # The base policy, for the KL term and to restore the server at the end: a frozen copy of the
        # initial transformer (there is no adapter to disable), in a pipeline sharing everything else.
        base = copy.deepcopy(pipe.transformer).requires_grad_(False)
        base_pipe = type(pipe)(**{**pipe.components, "transformer": base})
        base_pipe.set_progress_bar_config(disable=True)
        pipe.transformer.requires_grad_(True)  # every parameter trains
    else:
        torch.manual_seed(seed)  # lora_A's initialisation
        pipe.transformer = get_peft_model(pipe.transformer, config)  # only the LoRA factors train
    pipe.transformer.train(False)  # no dropout: the server's forward, bit for bit
    lr = lr if lr is not None else (FULL_LR if full else LORA_LR)
    optimizer = torch.optim.Adam([p for p in pipe.transformer.parameters() if p.requires_grad], lr=lr)
    history: list[Iteration] = []

    def push(client: Client) -> tuple[str, int]:
        """Push the trainer's policy; (digest, weights_version). A full push must answer the trainer's
        own digest of its state (the server holds exactly these weights), or the run stops here."""
        if not full:
            put = client.push_lora(MODEL, get_peft_model_state_dict(pipe.transformer), config)
            return put["digest"], put["weights_version"]
        pushed = client.push_weights(MODEL, pipe.transformer.state_dict())  # only the tensors that changed
        mine = trainer_digest(pipe, frozen)
        if pushed != mine:
            raise RuntimeError(f"the server's weights are not the trainer's after the push: it answered digest "
                               f"{pushed}, the trainer's is {mine}")
        return str(pushed), pushed.weights_version

    with Client(url, token=token) as client:
        digest, version = push(client)  # --full: the trainer's initial weights (as served: nothing is sent)
        original = digest
        try:
            def evaluate() -> float:
                ticket = client.submit(model=MODEL, prompts=list(EVAL_PROMPTS), num_outputs_per_prompt=eval_group,
                                       num_inference_steps=steps, seed=EVAL_SEED, sampler=SAMPLER, guidance_scale=GUIDANCE,
                                       expected_digest=digest, return_={"outputs": True})
                return float(score(client.pull_outputs(ticket)).mean())

            before = evaluate()

            def request(it: int) -> dict[str, Any]:
                return {"model": MODEL, "prompts": list(TRAIN_PROMPTS), "num_outputs_per_prompt": group,
                        "num_inference_steps": steps, "seed": seed + it, "sampler": SAMPLER,
                        "guidance_scale": GUIDANCE, "return_": {"outputs": True, "conditioning": True}}

            def sync_rollouts() -> Iterator[tuple[Any, Any, np.ndarray]]:
                """One rollout per iteration on the weights just pushed (expected_digest: on-policy)."""
                for it in range(iterations):
                    ticket = client.submit(**request(it), expected_digest=digest)
                    yield ticket, client.pull(ticket), client.pull_outputs(ticket)

            def async_rollouts() -> Iterator[tuple[Any, Any, np.ndarray]]:
                """Client.stream keeps the next iteration's rollout running while this one trains: it is
                submitted when the previous one is taken (in_flight=1), so it runs on the weights pushed
                at most one iteration ago; one more than a version behind is run again (max_staleness=1)."""
                with client.stream((request(it) for it in range(iterations)), in_flight=1, outputs=True,
                                   max_staleness=1, progress=False) as rollouts:
                    for r in rollouts:
                        if r.error is not None:
                            raise r.error
                        yield r.ticket, r.trajectory, r.outputs

            t0 = time.perf_counter()
            for it, (ticket, traj, images) in enumerate(async_rollouts() if use_async else sync_rollouts()):
                cond = client.pull_conditioning(ticket)
                # On the weights the trainer holds (always, without --async): the first inner step is
                # on-policy and checked; a rollout one version behind (--async) is off-policy by design,
                # its recorded log-probs the old policy's, as in Flow-GRPO.
                current = traj.metadata["model"]["digest"] == digest
                rewards = sign * score(images)  # [B] float64
                adv = torch.from_numpy(group_advantages(rewards, traj.prompt_index)).float()  # [B]
                sde = list(traj.sde_steps)
                logp_old = traj.log_probs[:, sde]  # [B, S], recorded by the server
                ref_means: dict[int, torch.Tensor] = {}
                if kl_beta and full:
                    with torch.no_grad():  # the base policy: the frozen initial transformer
                        _, ref_means, _ = replay_log_probs(base_pipe, traj, conditioning=cond, check_weights=False,
                                                           with_means=True)
                elif kl_beta:
                    with pipe.transformer.disable_adapter(), torch.no_grad():  # the base policy
                        _, ref_means, _ = replay_log_probs(pipe, traj, conditioning=cond, check_weights=False,
                                                           with_means=True)
                on_policy = False
                loss_v = kl_v = 0.0
                for k in range(inner_steps):
                    # The first step is on-policy (strict: the transformer holds the rollout's adapter);
                    # the later ones are off-policy on purpose.
                    logp, means, stds = replay_log_probs(pipe, traj, conditioning=cond, grad=True, strict=True,
                                                         check_weights=k == 0 and current, with_means=True)
                    loss, ratio = policy_loss(logp[:, sde], logp_old, adv, clip)
                    if k == 0:
                        on_policy = torch.equal(ratio.detach(), torch.ones_like(ratio)) if current else None
                    if kl_beta:
                        kl = kl_to_base(means, ref_means, stds, sde)
                        loss = loss + kl_beta * kl
                        kl_v = float(kl.detach())
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    loss_v = float(loss.detach())
                made_with = traj.metadata["model"]["weights_version"]
                trained_on, (digest, version) = version, push(client)
                now = time.perf_counter()
                history.append(Iteration(reward=float(rewards.mean()), loss=loss_v, kl=kl_v,
                                         on_policy_ratio_is_one=on_policy, seconds=now - t0))
                t0 = now  # an iteration's wall time: from the end of the last one (its rollout included)
                h = history[-1]
                log(f"iteration {it}: reward {h.reward:+.4f}  loss {h.loss:+.5f}"
                    + (f"  kl {h.kl:.5f}" if kl_beta else "")
                    + (f"  on-policy ratio == 1: {on_policy}" if on_policy is not None
                       else f"  off-policy: rolled out on weights version {made_with}, trained at {trained_on}")
                    + ("  push digest == trainer's: True" if full else "")
                    + f"  ({h.seconds:.1f} s)")
            after = evaluate()
        finally:
            if keep_adapter:
                pass
            elif full:  # the initial weights back: later rollouts run the base model again
                restored = client.push_weights(MODEL, base_pipe.transformer.state_dict())
                if restored != original:
                    raise RuntimeError(f"restoring the initial weights answered digest {restored}, not {original}")
            else:
                client.delete_lora(MODEL)  # later rollouts run the base weights again
    if plot:
        draw(plot, history, before, after, reward, sign)
    return before, after, history


def draw(path: str, history: list[Iteration], before: float, after: float, reward: str, sign: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(history)), [h.reward for h in history], marker="o", label="training reward (mean)")
    ax.plot([0, max(len(history) - 1, 0)], [sign * before, sign * after], "s--", label="eval reward (fixed set)")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"{'-' if sign < 0 else ''}{reward}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None, allow_abbrev=False)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="REST URL of a running sigmaflight server")
    p.add_argument("--token", default=None, help="bearer token, if the server needs one")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--group", type=int, default=8, help="outputs per training prompt (the GRPO group)")
    p.add_argument("--eval-group", type=int, default=4, help="outputs per evaluation prompt")
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (lora_alpha = 2 * rank)")
    p.add_argument("--inner-steps", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--lr", type=float, default=None,
                   help=f"Adam's learning rate (default {LORA_LR:g}; with --full {FULL_LR:g})")
    p.add_argument("--clip", type=float, default=0.2, help="the ratio's clip range")
    p.add_argument("--kl-beta", type=float, default=0.0, help="weight of the KL term against the base policy")
    p.add_argument("--reward", choices=sorted(REWARDS), default="bright-pixels",
                   help="bright-pixels: the fraction of pixels brighter than mid-grey, in [0, 1] (it moves); "
                   "brightness: the mean pixel value / 255 (the tiny model's VAE barely moves it); "
                   "jpeg: JPEG compressibility")
    p.add_argument("--sign", type=float, choices=[1.0, -1.0], default=1.0,
                   help="train on the reward times this (-1: push the reward down)")
    p.add_argument("--plot", metavar="PNG", default=None, help="draw the reward curve into this file")
    p.add_argument("--keep-adapter", action="store_true",
                   help="keep the trained weights/adapter on the server (by default it ends on the base weights)")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="Client.stream: the next iteration's rollout runs while this one trains (one weights "
                   "version behind at most)")
    p.add_argument("--full", action="store_true",
                   help="train every transformer weight (no LoRA) and push it whole each iteration "
                   "(Client.push_weights, only the tensors that changed)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    before, after, history = train(
        args.url, token=args.token, iterations=args.iterations, group=args.group, steps=args.steps, rank=args.rank,
        lr=args.lr, clip=args.clip, inner_steps=args.inner_steps, kl_beta=args.kl_beta, reward=args.reward,
        sign=args.sign, eval_group=args.eval_group, keep_adapter=args.keep_adapter, plot=args.plot,
        use_async=args.use_async, full=args.full,
    )
    print(f"{len(history)} iterations in {time.perf_counter() - t0:.1f} s"
          + ("" if args.keep_adapter else f"; {MODEL}'s initial weights were pushed back" if args.full
             else f"; the adapter was removed from {MODEL}"), file=sys.stderr)
    print(f"eval reward: {before:.4f} -> {after:.4f}")
    return 0 if all(h.on_policy_ratio_is_one is not False for h in history) else 1


if __name__ == "__main__":
    raise SystemExit(main())
