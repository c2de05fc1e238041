"""Extra streams under --data-dir (dataplane/durable.py): written whole when published, served
again after a restart, checked, and deleted with their rollout. In-process stores and a real
Flight server, read with plain pyarrow; the reference is the published table itself."""

from __future__ import annotations

import dataclasses
import logging

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore
from sigmaflight.dataplane.streams import column_tensor, stream_table
from sigmaflight.dataplane.tickets import stream_ticket

from tests.dataplane.helpers import build_header, make_steps, mapped_ranges


def _header(rollout_id: str):
    h = build_header(rollout_id, B=4, n_per_prompt=2)
    return dataclasses.replace(h, rollout={**h.rollout, "streams": ["trajectory", "outputs", "conditioning"]})


def _tables(header) -> dict[str, pa.Table]:
    g = torch.Generator().manual_seed(3)
    return {
        "conditioning": stream_table("conditioning", header, {
            "prompt_embeds": torch.randn(4, 7, 8, generator=g).to(torch.bfloat16),
            "pooled_prompt_embeds": torch.randn(4, 16, generator=g),
        }, max_batch_bytes=200),  # several batches
        "outputs": stream_table("outputs", header, {"image": torch.randint(0, 256, (4, 8, 8, 3), generator=g,
                                                                           dtype=torch.uint8).numpy()}),
    }


def _run(store: ResultStore, header, tables: dict[str, pa.Table], *, finish: bool = True):
    w = store.create(header)
    steps = make_steps(header)
    for i in header.steps:
        w.append(steps[i])
    for name, table in tables.items():
        w.publish(name, table)
    if finish:
        w.finish()
    return w


def _pull(location: str, ticket: str) -> pa.Table:
    with flight.FlightClient(location) as fc:
        return fc.do_get(flight.Ticket(ticket.encode())).read_all()


def test_streams_are_served_again_after_a_restart_and_deleted_on_release(tmp_path):
    data = tmp_path / "data"
    header = _header("s1")
    tables = _tables(header)
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store:
        w = _run(store, header, tables)
        ticket = w.ticket
        files = {n: data / "streams" / f"s1.{n}.arrow" for n in tables}
        assert all(p.is_file() for p in files.values())
        on_disk = store.stats()["bytes_on_disk"]
        assert on_disk == (data / "trajectories" / "s1.arrow").stat().st_size + sum(
            p.stat().st_size for p in files.values())
    # plain pyarrow reads a stream file as it was published
    assert pa.ipc.open_file(pa.memory_map(str(files["conditioning"]))).read_all().equals(tables["conditioning"])

    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store, FlightDataServer(store) as srv:
        assert store.stats()["bytes_in_memory"] == 0  # mapped from the files, not on the heap
        for name, table in tables.items():
            got = _pull(srv.locations[0], stream_ticket(ticket, name))
            assert got.equals(table), name
            assert got.schema.equals(table.schema, check_metadata=True)
        cond = _pull(srv.locations[0], stream_ticket(ticket, "conditioning"))
        for col in ("prompt_embeds", "pooled_prompt_embeds"):
            assert torch.equal(column_tensor(cond, col), column_tensor(tables["conditioning"], col))
        assert store.release("s1")
        assert not any(p.exists() for p in files.values())
        with pytest.raises(flight.FlightError):
            _pull(srv.locations[0], stream_ticket(ticket, "outputs"))


def test_a_corrupt_stream_file_is_not_served_and_the_trajectory_still_is(tmp_path, caplog):
    data = tmp_path / "data"
    header = _header("s2")
    tables = _tables(header)
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store:
        ticket = _run(store, header, tables).ticket
    path = data / "streams" / "s2.conditioning.arrow"
    raw = bytearray(path.read_bytes())
    needle = column_tensor(tables["conditioning"], "pooled_prompt_embeds").numpy().tobytes()[:16]
    at = bytes(raw).index(needle)
    raw[at] ^= 0x01  # one bit of one value, in place (the file stays a readable IPC file)
    path.write_bytes(bytes(raw))
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store, FlightDataServer(store) as srv:
        [why] = [r.reason for r in caplog.records if r.msg.startswith("discarding corrupt stream file")]
        assert "checksum mismatch" in why, why
        assert not path.exists() and path.with_name(path.name + ".corrupt").exists()
        with pytest.raises(flight.FlightServerError, match="not held any more"):
            _pull(srv.locations[0], stream_ticket(ticket, "conditioning"))
        assert _pull(srv.locations[0], stream_ticket(ticket, "outputs")).equals(tables["outputs"])
        assert _pull(srv.locations[0], ticket).num_rows == 4 * len(header.steps)


def test_stream_files_without_a_finished_rollout_are_removed_at_start(tmp_path, caplog):
    data = tmp_path / "data"
    header = _header("s3")
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store:
        _run(store, header, _tables(header), finish=False)  # the server stops before the rollout finishes
    assert (data / "streams" / "s3.outputs.arrow").exists()
    caplog.set_level(logging.WARNING, logger="sigmaflight.dataplane.store")
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store:
        assert store.ids() == []
    assert not list((data / "streams").iterdir())
    assert "discarding stream file" in caplog.text


def test_a_failed_rollout_leaves_no_stream_files(tmp_path):
    data = tmp_path / "data"
    header = _header("s4")
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as store:
        w = _run(store, header, _tables(header), finish=False)
        assert len(list((data / "streams").iterdir())) == 2
        w.fail("failed", "boom")
        assert not list((data / "streams").iterdir())


def test_streams_spill_with_their_rollout(tmp_path):
    data = tmp_path / "data"
    first, second = _header("s5"), _header("s6")
    tables = _tables(first)
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=data) as probe:  # how much one rollout holds
        _run(probe, first, tables)
        one = probe.stats()["bytes_in_memory"]
        extra = probe.get("s5").extra_bytes
        probe.release("s5")
    assert extra == sum(t.nbytes for t in tables.values()) > 0
    with ResultStore(memory_budget_bytes=one + one // 2, data_dir=data) as store, FlightDataServer(store) as srv:
        ticket = _run(store, first, tables).ticket
        assert store.stats()["bytes_in_memory"] == one
        _run(store, second, _tables(second))  # over the budget: the older one spills, streams included
        assert store.stats()["bytes_in_memory"] == one
        spilled = store.get("s5")
        assert not spilled.in_memory and spilled.extra_bytes == 0
        ranges = mapped_ranges(data / "streams" / "s5.conditioning.arrow")
        col = spilled.extras["conditioning"].column("prompt_embeds").chunk(0).storage.values.buffers()[1]
        assert ranges and any(lo <= col.address < hi for lo, hi in ranges)  # served from its file
        assert _pull(srv.locations[0], stream_ticket(ticket, "conditioning")).equals(tables["conditioning"])
        assert store.release("s5") and store.stats()["bytes_in_memory"] == one
