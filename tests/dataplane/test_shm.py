"""--shm-dir: finished trajectories as shared-memory Arrow files, read directly by same-host clients.

Real server (tests/servers.py) for the wire behaviour; in-process stores for budget and spill."""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.shm import host_id, parse_file_location
from sigmaflight.dataplane.store import ResultStore, TrajectoryWriter

from tests.dataplane.helpers import build_header, fill, make_steps, mapped_ranges
from tests.servers import AnyServer, InProcessServer, ServerProcess, wait_for_status

SMALL = {"prompts": ["a red cube", "a blue ball"], "num_inference_steps": 3, "seed": 12}
TOKEN = "sfk-shm-test-token-4f1e2d3c4b5a6978"
PRIVATE = f"sigmaflight-{os.geteuid()}"  # the files live in <shm-dir>/sigmaflight-<uid>/


def _bytes_served(server: AnyServer, token: str | None = None) -> float:
    with server.client(token) as c:
        text = c.get("/metrics").text
    m = re.search(r"^sigmaflight_flight_bytes_served_total (\S+)$", text, re.M)
    assert m is not None, text[:500]
    return float(m.group(1))


def _locations(flight_url: str, rollout_id: str, token: str | None = None) -> list[str]:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    with flight.FlightClient(flight_url) as fc:
        fi = fc.get_flight_info(
            flight.FlightDescriptor.for_path("rollouts", rollout_id), flight.FlightCallOptions(headers=headers)
        )
    return [loc.uri.decode() for loc in fi.endpoints[0].locations]


def _equal(a: object, b: object) -> None:
    for name in ("latents", "log_probs", "steps", "seeds", "sigmas", "timesteps"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y) or (x.dtype.is_floating_point and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))), name


@pytest.mark.e2e
def test_real_server_offers_the_file_and_a_same_host_client_reads_it_without_a_stream(tmp_path, caplog):
    shm, data = tmp_path / "shm", tmp_path / "data"
    server = ServerProcess("--shm-dir", str(shm), "--data-dir", str(data))
    try:
        with server.client() as c:
            t = c.post("/v1/rollouts", json=SMALL).json()
            wait_for_status(c, t["id"], {"succeeded"})
        rid, ticket = t["id"], t["flight"]["ticket"]
        path = shm / PRIVATE / f"{rid}.arrow"
        locs = _locations(server.flight_url, rid)
        assert locs[0] == server.flight_url and len(locs) == 2  # grpc first, then the file
        assert parse_file_location(locs[1]) == (path, host_id())
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # no tokens
        # the file is a plain trajectory/v1 IPC file: pyarrow reads it as the Flight stream gives it
        with flight.FlightClient(server.flight_url) as fc:
            streamed = fc.do_get(flight.Ticket(ticket.encode())).read_all()
        assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().equals(streamed)

        with TrajectoryClient(server.flight_url, transport="flight") as fc:
            over_grpc = fc.pull(ticket)
        served = _bytes_served(server)
        with TrajectoryClient(server.flight_url) as tc:
            local = tc.pull(ticket)
            chunks = list(tc.iter_chunks(rid))
            steps = list(tc.iter_steps(ticket))
            ranges = mapped_ranges(path)
            assert ranges and all(any(lo <= ch.latent.data_ptr() < hi for lo, hi in ranges) for ch in chunks)
        assert _bytes_served(server) == served  # no gRPC stream was opened
        _equal(local, over_grpc)
        assert local.latents.is_contiguous() and local.latents.data_ptr() % 64 == 0
        assert local.latents.numpy().flags.writeable
        for st in steps:
            assert torch.equal(st.latent, over_grpc.latent(st.step))

        # a client that is told another host id, and one whose file vanished, fall back to Flight
        caplog.set_level(logging.DEBUG, logger="sigmaflight.dataplane.client")
        with TrajectoryClient(server.flight_url, host="another-host") as other:
            _equal(other.pull(ticket), over_grpc)
        assert "not this host" in caplog.text
        moved = _bytes_served(server)
        assert moved > served
        hidden = path.with_name("hidden")
        os.rename(path, hidden)
        with TrajectoryClient(server.flight_url) as tc:
            _equal(tc.pull(ticket), over_grpc)
        assert "cannot read" in caplog.text and _bytes_served(server) > moved
        os.rename(hidden, path)

    finally:
        server.kill()  # kill -9
    # the restart (in this process): a stale file is removed, nothing finished is lost, the file comes back
    (shm / PRIVATE / "ghost.arrow").write_bytes(b"left by a dead process")
    with InProcessServer("--shm-dir", str(shm), "--data-dir", str(data)) as again:
        assert "removing stale shared-memory trajectory" in again.log_text
        assert not (shm / PRIVATE / "ghost.arrow").exists()
        assert parse_file_location(_locations(again.flight_url, rid)[1]) == (path, host_id())
        with TrajectoryClient(again.flight_url) as tc:
            _equal(tc.pull(ticket), over_grpc)
        with TrajectoryClient(again.flight_url, transport="flight") as fc:
            _equal(fc.pull(ticket), over_grpc)

        # release removes both files
        with again.client() as c:
            assert c.delete(f"/v1/rollouts/{rid}").status_code in (200, 204)
        assert not path.exists() and not (data / "trajectories" / f"{rid}.arrow").exists()


def test_real_server_with_tokens_makes_the_files_0600(tmp_path):
    shm = tmp_path / "shm"
    with InProcessServer("--shm-dir", str(shm), "--token", TOKEN) as server, server.client(TOKEN) as c:
        t = c.post("/v1/rollouts", json=SMALL).json()
        wait_for_status(c, t["id"], {"succeeded"})
        path = shm / PRIVATE / f"{t['id']}.arrow"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        served = _bytes_served(server, TOKEN)
        with TrajectoryClient(server.flight_url, token=TOKEN) as tc:
            assert tc.pull(t["flight"]["ticket"]).num_samples == 2
        assert _bytes_served(server, TOKEN) == served


def test_a_live_rollout_streams_over_flight_and_its_file_is_offered_once_finished(tmp_path):
    header = build_header("live", T=3, B=2)
    with ResultStore(memory_budget_bytes=1 << 30, shm_dir=tmp_path / "shm") as store, FlightDataServer(store) as srv:
        w = store.create(header)
        with TrajectoryClient(srv.locations[0]) as tc:
            assert tc.local_file("live") is None  # running: no file yet
            assert _locations(srv.locations[0], "live") == srv.locations
            ref = fill_steps(w, header)
            got = tc.pull("live")
            assert srv.metrics()["streams_served"] == 0  # read from the file
        for i, st in ref.items():
            assert torch.equal(got.latent(i), st.latent)


def fill_steps(w: TrajectoryWriter, header: TrajectoryHeader) -> dict[int, StepBatch]:
    steps = make_steps(header)
    for i in header.steps:
        w.append(steps[i])
    w.finish()
    return steps


def test_budget_counts_the_files_and_spill_moves_them_to_the_durable_copy(tmp_path):
    shm, data = tmp_path / "shm", tmp_path / "data"
    header = build_header("a", T=3, B=4, shape=(4, 16, 16))  # 4 steps x 4 x 4 KiB = 64 KiB of latents
    with ResultStore(memory_budget_bytes=100_000, data_dir=data, shm_dir=shm) as s:
        fill(s, header)
        a = s.get("a")
        assert a.shm_path == shm / PRIVATE / "a.arrow" and a.in_memory
        served = a.served_table()  # what do_get streams (made once, cached)
        assert served is not None and served[0].equals(pa.Table.from_batches(a.batches))
        again = a.served_table()
        assert again is not None and again[0] is served[0]
        st = s.stats()
        assert st["bytes_in_memory"] == a.num_bytes and st["bytes_in_shm"] == (shm / PRIVATE / "a.arrow").stat().st_size
        fill(s, build_header("b", T=3, B=4, shape=(4, 16, 16)))  # over the budget: the older one spills
        assert not (shm / PRIVATE / "a.arrow").exists() and a.shm_path is None and not a.in_memory
        assert s.file_location(a) is None and s.file_location(s.get("b")) is not None
        assert s.stats()["bytes_in_memory"] == s.get("b").num_bytes
        # served from data_dir now, same bytes; do_get's cached table went with the old batches
        assert pa.Table.from_batches(a.batches).equals(pa.ipc.open_file(str(data / "trajectories" / "a.arrow")).read_all())
        now = a.served_table()
        assert now is not None and now[0] is not served[0] and now[0].equals(served[0])
        ranges = mapped_ranges(data / "trajectories" / "a.arrow")
        col = now[0].column("latent").chunk(0).storage.values.buffers()[1]
        assert ranges and any(lo <= col.address < hi for lo, hi in ranges)
    assert not (shm / PRIVATE / "b.arrow").exists()  # a closed store leaves no shared-memory files


def test_without_data_dir_an_over_budget_store_keeps_its_files(tmp_path, caplog):
    with ResultStore(memory_budget_bytes=1000, shm_dir=tmp_path / "shm") as s:
        fill(s, build_header("a", T=3, B=4, shape=(4, 16, 16)))
        assert (tmp_path / "shm" / PRIVATE / "a.arrow").exists() and s.stats()["bytes_in_memory"] > 1000
    assert "no data_dir to spill to" in caplog.text


def test_a_second_live_store_on_the_same_directory_is_refused(tmp_path):
    with ResultStore(memory_budget_bytes=1 << 20, shm_dir=tmp_path / "shm"):
        with pytest.raises(RuntimeError, match="in use by another live server"):
            ResultStore(memory_budget_bytes=1 << 20, shm_dir=tmp_path / "shm")
    ResultStore(memory_budget_bytes=1 << 20, shm_dir=tmp_path / "shm").close()  # free again


def test_a_file_of_another_trajectory_at_the_path_is_not_read(tmp_path, caplog):
    with ResultStore(memory_budget_bytes=1 << 30, shm_dir=tmp_path / "shm") as s, FlightDataServer(s) as srv:
        ref = fill(s, build_header("x", T=2, B=2))
        other = tmp_path / "other.arrow"
        with ResultStore(memory_budget_bytes=1 << 30, shm_dir=tmp_path / "shm2") as s2:
            fill(s2, build_header("x", T=2, B=2), seed=5)  # same id, another ticket and values
            os.replace(tmp_path / "shm2" / PRIVATE / "x.arrow", other)
        os.replace(other, tmp_path / "shm" / PRIVATE / "x.arrow")
        caplog.set_level(logging.DEBUG, logger="sigmaflight.dataplane.client")
        with TrajectoryClient(srv.locations[0]) as tc:
            got = tc.pull("x")
        assert "holds another trajectory" in caplog.text and srv.metrics()["streams_served"] == 1
        assert torch.equal(got.latent(0), ref[0].latent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pull_from_the_file_reads_every_dtype_split_steps_and_long_batches_bit_exactly(tmp_path, dtype):
    # 1500 samples of 2x2x2: one batch holds more rows than one preadv takes (IOV_MAX 1024);
    # with max_batch_bytes 8 KiB a step spans several batches.
    header = build_header("wide", T=2, B=1500, shape=(2, 2, 2), dtype=dtype)
    for max_batch in (8 << 10, 8 << 20):
        shm = tmp_path / f"shm{max_batch}"
        with ResultStore(memory_budget_bytes=1 << 30, shm_dir=shm, max_batch_bytes=max_batch) as s, \
                FlightDataServer(s) as srv:
            ref = fill(s, header)
            with TrajectoryClient(srv.locations[0]) as tc:
                local = tc.local_file("wide")
                per_step = -(-1500 // max(1, max_batch // (8 * header.latent_dtype.itemsize)))  # batches a step
                assert local is not None and len(local.batches) == 3 * per_step
                local.source.close()
                got = tc.pull("wide")
            assert srv.metrics()["streams_served"] == 0
            for i, st in ref.items():
                assert torch.equal(got.latent(i), st.latent)


def _open_fds_of(path: Path) -> int:
    n = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            n += os.readlink(fd) == str(path)
        except OSError:
            pass
    return n


def test_pull_closes_its_descriptor_and_reads_the_checked_file_even_once_its_name_is_gone(tmp_path):
    header = build_header("gone", T=3, B=6, shape=(4, 8, 8))
    with ResultStore(memory_budget_bytes=1 << 30, shm_dir=tmp_path / "shm", max_batch_bytes=1 << 10) as s, \
            FlightDataServer(s) as srv:
        ref = fill(s, header)
        path = tmp_path / "shm" / PRIVATE / "gone.arrow"
        with TrajectoryClient(srv.locations[0]) as tc:
            got = tc.pull("gone")  # many small batches
            assert _open_fds_of(path) == 0  # the read's descriptor is closed, the map holds none
            local = tc.local_file("gone")
            assert local is not None and len(local.batches) > 8 and _open_fds_of(path) == 1
        for i, st in ref.items():
            assert torch.equal(got.latent(i), st.latent)
        path.unlink()  # the name goes; the descriptor that was checked still reads that file
        with local.source:
            again = Trajectory.from_batches(local.schema, local.batches, source=local.source)
        assert torch.equal(again.latents, got.latents)
        assert srv.metrics()["streams_served"] == 0


def test_a_large_read_is_spread_over_the_threads_in_equal_parts_and_a_small_one_is_not():
    # a seen bug: the pieces after the cut all landed in the first group, so two threads read in turn
    from sigmaflight.dataplane import samehost

    iov = np.zeros((301, 2), np.uint64)
    iov[:, 1] = 1 << 20  # 301 rows of 1 MiB, one preadv piece (an odd count: the cut is not at half)
    groups = samehost._spread([(0, 301)], iov, 301 << 20)
    n = samehost._read_threads()
    assert len(groups) == n
    sizes = [sum(int(iov[a:b, 1].sum()) for a, b in g) for g in groups]
    assert sum(sizes) == 301 << 20 and max(sizes) - min(sizes) <= 1 << 20
    assert samehost._spread([(0, 3)], iov[:3], 3 << 20) == [[(0, 3)]]  # under THREADS_MIN_BYTES


_TRUNCATED_PULL = r'''
import os, sys
from pathlib import Path
import pyarrow.flight as flight
from sigmaflight.dataplane.client import TrajectoryClient
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore
from tests.dataplane.helpers import build_header, fill

tmp, keep = Path(sys.argv[1]), float(sys.argv[2])


class TruncatingClient(TrajectoryClient):
    """The real client; the offered file is truncated by "another process" right after it is mapped."""

    def local_file(self, ticket_or_id):
        local = super().local_file(ticket_or_id)
        if local is not None:
            os.truncate(local.source.path, int(local.source.size * keep))
            print("truncated", flush=True)
        return local


header = build_header("cut", T=3, B=6, shape=(4, 16, 16))
with ResultStore(memory_budget_bytes=1 << 30, shm_dir=tmp / "shm") as store, FlightDataServer(store) as srv:
    fill(store, header)
    with TruncatingClient(srv.locations[0]) as client:
        try:
            traj = client.pull("cut")
            print("pulled", list(traj.latents.shape), flush=True)
        except flight.FlightError as exc:
            print("refused", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
'''


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.98])
def test_a_file_truncated_between_the_map_and_the_read_never_kills_the_client(tmp_path, keep):
    """Another process truncates the served file after the client mapped it and before pull reads
    it: the pull gives a typed Flight error (the server finds the file truncated too) or the data,
    never a read of the mapping past the file's end (SIGBUS). In a child process, so a SIGBUS is a
    failed test, not a dead pytest."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _TRUNCATED_PULL, str(tmp_path), str(keep)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc {proc.returncode} (-7 is SIGBUS)\n{proc.stdout}\n{proc.stderr[-2000:]}"
    assert "truncated" in proc.stdout
    assert "refused FlightInternalError" in proc.stdout and "truncated" in proc.stdout.split("refused", 1)[1], proc.stdout
