"""The Python API for trainers: REST calls plus Flight pulls into torch tensors.

    from sigmaflight import Client
    client = Client("http://127.0.0.1:8000", token=None)
    ticket = client.submit(prompts=["a red cube"], num_outputs_per_prompt=4, num_inference_steps=8, seed=7)
    status = client.wait(ticket, timeout=60)          # RolloutFailed (RolloutCancelled) unless it succeeded
    traj = client.pull(ticket)                        # sigmaflight.dataplane.client.Trajectory (torch)
    images = client.pull_outputs(ticket)              # uint8 [B, H, W, 3], with return={"outputs": True}
    for i, x, x_next, sigma, sigma_next, log_prob in traj.transitions():
        ...

`submit` takes the RolloutRequest fields as keyword arguments (`return_=` or
`**{"return": ...}` for the `return` object); the server validates them and a refusal
raises `ApiError` (NotFound, Unauthorized) with the contract's error body; sigmaflight/errors.py
has the typed errors. docs/trainers.md has the whole tour.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import pyarrow as pa
from pyarrow import flight

from sigmaflight.dataplane.auth import bearer_header
from sigmaflight.dataplane.transport import Transport, check_transport
from sigmaflight.errors import (
    ApiError,
    NotFound,
    RolloutCancelled,
    RolloutFailed,
    ServerUnreachable,
    Unauthorized,
    WeightsMismatch,
)
from sigmaflight.wire import TERMINAL, RolloutStatus, Ticket

if TYPE_CHECKING:  # torch and the data plane's torch side load on first use: `sigmaflight status` needs neither
    import numpy as np
    import torch

    from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
    from sigmaflight.pipeline.spec import RolloutSpec

__all__ = [
    "ApiError", "Client", "NotFound", "RolloutCancelled", "RolloutFailed", "ServerUnreachable", "Unauthorized",
    "WeightsMismatch",
    "replay_log_probs", "rollout_spec",
]


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json()["error"]
        type_, message, details = str(err["type"]), str(err["message"]), err.get("details")
    except (ValueError, KeyError, TypeError):
        type_, message, details = "http_error", r.text[:500], None
    kind = {404: NotFound, 401: Unauthorized}.get(r.status_code, ApiError)
    raise kind(r.status_code, type_, message, details)


def _unreachable_reason(exc: httpx.TransportError, timeout: float) -> str:
    """Why a REST call got no HTTP answer, in words that say what to check."""
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout:g} s ({type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return (f"what answers there does not speak HTTP/1.1 ({exc}); is this the Flight port? The REST port is "
                "`sigmaflight serve --port` (default 8000), Flight's is --flight-port (default 8815)")
    return f"{exc or type(exc).__name__} (is `sigmaflight serve` running there?)"


def _flight_message(exc: Exception) -> str:
    """The server's own message out of a pyarrow Flight error (no gRPC debug context)."""
    text = str(exc)
    for cut in (". Detail:", ". gRPC client debug context", "gRPC client debug context", ". Client context:"):
        text = text.split(cut, 1)[0]
    for prefix in ("Flight returned internal error, with message: ", "with message: "):
        if prefix in text:
            text = text.split(prefix, 1)[1]
    return text.strip()


class Client:
    """One REST connection (httpx) and one Flight connection per location, reused."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: Transport = "auto",
        host: str | None = None,
    ) -> None:
        """``transport`` and ``host`` go to each TrajectoryClient: ``"auto"`` reads a finished
        rollout's shared-memory file (a server with --shm-dir on this host) instead of a
        stream; ``"flight"`` always streams. ``host``: this host's id (default: computed)."""
        self.url = url.rstrip("/")
        self.token = token
        self.transport: Transport = check_transport(transport)
        self.host = host
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=bearer_header(token), timeout=timeout)
        self._flight: dict[str, TrajectoryClient] = {}

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One REST call; ApiError (NotFound, Unauthorized) for a refusal, ServerUnreachable when
        nothing at `url` answers HTTP (httpx's transport errors never reach the caller)."""
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnreachable(self.url, _unreachable_reason(exc, self.timeout)) from exc
        _raise_for(r)
        return r

    def close(self) -> None:
        self._http.close()
        for c in self._flight.values():
            c.close()
        self._flight.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- REST ----------------------------------------------------------------------------
    def submit(self, *, idempotency_key: str | None = None, **request: Any) -> Ticket:
        """POST /v1/rollouts with the RolloutRequest fields given as keywords; the 202 Ticket."""
        if "return_" in request:
            request["return"] = request.pop("return_")
        headers = {"idempotency-key": idempotency_key} if idempotency_key else {}
        r = self._send("POST", "/v1/rollouts", json=request, headers=headers)
        return Ticket.model_validate(r.json())

    def branch(
        self,
        parent: str | Ticket,
        step: int,
        samples: list[int] | None = None,
        *,
        branches: int = 1,
        sampler: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        **request: Any,
    ) -> Ticket:
        """POST a branch rollout (contract, "Branch rollouts"): `branches` samples from each of the
        parent's x_step rows `samples` (None = all), on the parent's model, prompts and schedule.
        `sampler` and the other keywords (`seed`, `return_`, ...) are the branch's own; e.g.
        `sampler={"type": "sde", "sde_steps": [step]}` makes only transition `step` stochastic."""
        body: dict[str, Any] = dict(request)
        body["branch_from"] = {"rollout": _id(parent), "step": int(step),
                               "samples": None if samples is None else [int(j) for j in samples]}
        body["num_outputs_per_prompt"] = int(branches)
        if sampler is not None:
            body["sampler"] = dict(sampler)
        return self.submit(idempotency_key=idempotency_key, **body)

    def status(self, rollout_id: str | Ticket) -> RolloutStatus:
        r = self._send("GET", f"/v1/rollouts/{_id(rollout_id)}")
        return RolloutStatus.model_validate(r.json())

    def rollouts(self, status: str | None = None, limit: int = 100, *, ticket: str | None = None) -> list[RolloutStatus]:
        """GET /v1/rollouts, newest first (optionally only one status, or only the rollout that a
        Flight ticket belongs to)."""
        params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {}),
                                  **({"ticket": ticket} if ticket else {})}
        r = self._send("GET", "/v1/rollouts", params=params)
        return [RolloutStatus.model_validate(s) for s in r.json()["rollouts"]]

    def wait(
        self, ticket: str | Ticket, timeout: float = 300.0, *, poll_s: float = 0.05, max_poll_s: float = 1.0,
        raise_on_failure: bool = True,
    ) -> RolloutStatus:
        """Poll until the rollout is finished; TimeoutError after `timeout` seconds.

        Polls after `poll_s`, then backs off, doubling the pause up to `max_poll_s` (a long rollout
        costs the server a poll a second, a short one is seen within tens of ms). Raises
        RolloutFailed (RolloutCancelled when cancelled) when it ended other than succeeded,
        unless `raise_on_failure=False`."""
        deadline = time.monotonic() + timeout
        pause = poll_s
        while True:
            st = self.status(ticket)
            if st.status in TERMINAL:
                if raise_on_failure and st.status != "succeeded":
                    raise RolloutFailed.from_status(st)
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rollout {st.id} still {st.status} after {timeout} s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, max(max_poll_s, poll_s))

    def cancel(self, rollout_id: str | Ticket) -> RolloutStatus:
        """DELETE: cancel a queued/running rollout, or release a finished one's result."""
        r = self._send("DELETE", f"/v1/rollouts/{_id(rollout_id)}")
        return RolloutStatus.model_validate(r.json())

    def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: id, family, dtype, device, digest, defaults, ... per model."""
        r = self._send("GET", "/v1/models")
        return list(r.json()["models"])

    def push_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor]) -> str:
        """PUT the transformer's state dict (safetensors); returns the server's new weights digest."""
        from safetensors.torch import save

        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        r = self._send(
            "PUT",
            f"/v1/models/{model_id}/weights",
            content=save(tensors),
            headers={"content-type": "application/octet-stream"},
        )
        return str(r.json()["digest"])

    def push_lora(self, model_id: str, adapter: Mapping[str, torch.Tensor], lora_config: Any) -> dict[str, Any]:
        """PUT a LoRA adapter: `adapter` as `peft.get_peft_model_state_dict` gives it, `lora_config`
        a peft LoraConfig (or its `to_dict()`). Returns {"id", "digest", "weights_version", ...}."""
        from safetensors.torch import save

        config = lora_config.to_dict() if hasattr(lora_config, "to_dict") else dict(lora_config)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}
        body = save(tensors, metadata={"lora_config": json.dumps(config, default=sorted)})
        r = self._send("PUT", f"/v1/models/{model_id}/lora", content=body,
                       headers={"content-type": "application/octet-stream"})
        return dict(r.json())

    def delete_lora(self, model_id: str) -> dict[str, Any]:
        """DELETE the model's LoRA adapter (ApiError 404 "lora_not_loaded" when there is none)."""
        r = self._send("DELETE", f"/v1/models/{model_id}/lora")
        return dict(r.json())

    # -- Flight --------------------------------------------------------------------------
    def flight(self, location: str) -> TrajectoryClient:
        """The (cached) data-plane client for one Flight location."""
        from sigmaflight.dataplane.client import TrajectoryClient

        if location not in self._flight:
            self._flight[location] = TrajectoryClient(
                location, token=self.token, transport=self.transport, host=self.host
            )
        return self._flight[location]

    def locate(self, ticket: str | Ticket) -> tuple[str, str]:
        """(Flight location, Flight ticket) of a Ticket, a rollout id or a Flight ticket string.

        Tickets are opaque here: a string is looked up as a rollout id first; one the server
        does not know as an id is looked up as a Flight ticket (GET /v1/rollouts?ticket=), whose
        rollout names the Flight location that holds it (under Ray, its worker's)."""
        if isinstance(ticket, Ticket):
            return ticket.flight.locations[0], ticket.flight.ticket
        try:
            st = self.status(ticket)
        except NotFound:
            owners = self.rollouts(limit=1, ticket=ticket)
            if not owners:
                raise NotFound(404, "not_found", f"no rollout or ticket {ticket!r} on {self.url}") from None
            return owners[0].flight.locations[0], ticket
        return st.flight.locations[0], st.flight.ticket

    def pull(self, ticket: str | Ticket) -> Trajectory:
        """The whole trajectory as torch tensors (waits for a running rollout; see sigmaflight.dataplane.client).

        A rollout that ended failed raises RolloutFailed, a cancelled one RolloutCancelled, an
        unknown ticket NotFound, a refused token Unauthorized: each with the server's message."""
        location, flight_ticket = self.locate(ticket)
        try:
            return self.flight(location).pull(flight_ticket)
        except flight.FlightError as exc:
            raise self.flight_error(ticket, exc) from None

    def stream_ticket(self, ticket: str | Ticket, stream: str) -> tuple[str, str]:
        """(Flight location, Flight ticket) of one named stream of a rollout ("trajectory",
        "outputs", "conditioning"); NotFound naming it when the rollout did not ask for it."""
        flight_ticket = ticket.flight if isinstance(ticket, Ticket) else self.status(ticket).flight
        found = flight_ticket.streams.get(stream)
        if found is None:
            raise NotFound(None, "not_found", f"rollout {_id(ticket)} has no {stream!r} stream (streams: "
                           f"{', '.join(flight_ticket.streams) or 'none'}); ask for it with return.{stream}")
        return flight_ticket.locations[0], found.ticket

    def pull_stream(self, ticket: str | Ticket, stream: str) -> pa.Table:
        """One stream of a rollout as a pyarrow Table (waits while the rollout runs)."""
        location, flight_ticket = self.stream_ticket(ticket, stream)
        try:
            return self.flight(location).reader(flight_ticket).read_all()
        except flight.FlightError as exc:
            raise self.flight_error(ticket, exc) from None

    def pull_outputs(self, ticket: str | Ticket) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The decoded outputs of a rollout asked with `return={"outputs": True}`: uint8
        [B, H, W, 3] images (image models) or [B, F, H, W, 3] video frames, row b = sample b."""
        import numpy as np

        table = self.pull_stream(ticket, "outputs")
        column = "video" if "video" in table.column_names else "image"
        return np.asarray(table.column(column).combine_chunks().to_numpy_ndarray())

    def pull_conditioning(self, ticket: str | Ticket) -> dict[str, torch.Tensor]:
        """The "conditioning/v1" stream of a rollout asked with `return={"conditioning": True}`:
        {stock `__call__` keyword: [B, ...] tensor in the dtype the transformer consumed}, row b =
        sample b. Pass it as `conditioning=` to `replay_log_probs` (no text encoders needed), or
        as keywords to the stock pipeline instead of prompts."""
        from sigmaflight.dataplane.streams import KEY_COLUMNS, column_tensor

        table = self.pull_stream(ticket, "conditioning")
        return {c: column_tensor(table, c) for c in table.column_names if c not in KEY_COLUMNS}

    def flight_error(self, ticket: str | Ticket, exc: Exception) -> ApiError:
        """The typed error for a Flight error on `ticket`, by the error's type (`extra_info`, see
        sigmaflight.dataplane.errors): a refused token is Unauthorized; a rollout that ended other
        than succeeded is RolloutFailed (RolloutCancelled) from its REST status when there is one;
        an unknown ticket NotFound. The message is the server's, for people."""
        from sigmaflight.dataplane.errors import error_info

        info = error_info(exc) or {}
        kind = info.get("type")
        if kind == "not_found" and info.get("ended"):  # a ticket gone because its rollout ended
            kind = info["ended"]
        message = _flight_message(exc)
        if kind == "unauthenticated" or isinstance(exc, flight.FlightUnauthenticatedError):
            return Unauthorized(401, "unauthorized", message)
        try:
            st = self.status(ticket)
        except ApiError:
            st = None
        if st is not None and st.status in TERMINAL and st.status != "succeeded":
            return RolloutFailed.from_status(st, message)
        if kind == "failed":
            return RolloutFailed(message)
        if kind == "cancelled":
            return RolloutCancelled(message)
        if kind in ("not_found", "released", "expired") and st is None:
            return NotFound(None, "not_found", message)
        return ApiError(None, kind or "flight_error", message)


def _id(ticket: str | Ticket) -> str:
    return ticket.id if isinstance(ticket, Ticket) else ticket


def rollout_spec(traj: Trajectory) -> RolloutSpec:
    """The RolloutSpec the server ran, from the trajectory's `sigmaflight.rollout.request`
    (`RolloutSpec.from_json`); for a branch rollout with `branch_from` rebuilt from the trajectory
    (its x_k, schedule, prompt indices)."""
    import torch

    from sigmaflight.pipeline.spec import BranchStart, RolloutSpec

    req = traj.metadata["request"]
    parent = req.get("branch_from")
    if parent is None:
        return RolloutSpec.from_json(req)
    # A branch rollout: it replays from its own x_k (the parent's, repeated per branch) on the
    # recorded schedule; one BranchStart row per parent sample.
    n, k = int(req.get("num_outputs_per_prompt", 1)), int(parent["step"])
    rows = traj.latent(k)[::n].clone() if traj.has_step(k) else torch.zeros(
        (len(parent["samples"]), *traj.header.latent_shape), dtype=traj.latents.dtype)
    branch = BranchStart(
        step=k,
        latents=rows,
        sigmas=traj.sigmas,
        timesteps=traj.timesteps,
        set_timesteps_kwargs=dict((traj.metadata.get("scheduler") or {}).get("set_timesteps") or {}),
        samples=tuple(int(j) for j in parent["samples"]),
        prompt_index=tuple(int(p) for p in traj.prompt_index[::n]),
        rollout=str(parent.get("rollout", "")),
    )
    return RolloutSpec.from_json(req, branch_from=branch)


def replay_log_probs(
    pipeline: Any,
    traj: Trajectory,
    *,
    grad: bool = False,
    per_sample_model_calls: bool = False,
    strict: bool = False,
    check_weights: bool = True,
    conditioning: Mapping[str, torch.Tensor] | None = None,
    with_means: bool = False,
    scheduler: Any = None,
) -> Any:
    """log p(x_{i+1} | x_i) [B, T] recomputed with `pipeline` on `traj`.

    `pipeline`: the trainer's own stock diffusers pipeline, as it loaded it (`from_pretrained`,
    on its device and dtype; its transformer may be peft-wrapped, `get_peft_model` or
    `add_adapter`), or a `sigmaflight.pipeline.models.LoadedModel`. The pipeline is called as the
    server called it: the request and the call's other keywords (height, width, guidance_scale,
    max_sequence_length, ...) come from the trajectory's metadata (`request`, `call`), so the
    pipeline needs nothing else. With the server's weights this gives the trajectory's own
    `log_probs` bit for bit; with `grad=True` the result carries a graph to the pipeline's
    trainable parameters.

    The trajectory's `model.components` (a weights digest per component) are compared with
    `current_components(model)`, the components `model` holds as they are now (None ones, such as
    text encoders a trainer leaves out, are skipped; a trajectory without `components` is compared
    on its whole `model.digest`): when one differs (the trajectory was made with other weights,
    e.g. before a weights push, or this is an off-policy inner step) it warns `WeightsMismatch`
    naming it, or raises ValueError with `strict=True`. `check_weights=False` skips the check (an
    off-policy step on purpose).

    `conditioning`: the rollout's "conditioning/v1" tensors (`Client.pull_conditioning`): the
    prompts are not encoded, so the pipeline's text encoders may be None.

    Instead of a pipeline, its transformer (peft-wrapped or not) with `scheduler=` its scheduler: the
    family's stock pipeline is built around the two (no VAE, no text encoders), so `conditioning`
    is required. Without a VAE the pipeline takes the usual scale factor 8 (every SD3, FLUX and Wan
    checkpoint); the built-in tiny models' VAEs scale by 2, so tiny-flux replays from its pipeline.

    `with_means=True` returns `(log_probs, means, stds)`: for each scored transition i, the mean
    (float32 [B, *latent_shape], with the graph under `grad=True`) and std (0-d) of the Gaussian
    kernel p(x_{i+1} | x_i), as dicts keyed by i: what a KL term against a reference policy needs
    (`((means[i] - ref_means[i]) ** 2 / (2 * stds[i] ** 2))`, the two kernels sharing the std).

    It runs a diffusers model: diffusers must be installed (the trainer's own, or the `train`
    extra). Scoring transitions from velocities you computed needs only torch: `step_log_prob`."""
    try:
        from sigmaflight.pipeline.replay import Replayer
    except ModuleNotFoundError as exc:
        if exc.name != "diffusers":
            raise
        raise ModuleNotFoundError("replay_log_probs runs a diffusers model and diffusers is not installed: "
                                  "pip install 'sigmaflight[train]' (or your own diffusers)", name=exc.name) from exc

    if scheduler is not None:
        if conditioning is None:
            raise ValueError("conditioning: a transformer and scheduler replay on the rollout's conditioning stream "
                             "(Client.pull_conditioning); pass conditioning=, or pass the whole pipeline")
        pipeline = _pipeline_around(pipeline, scheduler)
    model = _replay_model(pipeline, traj)
    if check_weights:
        _check_weights(model, traj, strict=strict)
    result = Replayer(model).replay(
        rollout_spec(traj),
        latents=traj.latents,
        steps=[int(s) for s in traj.steps],
        sigmas=traj.sigmas,
        timesteps=traj.timesteps,
        seeds=[int(s) for s in traj.seeds],
        per_sample_model_calls=per_sample_model_calls,
        grad=grad,
        conditioning=conditioning,
    )
    return (result.log_probs, result.means, result.stds) if with_means else result.log_probs


_RESOLVED = ("height", "width", "guidance_scale", "num_frames")
"""The `call` keys that are ModelDefaults fields; the others are the model's fixed call keywords."""


_PIPELINE_OF = {
    "SD3Transformer2DModel": "StableDiffusion3Pipeline",
    "FluxTransformer2DModel": "FluxPipeline",
    "WanTransformer3DModel": "WanPipeline",
}
"""The stock pipeline class around a transformer class (the families sigmaflight serves)."""


def _pipeline_around(transformer: Any, scheduler: Any) -> Any:
    """The family's stock diffusers pipeline holding `transformer` and `scheduler` and nothing else."""
    import inspect

    import diffusers

    base = transformer.get_base_model() if hasattr(transformer, "get_base_model") else transformer  # a PeftModel
    name = _PIPELINE_OF.get(type(base).__name__)
    if name is None:
        raise TypeError(f"a transformer with scheduler= must be one of {', '.join(sorted(_PIPELINE_OF))}, got "
                        f"{type(base).__name__}; pass the whole pipeline instead")
    cls = getattr(diffusers, name)
    params = inspect.signature(cls.__init__).parameters
    missing = {k: None for k, p in params.items() if k not in ("self", "transformer", "scheduler")
               and p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
    pipe = cls(transformer=transformer, scheduler=scheduler, **missing)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _replay_model(pipeline: Any, traj: Trajectory) -> Any:
    """A LoadedModel as is; a stock diffusers pipeline wrapped in one whose defaults are the
    trajectory's recorded `call` (what the server resolved), so the replay calls it as the server did."""
    import torch

    from sigmaflight.pipeline.families import family_of_pipeline
    from sigmaflight.pipeline.models import LoadedModel, ModelDefaults

    if isinstance(pipeline, LoadedModel):
        return pipeline
    transformer = getattr(pipeline, "transformer", None)
    if not isinstance(getattr(pipeline, "components", None), Mapping) or not isinstance(transformer, torch.nn.Module):
        raise TypeError("pipeline must be a diffusers pipeline with a transformer (e.g. "
                        f"StableDiffusion3Pipeline.from_pretrained(...)) or a LoadedModel, got {type(pipeline).__name__}")
    call = traj.metadata.get("call")
    if not isinstance(call, Mapping) or any(k not in call for k in ("height", "width", "guidance_scale")):
        raise ValueError(f"trajectory {traj.header.rollout_id} records no `call` (height, width, guidance_scale, ...) "
                         "in its metadata: a server older than this client made it; replay it with a LoadedModel")
    base = [p for n, p in transformer.named_parameters() if "lora_" not in n] or list(transformer.parameters())
    family = family_of_pipeline(pipeline)
    defaults = ModelDefaults(
        height=int(call["height"]),
        width=int(call["width"]),
        num_inference_steps=int(traj.metadata["request"]["num_inference_steps"]),
        guidance_scale=float(call["guidance_scale"]),
        num_frames=None if call.get("num_frames") is None else int(call["num_frames"]),
        is_video=family.is_video,
        call_kwargs={k: v for k, v in call.items() if k not in _RESOLVED},
    )
    made = traj.metadata.get("model") or {}
    return LoadedModel(id=str(made.get("id", "")), family=family.name, pipeline=pipeline, device=base[0].device,
                       dtype=base[0].dtype, digest="", defaults=defaults)


def _check_weights(model: Any, traj: Trajectory, *, strict: bool) -> None:
    made = traj.metadata.get("model") or {}
    made_with, recorded = made.get("digest"), made.get("components")
    if made_with is None:
        return
    from sigmaflight.pipeline.digests import current_components

    have = current_components(model)
    if isinstance(recorded, Mapping) and "transformer" in recorded and "transformer" in have:
        # Compare the components this model holds (a trainer without text encoders holds fewer).
        differ = sorted(n for n in have if have[n] != recorded.get(n))
        if not differ:
            return
        detail = ", ".join(
            f"{n} ({_short(have[n])}, the rollout's {_short(recorded[n])})" if n in recorded
            else f"{n} (the rollout's model has none)" for n in differ)
        message = (f"trajectory {traj.header.rollout_id} was made with other weights than the model replaying it "
                   f"has: {detail}")
    else:
        from sigmaflight.pipeline.models import combine_digests

        have_digest = combine_digests(have)
        if have_digest == made_with:
            return
        message = (f"trajectory {traj.header.rollout_id} was made with weights {made_with[:12]}, but the model "
                   f"replaying it has weights {have_digest[:12]}")
    message += ": the log-probs are not the rollout's own (pass check_weights=False for an intended off-policy replay)"
    if strict:
        raise ValueError(message)
    warnings.warn(WeightsMismatch(message), stacklevel=3)


def _short(digest: str) -> str:
    return digest[:12] + "..."


def __getattr__(name: str) -> Any:
    """`current_components` and `current_digest` (the trainer's side of the weights check) live in
    sigmaflight.pipeline.digests and need torch: imported on first use (PEP 562)."""
    if name in ("current_components", "current_digest"):
        from sigmaflight.pipeline import digests

        return getattr(digests, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
