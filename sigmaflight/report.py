"""`sigmaflight inspect`: what a trajectory holds, and where it is inconsistent.

Reads a "trajectory/v1" stream (an `.arrow` file, or a Flight ticket) with plain pyarrow,
without the data plane's validation, so that a broken file is reported rather than refused:
the schema, the schedule by absolute index (timestep, sigma, float32(timestep / 1000) and
whether it equals the sigma that ran), per-step latent statistics, per-step log-prob
summaries, a list of flags (defects of the file: `inspect --strict` exits 1 on any) and a
list of hints (true of a valid file, worth knowing: where t/1000 drifts from the sigma).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sigmaflight.dataplane.schema import (
    FORMAT,
    KEY_FORMAT,
    KEY_LOG_PROBS,
    KEY_ROLLOUT,
    KEY_SDE_STEPS,
    KEY_SIGMAS,
    KEY_STEPS,
    KEY_TIMESTEPS,
    latent_dtype_of,
    schema_metadata,
)


def read_arrow_file(path: str | Path) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """An Arrow IPC file (or stream) as (schema, batches); no trajectory validation."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    source = pa.memory_map(str(path), "r")
    try:
        reader: Any = pa.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            reader = pa.ipc.open_stream(source)
            batches = list(reader)
        except (pa.ArrowInvalid, OSError) as exc:
            size = Path(path).stat().st_size
            raise ValueError(
                f"{path}: not a complete Arrow IPC file ({size} bytes; truncated or corrupt: {exc}); "
                "pull it again (`sigmaflight pull` replaces an incomplete file)"
            ) from None
    return reader.schema, batches


def written_checksums(path: str | Path) -> list[int | None] | None:
    """Each batch's CRC-32C as its writer stored it beside the batch (`sigmaflight pull`, the
    server's files: ``sigmaflight.crc32c`` in the batch's message metadata), None where a batch
    carries none; None for an Arrow stream, which has no such metadata to read back."""
    from sigmaflight.dataplane.files import KEY_CRC

    with pa.memory_map(str(path), "r") as source:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            return None
        crcs: list[int | None] = []
        for i in range(reader.num_record_batches):
            meta = reader.get_batch_with_custom_metadata(i).custom_metadata
            value = None if meta is None else meta.get(KEY_CRC.encode())
            crcs.append(int(value) if value is not None and value.isdigit() else None)
    return crcs


def latent_values(column: pa.Array, schema: pa.Schema) -> np.ndarray[Any, Any]:
    """float64 [rows, elements] of a latent column (bf16 travels as uint16)."""
    storage = column.storage if isinstance(column, pa.ExtensionArray) else column
    rows = len(storage)
    flat = storage.flatten().to_numpy(zero_copy_only=False)
    import torch

    dtype = latent_dtype_of(schema)
    if dtype == torch.bfloat16:
        flat = torch.from_numpy(flat.astype(np.uint16).copy()).view(torch.bfloat16).float().numpy()
    return np.asarray(flat, dtype=np.float64).reshape(rows, -1)


@dataclass
class _Acc:
    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nonfinite: int = 0

    def add(self, values: np.ndarray[Any, Any]) -> None:
        finite = values[np.isfinite(values)]
        self.nonfinite += int(values.size - finite.size)
        if finite.size:
            self.n += int(finite.size)
            self.total += float(finite.sum())
            self.total_sq += float(np.square(finite).sum())
            self.lo = min(self.lo, float(finite.min()))
            self.hi = max(self.hi, float(finite.max()))

    def summary(self) -> dict[str, Any]:
        if not self.n:
            return {"count": 0, "mean": None, "std": None, "min": None, "max": None, "nonfinite": self.nonfinite}
        mean = self.total / self.n
        var = max(self.total_sq / self.n - mean * mean, 0.0)
        return {"count": self.n, "mean": mean, "std": math.sqrt(var), "min": self.lo, "max": self.hi,
                "nonfinite": self.nonfinite}


@dataclass
class Report:
    source: str
    schema: pa.Schema
    meta: dict[str, Any]
    rollout: dict[str, Any]
    schedule: list[dict[str, Any]] = field(default_factory=list)
    latents: list[dict[str, Any]] = field(default_factory=list)
    log_probs: list[dict[str, Any]] = field(default_factory=list)
    log_prob_matrix: dict[int, dict[int, float]] = field(default_factory=dict)
    """step -> sample -> log_prob (non-null values only), for plots."""
    flags: list[str] = field(default_factory=list)
    """Defects: the file is inconsistent with trajectory/v1 or with itself."""
    hints: list[str] = field(default_factory=list)
    """Facts of a valid file a reader should know: float32(t / 1000) != sigma at i (the drift that is
    why sigmaflight ships sigmas; a diffusers schedule has it at some steps)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "format": self.meta.get(KEY_FORMAT),
            "rollout_id": self.rollout.get("id"),
            "model": self.rollout.get("model"),
            "sampler": self.rollout.get("sampler"),
            "num_samples": self.rollout.get("num_samples"),
            "num_steps": len(self.meta.get(KEY_TIMESTEPS) or []),
            "steps": self.meta.get(KEY_STEPS),
            "sde_steps": self.meta.get(KEY_SDE_STEPS),
            "columns": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in self.schema],
            "schedule": self.schedule,
            "latents": self.latents,
            "log_probs": self.log_probs,
            "flags": self.flags,
            "hints": self.hints,
        }


COLUMNS = ("step", "sample", "seed", "latent", "sigma", "sigma_next", "timestep", "log_prob")
"""The trajectory/v1 columns the report reads; a file without one is flagged, and read without it."""


class _Rows:
    """The row checks a data-plane client makes before it hands out a trajectory (it refuses such a
    file; inspect reports it): nulls in columns that are not nullable, a sample outside 0..B-1, a
    (step, sample) twice, a seed other than the metadata's for its sample."""

    def __init__(self, rollout: dict[str, Any]) -> None:
        self.num_samples = rollout.get("num_samples")
        seeds = rollout.get("seeds")
        self.seeds = seeds if isinstance(seeds, list) else None
        self.seen: set[tuple[int, int]] = set()
        self.nulls: dict[str, int] = {}
        self.bad: dict[str, list[str]] = {"twice": [], "outside": [], "seed": []}

    def batch(self, batch: pa.RecordBatch, cols: dict[str, list[Any]], missing: list[str]) -> None:
        for name in ("sample", "seed", "latent"):
            if name not in missing:
                n = batch.column(name).null_count if name == "latent" else cols[name].count(None)
                self.nulls[name] = self.nulls.get(name, 0) + n

    def row(self, step: int, sample: Any, seed: Any) -> None:
        if sample is None:
            return
        if (step, sample) in self.seen:
            self.bad["twice"].append(f"step {step}, sample {sample}")
        self.seen.add((step, sample))
        if isinstance(self.num_samples, int) and not 0 <= sample < self.num_samples:
            self.bad["outside"].append(f"step {step}, sample {sample}")
        elif self.seeds is not None and seed is not None and 0 <= sample < len(self.seeds) and seed != self.seeds[sample]:
            self.bad["seed"].append(f"step {step}, sample {sample}: {seed} != {self.seeds[sample]}")

    def flags(self) -> list[str]:
        out = [f"{name} column: {n} nulls (not nullable)" for name, n in self.nulls.items() if n]
        what = {"twice": "rows for a (step, sample) already seen",
                "outside": f"samples outside 0..{(self.num_samples or 0) - 1}",
                "seed": "seed column disagrees with sigmaflight.rollout.seeds"}
        for kind, found in self.bad.items():
            if found:
                more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
                out.append(f"{what[kind]}: {'; '.join(found[:3])}{more}")
        return out


def _f32(x: float) -> float:
    return float(np.float32(x))


def _numbers(meta: dict[str, Any], key: str, flags: list[str], *, integers: bool = False) -> list[Any]:
    """A metadata list of numbers (JSON); a flag and [] when it is something else."""
    value = meta.get(key)
    if value is None:
        return []
    kinds = (int,) if integers else (int, float)
    if not isinstance(value, list) or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in value):
        flags.append(f"{key} is not a JSON list of {'integers' if integers else 'numbers'}: {str(value)[:80]!r}")
        return []
    return value


def build_report(source: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch], *,
                 checksums: list[int | None] | None = None) -> Report:
    """`checksums`: each batch's CRC-32C as written (`written_checksums`); a batch whose bytes no
    longer match is a flag, as a data-plane client refuses the file."""
    meta = schema_metadata(schema)
    rollout = dict(meta.get(KEY_ROLLOUT) or {})
    rep = Report(source=source, schema=schema, meta=meta, rollout=rollout)
    flags = rep.flags
    if meta.get(KEY_FORMAT) != FORMAT:
        flags.append(f"{KEY_FORMAT} is {meta.get(KEY_FORMAT)!r}, not {FORMAT!r}")
    sigmas = [_f32(s) for s in _numbers(meta, KEY_SIGMAS, flags)]
    timesteps = [_f32(t) for t in _numbers(meta, KEY_TIMESTEPS, flags)]
    steps = [int(s) for s in _numbers(meta, KEY_STEPS, flags, integers=True)]
    sde_steps = {int(s) for s in _numbers(meta, KEY_SDE_STEPS, flags, integers=True)}
    t_count = len(timesteps)
    if len(sigmas) != t_count + 1:
        flags.append(f"sigmas has {len(sigmas)} entries, expected T+1 = {t_count + 1}")
    if steps != sorted(set(steps)):
        flags.append(f"{KEY_STEPS} is not ascending and unique: {steps}")
    if sigmas and sigmas[-1] != 0.0:
        flags.append(f"terminal sigma sigmas[{len(sigmas) - 1}] = {sigmas[-1]!r}, not 0")
    for i in range(len(sigmas)):
        t = timesteps[i] if i < t_count else None
        t_over = float(np.float32(t) / np.float32(1000)) if t is not None else None
        row = {"i": i, "timestep": t, "sigma": sigmas[i], "timestep_over_1000": t_over,
               "matches": None if t_over is None else t_over == sigmas[i],
               "sde": (i in sde_steps) if i < t_count else None, "streamed": i in steps}
        rep.schedule.append(row)
        if t_over is not None and t_over != sigmas[i]:
            rep.hints.append(f"i={i}: float32(timesteps[{i}] / 1000) = {t_over!r} != sigma {sigmas[i]!r}: "
                             "recomputing sigma from the timestep would be wrong here; use the shipped sigmas")
        if i > 0 and not sigmas[i] < sigmas[i - 1]:
            flags.append(f"i={i}: sigma {sigmas[i]!r} does not decrease (sigma[{i - 1}] = {sigmas[i - 1]!r})")

    acc: dict[int, _Acc] = {}
    lp_acc: dict[int, _Acc] = {}
    seen_order: list[int] = []
    wants_lp = bool(meta.get(KEY_LOG_PROBS, True))
    column_bad: set[str] = set()
    lp_bad: set[int] = set()
    batches = list(batches)
    if checksums is not None:
        flags.extend(_checksum_flags(batches, checksums))
    missing = [name for name in COLUMNS if schema.get_field_index(name) < 0]
    if missing:
        flags.append(f"columns missing: {', '.join(missing)} (trajectory/v1 has {', '.join(COLUMNS)})")
    if "step" in missing:
        batches = []  # nothing can be placed by step
    if "latent" not in missing:
        try:
            latent_dtype_of(schema)
        except (ValueError, TypeError, KeyError) as exc:  # the latent column's type and its dtype label disagree
            flags.append(f"latent values unreadable: {exc}")
            missing.append("latent")
    null = {"step": 0}
    rows = _Rows(rollout)
    for batch in batches:
        cols = {name: batch.column(name).to_pylist() if name not in missing else [None] * batch.num_rows
                for name in COLUMNS if name != "latent"}
        step_col = cols["step"]
        null["step"] += step_col.count(None)
        present = sorted({s for s in step_col if s is not None})
        if len(present) > 1:
            flags.append(f"a record batch mixes steps {present}")
        vals = latent_values(batch.column("latent"), schema) if "latent" not in missing else None
        sig_col, nxt_col, ts_col = cols["sigma"], cols["sigma_next"], cols["timestep"]
        lp_col, sample_col = cols["log_prob"], cols["sample"]
        rows.batch(batch, cols, missing)
        for r, step in enumerate(step_col):
            if step is None:
                continue
            rows.row(step, sample_col[r], cols["seed"][r])
            if not seen_order or seen_order[-1] != step:
                seen_order.append(step)
            if vals is not None:
                acc.setdefault(step, _Acc()).add(vals[r])
            else:
                acc.setdefault(step, _Acc())
            if "sigma" not in missing and sigmas and 0 <= step < len(sigmas) and sig_col[r] != sigmas[step]:
                column_bad.add(f"sigma column at step {step} = {sig_col[r]!r} != sigmas[{step}] = {sigmas[step]!r}")
            want_next = sigmas[step + 1] if 0 <= step < len(sigmas) - 1 else None
            if "sigma_next" not in missing and sigmas and nxt_col[r] != want_next:
                column_bad.add(f"sigma_next column at step {step} = {nxt_col[r]!r}, expected {want_next!r}")
            want_t = timesteps[step] if 0 <= step < t_count else None
            if "timestep" not in missing and timesteps and ts_col[r] != want_t:
                column_bad.add(f"timestep column at step {step} = {ts_col[r]!r}, expected {want_t!r}")
            lp = lp_col[r]
            if lp is not None:
                lp_acc.setdefault(step, _Acc()).add(np.asarray([lp], dtype=np.float64))
                sample = sample_col[r]
                if sample is not None:
                    rep.log_prob_matrix.setdefault(step, {})[int(sample)] = float(lp)
                if step not in sde_steps:
                    lp_bad.add(step)
            elif wants_lp and "log_prob" not in missing and step in sde_steps:  # recorded on every stochastic row, x_{i+1} streamed or not
                lp_bad.add(step)
    if null["step"]:
        flags.append(f"step column: {null['step']} null values (rows left out of the report)")
    flags.extend(rows.flags())
    flags.extend(sorted(column_bad))
    for step in sorted(lp_bad):
        kind = "stochastic" if step in sde_steps else "deterministic"
        flags.append(f"step {step}: log_prob {'missing' if kind == 'stochastic' else 'present'} on a {kind} transition")
    if seen_order != sorted(seen_order) or len(seen_order) != len(set(seen_order)):
        flags.append(f"steps in the stream are not ascending: {seen_order}")
    if sorted(acc) != sorted(set(steps)):
        flags.append(f"the stream holds steps {sorted(acc)}, the metadata lists {steps}")
    n_samples = rollout.get("num_samples")
    for step in sorted(acc):
        s = acc[step].summary()
        rep.latents.append({"step": step, **s})
        if s["nonfinite"]:
            flags.append(f"step {step}: {s['nonfinite']} non-finite latent values")
    for step in sorted(lp_acc):
        s = lp_acc[step].summary()
        rep.log_probs.append({"step": step, **s})
        if s["nonfinite"]:
            flags.append(f"step {step}: non-finite log_prob")
    if n_samples is not None:
        for step in sorted(acc):
            got = len(rep.log_prob_matrix.get(step, {}))
            if got and got != n_samples:
                flags.append(f"step {step}: {got} log-probs for {n_samples} samples")
    return rep


def _checksum_flags(batches: list[pa.RecordBatch], checksums: list[int | None]) -> list[str]:
    from sigmaflight.dataplane.files import batch_crc

    if len(checksums) != len(batches):
        return [f"{len(batches)} record batches, {len(checksums)} checksums"]
    flags = []
    for i, (batch, want) in enumerate(zip(batches, checksums, strict=True)):
        got = None if want is None else batch_crc(batch)
        if got != want:
            flags.append(f"batch {i}: checksum mismatch (crc32c {got:08x}, written {want:08x}): "
                         "the file changed after it was written")
    return flags


def _fmt(x: Any, width: int = 12) -> str:
    if x is None:
        return "-".rjust(width)
    if isinstance(x, bool):
        return ("yes" if x else "NO").rjust(width)
    if isinstance(x, float):
        return f"{x:.6g}".rjust(width)
    return str(x).rjust(width)


def render_text(rep: Report) -> str:
    j = rep.to_json()
    model = j["model"] or {}
    out = [
        f"source     {j['source']}",
        f"format     {j['format']}   rollout {j['rollout_id']}",
        f"model      {model.get('id')} ({model.get('dtype')}) digest {model.get('digest')}",
        f"sampler    {json.dumps(j['sampler'])}",
        f"samples    B = {j['num_samples']}   steps T = {j['num_steps']}   streamed {j['steps']}   sde {j['sde_steps']}",
        "",
        "schema",
    ]
    out += [f"  {c['name']:<13} {c['type']}{'' if c['nullable'] else ' not null'}" for c in j["columns"]]
    out += ["", "schedule (absolute index i)",
            "     i    timestep       sigma  t/1000(f32)  t/1000==sigma  sde  streamed"]
    for r in rep.schedule:
        out.append(f"{r['i']:>6}{_fmt(r['timestep'])}{_fmt(r['sigma'])}{_fmt(r['timestep_over_1000'], 13)}"
                   f"{_fmt(r['matches'], 15)}{_fmt(r['sde'], 5)}{_fmt(r['streamed'], 10)}")
    out += ["", "latents per step (x_i over all samples and elements)",
            "  step        mean         std         min         max  nonfinite"]
    for r in rep.latents:
        out.append(f"{r['step']:>6}{_fmt(r['mean'])}{_fmt(r['std'])}{_fmt(r['min'])}{_fmt(r['max'])}{_fmt(r['nonfinite'], 11)}")
    out += ["", "log_prob per transition i (over samples)",
            "     i   n        mean         std         min         max"]
    if not rep.log_probs:
        out.append("  (none: not requested, or no stochastic transition with both ends streamed)")
    for r in rep.log_probs:
        out.append(f"{r['step']:>6}{r['count']:>4}{_fmt(r['mean'])}{_fmt(r['std'])}{_fmt(r['min'])}{_fmt(r['max'])}")
    out += ["", f"flags ({len(rep.flags)})"]
    out += [f"  ! {f}" for f in rep.flags] or ["  none: consistent"]
    if rep.hints:
        out += ["", f"hints ({len(rep.hints)}; not defects: --strict ignores them)"]
        out += [f"  - {h}" for h in rep.hints]
    return "\n".join(out) + "\n"
