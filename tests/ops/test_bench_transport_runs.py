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


def test_bench_transport_prints_the_pull_ratios_at_every_trainer_size():
    """The transport table: the five ways at 1, 3, 13, 64 and 256 MiB in one run (one round each
    here: the figures are the docs', this checks the run and its ratio lines)."""
    sizes = ["1M", "3M", "13M", "64M", "256M"]
    out = subprocess.run(
        [sys.executable, "ops/bench_transport.py", "--paths", "pulls,read-threads", "--sizes", ",".join(sizes),
         "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    blocks = re.split(r"^# ", out.stdout, flags=re.M)[1:]
    assert [b.split(":")[0] for b in blocks] == [s.replace("M", " MiB") for s in sizes], out.stdout
    for block in blocks:
        for way in ("memcpy-fresh", "read-all", "pull-flight", "pull-file", "pull-file-into"):
            assert re.search(rf"^  {way} +[\d.]+ ms +[\d.]+ GB/s", block, re.M), block
        for ratio in ("pull-flight / read-all", "pull-file / pull-flight", "pull-file / memcpy-fresh",
                      "pull-file-into / memcpy-fresh"):
            assert re.search(rf"ratio {ratio} = [\d.]+x", block), block
        assert re.search(r"read-threads .* ratio 1 thread / \d+ threads = [\d.]+x", block), block
