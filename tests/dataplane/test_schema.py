import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.dataplane.codec import encode_step
from sigmaflight.dataplane.schema import (
    COLUMNS,
    FORMAT,
    exact_float32,
    float32_list,
    header_from_schema,
    trajectory_schema,
)

from tests.dataplane.helpers import build_header, make_steps


@pytest.mark.parametrize(
    ("dtype", "value_type", "name"),
    [(torch.float32, pa.float32(), "float32"), (torch.float16, pa.float16(), "float16"), (torch.bfloat16, pa.uint16(), "bfloat16")],
)
def test_schema_columns_types_nullability(dtype, value_type, name):
    s = trajectory_schema(build_header(dtype=dtype, shape=(4, 2, 8, 8)))
    assert tuple(s.names) == COLUMNS
    types = {f.name: f.type for f in s}
    assert types["step"] == pa.int32() and types["sample"] == pa.int32() and types["prompt_index"] == pa.int32()
    assert types["seed"] == pa.int64()
    assert types["timestep"] == types["sigma"] == types["sigma_next"] == types["log_prob"] == pa.float32()
    assert types["sde"] == pa.bool_()
    assert types["latent"] == pa.fixed_shape_tensor(value_type, [4, 2, 8, 8])
    nullable = {f.name for f in s if f.nullable}
    assert nullable == {"timestep", "sigma_next", "sde", "log_prob"}
    assert s.field("latent").metadata == {b"sigmaflight.dtype": name.encode()}


def test_schema_metadata_is_json():
    h = build_header(T=3, steps=(0, 2, 3), sde_steps=(1, 2))
    meta = {k.decode(): json.loads(v) for k, v in trajectory_schema(h).metadata.items()}
    assert meta["sigmaflight.format"] == FORMAT
    assert meta["sigmaflight.steps"] == [0, 2, 3]
    assert meta["sigmaflight.sde_steps"] == [1, 2]
    assert len(meta["sigmaflight.sigmas"]) == 4 and len(meta["sigmaflight.timesteps"]) == 3
    r = meta["sigmaflight.rollout"]
    assert r["id"] == "r1" and r["seeds"] == [1000, 1001, 1002] and r["num_samples"] == 3
    assert r["num_outputs_per_prompt"] == 1 and r["model"]["id"] == "tiny"


TRICKY = [0.1, 1 / 3, 0.00893, 1e-45, 3.4028235e38, -0.0, 0.0, 0.99999994, 1.0000001, 2.0**-126, 0.009]


@pytest.mark.parametrize("v", TRICKY)
def test_exact_float32_tricky(v):
    f = np.float32(v)
    out = exact_float32(f)
    assert np.float32(json.loads(json.dumps(out))).view(np.uint32) == f.view(np.uint32)
    assert len(repr(out)) <= len(repr(float(f)))  # never longer than the float64 spelling


def test_exact_float32_is_short():
    assert exact_float32(np.float32(0.1)) == 0.1
    assert json.dumps(float32_list(torch.tensor([0.1, 0.2, 1 / 3]))) == "[0.1, 0.2, 0.33333334]"


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 0x7F7FFFFF))
def test_exact_float32_roundtrips_any_bits(bits):
    f = np.uint32(bits).view(np.float32)
    assert np.float32(json.loads(json.dumps(exact_float32(f)))).view(np.uint32) == bits


def test_header_from_schema_inverse():
    sig = torch.tensor([1.0, 0.97, 0.5, 0.00893, 0.0], dtype=torch.float32)
    h = build_header(T=4, sigmas=sig, dtype=torch.bfloat16, steps=(1, 4), sde_steps=(2,), log_probs=False, n_per_prompt=3, B=6)
    back = header_from_schema(trajectory_schema(h))
    assert torch.equal(back.sigmas.view(torch.int32), h.sigmas.view(torch.int32))
    assert torch.equal(back.timesteps.view(torch.int32), h.timesteps.view(torch.int32))
    assert (back.rollout_id, back.steps, back.sde_steps, back.seeds) == (h.rollout_id, h.steps, h.sde_steps, h.seeds)
    assert (back.num_outputs_per_prompt, back.latent_shape, back.latent_dtype, back.log_probs) == (3, (2, 3, 3), torch.bfloat16, False)
    assert back.rollout["model"] == {"id": "tiny", "dtype": "torch.bfloat16"}


@pytest.mark.parametrize(
    "kw",
    [dict(steps=(2, 1)), dict(steps=(0, 9)), dict(sde_steps=(4,)), dict(B=3, n_per_prompt=2), dict(dtype=torch.float64)],
)
def test_invalid_headers_rejected(kw):
    with pytest.raises(ValueError):
        trajectory_schema(build_header(**kw))


def test_not_a_trajectory_schema():
    with pytest.raises(ValueError, match="trajectory/v1"):
        header_from_schema(pa.schema([("a", pa.int32())]))


def test_v1_readers_ignore_columns_and_keys_they_do_not_know():
    """Contract evolution: adding a column or a metadata key keeps "trajectory/v1" readable."""

    h = build_header(T=2, B=2)
    steps = make_steps(h)
    batches = [b for i in h.steps for b in encode_step(h, steps[i])]
    table = pa.Table.from_batches(batches)
    table = table.append_column("reward", pa.array([0.5] * table.num_rows, pa.float32()))
    table = table.replace_schema_metadata({**table.schema.metadata, b"sigmaflight.future_key": b'{"x": 1}'})
    traj = Trajectory.from_table(table)
    assert torch.equal(traj.sigmas, h.sigmas) and traj.steps.tolist() == [0, 1, 2]
    assert torch.equal(traj.latent(1), steps[1].latent)
    assert header_from_schema(table.schema).sde_steps == h.sde_steps
