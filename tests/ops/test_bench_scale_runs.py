"""ops/bench_scale.py still runs (one small round on a local Ray cluster: the figures are not
checked here, only that it prints each configuration and the Ray/local ratio). It had not run since
JobManager.submit lost its second argument and started handing out snapshots."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")


@pytest.mark.timeout(300)
def test_bench_scale_prints_the_ray_to_local_ratio():
    out = subprocess.run([sys.executable, "ops/bench_scale.py", "--model", "tiny-sd3", "--rollouts", "2",
                          "--rounds", "1", "--workers", "1", "--steps", "2", "--cpus", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = re.findall(r"^\s+1\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", out.stdout, re.M)
    local, ray, ratio = map(float, row)
    assert local > 0 and ray > 0 and abs(ratio - ray / local) < 0.01, out.stdout
