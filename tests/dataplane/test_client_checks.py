"""What the trajectory client checks when it assembles a pull: a stream that breaks the contract
(docs/dataplane.md, "What the client checks") is a ValueError naming the field, never a
trajectory with other values in it.

The streams come from a small Flight server of this file's own (pyarrow's FlightServerBase on
port 0, as pyarrow's own tests do) that serves whatever schema and batches a test crafts; they
start from what sigmaflight's encoder writes and change one thing each with plain pyarrow."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
from sigmaflight.dataplane.client import TrajectoryClient
from sigmaflight.dataplane.codec import encode_step
from sigmaflight.dataplane.schema import trajectory_schema

from tests.dataplane.helpers import build_header, make_steps

Craft = tuple[pa.Schema, list[pa.RecordBatch]]


class CraftedServer(flight.FlightServerBase):
    """Serves ``schema`` and ``batches`` as they are to every do_get, whatever the ticket."""

    def __init__(self, schema: pa.Schema, batches: list[pa.RecordBatch]) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.schema, self.batches = schema, batches

    def do_get(self, context: flight.ServerCallContext, ticket: flight.Ticket) -> flight.FlightDataStream:
        return flight.GeneratorStream(self.schema, iter(self.batches))


def _good() -> Craft:
    header = build_header("crafted", T=4, B=3, shape=(2, 3))
    steps = make_steps(header, seed=3)
    schema = trajectory_schema(header)
    return schema, [b for i in header.steps for b in encode_step(header, steps[i], schema=schema)]


def _relabel(schema: pa.Schema, batches: list[pa.RecordBatch]) -> Craft:
    return schema, [pa.RecordBatch.from_arrays(b.columns, schema=schema) for b in batches]


def _with_meta(craft: Craft, **values: Any) -> Craft:
    schema, batches = craft
    meta = dict(schema.metadata)
    for key, value in values.items():
        meta[f"sigmaflight.{key}".encode()] = json.dumps(value).encode()
    return _relabel(schema.with_metadata(meta), batches)


def _meta(craft: Craft, key: str) -> Any:
    return json.loads(craft[0].metadata[f"sigmaflight.{key}".encode()])


def _replace_column(craft: Craft, name: str, field: pa.Field, make: Callable[[pa.RecordBatch], pa.Array]) -> Craft:
    schema, batches = craft
    i = schema.get_field_index(name)
    new_schema = schema.set(i, field)
    return new_schema, [pa.RecordBatch.from_arrays([make(b) if j == i else c for j, c in enumerate(b.columns)],
                                                   schema=new_schema) for b in batches]


def _latent_field(craft: Craft, value_type: pa.DataType, label: str) -> pa.Field:
    shape = list(craft[0].field("latent").type.shape)
    return pa.field("latent", pa.fixed_shape_tensor(value_type, shape), nullable=False,
                    metadata={b"sigmaflight.dtype": label.encode()})


def _latents_as(craft: Craft, value_type: pa.DataType, label: str) -> Craft:
    """The latent column's float32 values cast to ``value_type`` (float64 keeps them exact),
    labelled ``label`` in its field metadata."""
    field = _latent_field(craft, value_type, label)

    def make(b: pa.RecordBatch) -> pa.Array:
        storage = b.column("latent").storage
        values = storage.values.cast(value_type)
        return pa.ExtensionArray.from_storage(field.type, pa.FixedSizeListArray.from_arrays(values, storage.type.list_size))

    return _replace_column(craft, "latent", field, make)


def _relabel_dtype(craft: Craft, label: str) -> Craft:
    """The same float32 bytes, their field metadata saying ``label``."""
    schema, batches = craft
    field = schema.field("latent").with_metadata({b"sigmaflight.dtype": label.encode()})
    return _relabel(schema.set(schema.get_field_index("latent"), field), batches)


def _step_twice(craft: Craft, step: int) -> Craft:
    """``sigmaflight.steps`` lists ``step`` twice and the stream carries its batch twice."""
    steps = _meta(craft, "steps")
    schema, batches = _with_meta(craft, steps=sorted([*steps, step]))
    twice = [c for b in batches for c in ([b, b] if b.column("step")[0].as_py() == step else [b])]
    return schema, twice


def _seed_changed(craft: Craft) -> Craft:
    def make(b: pa.RecordBatch) -> pa.Array:
        seeds = b.column("seed").to_numpy().copy()
        if b.column("step")[0].as_py() == 2:
            seeds[1] += 1
        return pa.array(seeds)

    return _replace_column(craft, "seed", craft[0].field("seed"), make)


def _null_latent(craft: Craft) -> Craft:
    """Sample 1's latent at step 3 null (validity bit off), in a column the schema says is not nullable."""
    field = craft[0].field("latent")

    def make(b: pa.RecordBatch) -> pa.Array:
        ext = b.column("latent")
        if b.column("step")[0].as_py() != 3:
            return ext
        mask = pa.array([j == 1 for j in range(len(ext))])
        storage = pa.FixedSizeListArray.from_arrays(ext.storage.values, ext.type.storage_type.list_size, mask=mask)
        return pa.ExtensionArray.from_storage(field.type, storage)

    return _replace_column(craft, "latent", field, make)


@pytest.fixture
def serve() -> Iterator[Callable[[Craft], TrajectoryClient]]:
    """serve(craft) -> a real TrajectoryClient streaming from a CraftedServer of that craft."""
    servers: list[CraftedServer] = []
    clients: list[TrajectoryClient] = []

    def start(craft: Craft) -> TrajectoryClient:
        servers.append(CraftedServer(*craft))
        clients.append(TrajectoryClient(f"grpc+tcp://127.0.0.1:{servers[-1].port}", transport="flight"))
        return clients[-1]

    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.shutdown()


def test_the_crafted_server_serves_a_good_stream_the_client_takes(serve):
    """The baseline every other case changes one thing of: pulled as it is, the values are the stream's."""
    craft = _good()
    traj = serve(craft).pull("any")
    table = pa.Table.from_batches(craft[1])
    x2 = table.filter(pc.equal(table["step"], 2))["latent"].combine_chunks().storage.flatten()
    assert np.array_equal(traj.latent(2).reshape(-1).numpy(), x2.to_numpy())
    assert traj.seeds.tolist() == _meta(craft, "rollout")["seeds"]


@pytest.mark.parametrize(("case", "message"), [
    (lambda c: _step_twice(c, 1), r"sigmaflight\.steps lists step 1 more than once"),
    (lambda c: _with_meta(c, steps=[0, 1, 2, 3, 4, 7]), r"sigmaflight\.steps lists step 7, outside 0\.\.T = 0\.\.4"),
    (lambda c: _with_meta(c, steps=[0, 2, 1, 3, 4]), r"sigmaflight\.steps is not ascending"),
], ids=["step-listed-twice", "step-past-T", "steps-out-of-order"])
def test_steps_listed_twice_or_outside_the_schedule_are_refused(serve, case, message):
    with pytest.raises(ValueError, match=message):
        serve(case(_good())).pull("any")


@pytest.mark.parametrize(("case", "message"), [
    (lambda c: _relabel_dtype(c, "float16"), r"latent: field metadata sigmaflight\.dtype is 'float16'.*holds float values"),
    (lambda c: _relabel_dtype(c, "bfloat16"), r"latent: field metadata sigmaflight\.dtype is 'bfloat16'.*holds float values"),
    (lambda c: _latents_as(c, pa.float64(), "float32"), r"latent: field metadata sigmaflight\.dtype is 'float32'.*holds double"),
], ids=["float32-labelled-float16", "float32-labelled-bfloat16", "float64-labelled-float32"])
def test_latent_bytes_of_another_type_than_the_label_are_refused(serve, case, message):
    """Read as the label says, these bytes would be other numbers (float32 pairs as float16, ...)."""
    with pytest.raises(ValueError, match=message):
        serve(case(_good())).pull("any")


@pytest.mark.parametrize(("case", "message"), [
    (lambda c: _with_meta(c, sigmas=_meta(c, "sigmas")[:-1]), r"sigmaflight\.sigmas has 4 values, expected T\+1 = 5"),
    (lambda c: _with_meta(c, sigmas=[*_meta(c, "sigmas")[:2], float("nan"), *_meta(c, "sigmas")[3:]]),
     r"sigmaflight\.sigmas\[2\] is nan, not a finite number"),
    (lambda c: _with_meta(c, sigmas=[*_meta(c, "sigmas")[:-1], 0.01]), r"sigmaflight\.sigmas ends in 0\.01.*not 0"),
    (_seed_changed, r"column 'seed' holds 1002 for sample 1 at step 2, but sigmaflight\.rollout\.seeds\[1\] is 1001"),
    (_null_latent, r"column 'latent' holds 1 null\(s\); it is not nullable"),
], ids=["T-sigmas", "nan-sigma", "terminal-sigma-not-0", "seed-column-disagrees", "null-latent"])
def test_a_stream_that_breaks_the_contract_is_refused_naming_the_field(serve, case, message):
    with pytest.raises(ValueError, match=message):
        serve(case(_good())).pull("any")

