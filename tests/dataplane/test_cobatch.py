"""A co-batched call's steps, encoded once for the call (`CallWriters`): each member's trajectory,
read back over Flight with plain pyarrow, holds exactly its own rows of the call's tensors (with
its own sde window, log-prob and velocity choices), in buffers of its own, counted as pyarrow
counts them; a member that cannot take a step fails alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.cobatch import CallWriters
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.schema import trajectory_schema
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore

from tests.dataplane.helpers import build_header

T = 3
SHAPE = (2, 3, 3)


def members(dtype: torch.dtype) -> list[tuple[TrajectoryHeader, int, int]]:
    """Three rollouts of one call, rows [0, 2), [2, 5), [5, 6): another sde window, no log-probs,
    velocities for two, two outputs a prompt for one."""
    a = dataclasses.replace(build_header("a", T=T, B=2, shape=SHAPE, dtype=dtype, sde_steps=(0, 1)), velocities=True)
    b = dataclasses.replace(build_header("b", T=T, B=3, shape=SHAPE, dtype=dtype, log_probs=False, n_per_prompt=3),
                            seeds=(7, 8, 9))
    c = dataclasses.replace(build_header("c", T=T, B=1, shape=SHAPE, dtype=dtype), velocities=True, seeds=(2**62,))
    return [(a, 0, 2), (b, 2, 5), (c, 5, 6)]


def call_steps(dtype: torch.dtype) -> dict[int, StepBatch]:
    """The call's tensors at every step: x_i [6, ...], log-probs [6] (one NaN), velocities [6, ...]."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(T + 1):
        lp = torch.randn(6, generator=g)
        lp[1] = float("nan")
        out[i] = StepBatch(step=i, latent=torch.randn(6, *SHAPE, generator=g).to(dtype),
                           log_prob=lp if i < T else None,
                           velocity=torch.randn(6, *SHAPE, generator=g) if i < T else None)
    return out


def read(server: FlightDataServer, store: ResultStore, rollout_id: str) -> pa.Table:
    with flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as fc:
        return fc.do_get(flight.Ticket(store.ticket_for(rollout_id).encode())).read_all()


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's values as the stream stores them (bfloat16 as its uint16 bits)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.fixture
def flight_store():
    with ResultStore(memory_budget_bytes=1 << 30) as store, FlightDataServer(store) as server:
        yield store, server


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_member_holds_its_own_rows_as_if_written_alone(flight_store, dtype):
    store, server = flight_store
    ms = members(dtype)
    writers = [(store.create(h), a, e) for h, a, e in ms]
    call = CallWriters(writers, 6, max_batch_bytes=8 << 20)
    steps = call_steps(dtype)
    expected = {i: StepBatch(step=i, latent=s.latent.clone(), log_prob=None if s.log_prob is None else s.log_prob.clone(),
                             velocity=None if s.velocity is None else s.velocity.clone()) for i, s in steps.items()}
    for i in range(T + 1):
        assert call.append(steps[i], [w for w, _, _ in writers]) == []
        for t in (steps[i].latent, steps[i].log_prob, steps[i].velocity):  # the call's tensors are reused
            if t is not None:
                t.zero_()
    for w, _, _ in writers:
        w.finish()
    for h, first, end in ms:
        table = read(server, store, h.rollout_id)
        assert table.schema.equals(trajectory_schema(h), check_metadata=True)
        n = end - first
        assert table.column("step").to_pylist() == [i for i in range(T + 1) for _ in range(n)]
        assert table.column("sample").to_pylist() == list(range(n)) * (T + 1)
        assert table.column("seed").to_pylist() == list(h.seeds) * (T + 1)
        assert table.column("prompt_index").to_pylist() == [s // h.num_outputs_per_prompt for s in range(n)] * (T + 1)
        assert table.column("sigma").to_pylist() == [float(h.sigmas[i]) for i in range(T + 1) for _ in range(n)]
        assert table.column("sde").to_pylist() == [(i in h.sde_steps) if i < T else None
                                                   for i in range(T + 1) for _ in range(n)]
        for i in range(T + 1):
            rows = table.filter(pc.equal(table["step"], i))
            want = bits(expected[i].latent[first:end])
            assert np.array_equal(rows.column("latent").combine_chunks().to_numpy_ndarray(), want)
            lp = expected[i].log_prob
            want_lp = [None if lp is None or not h.log_probs or i not in h.sde_steps or lp[r].isnan() else float(lp[r])
                       for r in range(first, end)]
            assert rows.column("log_prob").to_pylist() == want_lp
            if h.velocities:
                v = rows.column("velocity").combine_chunks()
                want_v = expected[i].velocity
                if want_v is not None:
                    assert np.array_equal(v.to_numpy_ndarray(), want_v[first:end].numpy())
                else:
                    assert v.null_count == n
            else:
                assert "velocity" not in table.column_names
        entry = store.get(h.rollout_id)
        assert entry.num_bytes == sum(b.nbytes for b in entry.batches)  # counted as pyarrow counts
        for batch in entry.batches:  # its own buffers: the latents of its rows, not the call's six
            values = batch.column("latent").storage.values
            assert values.buffers()[1].size == n * np.prod(SHAPE) * values.type.bit_width // 8
            assert batch.schema.equals(trajectory_schema(h), check_metadata=True)


def test_a_member_is_split_as_it_would_be_alone(flight_store):
    """At most max_batch_bytes of latents a record batch (one sample at least), per member."""
    store, _ = flight_store
    ms = members(torch.float32)
    writers = [(store.create(h), a, e) for h, a, e in ms]
    per_sample = int(np.prod(SHAPE)) * 4
    call = CallWriters(writers, 6, max_batch_bytes=2 * per_sample)
    for i in range(T + 1):
        step = call_steps(torch.float32)[i]
        assert call.append(dataclasses.replace(step, velocity=None), [w for w, _, _ in writers]) == []
    # b: 3 rows -> 2 + 1 a step; a and c: one batch a step
    assert [len(store.get(h.rollout_id).batches) for h, _, _ in ms] == [T + 1, 2 * (T + 1), T + 1]
    assert [b.num_rows for b in store.get("b").batches[:2]] == [2, 1]


def test_a_member_that_cannot_take_a_step_fails_alone_and_a_bad_call_tensor_fails_every_one(flight_store):
    store, _ = flight_store
    ms = members(torch.float32)
    writers = [(store.create(h), a, e) for h, a, e in ms]
    call = CallWriters(writers, 6, max_batch_bytes=8 << 20)
    steps = call_steps(torch.float32)
    writers[1][0].fail("cancelled", "cancelled by the test")
    failed = call.append(steps[0], [w for w, _, _ in writers])
    assert [(w.rollout_id, type(exc)) for w, exc in failed] == [("b", RuntimeError)]
    assert [len(store.get(h).batches) for h in ("a", "c")] == [1, 1]
    bad = dataclasses.replace(steps[1], latent=steps[1].latent[:5])
    failed = call.append(bad, [writers[0][0], writers[2][0]])
    assert [w.rollout_id for w, _ in failed] == ["a", "c"]
    assert all("B=6" in str(exc) for _, exc in failed)
    assert [len(store.get(h).batches) for h in ("a", "c")] == [1, 1]  # nothing half-written


def test_a_call_of_one_rollout_stores_its_tensor_without_a_copy(flight_store):
    store, _ = flight_store
    h = build_header("alone", T=T, B=4, shape=SHAPE)
    w = store.create(h)
    call = CallWriters([(w, 0, 4)], 4, max_batch_bytes=8 << 20)
    x = torch.randn(4, *SHAPE)
    assert call.append(StepBatch(step=0, latent=x, log_prob=torch.zeros(4)), [w]) == []
    (batch,) = store.get("alone").batches
    assert batch.column("latent").storage.values.buffers()[1].address == x.data_ptr()


def test_branch_members_keep_their_parent_samples(flight_store):
    store, server = flight_store
    parent = {"rollout": "p", "step": 1, "samples": [0, 2]}
    hs = [dataclasses.replace(build_header(rid, T=T, B=2, shape=SHAPE), parent_sample=ps, prompt_index=pi, parent=parent)
          for rid, ps, pi in (("x", (0, 2), (0, 1)), ("y", (2, 2), (1, 1)))]
    writers = [(store.create(h), 2 * k, 2 * k + 2) for k, h in enumerate(hs)]
    call = CallWriters(writers, 4, max_batch_bytes=8 << 20)
    for step in call_steps(torch.float32).values():  # the call's first four rows
        rows = dataclasses.replace(step, latent=step.latent[:4], velocity=None,
                                   log_prob=None if step.log_prob is None else step.log_prob[:4])
        assert call.append(rows, [w for w, _, _ in writers]) == []
    for w, _, _ in writers:
        w.finish()
    for h in hs:
        table = read(server, store, h.rollout_id)
        assert table.schema.equals(trajectory_schema(h), check_metadata=True)
        assert table.column("parent_sample").to_pylist() == list(h.parent_sample or ()) * (T + 1)
        assert table.column("prompt_index").to_pylist() == list(h.prompt_index) * (T + 1)
