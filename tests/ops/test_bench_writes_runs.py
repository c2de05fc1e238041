"""ops/bench_writes.py still runs (one small round: the figures are not checked here, only that
every call size prints both ways and their ratio)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_writes_prints_each_call_size_both_ways():
    out = subprocess.run([sys.executable, "ops/bench_writes.py", "--members", "2", "5", "--samples", "1", "3",
                          "--steps", "2", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
    assert [(int(m), int(s)) for m, s, *_ in rows] == [(2, 1), (2, 3), (5, 1), (5, 3)], out.stdout
    assert all(float(e) > 0 and float(c) > 0 for _, _, e, c, _ in rows)
