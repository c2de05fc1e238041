"""Back-pressure and sharing, measured on the real server's RSS: 32 concurrent consumers of one
large rollout, a slow consumer, consumers that disconnect mid-stream."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pyarrow.flight as flight
import pytest

from tests.faults.conftest import RssSampler, metric, rss
from tests.servers import ServerProcess, wait_for_status

pytestmark = pytest.mark.e2e

MiB = 1 << 20
# 64 prompts x 16 outputs = 1024 samples; T steps -> (T + 1) latents of 16x32x32 fp32 (64 KiB) each.
STEPS = int(os.environ.get("SIGMAFLIGHT_HARDENING_STEPS", "1"))  # 1 -> 128 MiB, 3 -> 256 MiB
BIG = {"prompts": [f"prompt {i}" for i in range(64)], "num_outputs_per_prompt": 16, "num_inference_steps": STEPS,
       "height": 128, "width": 128, "guidance_scale": 1.0, "seed": 7, "return": {"log_probs": False}}
CONSUMERS = 32
GROWTH_LIMIT = 64 * MiB


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    with ServerProcess("--max-samples", "1024", "--max-flight-streams", "64") as server, server.client() as c:
        ticket = c.post("/v1/rollouts", json=BIG).json()
        status = wait_for_status(c, ticket["id"], {"succeeded"}, timeout=240)
        _drain(server.flight_url, ticket["flight"]["ticket"])  # warm up gRPC's buffers once
        yield server, ticket, status["result"]


def _drain(location: str, ticket: str, pause: float = 0.0) -> tuple[int, int]:
    rows = nbytes = 0
    with flight.FlightClient(location) as c:
        reader = c.do_get(flight.Ticket(ticket.encode()))
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return rows, nbytes
            rows += chunk.data.num_rows
            nbytes += chunk.data.nbytes
            if pause:
                time.sleep(pause)


def _settle(server: ServerProcess, baseline: int, slack: int, timeout: float = 10.0) -> int:
    """Waits until no stream is open and RSS is within `slack` of `baseline`; returns the last RSS."""
    deadline = time.monotonic() + timeout
    while True:
        with server.client() as c:
            streams = metric(c.get("/metrics").text, "sigmaflight_flight_streams")
        now = rss(server.proc.pid)
        if (streams == 0 and now - baseline < slack) or time.monotonic() > deadline:
            assert streams == 0, f"{streams} streams still open"
            return now
        time.sleep(0.1)


def test_32_concurrent_consumers_share_the_stored_batches(big):
    server, ticket, result = big
    assert result["num_bytes"] >= (STEPS + 1) * 1024 * 64 * 1024
    baseline = rss(server.proc.pid)
    got: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            got.append(_drain(server.flight_url, ticket["flight"]["ticket"]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume) for _ in range(CONSUMERS)]
    t0 = time.monotonic()
    with RssSampler(server.proc.pid) as sampler:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    elapsed = time.monotonic() - t0
    assert not errors, errors[:3]
    assert got == [(result["num_rows"], got[0][1])] * CONSUMERS and got[0][1] >= result["num_bytes"]
    growth = sampler.peak - baseline
    print(f"\n{CONSUMERS} consumers x {result['num_bytes'] / MiB:.0f} MiB in {elapsed:.1f} s "
          f"({CONSUMERS * result['num_bytes'] / elapsed / 1e9:.2f} GB/s); server RSS baseline "
          f"{baseline / MiB:.0f} MiB, peak {sampler.peak / MiB:.0f} MiB, growth {growth / MiB:.1f} MiB")
    assert growth < GROWTH_LIMIT


def test_slow_and_stalled_consumers_do_not_grow_server_memory(big):
    server, ticket, result = big
    baseline = rss(server.proc.pid)
    with flight.FlightClient(server.flight_url) as c, RssSampler(server.proc.pid) as sampler:
        reader = c.do_get(flight.Ticket(ticket["flight"]["ticket"].encode()))
        rows = reader.read_chunk().data.num_rows
        time.sleep(2.0)  # stalled: the server must not read ahead into memory
        stalled_peak = sampler.peak
        for chunk in reader:  # then slow: 30 ms per batch
            rows += chunk.data.num_rows
            time.sleep(0.03)
    assert rows == result["num_rows"]
    print(f"\nslow consumer: server RSS baseline {baseline / MiB:.0f} MiB, peak while stalled "
          f"{stalled_peak / MiB:.0f} MiB, peak overall {sampler.peak / MiB:.0f} MiB")
    assert stalled_peak - baseline < GROWTH_LIMIT
    assert sampler.peak - baseline < GROWTH_LIMIT


CLIENT = """
import sys, time, pyarrow.flight as flight
r = flight.FlightClient(sys.argv[1]).do_get(flight.Ticket(sys.argv[2].encode()))
r.read_chunk()
print("reading", flush=True)
time.sleep(60)
"""


def test_consumers_that_disconnect_mid_stream_free_their_resources(big):
    server, ticket, result = big
    baseline = rss(server.proc.pid)
    for _ in range(3):
        # in-process clients closed mid-stream
        for _ in range(4):
            c = flight.FlightClient(server.flight_url)
            reader = c.do_get(flight.Ticket(ticket["flight"]["ticket"].encode()))
            reader.read_chunk()
            reader.cancel()
            del reader
            c.close()
        # client processes killed with SIGKILL mid-stream
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, server.flight_url, ticket["flight"]["ticket"]],
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "reading"
        for p in procs:
            p.kill()
            p.wait()
            assert p.stdout is not None
            p.stdout.close()
    after = _settle(server, baseline, 16 * MiB)
    print(f"\ndisconnects: server RSS baseline {baseline / MiB:.0f} MiB, after 24 broken streams {after / MiB:.0f} MiB")
    assert after - baseline < 16 * MiB
    # and the slots came back: a full pull still works
    assert _drain(server.flight_url, ticket["flight"]["ticket"])[0] == result["num_rows"]
