"""ops/bench_transport.py still runs (a smoke run at 1 MiB: the figures are not checked here,
only that a same-host path and the do_get comparison produce their ratio lines)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_transport_prints_the_same_host_and_do_get_ratios():
    paths = "memcpy,shm-pull-into,doget-py"  # the other paths share their code (keep it short)
    out = subprocess.run(
        [sys.executable, "ops/bench_transport.py", "--paths", paths, "--sizes", "1M", "--repeats", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"ratio shm-pull-into / memcpy = [\d.]+x", text), text
    assert re.search(r"doget-py .* sigmaflight \d+ us, bare \d+ us", text), text
