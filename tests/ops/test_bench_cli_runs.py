"""ops/bench_cli.py still runs (one round: the figures are not checked here, only the ratio line)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cli_prints_the_help_over_stack_ratio():
    out = subprocess.run([sys.executable, "ops/bench_cli.py", "--repeats", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"ratio help / stack = [\d.]+x", out.stdout), out.stdout
