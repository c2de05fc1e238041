"""ResultStore: budget and spill, durability across restarts (kill -9), corrupt files, TTL."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
from sigmaflight.dataplane.files import read_trajectory, write_trajectory
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore, TicketNotFound

from tests.dataplane.helpers import build_header, fill, make_steps

ROOT = Path(__file__).resolve().parents[2]


def _pull(store, rollout_id):
    with FlightDataServer(store) as srv, TrajectoryClient(srv.locations[0]) as c:
        ticket = store.ticket_for(rollout_id)
        return c.pull(ticket), c.flight_client.do_get(flight.Ticket(ticket.encode())).read_all()


def test_spill_then_restart_serves_unchanged(tmp_path):
    data = tmp_path / "d"
    h1 = build_header("one", T=3, B=4, shape=(4, 16, 16))
    h2 = build_header("two", T=3, B=4, shape=(4, 16, 16), dtype=torch.bfloat16)
    with ResultStore(memory_budget_bytes=20_000, data_dir=data) as s:
        st1, st2 = fill(s, h1, seed=1), fill(s, h2, seed=2)
        stats = s.stats()
        assert stats["bytes_in_memory"] <= 20_000 and stats["bytes_on_disk"] > 0
        e1 = s.get("one")
        assert not e1.in_memory  # spilled: served memory-mapped
        assert (data / "trajectories" / "one.arrow").exists()
        tickets = {i: s.ticket_for(i) for i in ("one", "two")}
        before, table_before = _pull(s, "one")
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as s2:
        assert sorted(s2.ids()) == ["one", "two"]
        assert {i: s2.ticket_for(i) for i in ("one", "two")} == tickets
        after, table_after = _pull(s2, "one")
        two, _ = _pull(s2, "two")
    assert table_after.schema.equals(table_before.schema, check_metadata=True)
    assert table_after.equals(table_before)
    assert torch.equal(after.latents, before.latents)
    assert all(torch.equal(after.latent(i), st1[i].latent) for i in h1.steps)
    assert all(torch.equal(two.latent(i), st2[i].latent) for i in h2.steps) and two.latents.dtype == torch.bfloat16


def test_spilled_batches_are_memory_mapped(tmp_path):
    with ResultStore(memory_budget_bytes=0, data_dir=tmp_path) as s:
        fill(s, build_header("mm", B=2, shape=(4, 32, 32)))
        e = s.get("mm")
        assert not e.in_memory and s.stats()["bytes_in_memory"] == 0
        buf = e.batches[0].column("latent").storage.values.buffers()[1]
        assert not buf.is_mutable
        # The buffer lies inside a mapping of that very file (/proc/self/maps names the file).
        assert e.path is not None
        maps = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5] == str(e.path.resolve()):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                maps.append((lo, hi))
        assert any(lo <= buf.address and buf.address + buf.size <= hi for lo, hi in maps), maps


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {root!r})
    from tests.dataplane.helpers import build_header, fill, make_steps
    from sigmaflight.dataplane.store import ResultStore
    s = ResultStore(memory_budget_bytes=1 << 30, data_dir={data!r})
    fill(s, build_header("done", T=3), seed=7)
    print(s.ticket_for("done"), flush=True)
    h = build_header("half", T=3)
    w = s.create(h)
    steps = make_steps(h)
    w.append(steps[0]); w.append(steps[1])
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_finished_survives_kill_9_and_half_written_is_discarded(tmp_path, caplog):
    data = tmp_path / "d"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER.format(root=str(ROOT), data=str(data))],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ticket = proc.stdout.strip()
    assert (data / "trajectories" / "half.arrow.partial").exists()
    caplog.set_level(logging.INFO)
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as s:
        assert s.ids() == ["done"] and s.ticket_for("done") == ticket
        t, _ = _pull(s, "done")
        expected = make_steps(build_header("done", T=3), seed=7)
        assert all(torch.equal(t.latent(i), expected[i].latent) for i in range(4))
        with pytest.raises(TicketNotFound):
            s.get("half")
    assert [r.path for r in caplog.records if r.msg.startswith("discarding half-written")] == [
        str(data / "trajectories" / "half.arrow.partial")]
    assert not (data / "trajectories" / "half.arrow.partial").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_id", "not_trajectory", "no_ticket"])
def test_corrupt_files_are_discarded_with_a_log_line(tmp_path, caplog, damage):
    data = tmp_path / "d"
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as s:
        fill(s, build_header("good"))
        fill(s, build_header("bad"))
    tdir = data / "trajectories"
    bad = tdir / "bad.arrow"
    if damage == "truncate":
        raw = bad.read_bytes()
        bad.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        bad.write_bytes(os.urandom(4096))
    elif damage == "wrong_id":
        os.replace(tdir / "good.arrow", bad)
        fill_path = tdir / "good.arrow"
        schema, batches, footer = read_trajectory(bad)
        write_trajectory(fill_path, schema, batches, footer=footer)
    elif damage == "not_trajectory":
        write_trajectory(bad, pa.schema([("a", pa.int32())]), [])
    else:
        schema, batches, _ = read_trajectory(bad)
        write_trajectory(tdir / "tmp.arrow.x", schema, batches)
        os.replace(tdir / "tmp.arrow.x", bad)
    caplog.set_level(logging.INFO)
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as s:
        assert s.ids() == ["good"]
        assert Trajectory.from_file(tdir / "good.arrow").latents.shape[0] == 3
    assert [r.path for r in caplog.records if r.msg.startswith("discarding corrupt trajectory file")] == [
        str(data / "trajectories" / "bad.arrow.corrupt")]
    assert (tdir / "bad.arrow.corrupt").exists() and not bad.exists()


def test_release_deletes_file_and_frees_memory(tmp_path):
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path) as s:
        fill(s, build_header("r"))
        path = s.get("r").path
        assert path is not None and path.exists() and s.stats()["bytes_in_memory"] > 0
        ticket = s.ticket_for("r")
        assert s.release("r") is True and s.release("r") is False
        assert not path.exists()
        assert s.stats() == {"bytes_in_memory": 0, "bytes_on_disk": 0, "bytes_in_shm": 0, "entries": 0, "live": 0}
        with pytest.raises(TicketNotFound, match="released"):
            s.lookup_ticket(ticket.encode())


def test_running_rollout_cannot_be_released(store):
    w = store.create(build_header("live"))
    assert store.release("live") is False
    assert store.stats()["live"] == 1
    w.fail("failed", "x")
    assert store.release("live") is True


def test_the_store_keeps_finished_rollouts_until_released_whatever_their_age(tmp_path):
    """No TTL in the store (the jobs layer's reaper releases what expired): an old finished
    rollout is served, and found again by the restart scan however old its file is."""
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path) as s:
        steps = fill(s, build_header("old"))
        ticket = s.ticket_for("old")
        s.get("old").finished_at = 0.0  # finished in 1970
        assert s.lookup_ticket(ticket)[0].rollout_id == "old"
    path = tmp_path / "trajectories" / "old.arrow"
    os.utime(path, (0, 0))
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path) as s:
        assert s.ids() == ["old"] and s.ticket_for("old") == ticket
        with FlightDataServer(s) as srv, TrajectoryClient(srv.locations[0]) as c:
            assert torch.equal(c.pull(ticket).latent(2), steps[2].latent)
        assert s.release("old") and not path.exists()
        with pytest.raises(TicketNotFound, match="released"):
            s.lookup_ticket(ticket)


def test_writer_enforces_step_order_and_completeness(store):
    h = build_header("order", T=3)
    steps = make_steps(h)
    w = store.create(h)
    with pytest.raises(ValueError, match="out of order"):
        w.append(steps[1])
    w.append(steps[0])
    with pytest.raises(ValueError, match="never appended"):
        w.finish()
    with pytest.raises(ValueError, match="already exists"):
        store.create(h)
    with pytest.raises(ValueError, match="rollout id"):
        store.create(build_header("../etc/passwd"))
