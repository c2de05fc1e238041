"""Weights digests: one CRC32C per tensor, a sha256 per component over those, a sha256 over the components.

The digest is made of one digest per component (`component_digests`: the transformer, each
text encoder, the VAE), so a trainer that holds only some of them (no text encoders, replaying on
the conditioning stream) can still check the ones it has against a trajectory's
`model.components`, and a push hashes only the transformer. pipeline/digests.py computes the same
values on the trainer's side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import crc32c
import torch

__all__ = ["combine_digests", "component_digest", "component_digests", "state_digest", "tensor_crc",
           "weights_digest"]


def component_digest(name: str, module: torch.nn.Module) -> str:
    """sha256 over one component's state dict (`state_digest` of it)."""
    return state_digest(name, module.state_dict())


def tensor_crc(tensor: torch.Tensor) -> str:
    """A tensor's checksum: CRC32C (Castagnoli) of its raw C-order bytes on the CPU, 8 hex digits
    (the weights manifest's per-tensor value; hardware CRC32C, about 7x sha256's speed here)."""
    t = tensor.detach().to("cpu").contiguous()
    return f"{crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b''):08x}"


def state_digest(name: str, state: Mapping[str, torch.Tensor], known: Mapping[str, str] | None = None) -> str:
    """sha256 over "sigmaflight/tensors/v1\n" and, for each tensor sorted by key,
    "<name>.<key>:<dtype>:<shape>:<tensor_crc>\n": a component's digest derives from its per-tensor
    checksums (the weights manifest's), so a change of weights costs a CRC32C pass, not a sha256
    over every byte. `known`: tensor_crc of some keys, already computed (tensors a change kept)."""
    known = known or {}
    h = hashlib.sha256(b"sigmaflight/tensors/v1\n")
    for key, tensor in sorted(state.items()):
        crc = known.get(key) or tensor_crc(tensor)
        h.update(f"{name}.{key}:{tensor.dtype}:{tuple(tensor.shape)}:{crc}\n".encode())
    return h.hexdigest()


def component_digests(pipeline: Any) -> dict[str, str]:
    """{component name: component_digest} for every torch module of a pipeline (None ones skipped)."""
    return {name: component_digest(name, module) for name, module in sorted(pipeline.components.items())
            if isinstance(module, torch.nn.Module)}


def combine_digests(components: Mapping[str, str]) -> str:
    """The weights digest from the per-component ones: sha256 over "sigmaflight/weights/v3\\n" and
    "<name>:<digest>\\n" per component, sorted by name."""
    h = hashlib.sha256(b"sigmaflight/weights/v3\n")
    for name in sorted(components):
        h.update(f"{name}:{components[name]}\n".encode())
    return h.hexdigest()


def weights_digest(pipeline: Any) -> str:
    """The digest of all the torch modules of a pipeline: combine_digests(component_digests(pipeline))."""
    return combine_digests(component_digests(pipeline))
