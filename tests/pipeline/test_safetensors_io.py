"""sigmaflight.pipeline.safetensors_io against the safetensors package (the reference reader and writer)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load, save
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.safetensors_io import lora_config_from_metadata, read_safetensors
from sigmaflight.pipeline.spec import RolloutInputError


def _inside(t: torch.Tensor, body: bytes) -> bool:
    import ctypes

    start = ctypes.cast(ctypes.c_char_p(body), ctypes.c_void_p).value or 0
    return start <= t.data_ptr() < start + len(body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_reads_what_safetensors_writes_without_a_copy(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": (torch.randn(3, 5, generator=g) * 4).to(dtype),
        "b": (torch.randn(7, generator=g) * 4).to(dtype),
        "scalar": torch.tensor(3).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    body = save(tensors, metadata={"lora_config": '{"r": 4}', "x": "y"})
    got, meta = read_safetensors(body)
    ref = load(body)
    assert set(got) == set(ref) and meta == {"lora_config": '{"r": 4}', "x": "y"}
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8))
    assert _inside(got["a.weight"], body) and _inside(got["b"], body)
    assert lora_config_from_metadata(meta) == {"r": 4}


def _body(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "body, field, reason",
    [
        (b"\x01\x02", "body", "shorter than the 8-byte header"),
        (struct.pack("<Q", 1 << 40) + b"{}", "body", "does not fit"),
        (struct.pack("<Q", 3) + b"{x}", "body", "not JSON"),
        (_body([1, 2]), "body", "not a JSON object"),  # type: ignore[arg-type]
        (_body({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "w", "unknown dtype"),
        (_body({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "w", "needs 8"),
        (_body({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 4), "w", "do not fit"),
        (_body({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "w", "non-negative"),
        (_body({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "w", "exactly dtype"),
        (_body({"v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "w", "overlaps"),
        (_body({"__metadata__": {"lora_config": {"r": 4}}}), "__metadata__", "strings"),
    ],
)
def test_bad_bodies_are_refused_naming_the_key(body, field, reason):
    with pytest.raises(RolloutInputError) as err:
        read_safetensors(body)
    assert err.value.field == field and reason in err.value.reason, str(err.value)


def _raw_body(header: str, data: bytes) -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + data


MALFORMED = {  # each refused by the reference reader, safetensors.torch.load; accepted here before
    "a key twice": (_raw_body('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                              '"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8),
                    "w", "twice"),
    "bytes no tensor points to": (_body({"v": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                         "w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}},
                                        b"\0" * 12), "w", "belong to no tensor"),
    "bytes after the last tensor": (_body({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                          b"\0" * 12), "body", "belong to no tensor"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_body_the_reference_reader_refuses_is_refused(case):
    """A key given twice (the last one was served), a hole in the data, or bytes after the last
    tensor's: the safetensors format allows none (its data section is indexed entirely)."""
    body, field, reason = MALFORMED[case]
    with pytest.raises(Exception):  # noqa: B017 (the reference raises its own error types)
        load(body)
    with pytest.raises(RolloutInputError) as err:
        read_safetensors(body)
    assert err.value.field == field and reason in err.value.reason, str(err.value)


@pytest.mark.parametrize("meta, reason", [({}, "missing"), ({"lora_config": "{r"}, "not JSON"),
                                          ({"lora_config": "[1]"}, "JSON object")])
def test_lora_config_metadata(meta, reason):
    with pytest.raises(RolloutInputError) as err:
        lora_config_from_metadata(meta)
    assert err.value.field == "lora_config" and reason in err.value.reason


def test_a_push_from_a_body_keeps_the_body_as_the_weights():
    reg = ModelRegistry()
    model = reg.get("tiny-sd3")
    state = {k: v + 0.25 for k, v in model.base_transformer().state_dict().items()}
    body = save(state)
    tensors, _ = read_safetensors(body)
    policy = reg.replace_weights("tiny-sd3", tensors)
    new = model.pipeline.transformer.state_dict()
    assert all(torch.equal(new[k], state[k]) for k in state)
    assert _inside(model.pipeline.transformer.proj_out.weight, body)
    assert policy.digest == ModelRegistry().replace_weights("tiny-sd3", state).digest
