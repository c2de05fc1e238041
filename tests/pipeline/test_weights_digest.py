"""The weights digest as the contract describes it, transcribed here with hashlib and crc32c:
per component, sha256 over "sigmaflight/tensors/v1" and "component.key:dtype:shape:crc32c" per
tensor (CRC32C of its raw bytes), sorted; the model's, sha256 over "sigmaflight/weights/v3" and
"name:digest" per component. The trainer's side gives the same value for fresh detached tensors."""

from __future__ import annotations

import hashlib

import crc32c
import torch
from sigmaflight.pipeline.digests import current_digest
from sigmaflight.pipeline.models import ModelRegistry, state_digest


def _crc(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else \
        t.detach().contiguous().view(torch.int16).numpy().tobytes()
    return f"{crc32c.crc32c(raw):08x}"


def _component(name: str, state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(b"sigmaflight/tensors/v1\n")
    for key in sorted(state):
        t = state[key]
        h.update(f"{name}.{key}:{t.dtype}:{tuple(t.shape)}:{_crc(t)}\n".encode())
    return h.hexdigest()


def test_the_digest_is_made_from_per_tensor_crc32c_as_documented():
    model = ModelRegistry().get("tiny-sd3")
    components = {name: _component(name, module.state_dict())
                  for name, module in model.pipeline.components.items() if isinstance(module, torch.nn.Module)}
    h = hashlib.sha256(b"sigmaflight/weights/v3\n")
    for name in sorted(components):
        h.update(f"{name}:{components[name]}\n".encode())
    assert components == model.components and h.hexdigest() == model.digest


def test_the_trainers_side_gives_the_same_digest_for_fresh_detached_tensors_and_after_a_change():
    model = ModelRegistry().get("tiny-sd3")
    fresh = {k: v.detach().clone() for k, v in model.pipeline.transformer.state_dict().items()}
    assert state_digest("transformer", fresh) == model.components["transformer"]
    assert current_digest(model) == model.digest
    key = sorted(k for k, v in fresh.items() if v.is_floating_point())[0]
    with torch.no_grad():
        model.pipeline.transformer.state_dict()[key].add_(1.0)  # in place: the trainer's cache sees it
    changed = {**fresh, key: fresh[key] + 1.0}
    assert current_digest(model) != model.digest
    assert state_digest("transformer", changed) == _component("transformer", changed)
    known = {k: _crc(v) for k, v in fresh.items() if k != key}  # the kept tensors' CRCs, as a commit reuses them
    assert state_digest("transformer", changed, known) == _component("transformer", changed)
