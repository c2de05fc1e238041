"""trajectory/v1 additions: the `velocity` and `parent_sample` columns, a branch's own
prompt_index and `sigmaflight.parent`; checked with plain pyarrow against the input tensors, and a
v1 reader (Trajectory) keeps working. Also through a real store and file (data_dir round trip)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.dataplane.codec import batch_to_tensors, encode_step
from sigmaflight.dataplane.record import StepBatch
from sigmaflight.dataplane.schema import COLUMNS, header_from_schema, trajectory_schema
from sigmaflight.dataplane.store import ResultStore

from tests.dataplane.helpers import build_header

PARENT = {"rollout": "p0", "step": 1, "samples": [2, 0]}


def _branch_header(T: int = 3):
    h = build_header(T=T, B=4, n_per_prompt=2, steps=tuple(range(1, T + 1)), sde_steps=(1,))
    return dataclasses.replace(h, prompt_index=(1, 1, 0, 0), parent_sample=(2, 2, 0, 0), parent=PARENT,
                               velocities=True)


def _steps(h, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in h.steps:
        x = torch.randn((h.num_samples, *h.latent_shape), generator=g)
        v = torch.randn((h.num_samples, *h.latent_shape), generator=g) if i < h.num_steps else None
        out[i] = StepBatch(step=i, latent=x, log_prob=torch.randn(h.num_samples, generator=g), velocity=v)
    return out


def _table(h, steps, **kw):
    schema = trajectory_schema(h)
    return pa.Table.from_batches([b for i in h.steps for b in encode_step(h, steps[i], schema=schema, **kw)],
                                 schema=schema)


@pytest.mark.parametrize("max_batch_bytes", [8 << 20, 200])  # one batch per step, and split by samples
def test_velocity_parent_sample_and_prompt_index_with_plain_pyarrow(max_batch_bytes):
    h = _branch_header()
    steps = _steps(h)
    table = _table(h, steps, max_batch_bytes=max_batch_bytes)
    assert table.column_names == [*COLUMNS, "velocity", "parent_sample"]
    assert table.schema.field("velocity").type == pa.fixed_shape_tensor(pa.float32(), list(h.latent_shape))
    assert json.loads(table.schema.metadata[b"sigmaflight.parent"]) == PARENT
    rollout = json.loads(table.schema.metadata[b"sigmaflight.rollout"])
    assert rollout["prompt_index"] == [1, 1, 0, 0]
    for i in h.steps:
        rows = table.filter(pc.equal(table.column("step"), i))
        assert rows.column("prompt_index").to_pylist() == [1, 1, 0, 0]
        assert rows.column("parent_sample").to_pylist() == [2, 2, 0, 0]
        vel = rows.column("velocity")
        if i == h.num_steps:
            assert vel.null_count == 4
        else:
            assert vel.null_count == 0
            got = torch.from_numpy(np.asarray(vel.combine_chunks().to_numpy_ndarray()).copy())
            assert torch.equal(got, steps[i].velocity)
    back = header_from_schema(table.schema)
    assert back.velocities and back.parent == PARENT and back.parent_sample == (2, 2, 0, 0)
    assert back.prompt_index == (1, 1, 0, 0)
    traj = Trajectory.from_table(table)  # a v1 reader: selects its columns by name
    assert traj.prompt_index.tolist() == [1, 1, 0, 0]
    assert torch.equal(traj.latent(1), steps[1].latent)
    assert batch_to_tensors(table.to_batches()[0]).prompt_index.tolist()[:1] == [1]


def test_without_additions_the_schema_is_v1_unchanged():
    h = build_header(B=4, n_per_prompt=2)
    schema = trajectory_schema(h)
    assert schema.names == list(COLUMNS) and b"sigmaflight.parent" not in schema.metadata
    assert "prompt_index" not in json.loads(schema.metadata[b"sigmaflight.rollout"])
    rows = encode_step(h, StepBatch(step=0, latent=torch.zeros(4, *h.latent_shape), log_prob=None), schema=schema)[0]
    assert rows.column("prompt_index").to_pylist() == [0, 0, 1, 1]  # s // n


def test_bad_velocity_or_prompt_index_is_refused():
    h = _branch_header()
    with pytest.raises(ValueError, match="prompt_index must have one entry per sample"):
        trajectory_schema(dataclasses.replace(h, prompt_index=(0,)))
    bad = StepBatch(step=1, latent=torch.zeros(4, *h.latent_shape), log_prob=None, velocity=torch.zeros(4, 1))
    with pytest.raises(ValueError, match="velocity must be"):
        encode_step(h, bad)


def test_velocity_column_survives_the_stores_file(tmp_path):
    h = _branch_header()
    steps = _steps(h, seed=3)
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path) as store:
        w = store.create(h)
        for i in h.steps:
            w.append(steps[i])
        w.finish()
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path) as store:  # restored from the file
        batches = store.get(h.rollout_id).snapshot()
        assert batches is not None
        table = pa.Table.from_batches(batches)
    rows = table.filter(pc.equal(table.column("step"), 2))
    got = torch.from_numpy(np.asarray(rows.column("velocity").combine_chunks().to_numpy_ndarray()).copy())
    assert torch.equal(got, steps[2].velocity)
    assert header_from_schema(table.schema).parent_sample == (2, 2, 0, 0)


def test_extra_streams_carry_the_headers_prompt_index():
    from sigmaflight.dataplane.streams import CONDITIONING, stream_table

    h = _branch_header()
    table = stream_table(CONDITIONING, h, {"prompt_embeds": torch.zeros(4, 2, 3)})
    assert table.column("prompt_index").to_pylist() == [1, 1, 0, 0]  # not s // n = [0, 0, 1, 1]
