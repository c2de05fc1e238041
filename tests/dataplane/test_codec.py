import dataclasses
import gc

import numpy as np
import pyarrow as pa
import pytest
import torch
from sigmaflight.dataplane.codec import (
    HeaderColumns,
    batch_to_tensors,
    encode_step,
    encode_step_sized,
    latent_view,
)
from sigmaflight.dataplane.record import StepBatch
from sigmaflight.dataplane.schema import trajectory_schema

from tests.dataplane.helpers import build_header

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _values_address(batch: pa.RecordBatch) -> int:
    col = batch.column("latent")
    return col.storage.values.buffers()[1].address + col.storage.values.offset * col.storage.values.type.bit_width // 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_is_zero_copy_by_address(dtype):
    h = build_header(dtype=dtype, B=4)
    x = torch.randn(4, 2, 3, 3).to(dtype)
    (batch,) = encode_step(h, StepBatch(step=0, latent=x, log_prob=None))
    assert _values_address(batch) == x.data_ptr()


def test_split_batches_point_into_the_tensor_and_keep_it_alive():
    h = build_header(B=8, shape=(4, 8, 8))
    x = torch.randn(8, 4, 8, 8)
    expected = x.clone()
    per_sample = 4 * 8 * 8 * 4
    batches = encode_step(h, StepBatch(step=1, latent=x, log_prob=None), max_batch_bytes=3 * per_sample)
    assert [b.num_rows for b in batches] == [3, 3, 2]
    assert [_values_address(b) for b in batches] == [x[k].data_ptr() for k in (0, 3, 6)]
    del x
    gc.collect()
    got = torch.cat([batch_to_tensors(b).latent for b in batches])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("velocities", [False, True])
@pytest.mark.parametrize("log_probs", ["none", "finite", "with_nan", "float64"])
def test_each_batch_s_counted_bytes_are_pyarrow_s_own_nbytes(dtype, velocities, log_probs):
    """The store budgets (and `result.num_bytes` reports) the bytes `encode_step_sized` counts
    without asking pyarrow: every step, split or whole, with nulls, equals `RecordBatch.nbytes`."""
    h = dataclasses.replace(build_header(dtype=dtype, B=5, T=3, sde_steps=(0, 2), log_probs=log_probs != "none"),
                            velocities=velocities, parent_sample=(0, 0, 1, 1, 2), prompt_index=(0, 0, 1, 1, 2))
    schema, columns = trajectory_schema(h), HeaderColumns(h)
    per_sample = 2 * 3 * 3 * (torch.empty(0, dtype=dtype).element_size() + 4 * velocities)
    counted = []
    for max_batch_bytes in (2 * per_sample, 1 << 20):  # split in three (the last step maybe in two), then whole
        for i in h.steps:
            lp = torch.randn(5, dtype=torch.float64 if log_probs == "float64" else torch.float32)
            if log_probs == "with_nan":
                lp[1] = float("nan")
            v = torch.randn(5, 2, 3, 3) if velocities and i < 3 else None
            step = StepBatch(step=i, latent=torch.randn(5, 2, 3, 3).to(dtype), log_prob=lp, velocity=v)
            sized = encode_step_sized(h, step, max_batch_bytes=max_batch_bytes, schema=schema, columns=columns)
            counted.append([(n, b.nbytes) for b, n in sized])
    assert max(map(len, counted)) == 3 and min(map(len, counted)) == 1  # split steps and whole ones
    assert all(n == nbytes for step in counted for n, nbytes in step), counted


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_is_zero_copy_and_dtype_restored(dtype):
    h = build_header(dtype=dtype)
    x = torch.randn(3, 2, 3, 3).to(dtype)
    (batch,) = encode_step(h, StepBatch(step=2, latent=x, log_prob=None))
    st = batch_to_tensors(batch)
    assert st.latent.dtype == dtype
    assert st.latent.data_ptr() == x.data_ptr()
    assert torch.equal(st.latent, x)
    before = x.clone()  # st.latent is a view of x: compare with a copy taken before
    c = batch_to_tensors(batch, copy=True)
    assert c.latent.data_ptr() != x.data_ptr() and c.latent.data_ptr() % 64 == 0
    c.latent.add_(1)  # writable
    assert torch.equal(c.latent, before + 1)  # the add landed in the copy
    assert torch.equal(x, before) and torch.equal(st.latent, before)  # and not in the encoded batch


def test_decode_misaligned_readonly_buffer():
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    raw = b"\x00" + x.numpy().tobytes()
    buf = pa.py_buffer(raw).slice(1)  # address % 4 != 0, read-only
    assert buf.address % 4 != 0
    values = pa.Array.from_buffers(pa.float32(), 8, [None, buf])
    col = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), [4]), pa.FixedSizeListArray.from_arrays(values, 4))
    view = latent_view(col, torch.float32)
    assert view.data_ptr() == buf.address
    assert torch.equal(view, x)
    copied = latent_view(col, torch.float32, copy=True)
    assert copied.data_ptr() % 64 == 0 and torch.equal(copied, x)


def test_columns_of_a_step():
    h = build_header(T=3, B=4, n_per_prompt=2, sde_steps=(1,))
    s = trajectory_schema(h)
    lp = torch.tensor([0.5, float("nan"), -1.0, 2.0])
    x = torch.zeros(4, 2, 3, 3)
    (b1,) = encode_step(h, StepBatch(step=1, latent=x, log_prob=lp))
    assert b1.schema.equals(s, check_metadata=True)
    d = b1.to_pydict()
    assert d["step"] == [1] * 4 and d["sample"] == [0, 1, 2, 3] and d["prompt_index"] == [0, 0, 1, 1]
    assert d["seed"] == [1000, 1001, 1002, 1003]
    assert d["sigma"] == [float(np.float32(h.sigmas[1]))] * 4
    assert d["sigma_next"] == [float(np.float32(h.sigmas[2]))] * 4
    assert d["timestep"] == [float(np.float32(h.timesteps[1]))] * 4
    assert d["sde"] == [True] * 4
    assert d["log_prob"] == [0.5, None, -1.0, 2.0]
    (b0,) = encode_step(h, StepBatch(step=0, latent=x, log_prob=lp))  # deterministic transition
    assert b0.column("sde").to_pylist() == [False] * 4 and b0.column("log_prob").null_count == 4
    (b3,) = encode_step(h, StepBatch(step=3, latent=x, log_prob=lp))  # i = T
    for name in ("timestep", "sigma_next", "sde", "log_prob"):
        assert b3.column(name).null_count == 4, name
    assert b3.column("sigma").to_pylist() == [0.0] * 4


def test_encode_rejects_wrong_inputs():
    h = build_header(B=3)
    with pytest.raises(ValueError):
        encode_step(h, StepBatch(step=9, latent=torch.zeros(3, 2, 3, 3), log_prob=None))
    with pytest.raises(ValueError):
        encode_step(h, StepBatch(step=0, latent=torch.zeros(2, 2, 3, 3), log_prob=None))
    with pytest.raises(ValueError):
        encode_step(h, StepBatch(step=0, latent=torch.zeros(3, 2, 3, 3, dtype=torch.float16), log_prob=None))
