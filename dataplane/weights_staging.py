"""One weights push's staging: each declared tensor's bytes as they land, checked chunk by chunk,
and the byte ranges received so far (what a resumed push still has to send).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping
from typing import Any

import crc32c
import numpy as np
import pyarrow as pa
import torch
from sigmaflight.dataplane.errors import clip
from sigmaflight.dataplane.weights_wire import PushRefused, PushStats, TensorSpec, dtype_name

__all__ = ["Staging"]


class Staging:
    """One push's staging: a tensor per declared key (allocated at its first chunk) and the byte
    ranges received so far, merged. `lock` is held by the stream feeding it (one at a time), even
    while that stream sends nothing; `busy` only while the push opens, a chunk lands or it
    commits: a push that is not busy may expire (`dropped` then says why, and every later
    write or commit is refused)."""

    def __init__(self, push_id: str, model_id: str, header: dict[str, Any], declared: dict[str, TensorSpec],
                 model_bytes: int, live: Mapping[str, torch.Tensor] | None = None) -> None:
        self.push_id, self.model_id, self.header, self.declared = push_id, model_id, header, declared
        self.partial = bool(header.get("partial", False))
        self.base_digest: str | None = header.get("base_digest")
        self.tensors: dict[str, torch.Tensor] = {}
        self.flat: dict[str, np.ndarray] = {}
        self.ranges: dict[str, list[tuple[int, int]]] = {k: [] for k in declared}
        self.stats = PushStats(declared_bytes=sum(s.nbytes for s in declared.values()), model_bytes=model_bytes)
        self.lock = threading.Lock()
        self.busy = threading.Lock()
        self.dropped: str | None = None
        """Why the push was dropped while a stream still held it (it expired); None while it lives."""
        self.touched = time.monotonic()
        self.live = live
        """The served tensors the chunks are written into (in-place), or None: fresh staging copies."""
        self.wrote = False
        """Some bytes were written into their target (checked or not: in-place, the served weights changed)."""

    def check_live(self) -> None:
        """PushRefused("expired") once the push was dropped (call with `busy` held)."""
        if self.dropped is not None:
            raise PushRefused("expired", self.dropped)

    @property
    def staged_bytes(self) -> int:
        return 0 if self.live is not None else sum(t.nbytes for t in self.tensors.values())

    def write(self, name: str, offset: int, data: pa.Buffer | memoryview, crc: int | None) -> None:
        """Check and stage one chunk (crc None: a body without checksums, PUT .../weights)."""
        with self.busy:
            self.check_live()
            self._write(name, offset, data, crc)

    def _write(self, name: str, offset: int, data: pa.Buffer | memoryview, crc: int | None) -> None:
        spec = self.declared.get(name)
        if spec is None:
            raise PushRefused("unknown_tensor", f"tensor {clip(name, 200)!r} was not declared in this push's header",
                              tensor=clip(name, 200))
        size, item = (data.size if isinstance(data, pa.Buffer) else data.nbytes), spec.dtype.itemsize
        if offset < 0 or offset % item or size % item or offset + size > spec.nbytes:
            raise PushRefused("offset", f"tensor {name!r}: chunk at byte {offset} of {size} bytes is not a whole "
                              f"number of {dtype_name(spec.dtype)} elements inside its {spec.nbytes} bytes",
                              tensor=name)
        if crc is not None and (got := crc32c.crc32c(data)) != crc:
            raise PushRefused("checksum", f"tensor {name!r}: chunk at byte {offset} has crc32c {got:08x}, "
                              f"the chunk says {crc:08x}", tensor=name)
        ranges = self.ranges[name]
        i = bisect.bisect_right(ranges, (offset, offset + size))
        if size and ((i > 0 and ranges[i - 1][1] > offset) or (i < len(ranges) and ranges[i][0] < offset + size)):
            raise PushRefused("overlap", f"tensor {name!r}: chunk at byte {offset} of {size} bytes overlaps bytes "
                              "this push has already received", tensor=name)
        if name not in self.tensors:  # the staging allocation: a fresh copy, or (in-place) the served tensor
            t = torch.empty(spec.shape, dtype=spec.dtype) if self.live is None else self.live[name]
            self.tensors[name] = t
            on_cpu = t.device.type == "cpu"
            self.flat[name] = t.view(-1).view(torch.uint8).numpy() if t.numel() and on_cpu else np.empty(0, np.uint8)
        target = self.tensors[name]
        self.wrote = self.wrote or size > 0
        if target.device.type == "cpu":
            self.flat[name][offset:offset + size] = np.frombuffer(data, dtype=np.uint8)
            values = target.view(-1)[offset // item:(offset + size) // item]
        else:  # an in-place push into an accelerator's tensor: through one chunk-sized host buffer
            bounce = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
            target.view(-1).view(torch.uint8)[offset:offset + size].copy_(bounce)
            values = bounce.view(spec.dtype)
        if spec.dtype.is_floating_point and size:
            if not _all_finite(values):
                raise PushRefused("non_finite", f"tensor {name!r}: chunk at byte {offset} holds NaN or infinite "
                                  "values", tensor=name)
        ranges.insert(i, (offset, offset + size))
        if i + 1 < len(ranges) and ranges[i][1] == ranges[i + 1][0]:
            ranges[i:i + 2] = [(ranges[i][0], ranges[i + 1][1])]
        if i > 0 and ranges[i - 1][1] == ranges[i][0]:
            ranges[i - 1:i + 1] = [(ranges[i - 1][0], ranges[i][1])]
        self.stats.received_bytes += size
        self.touched = time.monotonic()

    def missing(self) -> list[str]:
        """Declared keys not yet received whole."""
        out = []
        for name, spec in self.declared.items():
            r = self.ranges[name]
            if spec.nbytes and r != [(0, spec.nbytes)]:
                out.append(name)
        return out

    def staged(self) -> dict[str, torch.Tensor]:
        return {name: self.tensors.get(name, torch.empty(spec.shape, dtype=spec.dtype))
                for name, spec in self.declared.items()}

    def status(self) -> dict[str, Any]:
        return {"push_id": self.push_id, "model": self.model_id,
                "received": {k: [list(r) for r in v] for k, v in self.ranges.items() if v},
                "received_bytes": self.stats.received_bytes, "declared_bytes": self.stats.declared_bytes}


def _all_finite(values: torch.Tensor) -> bool:
    """No NaN or infinity among `values` (a CPU tensor). numpy's isfinite is SIMD and one thread
    (torch.isfinite is far slower here); bfloat16 and float8, which numpy lacks, by min and max
    (both NaN when any value is)."""
    if values.dtype in (torch.float32, torch.float64, torch.float16):
        return bool(np.isfinite(values.numpy()).all())
    lo, hi = torch.aminmax(values if values.dtype.itemsize > 1 else values.float())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
