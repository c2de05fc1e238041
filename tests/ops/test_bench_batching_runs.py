"""ops/bench_batching.py and ops/measure_batch_drift.py still run (one small round: the figures are
not checked here, only that every workload and target line is printed and the servers batched)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_bench_batching_prints_every_workload_and_the_target_ratios():
    out = subprocess.run([sys.executable, "ops/bench_batching.py", "--n", "4", "--steps", "2", "--rounds", "1",
                          "--in-process-repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stderr[-3000:]
    for workload in ("one-B=N", "N x B=1", "N/2 x B=2", "lone B=1", "mixed"):
        for server in ("on-0", "on-W", "off"):
            assert re.search(rf"^{re.escape(workload)}\s+{server}\s+[\d.]+\s+[\d.]+", out.stdout, re.M), out.stdout
    calls = {m: (int(a), int(b)) for m, a, b in re.findall(r"^(on-0|on-W|off): (\d+) model calls for (\d+) rollouts",
                                                           out.stdout, re.M)}
    assert calls["off"][0] == calls["off"][1]  # --max-batch-samples 1: one call per rollout
    assert calls["on-W"][0] < calls["on-W"][1]  # with a wait, concurrent requests shared calls
    assert re.search(r"N x B=1 on-W / one-B=N: [\d.]+", out.stdout)
    assert re.search(r"lone B=1 latency, defaults / co-batching off: [\d.]+", out.stdout)
    assert re.search(r"stock diffusers __call__ [\d.]+ samples/s", out.stdout)


def test_bench_batching_server_cpu_prints_each_workload_for_every_server_and_the_ratios():
    """--server-cpu with --before and a --variant: a server per interpreter (here the same one twice)
    and one with the variant's flags, every workload on each, polled by httpx clients, and this
    checkout's also by http.client ones whose reads the server holds until the rollout ends
    (--clients stdlib+held: one read a request), with the event loop's share of the CPU, the clients' status reads, the model
    calls the requests ran as, the clients' own CPU and the cores busy."""
    out = subprocess.run([sys.executable, "ops/bench_batching.py", "--server-cpu", "--before", sys.executable, "--n", "3",
                          "--steps", "1", "--rounds", "1", "--variant", "threads-1=--torch-threads 1",
                          "--clients", "httpx", "stdlib+held"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = ["after", "before", "threads-1", "after/stdlib+held"]  # the second kind reads this checkout's server
    loops = clients = 0.0
    for workload in ("one-B=N", "N x B=1", "lone B=1"):
        for server in rows:
            row = re.search(rf"^{re.escape(workload)}\s+{re.escape(server)}\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)"
                            rf"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
            assert row, out.stdout
            cpu, loop, reads, calls, client, cores = map(float, row.groups())
            # a lone request is one model call; 3 clients' B=1 requests are 1-3 calls
            assert calls == 1 if workload != "N x B=1" else 1 <= calls <= 3, row.group(0)
            assert loop <= cpu, row.group(0)  # the event loop's CPU is part of the process tree's
            requests = 3 if workload == "N x B=1" else 1
            if server.endswith("+held"):  # each read held until its rollout ends: one a request
                assert reads == requests, row.group(0)
            else:
                assert reads >= requests, row.group(0)  # every client reads once at least
            assert cores > 0, row.group(0)  # the server's CPU and the clients' over the round's wall time
            loops += loop
            clients += client
    # the OS counts a thread's CPU in 10 ms ticks: one row may show 0, not all
    assert loops > 0 and clients > 0, out.stdout
    for server in rows:
        assert re.search(rf"^{re.escape(server)}: N x B=1 / one-B=N server CPU [\d.]+x .* wall samples/s [\d.]+x",
                         out.stdout, re.M)
    assert re.search(r"^after / before: lone B=1 latency [\d.]+ .* one-B=N samples/s [\d.]+", out.stdout, re.M)


def test_bench_batching_poll_probe_times_the_call_with_pollers_nowhere_on_its_server_and_on_another():
    out = subprocess.run([sys.executable, "ops/bench_batching.py", "--poll-probe", "--n", "3", "--steps", "1",
                          "--rounds", "1", "--clients", "stdlib"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^poll probe: .* 3 stdlib clients polling", out.stdout, re.M), out.stdout
    line = re.search(r"^one B=N request's model call, median ms: no pollers (\d+), pollers on same server (\d+) "
                     r"\(([\d.]+)x\), pollers on other server (\d+) \(([\d.]+)x\)$", out.stdout, re.M)
    assert line, out.stdout
    none, same, same_x, other, other_x = map(float, line.groups())
    assert none > 0 and same > 0 and other > 0, line.group(0)  # a real call took time in every place
    # each ratio is against the call without pollers (the printed ms are rounded)
    assert same_x == pytest.approx(same / none, rel=0.1) and other_x == pytest.approx(other / none, rel=0.1), line.group(0)
    reads = re.search(r"^status reads a round: none ([\d.]+), same server ([\d.]+), other server ([\d.]+)$", out.stdout, re.M)
    assert reads, out.stdout
    assert float(reads[1]) == 0 and float(reads[2]) > 0 and float(reads[3]) > 0, reads.group(0)  # the pollers polled


def test_measure_batch_drift_finds_batch_invariance_bit_identical():
    out = subprocess.run([sys.executable, "ops/measure_batch_drift.py", "--models", "tiny-sd3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("tiny-sd3")]
    assert row.split()[-1] == "torch.equal", out.stdout
