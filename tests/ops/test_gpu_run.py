"""ops/gpu/run.py in its CPU mode (tiny config): every part runs and says what the GPU run will say.

The figures of a CPU run on a shared box are not checked (the GPU run's are the ones that count);
this checks the table: its rows, that the exactness rows say equal, that every number is finite,
and that the run imported nothing the GPU machine lacks beyond the wheels ops/gpu/README.md carries."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ROWS = {
    "model": ["transformer parameters", "build time"],
    "exact": ["ode rollout == stock __call__", "sde log-probs == replay", "replay at batch 1"],
    "overhead": ["stock __call__", "run_rollout, full capture", "run_rollout / stock __call__",
                 "captured latents copied to the host per step"],
    "cobatch": ["one B=", "single-sample members, one call", "throughput"],
    "transport": ["pulled trajectory == captured", "Flight pull of one rollout", "weights push, in process"],
}
# Absent from the GPU machine and not carried there (ops/gpu/README.md): the run must not import them.
ABSENT = {"starlette", "uvicorn", "pydantic-settings", "pydantic_settings", "pydantic", "ray"}


def test_the_cpu_mode_prints_and_writes_the_whole_table(tmp_path):
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "ops/gpu/run.py", "--device", "cpu", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads(out.read_text())
    rows = table["rows"]
    assert not [r for r in rows if r["name"] in ("error", "skipped")], rows
    for part, names in ROWS.items():
        have = [r["name"] for r in rows if r["part"] == part]
        for name in names:
            assert any(name in h for h in have), (part, name, have)
            assert any(name in h for h in have if h in proc.stdout), (part, name)  # printed too
        if part != "model":
            assert {"peak accelerator memory", "wall time"} <= set(have), have
    for r in rows:
        if r["name"].startswith(("ode rollout ==", "sde log-probs ==", "pulled trajectory ==")):
            assert r["value"] is True and r["ok"] is True, r
        elif isinstance(r["value"], (int, float)) and not isinstance(r["value"], bool):
            assert math.isfinite(r["value"]) and r["value"] >= 0, r
        elif r["name"] != "peak accelerator memory":  # None on CPU
            raise AssertionError(f"row without a number or a verdict: {r}")
    (push,) = [r for r in rows if r["name"].startswith("weights push")]
    assert push["ok"] is True, push  # the same weights pushed back: the same digest
    meta = table["meta"]
    assert meta["size"] == "tiny" and meta["dtype"] == "bfloat16"
    used = {d.lower() for d in meta["distributions"]}
    assert "diffusers" in used and not used & ABSENT, sorted(used)
