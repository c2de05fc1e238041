"""A LoRA push against a full weights push of the same model: wall time and peak RSS, one run.

Each push starts from safetensors bytes (what `PUT /v1/models/{id}/weights` or `.../lora`
receives) and ends with the new weights swapped in: parse (`sigmaflight.pipeline.safetensors_io.read_safetensors`,
zero-copy; a third line shows `safetensors.torch.load`, which copies), check,
build the new transformer, digest. Full push: the whole transformer state dict, perturbed.
LoRA push: a peft adapter with Flow-GRPO's SD3 target modules (rank --rank). Peak RSS is the
kernel's high-water mark (VmHWM), reset to the current RSS before each push
(`/proc/self/clear_refs` = 5), so it is the push's own peak above what was resident.

    .venv/bin/python ops/bench_weights.py                    # small-sd3, rank 32, 3 pushes each
    .venv/bin/python ops/bench_weights.py --model tiny-sd3 --rank 4
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
_libc = ctypes.CDLL("libc.so.6")
TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
           "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(push: object, body: bytes, repeats: int) -> tuple[float, float]:
    """(median wall seconds, max peak RSS above the resident size before, MiB) over `repeats` pushes."""
    times, peaks = [], []
    for _ in range(repeats):
        gc.collect()
        _libc.malloc_trim(0)  # hand freed heap pages back, so the old weights' pages do not absorb the push
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        t0 = time.perf_counter()
        push(body)  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
        peaks.append((_status_kib("VmHWM") - before) / 1024)
    return statistics.median(times), max(peaks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-sd3")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import json

    import torch
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import load, save
    from sigmaflight.pipeline.lora import share_tensors_copy
    from sigmaflight.pipeline.models import ModelRegistry
    from sigmaflight.pipeline.safetensors_io import lora_config_from_metadata, read_safetensors

    torch.set_num_threads(1)
    reg = ModelRegistry()
    model = reg.get(args.model)
    g = torch.Generator().manual_seed(0)
    full_state = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                  for k, v in model.base_transformer().state_dict().items()}
    full_body = save(full_state)
    del full_state
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights="gaussian", target_modules=TARGETS)
    trainer = share_tensors_copy(model.base_transformer())
    trainer.add_adapter(config)
    lora_state = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(trainer).items()}
    lora_body = save(lora_state, metadata={"lora_config": json.dumps(config.to_dict(), default=sorted)})
    del trainer, lora_state

    def full_push(body: bytes) -> None:
        reg.replace_weights(args.model, read_safetensors(body)[0])

    def full_push_copying(body: bytes) -> None:
        reg.replace_weights(args.model, load(body))

    def lora_push(body: bytes) -> None:
        tensors, metadata = read_safetensors(body)
        reg.load_lora(args.model, tensors, lora_config_from_metadata(metadata))

    full_push(full_body)  # warm both paths once (imports, allocator)
    lora_push(lora_body)
    full_t, full_peak = _measure(full_push, full_body, args.repeats)
    copy_t, copy_peak = _measure(full_push_copying, full_body, args.repeats)
    lora_t, lora_peak = _measure(lora_push, lora_body, args.repeats)
    print(f"{args.model}: transformer {len(full_body) / MiB:.1f} MiB; LoRA rank {args.rank} on {len(TARGETS)} "
          f"target modules: {len(lora_body) / MiB:.2f} MiB ({len(lora_body) / len(full_body):.1%} of the full push)")
    print(f"full weights push: {full_t * 1e3:.1f} ms, peak RSS +{full_peak:.1f} MiB")
    print(f"full weights push parsed with safetensors.torch.load (a copy of the body): {copy_t * 1e3:.1f} ms, "
          f"peak RSS +{copy_peak:.1f} MiB")
    print(f"LoRA push:         {lora_t * 1e3:.1f} ms, peak RSS +{lora_peak:.1f} MiB")
    print(f"LoRA / full: wall time {lora_t / full_t:.3f}, peak RSS {lora_peak / max(full_peak, 1e-9):.3f}")
    print(f"weights_version after the run: {model.weights_version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
