"""One prepared run on a GPU: an SD3.5-Medium-sized transformer (random weights) through sigmaflight.

    python ops/gpu/run.py --json gpu.json                 # CUDA, full size, at most ~8 minutes
    python ops/gpu/run.py --device cpu --json cpu.json    # tiny config on CPU, well under a minute

The transformer is `SD3Transformer2DModel` with the published dimensions of SD3.5-Medium
(`SD35_MEDIUM` below), seeded random weights, in bf16; the text encoders, tokenizers and VAE are
sigmaflight's built-in tiny ones sized to fit it (`sigmaflight.pipeline.builtins.sd3_with_tiny_encoders`),
so the transformer's compute, memory and copies are the real ones and the rest is cheap. Parts
(each guarded: a failure records an `error` row and the next part runs):

  exact      an "ode" rollout against the stock diffusers `__call__` with the same seeds (every x_i
             and x_T, torch.equal); the sde log-probs against a replay on the same weights and batch
             (torch.equal); each sample replayed alone (batch 1): the largest |d log p|
  overhead   `run_rollout` (full capture, sde log-probs) against the stock `__call__`, B x T at HxW,
             interleaved repeats; where the captured latents are copied to the host
  cobatch    B single-sample members in one `run_batch` call against one B-sample rollout
  transport  one rollout streamed into a ResultStore as the service does (on_step -> writer), then
             pulled over Flight on loopback (in-process FlightDataServer); a full weights push in
             process (safetensors body -> `read_safetensors` -> `ModelRegistry.replace_weights`)

Every part ends with its peak accelerator memory (`torch.cuda.max_memory_allocated`, reset before
each part). One table is printed and written as JSON (`--json`). Exit status 1 when a part failed.
The script imports only torch, numpy, pyarrow, transformers, diffusers, safetensors, crc32c (the data
plane's store) and sigmaflight's pipeline/ and dataplane/: no Starlette, uvicorn or pydantic.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import sigmaflight  # noqa: E402  (the users' package; its server parts live beside it in a checkout)

try:
    import sigmaflight.pipeline  # noqa: F401  (installed: pip install -e .)
except ModuleNotFoundError:  # a bare checkout on PYTHONPATH: pipeline/ and dataplane/ sit at the root
    sigmaflight.__path__.append(str(ROOT))

# SD3.5-Medium's transformer: the `transformer/config.json` of the Hugging Face repository
# stabilityai/stable-diffusion-3.5-medium (diffusers SD3Transformer2DModel), field for field.
SD35_MEDIUM: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
    "qk_norm": "rms_norm",
}
# The CPU mode's transformer: the same structure (16 latent channels, dual attention, RMS qk-norm), tiny.
TINY: dict[str, Any] = {
    **SD35_MEDIUM,
    "sample_size": 32,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 32,
    "pos_embed_max_size": 32,
    "dual_attention_layers": [0],
}
MODEL_ID = "sd35m-random"
SEED = 20261202
MiB = 1 << 20
PARTS = ("exact", "overhead", "cobatch", "transport")
VERL_OMNI_DLOGP = 2.2e-5  # verl-omni #280: |d log p| across batch sizes, SD3.5-M in bf16


@dataclass
class Row:
    part: str
    name: str
    value: Any
    unit: str = ""
    target: str = ""
    ok: bool | None = None
    note: str = ""


@dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    rows: list[Row] = field(default_factory=list)

    def add(self, part: str, name: str, value: Any, unit: str = "", target: str = "", ok: bool | None = None,
            note: str = "") -> None:
        self.rows.append(Row(part, name, value, unit, target, ok, note))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- the model


def build_model(run: Run) -> Any:
    """The LoadedModel `MODEL_ID` in a fresh ModelRegistry (returned as (registry, model))."""
    from sigmaflight.pipeline.builtins import T5_LEN, ModelDefaults, sd3_with_tiny_encoders
    from sigmaflight.pipeline.models import LoadedModel, ModelRegistry, combine_digests, component_digests

    config = SD35_MEDIUM if run.args.size == "full" else TINY
    torch.manual_seed(SEED)
    with torch.device(run.device):  # weights drawn where they live: no 10 GB fp32 detour through the host
        pipeline = sd3_with_tiny_encoders(config)
    pipeline.to(device=run.device, dtype=run.args.dtype)
    for module in pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
            module.requires_grad_(False)
    pipeline.set_progress_bar_config(disable=True)
    components = component_digests(pipeline)
    model = LoadedModel(
        id=MODEL_ID, family="sd3", pipeline=pipeline, device=run.device, dtype=run.args.dtype,
        digest=combine_digests(components), components=components,
        defaults=ModelDefaults(height=run.args.size_px, width=run.args.size_px, num_inference_steps=run.args.steps,
                               guidance_scale=4.5, size_multiple=16, call_kwargs={"max_sequence_length": T5_LEN}),
    )
    registry = ModelRegistry(device=run.device, dtype=run.args.dtype)
    registry.add(model)
    params = sum(p.numel() for p in pipeline.transformer.parameters())
    run.add("model", "transformer parameters", params, note=f"{'SD3.5-Medium' if config is SD35_MEDIUM else 'tiny'}"
            f" config, {str(run.args.dtype).removeprefix('torch.')}, random (seed {SEED})")
    return registry, model


def prompts(n: int) -> tuple[str, ...]:
    return tuple(f"a photo of thing {k}" for k in range(n))


def spec_of(run: Run, n: int, **kw: Any) -> Any:
    from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

    base: dict[str, Any] = dict(model=MODEL_ID, prompts=prompts(n), num_inference_steps=run.args.steps, seed=7,
                                height=run.args.size_px, width=run.args.size_px, guidance_scale=4.5,
                                sampler=SamplerSpec(type="sde", noise_level=0.7))
    return RolloutSpec(**{**base, **kw})


def stock_call(model: Any, spec: Any, seeds: Any, on_latents: Callable[[torch.Tensor], None] | None = None) -> Any:
    """The stock diffusers `__call__` (a fresh stock scheduler) with the rollout's arguments."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from sigmaflight.pipeline.calls import call_kwargs

    kwargs = call_kwargs(model, spec, seeds)
    if on_latents is not None:
        def on_step_end(pipe: Any, i: int, t: Any, cb: dict[str, Any]) -> dict[str, Any]:
            on_latents(cb["latents"])
            return cb

        kwargs.update(callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])
    pipe = type(model.pipeline)(**{**model.pipeline.components,
                                   "scheduler": FlowMatchEulerDiscreteScheduler.from_config(model.pipeline.scheduler.config)})
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        return pipe(**kwargs).images


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, NaN where the other is NaN (log-prob columns of deterministic steps)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def interleaved(run: Run, fns: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
    """Each fn once untimed (warm-up), then `repeats` rounds, which runs first alternating."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(run.args.repeats):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(run.timed(fn))
    return times


# --------------------------------------------------------------------------- parts


def part_exact(run: Run, registry: Any, model: Any) -> None:
    from sigmaflight.pipeline.replay import Replayer
    from sigmaflight.pipeline.rollout import run_rollout
    from sigmaflight.pipeline.spec import SamplerSpec

    b = run.args.exact_batch
    ode = spec_of(run, b, sampler=SamplerSpec(type="ode"))
    res = run_rollout(model, ode)
    stock: list[torch.Tensor] = []
    final = stock_call(model, ode, res.seeds, lambda x: stock.append(x.detach().to("cpu").clone()))
    equal = len(stock) == ode.num_inference_steps and all(
        torch.equal(res.captures[i + 1].latent, x) for i, x in enumerate(stock)) and torch.equal(res.final_latents, final)
    run.add("exact", f"ode rollout == stock __call__ (x_1..x_T, B={b}, CFG)", equal, target="torch.equal", ok=equal)

    sde = spec_of(run, b)
    res = run_rollout(model, sde)
    latents = torch.stack([c.latent for c in res.captures], dim=1)  # [B, T+1, ...] as captured (bf16)
    steps = [c.step for c in res.captures]
    replayer = Replayer(model)
    replayed = replayer.log_probs(sde, latents=latents, steps=steps, sigmas=res.snapshot.sigmas,
                                  timesteps=res.snapshot.timesteps, seeds=res.seeds)
    equal = same(replayed, res.log_probs)
    run.add("exact", f"sde log-probs == replay (same weights, B={b})", equal, target="torch.equal", ok=equal,
            note=f"captured latents {str(latents.dtype).removeprefix('torch.')}")
    worst = 0.0
    for k in range(b):  # each sample replayed alone: a batch of 1 (2 rows with CFG) instead of b
        alone = replace(sde, prompts=(sde.prompts[k],), seed=None, seeds=(res.seeds[k],))
        lp = replayer.log_probs(alone, latents=latents[k:k + 1], steps=steps, sigmas=res.snapshot.sigmas,
                                timesteps=res.snapshot.timesteps, seeds=(res.seeds[k],))
        d = (lp[0] - res.log_probs[k]).abs()
        worst = max(worst, float(d[~torch.isnan(d)].max()) if bool((~torch.isnan(d)).any()) else 0.0)
    run.add("exact", f"replay at batch 1 vs B={b}: largest |d log p|", worst, target=f"verl-omni: {VERL_OMNI_DLOGP:g}",
            ok=math.isfinite(worst), note="per-row calls (--batch-invariant) make it 0 by construction")


def part_overhead(run: Run, registry: Any, model: Any) -> None:
    from sigmaflight.pipeline.rollout import latent_shape, run_rollout, sample_seeds

    b, t = run.args.batch, run.args.steps
    spec = spec_of(run, b)
    seeds = sample_seeds(spec)

    def rollout() -> None:
        res = run_rollout(model, spec)
        assert len(res.captures) == t + 1 and bool(torch.isfinite(res.log_probs).all())

    times = interleaved(run, {"stock": lambda: stock_call(model, spec, seeds), "rollout": rollout})
    p, r = statistics.median(times["stock"]), statistics.median(times["rollout"])
    pairs = sorted(y / x for x, y in zip(times["stock"], times["rollout"], strict=True))
    size = f"B={b}, T={t}, {run.args.size_px}x{run.args.size_px}, CFG 4.5"
    run.add("overhead", f"stock __call__ ({size})", round(p * 1e3, 1), "ms", note=f"{p * 1e3 / t:.1f} ms/step")
    run.add("overhead", "run_rollout, full capture + sde log-probs", round(r * 1e3, 1), "ms")
    ratio = r / p
    run.add("overhead", "run_rollout / stock __call__", round(ratio, 3), "x", "<= 1.05", ratio <= 1.05,
            note=f"median of per-round ratios {statistics.median(pairs):.3f} (range {pairs[0]:.3f}-{pairs[-1]:.3f}), "
                 f"{run.args.repeats} rounds")
    per_step = b * math.prod(latent_shape(model, spec)) * torch.finfo(run.args.dtype).bits // 8
    run.add("overhead", "captured latents copied to the host per step", round(per_step / MiB, 3), "MiB",
            note="one blocking .to('cpu') of the whole call's x_i per step (and of x_T after the last), made by "
                 "the rollout driver (pipeline/rollout.py, _Driver._host) in the scheduler's step, after the "
                 "transition and before the pipeline calls the transformer for step i+1: on the loop's thread, so "
                 "it does not overlap the next step (nor do the log-prob and finiteness checks, which also sync)")


def part_cobatch(run: Run, registry: Any, model: Any) -> None:
    from sigmaflight.pipeline.rollout import BatchMember, run_batch, sample_seeds

    b = run.args.batch
    whole = spec_of(run, b)
    seeds = sample_seeds(whole)
    singles = [replace(whole, prompts=(p,), seed=None, seeds=(s,)) for p, s in zip(whole.prompts, seeds, strict=True)]
    one = replace(whole, seed=None, seeds=seeds)  # the same rows, one member

    def call(specs: list[Any]) -> Callable[[], None]:
        def go() -> None:
            for out in run_batch(model, [BatchMember(spec=s) for s in specs]):
                if isinstance(out, BaseException):
                    raise out
        return go

    times = interleaved(run, {"one": call([one]), "members": call(singles)})
    o, m = statistics.median(times["one"]), statistics.median(times["members"])
    run.add("cobatch", f"one B={b} rollout", round(o * 1e3, 1), "ms")
    run.add("cobatch", f"{b} single-sample members, one call", round(m * 1e3, 1), "ms")
    run.add("cobatch", f"throughput {b} members / one B={b}", round(o / m, 3), "x", ">= 0.95", o / m >= 0.95,
            note=f"{run.args.repeats} rounds")


def part_transport(run: Run, registry: Any, model: Any) -> None:
    from safetensors.torch import save
    from sigmaflight.dataplane.client import TrajectoryClient
    from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
    from sigmaflight.dataplane.server import FlightDataServer
    from sigmaflight.dataplane.store import ResultStore
    from sigmaflight.pipeline.rollout import rollout_metadata, run_rollout
    from sigmaflight.pipeline.safetensors_io import read_safetensors

    spec = spec_of(run, run.args.batch)
    store = ResultStore(memory_budget_bytes=16 << 30)
    writer: list[Any] = []

    def on_schedule(snap: Any) -> None:  # the header as the service writes it (control's header_for)
        writer.append(store.create(TrajectoryHeader(
            rollout_id="gpu", sigmas=snap.sigmas, timesteps=snap.timesteps, steps=snap.steps,
            sde_steps=snap.sde_steps, seeds=snap.seeds, num_outputs_per_prompt=snap.num_outputs_per_prompt,
            latent_shape=snap.latent_shape, latent_dtype=snap.latent_dtype, log_probs=True,
            rollout=rollout_metadata(model, spec, snap), prompt_index=tuple(snap.prompt_index))))

    def on_step(cap: Any) -> None:
        writer[0].append(StepBatch(step=cap.step, latent=cap.latent, log_prob=cap.log_prob))

    res = run_rollout(model, spec, on_schedule=on_schedule, on_step=on_step)
    writer[0].finish()
    captured = torch.stack([c.latent for c in res.captures], dim=1)
    nbytes = captured.numel() * captured.element_size()
    try:
        with FlightDataServer(store) as srv, TrajectoryClient(srv.locations[0], transport="flight") as client:
            ticket = store.ticket_for("gpu")
            traj = client.pull(ticket)
            equal = torch.equal(traj.latents, captured) and same(traj.log_probs, res.log_probs)
            run.add("transport", "pulled trajectory == captured (latents, log-probs)", equal, target="torch.equal",
                    ok=equal)
            times = [run.timed(lambda: client.pull(ticket)) for _ in range(max(3, run.args.repeats))]
    finally:
        store.close()
    t = statistics.median(times)
    run.add("transport", f"Flight pull of one rollout ({nbytes / MiB:.3g} MiB, B={spec.num_samples}, "
            f"K={captured.shape[1]}), loopback", round(nbytes / t / 1e9, 3), "GB/s",
            note=f"median of {len(times)} pulls, {t * 1e3:.1f} ms; TrajectoryClient(transport='flight').pull")

    base = model.base_transformer()
    t0 = time.perf_counter()
    state = {k: v.detach().to("cpu").contiguous() for k, v in base.state_dict().items()}
    body = save(state)  # what Client.push_weights sends
    serialize = time.perf_counter() - t0
    del state
    size = len(body)
    cap = 512 * MiB
    t0 = time.perf_counter()
    tensors, _ = read_safetensors(body)
    parsed = time.perf_counter() - t0
    policy = registry.replace_weights(MODEL_ID, tensors)
    run.sync()
    total = time.perf_counter() - t0
    ok = policy.digest == model.digest  # the same weights pushed back: the same digest
    del tensors, body
    run.add("transport", f"weights push, in process ({size / 1e9:.3g} GB safetensors body)",
            round(size / total / 1e9, 3), "GB/s", ok=ok,
            note=f"read_safetensors {parsed:.2f} s + replace_weights {total - parsed:.2f} s (check, copy to "
                 f"{run.device.type}, digest); client side serialize {serialize:.2f} s; "
                 + ("over REST the default 512 MiB body cap (max_weights_bytes) refuses it with 413"
                    if size > cap else "within REST's default 512 MiB body cap"))


PART_FNS: dict[str, Callable[[Run, Any, Any], None]] = {
    "exact": part_exact, "overhead": part_overhead, "cobatch": part_cobatch, "transport": part_transport,
}


# --------------------------------------------------------------------------- table


def fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "equal" if value else "DIFFER"
    if isinstance(value, float):
        return f"{value:.3g}" if (value != 0 and abs(value) < 1e-2) else f"{value:g}"
    return str(value)


def table(rows: list[Row]) -> str:
    head = ("part", "measure", "value", "unit", "target", "ok")
    body = [(r.part, r.name, fmt(r.value), r.unit, r.target, "" if r.ok is None else ("yes" if r.ok else "NO"))
            for r in rows]
    widths = [max(len(h), *(len(b[k]) for b in body)) for k, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    notes = [f"  [{r.part}] {r.name}: {r.note}" for r in rows if r.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def distributions() -> list[str]:
    """The installed distributions whose modules this process imported (what the run needs)."""
    tops = {name.split(".")[0] for name in list(sys.modules)}
    found = importlib.metadata.packages_distributions()
    return sorted({d for top in tops for d in found.get(top, [])})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--size", choices=("full", "tiny"), default=None,
                    help="transformer config: SD3.5-Medium (default on cuda) or tiny (default on cpu)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, default=None, help="B of the overhead, cobatch and transport parts (16)")
    ap.add_argument("--exact-batch", type=int, default=None, help="B of the exactness part (4; cpu 2)")
    ap.add_argument("--steps", type=int, default=None, help="T (10; cpu 2)")
    ap.add_argument("--px", dest="size_px", type=int, default=None, help="image height and width (512; cpu 32)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per comparison (3; cpu 1)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip the parts not started by then (seconds)")
    ap.add_argument("--json", type=Path, default=None, help="write the table here as JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu for the small CPU mode)")
    gpu = device.type == "cuda"
    args.size = args.size or ("full" if gpu else "tiny")
    args.dtype = getattr(torch, args.dtype)
    for name, full, small in (("batch", 16, 4), ("exact_batch", 4, 2), ("steps", 10, 2), ("size_px", 512, 32),
                              ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, full if args.size == "full" else small)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; known: {list(PARTS)}")

    run = Run(args, device)
    start = time.perf_counter()
    if not gpu:
        torch.manual_seed(SEED)
    try:
        registry, model = build_model(run)
    except Exception as exc:
        traceback.print_exc()
        run.add("model", "error", f"{type(exc).__name__}: {exc}", ok=False)
        parts = []
    run.add("model", "build time", round(time.perf_counter() - start, 1), "s")
    for part in parts:
        if time.perf_counter() - start > args.budget_s:
            run.add(part, "skipped", f"time budget of {args.budget_s:g} s spent", ok=False)
            continue
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            PART_FNS[part](run, registry, model)
        except Exception as exc:
            traceback.print_exc()
            run.add(part, "error", f"{type(exc).__name__}: {exc}", ok=False)
        run.add(part, "peak accelerator memory", round(torch.cuda.max_memory_allocated(device) / MiB, 1) if gpu else None,
                "MiB" if gpu else "", note="" if gpu else "CPU run: no accelerator memory")
        run.add(part, "wall time", round(time.perf_counter() - t0, 1), "s")
    out = {
        "rows": [r.__dict__ for r in run.rows],
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu",
            "torch": torch.__version__,
            "diffusers": importlib.metadata.version("diffusers"),
            "python": platform.python_version(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "config": SD35_MEDIUM if args.size == "full" else TINY,
            "size": args.size, "dtype": str(args.dtype).removeprefix("torch."), "batch": args.batch,
            "exact_batch": args.exact_batch, "steps": args.steps, "px": args.size_px, "repeats": args.repeats,
            "wall_s": round(time.perf_counter() - start, 1),
            "distributions": distributions(),
        },
    }
    print(table(run.rows))
    print(f"\n{out['meta']['device']}, torch {torch.__version__}, {out['meta']['wall_s']} s")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 1 if any(r.name in ("error", "skipped") for r in run.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
