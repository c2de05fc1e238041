"""Wire models of the REST API (pydantic v2, unknown fields rejected).

They are separate from the engine's internal records (`sigmaflight.pipeline.spec`): one explicit
converter, `to_spec`, turns a validated request into a `RolloutSpec`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from sigmaflight.records import STATES as STATES  # re-exported: the wire's names for the shared records
from sigmaflight.records import TERMINAL as TERMINAL
from sigmaflight.records import ErrorInfo as ErrorInfo
from sigmaflight.records import RestStatus
from sigmaflight.records import ResultInfo as ResultInfo

if TYPE_CHECKING:  # the engine's records hold torch tensors; a client reading a status needs no torch
    from sigmaflight.pipeline.spec import RolloutSpec

INT64_MAX = (1 << 63) - 1
MAX_STATUS_WAIT_S = 60.0
"""The most `GET /v1/rollouts/{id}?wait_s=` may ask the server to hold a status read: below the idle
timeout of common proxies (60 s)."""
RolloutState = RestStatus
"""A status on the wire: one of the contract's six `sigmaflight.records.RolloutState`s."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class Sampler(_Wire):
    type: Literal["sde", "cps", "ode"] = Field("sde", description="Step kernel.")
    noise_level: float = Field(0.7, ge=0.0, description="The kernel's noise scale a (>= 0).")
    sde_steps: list[int] | None = Field(
        None,
        description="Absolute transition indices in 0..T-1 that are stochastic; null = all.",
    )
    log_prob: Literal["density", "no_const"] = Field("density", description="Log-probability flavour.")


class Return(_Wire):
    steps: list[int] | None = Field(
        None, description="Absolute latent indices in 0..T to stream, each at most once; null = all T+1."
    )
    log_probs: bool = Field(True, description="Compute and stream per-step log-probs.")
    latent_dtype: Literal["native", "float32", "float16", "bfloat16"] = Field(
        "native", description='"native" = exactly what the loop consumed; anything else is a lossy conversion.'
    )
    outputs: StrictBool = Field(
        False, description='Decode x_T with the model\'s VAE and publish the "outputs/v1" stream (flight.streams).'
    )
    velocities: StrictBool = Field(
        False, description="Add the trajectory column `velocity`: the CFG-combined model output at step i (null at T)."
    )
    conditioning: StrictBool = Field(
        False, description='Publish the "conditioning/v1" stream: the tensors the transformer consumed.'
    )


class BranchFrom(_Wire):
    rollout: str = Field(..., min_length=1, max_length=128, description="The parent rollout's id (succeeded).")
    step: int = Field(..., ge=0, description="k: the parent's streamed step to start from, in 0..T-1.")
    samples: list[int] | None = Field(
        None, min_length=1, description="Parent sample indices to branch from, each once; null = all."
    )


class RolloutRequest(_Wire):
    model: str | None = Field(None, description="Model id; default: the server's default model.")
    prompts: list[str] | None = Field(
        None, min_length=1, description="Prompts; samples are prompt-major. Required, except for a branch (inherited)."
    )
    negative_prompt: str | None = Field(None, description="Negative prompt for classifier-free guidance; default: the model's.")
    num_outputs_per_prompt: int = Field(1, ge=1, description="Samples per prompt (a GRPO group); B = prompts x this.")
    num_inference_steps: int | None = Field(None, ge=1, description="T; default: the model's.")
    guidance_scale: float | None = Field(None, ge=0, le=100, description="CFG scale, 0..100; default: the model's.")
    height: int | None = Field(None, ge=1, description="Image height in pixels; default: the model's.")
    width: int | None = Field(None, ge=1, description="Image width in pixels; default: the model's.")
    num_frames: int | None = Field(None, ge=1, description="Video models only.")
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description="Per-sample seeds are derived from it.")
    seeds: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        None, description="Exactly one per sample (0 <= seed < 2^63)."
    )
    sampler: Sampler = Field(default_factory=Sampler)
    return_: Return = Field(default_factory=Return, alias="return")
    branch_from: BranchFrom | None = Field(
        None, description="Start at a parent rollout's x_k; model, prompts, guidance, size and T are inherited."
    )
    expected_digest: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="The model's weights digest this request is for (GET /v1/models): 409 stale_policy when "
        "it differs at POST; the rollout fails with stale_policy when the weights change before it starts.",
    )

    @field_validator("seeds")
    @classmethod
    def _not_with_seed(cls, seeds: list[int] | None, info: ValidationInfo) -> list[int] | None:
        """Named at `seeds` (a model-level check would name only "body"); `seed` comes first."""
        if seeds is not None and info.data.get("seed") is not None:
            raise PydanticCustomError("seed_and_seeds", "give either seed or seeds, not both")
        return seeds

    @property
    def num_samples(self) -> int:
        """B of a plain request (a branch's B is known once its parent is resolved)."""
        return len(self.prompts or ()) * self.num_outputs_per_prompt


def to_spec(request: RolloutRequest, *, model_id: str, default_steps: int, seed: int) -> RolloutSpec:
    """The one converter from wire to engine. `seed` is used when the request gave neither seed nor seeds."""
    from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

    r = request.return_
    return RolloutSpec(
        model=model_id,
        prompts=tuple(request.prompts or ()),
        negative_prompt=request.negative_prompt,
        num_outputs_per_prompt=request.num_outputs_per_prompt,
        num_inference_steps=request.num_inference_steps or default_steps,
        guidance_scale=request.guidance_scale,
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        seed=None if request.seeds is not None else (request.seed if request.seed is not None else seed),
        seeds=tuple(request.seeds) if request.seeds is not None else None,
        sampler=SamplerSpec(
            type=request.sampler.type,
            noise_level=request.sampler.noise_level,
            sde_steps=tuple(request.sampler.sde_steps) if request.sampler.sde_steps is not None else None,
            log_prob=request.sampler.log_prob,
        ),
        return_steps=tuple(sorted(r.steps)) if r.steps is not None else None,  # any order; streamed ascending
        return_log_probs=r.log_probs,
        latent_dtype=r.latent_dtype,
        return_outputs=r.outputs,
        return_velocities=r.velocities,
        return_conditioning=r.conditioning,
        expected_digest=request.expected_digest,
    )


# ---- responses ----------------------------------------------------------------------------


class StreamTicket(_Wire):
    ticket: str = Field(..., description="Opaque Flight ticket of this stream for do_get.")
    descriptor_path: list[str] = Field(
        ..., description='["rollouts", id] (trajectory) or ["rollouts", id, "outputs" | "conditioning"].'
    )


class FlightTicket(_Wire):
    ticket: str = Field(..., description="Opaque Flight ticket for do_get (the trajectory's).")
    locations: list[str] = Field(..., description="Flight URIs that serve the ticket.")
    descriptor_path: list[str] = Field(..., description='FlightDescriptor.for_path(*descriptor_path): ["rollouts", id].')
    streams: dict[str, StreamTicket] = Field(
        default_factory=dict,
        description='Every stream of the rollout by name: "trajectory" always, "outputs" / "conditioning" when requested.',
    )


class Ticket(_Wire):
    id: str
    status: RolloutState
    status_url: str
    flight: FlightTicket


class Progress(_Wire):
    steps_done: int
    steps_total: int


class RolloutStatus(_Wire):
    id: str
    status: RolloutState
    model: str
    progress: Progress
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    error: ErrorInfo | None = None
    result: ResultInfo | None = None
    flight: FlightTicket


class RolloutList(_Wire):
    rollouts: list[RolloutStatus]
    next: str | None = Field(
        None, description="More follow: the id to pass as `after` for the next page (the last one here); null on the "
        "last page.")


class ValidationDetail(_Wire):
    loc: list[str | int]
    msg: str
    type: str


class ErrorDetail(_Wire):
    type: str = Field(..., description="Machine-readable kind, e.g. validation_error, not_found.")
    message: str
    details: list[ValidationDetail] | dict[str, Any] | None = None


class ErrorBody(_Wire):
    error: ErrorDetail



class ModelInfo(_Wire):
    model_config = ConfigDict(extra="allow")
    id: str
    default: bool


class ModelList(_Wire):
    models: list[ModelInfo]


class Health(_Wire):
    status: str
    checks: dict[str, bool] = Field(default_factory=dict)
    weights_failed: dict[str, str] | None = Field(
        None, description="Models an in-place weights push failed closed (model id: why); they refuse rollouts "
        "until a full push commits. Absent when none.")
