"""A trajectory .arrow file is readable by plain pyarrow, polars and DuckDB (no sigmaflight)."""

import json

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.ipc as ipc
import torch
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.dataplane.codec import encode_step
from sigmaflight.dataplane.files import read_table, write_trajectory
from sigmaflight.dataplane.schema import trajectory_schema

from tests.dataplane.helpers import build_header, make_steps


def _write(tmp_path, dtype=torch.float32):
    h = build_header("file", T=3, B=2, dtype=dtype, sde_steps=(0, 2))
    steps = make_steps(h)
    schema = trajectory_schema(h)
    batches = [b for i in h.steps for b in encode_step(h, steps[i], schema=schema)]
    path = write_trajectory(tmp_path / "file.arrow", schema, batches)
    return h, steps, path


def test_plain_pyarrow_reads_the_file(tmp_path):
    h, steps, path = _write(tmp_path)
    with pa.memory_map(str(path)) as src:
        table = ipc.open_file(src).read_all()
    assert table.column_names == ["step", "sample", "prompt_index", "seed", "timestep", "sigma", "sigma_next", "sde", "log_prob", "latent"]
    assert table.column("step").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert json.loads(table.schema.metadata[b"sigmaflight.format"]) == "trajectory/v1"
    sig = np.asarray(json.loads(table.schema.metadata[b"sigmaflight.sigmas"]), dtype=np.float32)
    assert np.array_equal(sig.view(np.uint32), h.sigmas.numpy().view(np.uint32))
    lat = table.column("latent").combine_chunks().to_numpy_ndarray()  # [rows, C, H, W]
    assert lat.shape == (8, 2, 3, 3)
    assert np.array_equal(lat[2:4], steps[1].latent.numpy())
    assert table.column("log_prob").to_pylist()[2:4] == [None, None]  # deterministic transition 1


def test_polars_reads_the_file(tmp_path):
    h, steps, path = _write(tmp_path)
    df = pl.read_ipc(path)
    assert df.columns[:9] == ["step", "sample", "prompt_index", "seed", "timestep", "sigma", "sigma_next", "sde", "log_prob"]
    assert df["seed"].to_list() == [1000, 1001] * 4
    last = df.filter(pl.col("step") == 3)
    assert last["sigma_next"].null_count() == 2 and last["sde"].null_count() == 2
    first = df.filter(pl.col("step") == 0)
    assert first["log_prob"].to_list() == steps[0].log_prob.tolist()
    lat = np.asarray(df.filter(pl.col("step") == 2)["latent"].to_list(), dtype=np.float32)
    assert np.array_equal(lat.reshape(2, 2, 3, 3), steps[2].latent.numpy())  # polars: flat fixed-size lists


def test_duckdb_reads_the_file(tmp_path):
    h, steps, path = _write(tmp_path)
    con = duckdb.connect()
    # The file itself (an Arrow dataset over the IPC file, scanned by DuckDB at query time), latents included.
    con.register("traj", pads.dataset(str(path), format="ipc"))
    lat = con.execute("SELECT latent FROM traj WHERE step = 1 ORDER BY sample").fetchall()
    assert np.array_equal(np.asarray([r[0] for r in lat], dtype=np.float32), steps[1].latent.numpy().reshape(2, -1))
    rows = con.execute("SELECT step, count(*), min(sigma), any_value(sde) FROM traj GROUP BY step ORDER BY step").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    assert rows[1][2] == float(h.sigmas[1]) and rows[3][3] is None
    lp = con.execute("SELECT log_prob FROM traj WHERE step = 2 ORDER BY sample").fetchall()
    assert [r[0] for r in lp] == steps[2].log_prob.tolist()


def test_bf16_file_roundtrips_through_trajectory(tmp_path):
    h, steps, path = _write(tmp_path, torch.bfloat16)
    t = Trajectory.from_file(path)
    assert t.latents.dtype == torch.bfloat16
    assert all(torch.equal(t.latent(i), steps[i].latent) for i in h.steps)
    table = read_table(path)
    assert table.schema.field("latent").metadata == {b"sigmaflight.dtype": b"bfloat16"}
