"""What `return.outputs` costs, per image, against the rollout it decodes.

For each model, in one process and one run: the rollout (`run_rollout`, the model's default
steps, B samples, no capture: what the loop itself costs) and the "outputs/v1" table built
from its x_T (`sigmaflight.control.streams.outputs_table`: VAE decode, post-processing, Arrow table), each
the median of --repeats runs after one warm-up. Prints per-image milliseconds and the ratio.

    .venv/bin/python ops/bench_decode.py                       # tiny-sd3 and small-sd3, B=4
    .venv/bin/python ops/bench_decode.py --models small-sd3 --samples 8 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sigmaflight.control.backends.local import header_for  # noqa: E402
from sigmaflight.control.streams import outputs_table  # noqa: E402
from sigmaflight.pipeline.models import ModelRegistry  # noqa: E402
from sigmaflight.pipeline.rollout import rollout_metadata, run_rollout  # noqa: E402
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec  # noqa: E402


def measure(registry: ModelRegistry, model_id: str, samples: int, repeats: int) -> dict[str, float]:
    model = registry.get(model_id)
    spec = RolloutSpec(model=model_id, prompts=("a red cube",), num_outputs_per_prompt=samples,
                       num_inference_steps=model.defaults.num_inference_steps, seed=1,
                       sampler=SamplerSpec(type="sde"), capture=False, return_outputs=True)
    roll, dec = [], []
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        result = run_rollout(model, spec, keep=False)
        t1 = time.perf_counter()
        header = header_for("bench", result.snapshot, {"id": "bench", **rollout_metadata(model, spec, result.snapshot)},
                            False)
        header = dataclasses.replace(header, seeds=result.seeds)
        table = outputs_table(model, spec, header, result.final_latents)
        t2 = time.perf_counter()
        assert table.num_rows == samples
        if k:  # the first run warms up
            roll.append(t1 - t0)
            dec.append(t2 - t1)
    r, d = statistics.median(roll), statistics.median(dec)
    return {"rollout_ms_per_image": 1e3 * r / samples, "decode_ms_per_image": 1e3 * d / samples, "ratio": d / r,
            "steps": spec.num_inference_steps, "size": model.defaults.height}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-sd3", "small-sd3"])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    registry = ModelRegistry()
    print(f"B={args.samples}, median of {args.repeats}, torch threads {torch.get_num_threads()}, device cpu")
    print(f"{'model':<10} {'size':>5} {'steps':>5} {'rollout ms/img':>15} {'decode ms/img':>14} {'decode/rollout':>15}")
    for model_id in args.models:
        m = measure(registry, model_id, args.samples, args.repeats)
        print(f"{model_id:<10} {m['size']:>5.0f} {m['steps']:>5.0f} {m['rollout_ms_per_image']:>15.2f} "
              f"{m['decode_ms_per_image']:>14.2f} {m['ratio']:>15.3f}")


if __name__ == "__main__":
    main()
