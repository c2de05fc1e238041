"""The extra streams of a rollout on the control side: which were asked for, their tickets,
and the "outputs/v1" table decoded from x_T (contract, "More streams per rollout").

The data plane builds and serves the tables (dataplane/streams.py); the pipeline decodes
(pipeline/decode.py); this module joins them.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch
from sigmaflight.dataplane.record import TrajectoryHeader
from sigmaflight.dataplane.streams import CONDITIONING, OUTPUTS, TRAJECTORY, stream_table
from sigmaflight.dataplane.tickets import stream_ticket
from sigmaflight.pipeline.decode import DECODABLE_FAMILIES, decode_uint8
from sigmaflight.pipeline.models import LoadedModel
from sigmaflight.pipeline.spec import RolloutInputError, RolloutSpec

__all__ = ["output_bytes", "outputs_table", "stream_names", "stream_tickets",
           "validate_outputs"]


def stream_names(spec: RolloutSpec) -> list[str]:
    """The streams a rollout publishes: "trajectory", then those its `return` asked for."""
    names = [TRAJECTORY]
    if spec.return_outputs:
        names.append(OUTPUTS)
    if spec.return_conditioning:
        names.append(CONDITIONING)
    return names


def stream_tickets(ticket: str, rollout_id: str, streams: list[str]) -> dict[str, dict[str, Any]]:
    """The Ticket's `flight.streams`: name -> {"ticket", "descriptor_path"}."""
    out: dict[str, dict[str, Any]] = {}
    for name in streams:
        if name == TRAJECTORY:
            out[name] = {"ticket": ticket, "descriptor_path": ["rollouts", rollout_id]}
        else:
            out[name] = {"ticket": stream_ticket(ticket, name), "descriptor_path": ["rollouts", rollout_id, name]}
    return out


def validate_outputs(model: LoadedModel, spec: RolloutSpec) -> None:
    """`return.outputs` needs a model whose VAE sigmaflight decodes exactly."""
    if spec.return_outputs and model.family not in DECODABLE_FAMILIES:
        raise RolloutInputError(
            "return.outputs",
            f"model {model.id!r} ({model.family} family) has no exact decode; decodable families: "
            f"{', '.join(DECODABLE_FAMILIES)}",
        )


def _size(model: LoadedModel, spec: RolloutSpec) -> tuple[int, int, int | None]:
    d = model.defaults
    frames = (spec.num_frames or d.num_frames) if d.is_video else None
    return int(spec.height or d.height), int(spec.width or d.width), frames


def output_bytes(model: LoadedModel, spec: RolloutSpec) -> int:
    """Bytes of the "outputs/v1" payload (0 when not requested)."""
    if not spec.return_outputs:
        return 0
    h, w, frames = _size(model, spec)
    return spec.num_samples * h * w * 3 * (frames or 1)


def outputs_table(
    model: LoadedModel, spec: RolloutSpec, header: TrajectoryHeader, final_latents: torch.Tensor,
    *, max_batch_bytes: int | None = None,
) -> pa.Table:
    """x_T decoded on the rollout's device by the model's own VAE: `image` [H, W, 3] uint8 per
    sample (image models) or `video` [F, H, W, 3] (video models)."""
    h, w, _ = _size(model, spec)
    pixels = decode_uint8(model, final_latents, height=h, width=w)
    column = "video" if model.defaults.is_video else "image"
    return stream_table(OUTPUTS, header, {column: pixels}, max_batch_bytes=max_batch_bytes)
