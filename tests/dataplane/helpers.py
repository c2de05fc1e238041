"""Shared helpers for the data-plane tests: real stores, real Flight servers on port 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sigmaflight.dataplane.record import StepBatch, TrajectoryHeader
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore

HeaderFactory = Callable[..., TrajectoryHeader]


def build_header(
    rollout_id: str = "r1",
    *,
    T: int = 4,
    B: int = 3,
    n_per_prompt: int = 1,
    shape: tuple[int, ...] = (2, 3, 3),
    dtype: torch.dtype = torch.float32,
    steps: tuple[int, ...] | None = None,
    sde_steps: tuple[int, ...] | None = None,
    log_probs: bool = True,
    sigmas: torch.Tensor | None = None,
) -> TrajectoryHeader:
    if sigmas is None:
        sigmas = torch.linspace(1.0, 0.0, T + 1, dtype=torch.float32) ** 1.3
    return TrajectoryHeader(
        rollout_id=rollout_id,
        sigmas=sigmas,
        timesteps=sigmas[:-1] * 1000,
        steps=tuple(range(T + 1)) if steps is None else steps,
        sde_steps=tuple(range(T)) if sde_steps is None else sde_steps,
        seeds=tuple(1000 + s for s in range(B)),
        num_outputs_per_prompt=n_per_prompt,
        latent_shape=shape,
        latent_dtype=dtype,
        log_probs=log_probs,
        rollout={"model": {"id": "tiny", "dtype": str(dtype)}, "sampler": {"type": "sde"}},
    )


def make_steps(header: TrajectoryHeader, seed: int = 0) -> dict[int, StepBatch]:
    """Distinct random latents and log-probs for every step in header.steps."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in header.steps:
        x = torch.randn((header.num_samples, *header.latent_shape), generator=g).to(header.latent_dtype)
        lp = torch.randn(header.num_samples, generator=g)
        out[i] = StepBatch(step=i, latent=x, log_prob=lp)
    return out


def fill(store: ResultStore, header: TrajectoryHeader, seed: int = 0) -> dict[int, StepBatch]:
    steps = make_steps(header, seed)
    w = store.create(header)
    for i in header.steps:
        w.append(steps[i])
    w.finish()
    return steps


@pytest.fixture
def make_header() -> HeaderFactory:
    return build_header


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ResultStore]:
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path / "data") as s:
        yield s


@pytest.fixture
def server(store: ResultStore) -> Iterator[FlightDataServer]:
    with FlightDataServer(store) as srv:
        yield srv


def expected_log_prob(header: TrajectoryHeader, steps: dict[int, StepBatch], i: int) -> Any:
    """What the log_prob column must hold at step i (NaN = null)."""
    b = header.num_samples
    if i >= header.num_steps or i not in header.sde_steps or not header.log_probs:
        return torch.full((b,), float("nan"))
    lp = steps[i].log_prob
    assert lp is not None
    return lp


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (from /proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out
