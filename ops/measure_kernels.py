"""Largest log-prob difference between sigmaflight's rollouts and the reference kernels.

For tiny-sd3 and tiny-flux (T=5, noise_level 0.7, B=4, CPU fp32), every transition's
(x_i, velocity, x_{i+1}) is recorded as the rollout's scheduler saw it and re-scored with the
transcriptions of Flow-GRPO's `sde_step_with_logprob` and SGLang's `flow_sde_sampling` in
tests/pipeline/test_kernels.py (SGLang from the rollout's own noise draw, as it scores its
draw; Flow-GRPO from the stored x_{i+1}). Prints max |sigmaflight - reference| per model,
kernel and log-prob kind ("n/a": Flow-GRPO defines sde only as a density and cps only without
constants). The last column is the pre-fix numerator substitution vs Flow-GRPO, for scale.

    .venv/bin/python ops/measure_kernels.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sigmaflight.pipeline.models import ModelRegistry  # noqa: E402
from sigmaflight.pipeline.rollout import run_rollout  # noqa: E402
from sigmaflight.pipeline.schedules import RolloutScheduler  # noqa: E402
from sigmaflight.pipeline.seeds import draw_noise  # noqa: E402
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec  # noqa: E402

from tests.pipeline.test_kernels import flow_grpo_step, sglang_step  # noqa: E402

A = 0.7
EPS32 = torch.finfo(torch.float32).eps


def _recorded_rollout(model, spec):
    rec: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = RolloutScheduler.step

    def recording(self, model_output, timestep, sample, *args, **kwargs):
        out = original(self, model_output, timestep, sample, *args, **kwargs)
        prev = out[0] if isinstance(out, tuple) else out.prev_sample
        rec.append((sample.clone(), model_output.clone(), prev.clone()))
        return out

    RolloutScheduler.step = recording  # type: ignore[method-assign]
    try:
        res = run_rollout(model, spec)
    finally:
        RolloutScheduler.step = original  # type: ignore[method-assign]
    return res, rec


def _old_density(sig, i, x, v, x_next):
    sigma, sigma_next = sig[i], sig[i + 1]
    s = sig[1] if bool(sigma == 1) else sigma
    std_t = torch.sqrt(s / (1 - s)) * A
    dt = sigma_next - sigma
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(torch.tensor(2 * torch.pi)))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    registry = ModelRegistry()
    print("model      kernel log_prob  | vs Flow-GRPO | vs SGLang (ULPs of max(|lp|, 1)) | old formula vs Flow-GRPO")
    for model_id in ("tiny-sd3", "tiny-flux"):
        model = registry.get(model_id)
        for kernel in ("sde", "cps"):
            for kind in ("density", "no_const"):
                spec = RolloutSpec(model=model_id, prompts=("a cat", "the dog"), num_outputs_per_prompt=2,
                                   num_inference_steps=5, seed=17, sampler=SamplerSpec(type=kernel, noise_level=A, log_prob=kind))
                res, rec = _recorded_rollout(model, spec)
                sig = res.snapshot.sigmas
                fg = sg = old = sg_ulps = 0.0
                for i in res.snapshot.sde_steps:
                    x, v, x_next = rec[i]
                    got = res.log_probs[:, i].double()
                    eps = draw_noise(res.seeds, i, tuple(x.shape[1:]))
                    _, sg_lp, _, _ = sglang_step(sig, i, x, v, A, kernel, no_const=kind == "no_const", noise=eps)
                    d = (got - sg_lp.double()).abs()
                    sg = max(sg, d.max().item())
                    sg_ulps = max(sg_ulps, (d / sg_lp.double().abs().clamp(min=1.0)).max().item() / EPS32)
                    if (kernel, kind) in (("sde", "density"), ("cps", "no_const")):
                        _, fg_lp, _, _, _ = flow_grpo_step(sig, i, x, v, A, kernel, prev_sample=x_next)
                        fg = max(fg, (got - fg_lp.double()).abs().max().item())
                        if kernel == "sde":
                            old = max(old, (_old_density(sig, i, x, v, x_next).double() - fg_lp.double()).abs().max().item())
                fg_s = f"{fg:.3e}" if (kernel, kind) in (("sde", "density"), ("cps", "no_const")) else "n/a"
                old_s = f"{old:.3e}" if (kernel, kind) == ("sde", "density") else ""
                print(f"{model_id:10} {kernel:6} {kind:9} | {fg_s:>12} | {sg:.3e} ({sg_ulps:.2f})       | {old_s}")


if __name__ == "__main__":
    main()
