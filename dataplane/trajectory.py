"""A rollout as torch tensors, aligned by absolute step index: ``Trajectory`` and ``Transition``.

``Trajectory.from_batches`` assembles "trajectory/v1" record batches (from a Flight stream, a
table or a memory-mapped file) into one ``[B, K, *latent_shape]`` tensor with one copy (the
copy and its checks: dataplane/assembly.py); ``iter_step_tensors`` groups batches by step
without assembling the whole rollout.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import torch
from sigmaflight.dataplane.assembly import Assembly
from sigmaflight.dataplane.codec import StepTensors, batch_to_tensors
from sigmaflight.dataplane.files import read_trajectory
from sigmaflight.dataplane.idle import flight_batches
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.samehost import FileSource
from sigmaflight.dataplane.schema import header_from_schema


@dataclass(frozen=True)
class Transition:
    """Transition i: x_i -> x_{i+1} (aligned by absolute index)."""

    i: int
    x: torch.Tensor
    """[B, *latent_shape]: x_i."""
    x_next: torch.Tensor
    """[B, *latent_shape]: x_{i+1}."""
    sigma: float
    sigma_next: float
    log_prob: torch.Tensor
    """float32 [B], NaN where null."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.i, self.x, self.x_next, self.sigma, self.sigma_next, self.log_prob))

    def __len__(self) -> int:
        return 6

    def __getitem__(self, k: int) -> Any:
        """`t[0]` is `t.i`, ... `t[5]` is `t.log_prob`, as unpacking gives them."""
        return tuple(self)[k]


class Trajectory:
    """A whole rollout as torch tensors, aligned by ABSOLUTE step index.

    ``latents[:, k]`` is x_{steps[k]}; use ``latent(i)`` to look up by absolute index.
    sigmas / timesteps are the full schedule (never filtered by a step selection).
    ``velocities`` (a rollout asked with ``return={"velocities": True}``, else None) is laid out
    as ``latents``, float32; ``velocity(i)`` looks up by absolute index.
    """

    def __init__(
        self,
        header: TrajectoryHeader,
        latents: torch.Tensor,
        log_probs: torch.Tensor,
        metadata: dict[str, Any],
        schema: pa.Schema,
        velocities: torch.Tensor | None = None,
    ) -> None:
        self.header = header
        self.latents = latents  # [B, K, *latent_shape]
        self.velocities = velocities  # [B, K, *latent_shape] float32, NaN at i = T; None without the column
        self.log_probs = log_probs  # [B, T] float32, NaN where null
        self.steps = torch.tensor(header.steps, dtype=torch.int64)  # [K]
        self.sigmas = header.sigmas  # [T+1] float32
        self.timesteps = header.timesteps  # [T] float32
        self.seeds = torch.tensor(header.seeds, dtype=torch.int64)  # [B]
        self.prompt_index = torch.tensor(header.prompt_indices(), dtype=torch.int64)  # [B] (a branch: the parent's)
        self.parent_sample = (None if header.parent_sample is None  # [B]: branch rollouts only
                              else torch.tensor(header.parent_sample, dtype=torch.int64))
        self.sde_steps = tuple(header.sde_steps)
        self.metadata = metadata  # the sigmaflight.rollout object
        self.schema = schema
        self._pos = {s: k for k, s in enumerate(header.steps)}

    @property
    def rollout_id(self) -> str:
        return self.header.rollout_id

    @property
    def num_steps(self) -> int:
        """T."""
        return self.header.num_steps

    @property
    def num_samples(self) -> int:
        """B."""
        return self.header.num_samples

    def __repr__(self) -> str:
        return (
            f"Trajectory(id={self.rollout_id!r}, B={self.num_samples}, T={self.num_steps}, "
            f"steps={list(self.header.steps)}, latents={list(self.latents.shape)} {self.latents.dtype})"
        )

    def has_step(self, i: int) -> bool:
        return _step(i) in self._pos

    def latent(self, i: int) -> torch.Tensor:
        """x_i for every sample, [B, *latent_shape], by absolute step index (an int, or an element
        of `steps`)."""
        i = _step(i)
        if i not in self._pos:
            raise KeyError(f"step {i} is not in this trajectory (steps {list(self.header.steps)})")
        return self.latents[:, self._pos[i]]

    def velocity(self, i: int) -> torch.Tensor:
        """The velocity step i stepped with (the ``velocity`` column), [B, *latent_shape] float32 by
        absolute step index; NaN at i = T, where no step leaves. Owned, writable memory: the
        assembly copied it out of the stream once, as it did the latents."""
        if self.velocities is None:
            raise ValueError(f"trajectory {self.rollout_id} has no velocity column; ask the rollout for "
                             'return={"velocities": True}')
        i = _step(i)
        if i not in self._pos:
            raise KeyError(f"step {i} is not in this trajectory (steps {list(self.header.steps)})")
        return self.velocities[:, self._pos[i]]

    def transitions(self, steps: Iterable[int] | None = None) -> Iterator[Transition]:
        """Transitions i (x_i -> x_{i+1}) where both latents are present, ascending."""
        wanted = range(self.num_steps) if steps is None else sorted({_step(s) for s in steps})
        for i in wanted:
            if 0 <= i < self.num_steps and i in self._pos and i + 1 in self._pos:
                yield Transition(
                    i=i,
                    x=self.latent(i),
                    x_next=self.latent(i + 1),
                    sigma=float(self.sigmas[i]),
                    sigma_next=float(self.sigmas[i + 1]),
                    log_prob=self.log_probs[:, i],
                )

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_batches(
        cls,
        schema: pa.Schema,
        batches: Iterable[pa.RecordBatch],
        *,
        source: FileSource | None = None,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> Trajectory:
        """Assemble (one copy per latent into one aligned, writable tensor; the same for the
        velocities when the stream has the ``velocity`` column).

        Where every row goes is known from the metadata (steps, B): a step-major stream's row r
        is x_{steps[r // B]} of sample r % B. A stream's batches are copied as they come; with
        ``source`` (the batches' file, on its checked descriptor) the latents are read from the
        file with a few preadv calls straight into the tensor (the kernel copies, no page faults
        on the mapping) and ``verify`` checks each batch's checksum over the bytes read. The
        order is checked afterwards with arithmetic over the step and sample columns; rows in
        another order are moved into place, a missing, repeated or unknown step or sample is a
        ValueError naming it. ``out``: a contiguous CPU tensor [B, K, *latent_shape] of the
        rollout's dtype to fill instead of a fresh one (a warm buffer reused across pulls costs
        no page faults)."""
        asm = Assembly(schema, out)
        if source is None:
            for batch in batches:
                asm.put(batch)
        else:
            asm.read_file(batches if isinstance(batches, list) else list(batches), source, verify)
        return asm.finish(cls)

    @classmethod
    def from_reader(cls, reader: pa.RecordBatchReader | flight.FlightStreamReader) -> Trajectory:
        if isinstance(reader, flight.FlightStreamReader):
            return cls.from_batches(reader.schema, flight_batches(reader))
        return cls.from_batches(reader.schema, reader)

    @classmethod
    def from_table(cls, table: pa.Table) -> Trajectory:
        return cls.from_batches(table.schema, table.to_batches())

    @classmethod
    def from_file(cls, path: str | Path) -> Trajectory:
        schema, batches, _ = read_trajectory(path)
        return cls.from_batches(schema, batches)


def iter_step_tensors(
    schema: pa.Schema, batches: Iterable[pa.RecordBatch], *, copy: bool = False
) -> Iterator[StepTensors]:
    """Group batches by step: one StepTensors with all B samples per step. A step in one
    batch is a zero-copy view (unless ``copy``); a split step is concatenated (one copy)."""
    dtype = header_from_schema(schema).latent_dtype
    pending: list[StepTensors] = []
    for batch in batches:
        st = batch_to_tensors(batch, copy=copy, dtype=dtype)
        if pending and pending[0].step != st.step:
            yield _merge(pending)
            pending = []
        pending.append(st)
    if pending:
        yield _merge(pending)


def _merge(parts: Sequence[StepTensors]) -> StepTensors:
    if len(parts) == 1:
        return parts[0]
    p = parts[0]
    return StepTensors(
        step=p.step,
        sample=torch.cat([q.sample for q in parts]),
        prompt_index=torch.cat([q.prompt_index for q in parts]),
        seed=torch.cat([q.seed for q in parts]),
        latent=torch.cat([q.latent for q in parts]),
        log_prob=torch.cat([q.log_prob for q in parts]),
        sigma=p.sigma,
        sigma_next=p.sigma_next,
        timestep=p.timestep,
        sde=p.sde,
    )


def pull_file(path: str | Path) -> Trajectory:
    """A ``.arrow`` trajectory file as a Trajectory (memory-mapped read, one copy)."""
    return Trajectory.from_file(path)


def _step(i: object) -> int:
    """An absolute step index as a Python int: `traj.steps[k]` is a 0-d tensor, which a dict of
    ints does not find (a tensor hashes by identity)."""
    try:
        return operator.index(i)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a step index is an integer (an int or an element of `steps`), got {i!r}") from None
