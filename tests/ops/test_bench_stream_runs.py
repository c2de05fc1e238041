"""ops/bench_stream.py still runs (one small round: the figures are not checked here, only that
both ways and the ratio are printed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_bench_stream_prints_both_ways_and_the_ratio():
    out = subprocess.run([sys.executable, "ops/bench_stream.py", "--n", "8", "--in-flight", "4", "--burst", "2",
                          "--steps", "2", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    for way in ("stream", "bursts"):
        assert re.search(rf"^{way}\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out.stdout, re.M), out.stdout
    assert re.search(r"^stream / bursts samples/s: [\d.]+ \(target >= 0.9\)$", out.stdout, re.M), out.stdout
