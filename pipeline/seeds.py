"""Seeds and noise: everything random in a rollout comes from one request seed.

Per-sample seeds: `derive_seeds(seed, n)[k]` = first 8 bytes (big-endian) of
sha256(b"sigmaflight/sample/<seed>/<k>") masked to 63 bits. Initial latents: the pipeline
gets one CPU `torch.Generator` per sample seeded with that sample's seed (diffusers draws
each sample separately). SDE noise of sample k at transition i: float32, drawn on CPU from a
generator seeded with `noise_seed(seed_k, i)` (same construction with b"sigmaflight/noise/"),
so it depends on neither the batch nor on which other transitions are stochastic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from sigmaflight.pipeline.spec import RolloutSpec

__all__ = ["SEED_MASK", "derive_seeds", "noise_seed", "sample_seeds", "draw_noise", "sample_generators"]

SEED_MASK = (1 << 63) - 1
"""Seeds are integers in 0..2**63-1 (they travel as int64)."""


def _hash63(tag: str, *parts: int) -> int:
    digest = hashlib.sha256(("sigmaflight/" + tag + "/" + "/".join(str(p) for p in parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & SEED_MASK


def derive_seeds(seed: int, n: int) -> tuple[int, ...]:
    """Per-sample seeds from one request seed: sha256(b"sigmaflight/sample/<seed>/<k>")[:8] & (2**63-1)."""
    return tuple(_hash63("sample", seed, k) for k in range(n))


def noise_seed(sample_seed: int, transition: int) -> int:
    """Seed of the CPU generator that draws sample `sample_seed`'s noise at transition i."""
    return _hash63("noise", sample_seed, transition)


def sample_seeds(spec: RolloutSpec) -> tuple[int, ...]:
    """`spec.seeds` if given, else `derive_seeds(spec.seed or 0, B)`."""
    if spec.seeds is not None:
        return tuple(int(s) for s in spec.seeds)
    return derive_seeds(0 if spec.seed is None else int(spec.seed), spec.num_samples)


def sample_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample, as the pipeline's `generator=` argument (draws x_0)."""
    return [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]


def draw_noise(seeds: Sequence[int], transition: int, shape: tuple[int, ...]) -> torch.Tensor:
    """eps of transition i: float32 [B, *shape] on CPU, one generator per (sample seed, transition)."""
    out = torch.empty((len(seeds), *shape), dtype=torch.float32)
    for k, s in enumerate(seeds):
        g = torch.Generator("cpu").manual_seed(noise_seed(s, transition))
        out[k] = torch.randn(shape, generator=g, dtype=torch.float32)
    return out
