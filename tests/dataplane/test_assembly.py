"""A Trajectory assembled from a Flight stream, a same-host file, a file and a table
equals what plain pyarrow reads from the same stream and file (latents and log-probs, bit for
bit), for step-filtered streams, branch rollouts (steps k..T), bf16 latents and batches split in
two; a missing, repeated or unknown step is a clear error.

The references are built here from plain pyarrow tables with numpy indexing, not by sigmaflight."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
from sigmaflight.dataplane.codec import encode_step
from sigmaflight.dataplane.files import CorruptTrajectoryFile, write_trajectory
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.schema import trajectory_schema
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore

from tests.dataplane.helpers import build_header, fill, make_steps


def _branch(header: TrajectoryHeader, k: int) -> TrajectoryHeader:
    """A branch rollout from step k of parent samples [1, 0] with 2 branches each: steps k..T."""
    return dataclasses.replace(
        header, steps=tuple(range(k, header.num_steps + 1)), sde_steps=tuple(range(k, header.num_steps)),
        seeds=(7, 8, 9, 10), num_outputs_per_prompt=2, prompt_index=(1, 1, 0, 0), parent_sample=(1, 1, 0, 0),
        parent={"rollout": "parent", "step": k, "samples": [1, 0]},
    )


def _reference(table: pa.Table, steps: tuple[int, ...], b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents [B, K, ...] as raw integer bits, log-probs [B, T] with NaN) from plain pyarrow."""
    step = table.column("step").to_numpy()
    sample = table.column("sample").to_numpy()
    col = table.column("latent").combine_chunks()
    values = col.storage.flatten().to_numpy(zero_copy_only=False)
    bits = values.view({2: np.int16, 4: np.int32}[values.dtype.itemsize])  # bf16 travels as uint16
    x = bits.reshape(len(table), *col.type.shape)
    k = np.searchsorted(np.asarray(steps), step)
    lat = np.zeros((b, len(steps), *col.type.shape), bits.dtype)
    lat[sample, k] = x
    lp = np.full((b, t), np.nan, np.float32)
    has = step < t
    lp[sample[has], step[has]] = table.column("log_prob").to_numpy(zero_copy_only=False)[has]
    return torch.from_numpy(lat), torch.from_numpy(lp)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_equal(traj: Trajectory, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    lat, lp = want
    assert torch.equal(_bits(traj.latents), lat)
    assert torch.equal(torch.isnan(traj.log_probs), torch.isnan(lp))
    assert torch.equal(traj.log_probs.nan_to_num(0.0), lp.nan_to_num(0.0))


CASES = {
    "step-filtered": lambda dtype: build_header("f", T=5, B=3, steps=(0, 2, 3, 5), sde_steps=(0, 2, 4), dtype=dtype),
    "branch": lambda dtype: _branch(build_header("br", T=5, B=4, dtype=dtype), 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("max_batch", [1 << 20, 40], ids=["one-batch-a-step", "split-steps"])
def test_every_way_in_equals_plain_pyarrow(tmp_path: Path, case: str, dtype: torch.dtype, max_batch: int) -> None:
    header = CASES[case](dtype)
    shm, data = tmp_path / "shm", tmp_path / "data"
    with ResultStore(memory_budget_bytes=1 << 30, shm_dir=shm, data_dir=data, max_batch_bytes=max_batch) as store, \
            FlightDataServer(store) as srv:
        fill(store, header)
        ticket = store.ticket_for(header.rollout_id)
        with flight.FlightClient(srv.locations[0]) as plain:
            streamed = plain.do_get(flight.Ticket(ticket.encode())).read_all()
        private = shm / f"sigmaflight-{os.geteuid()}"  # the store's files live in <shm-dir>/sigmaflight-<uid>/
        file = pa.ipc.open_file(pa.memory_map(str(private / f"{header.rollout_id}.arrow"))).read_all()
        assert file.equals(streamed)
        want = _reference(streamed, header.steps, header.num_samples, header.num_steps)
        with TrajectoryClient(srv.locations[0], transport="flight") as over_grpc:
            _assert_equal(over_grpc.pull(ticket), want)
        served = srv.metrics()["streams_served"]
        with TrajectoryClient(srv.locations[0]) as same_host:
            local = same_host.pull(ticket)
            into = torch.full_like(local.latents, 3.0)
            assert same_host.pull(ticket, out=into).latents is into
        assert srv.metrics()["streams_served"] == served  # both read the file, no stream
        _assert_equal(local, want)
        _assert_equal(Trajectory(local.header, into, local.log_probs, {}, local.schema), want)
        _assert_equal(Trajectory.from_file(data / "trajectories" / f"{header.rollout_id}.arrow"), want)
        _assert_equal(Trajectory.from_table(file), want)
        if header.parent_sample is not None:
            assert local.parent_sample is not None and local.parent_sample.tolist() == [1, 1, 0, 0]
            assert local.steps.tolist() == [2, 3, 4, 5] and local.prompt_index.tolist() == [1, 1, 0, 0]


class SplitServer(flight.FlightServerBase):
    """Plain pyarrow: streams `table` with every record batch sent as two (its halves)."""

    def __init__(self, table: pa.Table) -> None:
        super().__init__("grpc+tcp://127.0.0.1:0")
        halves = []
        for b in table.to_batches():
            n = b.num_rows // 2
            halves += [b.slice(0, n), b.slice(n)] if n else [b]
        self.table = pa.Table.from_batches(halves, schema=table.schema)

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        return flight.RecordBatchStream(self.table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_stream_whose_batches_arrive_split_in_two(dtype: torch.dtype) -> None:
    header = build_header("split", T=3, B=5, steps=(1, 2, 3), dtype=dtype)
    schema = trajectory_schema(header)
    table = pa.Table.from_batches(
        [b for st in make_steps(header).values() for b in encode_step(header, st, schema=schema)], schema=schema)
    want = _reference(table, header.steps, header.num_samples, header.num_steps)
    with SplitServer(table) as srv:
        assert srv.table.num_rows == table.num_rows and len(srv.table.to_batches()) == 2 * len(table.to_batches())
        with TrajectoryClient(f"grpc+tcp://127.0.0.1:{srv.port}", transport="flight") as c:
            _assert_equal(c.pull("split"), want)
        _assert_equal(Trajectory.from_table(srv.table), want)  # slices: buffers with offsets, in process


def _table(header: TrajectoryHeader, keep: Any = None) -> pa.Table:
    schema = trajectory_schema(header)
    steps = make_steps(header)
    batches = [b for i, st in steps.items() if keep is None or keep(i) for b in encode_step(header, st, schema=schema)]
    return pa.Table.from_batches(batches, schema=schema)


def test_rows_in_another_order_are_put_in_place() -> None:
    header = build_header("shuffled", T=3, B=4)
    table = _table(header)
    shuffled = table.take(pa.array(np.random.default_rng(3).permutation(table.num_rows)))
    _assert_equal(Trajectory.from_table(shuffled), _reference(table, header.steps, 4, 3))


def test_a_file_or_stream_with_a_missing_step_is_a_clear_error(tmp_path: Path) -> None:
    header = build_header("holes", T=4, B=2)
    table = _table(header, keep=lambda i: i != 2)
    with pytest.raises(ValueError, match=r"trajectory holes is incomplete: steps \[2\] missing"):
        Trajectory.from_table(table)
    path = write_trajectory(tmp_path / "holes.arrow", table.schema, table.to_batches())
    with pytest.raises(CorruptTrajectoryFile, match=r"8 rows, expected 10 \(B x steps\); step 2: 0 rows of 2$"):
        Trajectory.from_file(path)  # the step named, as the stream's check names it


def test_a_repeated_or_unlisted_step_is_a_clear_error() -> None:
    header = build_header("twice", T=3, B=2, steps=(0, 1, 3))
    table = _table(header)
    with pytest.raises(ValueError, match=r"step 1 of sample 0 appears more than once"):
        Trajectory.from_table(pa.concat_tables([table, table.slice(2, 1)]))
    other = _table(build_header("twice", T=3, B=2, steps=(0, 2, 3)))
    with pytest.raises(ValueError, match=r"stream holds step 2, not listed in sigmaflight.steps"):
        Trajectory.from_table(pa.Table.from_batches(other.to_batches(), schema=table.schema))


def _velocity_reference(table: pa.Table, steps: tuple[int, ...], b: int) -> np.ndarray:
    """The velocity column [B, K, ...] float32 from plain pyarrow, NaN where it is null (i = T)."""
    col = table.column("velocity").combine_chunks()
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    out = np.full((b, len(steps), *col.type.shape), np.nan, np.float32)
    k = np.searchsorted(np.asarray(steps), table.column("step").to_numpy())
    sample = table.column("sample").to_numpy()
    rows = np.asarray(col.filter(pa.array(valid)).to_numpy_ndarray())
    out[sample[valid], k[valid]] = rows
    return out


@pytest.mark.parametrize("max_batch", [1 << 20, 40], ids=["one-batch-a-step", "split-steps"])
def test_velocities_are_assembled_like_the_latents(tmp_path: Path, max_batch: int) -> None:
    header = dataclasses.replace(build_header("vel", T=4, B=3, steps=(0, 1, 3, 4)), velocities=True)
    g = torch.Generator().manual_seed(5)
    steps = {i: dataclasses.replace(st, velocity=None if i == header.num_steps else
                                    torch.randn((3, *header.latent_shape), generator=g))
             for i, st in make_steps(header).items()}
    shm, data = tmp_path / "shm", tmp_path / "data"
    with ResultStore(memory_budget_bytes=1 << 30, shm_dir=shm, data_dir=data, max_batch_bytes=max_batch) as store, \
            FlightDataServer(store) as srv:
        w = store.create(header)
        for i in header.steps:
            w.append(steps[i])
        w.finish()
        ticket = store.ticket_for(header.rollout_id)
        with flight.FlightClient(srv.locations[0]) as plain:
            streamed = plain.do_get(flight.Ticket(ticket.encode())).read_all()
        want = torch.from_numpy(_velocity_reference(streamed, header.steps, 3))
        with TrajectoryClient(srv.locations[0], transport="flight") as over_grpc, \
                TrajectoryClient(srv.locations[0]) as same_host:
            pulled = [over_grpc.pull(ticket)]
            served = srv.metrics()["streams_served"]
            pulled.append(same_host.pull(ticket))
            assert srv.metrics()["streams_served"] == served  # read from the shared-memory file, no stream
    shuffled = streamed.take(pa.array(np.random.default_rng(1).permutation(streamed.num_rows)))
    for traj in [*pulled, Trajectory.from_table(streamed), Trajectory.from_table(shuffled),
                 Trajectory.from_file(data / "trajectories" / "vel.arrow")]:
        assert traj.velocities is not None and traj.velocities.dtype == torch.float32
        assert torch.equal(traj.velocities.nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.isnan(traj.velocity(4)).all() and not torch.isnan(traj.velocities[:, :3]).any()
        recorded = steps[3].velocity
        assert recorded is not None and torch.equal(traj.velocity(3), recorded)  # what the rollout recorded, bit for bit
    with pytest.raises(KeyError, match="step 2 is not in this trajectory"):
        pulled[0].velocity(2)
    with pytest.raises(ValueError, match=r'has no velocity column; ask the rollout for return=\{"velocities": True\}'):
        Trajectory.from_table(_table(build_header("plain", T=2, B=1))).velocity(0)
