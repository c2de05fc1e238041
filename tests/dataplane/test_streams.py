"""Extra streams (dataplane/streams.py) through a real store and Flight server, read with plain pyarrow.

The generic builder takes a dict of [B, ...] tensors (what the "conditioning/v1" stream will be
fed); the reference is the tensors themselves, compared bit for bit after the round trip.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.streams import column_tensor, stream_table
from sigmaflight.dataplane.tickets import stream_ticket

from tests.dataplane.helpers import build_header, make_steps


def _header(rollout_id: str, streams: list[str]):
    h = build_header(rollout_id, B=4, n_per_prompt=2)
    return dataclasses.replace(h, rollout={**h.rollout, "streams": ["trajectory", *streams]})


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "prompt_embeds": torch.randn(4, 7, 8, generator=g).to(torch.bfloat16),
        "pooled_prompt_embeds": torch.randn(4, 16, generator=g),
        "negative_prompt_embeds": torch.randn(4, 7, 8, generator=g).to(torch.float16),
    }


def _publish_and_finish(store, header, name, table):
    w = store.create(header)
    steps = make_steps(header)
    for i in header.steps:
        w.append(steps[i])
    w.publish(name, table)
    w.finish()
    return w


def test_conditioning_shaped_stream_round_trips_bit_for_bit(store, server):
    header = _header("c1", ["conditioning"])
    tensors = _tensors()
    w = _publish_and_finish(store, header, "conditioning", stream_table("conditioning", header, tensors))
    with flight.FlightClient(server.locations[0]) as fc:
        table = fc.do_get(flight.Ticket(stream_ticket(w.ticket, "conditioning").encode())).read_all()
        info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "c1", "conditioning"))
    assert info.schema.equals(table.schema, check_metadata=True) and info.total_records == 4
    meta = table.schema.metadata
    assert json.loads(meta[b"sigmaflight.format"]) == "conditioning/v1"
    assert json.loads(meta[b"sigmaflight.rollout"])["id"] == "c1"
    assert table.column_names == ["sample", "prompt_index", "seed", *tensors]
    assert table.column("sample").to_pylist() == [0, 1, 2, 3]
    assert table.column("prompt_index").to_pylist() == [0, 0, 1, 1]
    assert table.column("seed").to_pylist() == list(header.seeds)
    pe = table.schema.field("prompt_embeds")
    assert pe.type == pa.fixed_shape_tensor(pa.uint16(), [7, 8]) and pe.metadata == {b"sigmaflight.dtype": b"bfloat16"}
    raw = table.column("prompt_embeds").combine_chunks().to_numpy_ndarray()  # plain pyarrow: the uint16 bits
    assert np.array_equal(raw, tensors["prompt_embeds"].view(torch.uint16).numpy())
    for name, t in tensors.items():
        back = column_tensor(table, name)
        assert back.dtype == t.dtype and torch.equal(back, t)


def test_streams_not_requested_are_refused_and_release_drops_them(store, server):
    header = _header("c2", ["outputs"])
    images = np.arange(4 * 2 * 2 * 3, dtype=np.uint8).reshape(4, 2, 2, 3)
    table = stream_table("outputs", header, {"image": images})
    w = store.create(header)
    with pytest.raises(ValueError, match="'conditioning' was not requested"):
        w.publish("conditioning", stream_table("conditioning", header, _tensors()))
    steps = make_steps(header)
    for i in header.steps:
        w.append(steps[i])
    used = store.budget.used
    w.publish("outputs", table)
    assert store.budget.used == used + table.nbytes
    w.finish()
    with flight.FlightClient(server.locations[0]) as fc:
        with pytest.raises(flight.FlightServerError, match="'conditioning' of rollout c2 not found"):
            fc.do_get(flight.Ticket(stream_ticket(w.ticket, "conditioning").encode())).read_all()
        got = fc.do_get(flight.Ticket(stream_ticket(w.ticket, "outputs").encode())).read_all()
        assert np.array_equal(got.column("image").combine_chunks().to_numpy_ndarray(), images)
        assert store.release("c2")
        assert store.budget.used == 0
        with pytest.raises(flight.FlightServerError, match="released"):
            fc.do_get(flight.Ticket(stream_ticket(w.ticket, "outputs").encode())).read_all()


def test_a_waiting_stream_reader_ends_when_the_rollout_fails(store, server):
    import threading

    header = _header("c3", ["outputs"])
    w = store.create(header)
    errors: list[BaseException] = []

    def read() -> None:
        with flight.FlightClient(server.locations[0]) as fc:
            try:
                fc.do_get(flight.Ticket(stream_ticket(w.ticket, "outputs").encode())).read_all()
            except flight.FlightError as exc:
                errors.append(exc)

    t = threading.Thread(target=read)
    t.start()
    w.fail("failed", "boom at step 1")
    t.join(10)
    assert not t.is_alive() and errors and "boom at step 1" in str(errors[0])


def test_builder_names_bad_columns():
    header = _header("c4", ["outputs"])
    with pytest.raises(ValueError, match="'image': first dimension must be the 4 samples"):
        stream_table("outputs", header, {"image": np.zeros((3, 2, 2, 3), dtype=np.uint8)})
    with pytest.raises(ValueError, match="'x': unsupported dtype bool"):
        stream_table("outputs", header, {"x": np.zeros((4, 2), dtype=bool)})
    with pytest.raises(ValueError, match="unknown stream 'latents'"):
        stream_table("latents", header, {"x": np.zeros((4, 2), dtype=np.uint8)})
    with pytest.raises(ValueError, match="key column"):
        stream_table("outputs", header, {"seed": np.zeros((4, 2), dtype=np.uint8)})



def test_a_tensor_column_whose_values_are_not_the_labelled_dtype_is_refused():
    """float32 values labelled bfloat16 would be read as twice as many other numbers (and
    labelled float16, cast without a word): ValueError naming the column and both types."""
    header = _header("c9", ["conditioning"])
    pooled = torch.randn(4, 6)
    table = stream_table("conditioning", header, {"pooled": pooled})
    assert torch.equal(column_tensor(table, "pooled"), pooled)  # as labelled: the values
    i = table.schema.get_field_index("pooled")
    for label in ("bfloat16", "float16"):
        field = table.schema.field("pooled").with_metadata({b"sigmaflight.dtype": label.encode()})
        with pytest.raises(ValueError, match=rf"column 'pooled': field metadata sigmaflight\.dtype is '{label}'.*"
                                             r"holds float32 values"):
            column_tensor(table.cast(table.schema.set(i, field)), "pooled")
