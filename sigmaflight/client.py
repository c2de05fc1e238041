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
has the typed errors. docs/trainers.md has the whole tour. `replay_log_probs` and
`rollout_spec` (sigmaflight/replay.py) are importable from here too: they take what `pull` gives.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
import pyarrow as pa
from pyarrow import flight

from sigmaflight import checks, rest
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
from sigmaflight.replay import replay_log_probs, rollout_spec
from sigmaflight.wire import TERMINAL, RolloutList, RolloutStatus, Ticket

if TYPE_CHECKING:  # torch and the data plane's torch side load on first use: `sigmaflight status` needs neither
    import numpy as np
    import torch

    from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
    from sigmaflight.stream import Stream
    from sigmaflight.weights import PushResult

__all__ = [
    "ApiError", "Client", "NotFound", "RolloutCancelled", "RolloutFailed", "ServerUnreachable", "Unauthorized",
    "WeightsMismatch",
    "replay_log_probs", "rollout_spec",
]

STREAMS = ("trajectory", "outputs", "conditioning")
"""The streams a rollout may have (contract, "More streams per rollout"); the last two when asked for."""
LOST_STREAM_WAIT_S = 10.0
"""How long a pull whose stream broke off untyped (its connection lost) waits for REST to say how
the rollout ended: a Ray worker's death is known to the control plane within its call timeout."""


class Client:
    """One REST connection (httpx) and one Flight connection per location, reused."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        *,
        timeout: float | None = 30.0,
        transport: Transport = "auto",
        host: str | None = None,
        pull_idle_timeout: float | None = 3600.0,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """``ca_file``: a PEM file of the certificate(s) to trust for an ``https://`` server (one
        started with ``--tls-cert``/``--tls-key``; a self-signed one's own cert.pem), on REST and on
        its ``grpc+tls://`` Flight plane (pulls, weights pushes) alike; None trusts the system's CAs.
        A file that cannot be read or holds no PEM certificate is ``rest.CAFileError`` (a
        ValueError) naming it, before any request.

        ``transport`` and ``host`` go to each TrajectoryClient: ``"auto"`` reads a finished
        rollout's shared-memory file (a server with --shm-dir on this host) instead of a
        stream; ``"flight"`` always streams. ``host``: this host's id (default: computed).

        ``timeout`` is REST's (each request; None or inf: no limit). ``pull_idle_timeout`` is the pulls' (``pull``,
        ``pull_stream``, ``pull_outputs``, ``pull_conditioning``): seconds without a record
        batch on a started stream before it is cancelled and ``TimeoutError`` raised (the wait
        of a queued rollout to start is not counted; None: no limit). The default, an hour, is
        the TrajectoryClient's (a running rollout is silent while it computes steps it does not
        return)."""
        if pull_idle_timeout is not None and not pull_idle_timeout > 0:
            raise ValueError(f"pull_idle_timeout must be a positive number of seconds or None, got {pull_idle_timeout!r}")
        self.pull_idle_timeout = pull_idle_timeout
        self.ca_file = None if ca_file is None else os.fspath(ca_file)
        self.trust = rest.trust(ca_file)
        """Whom REST (httpx `verify`) and Flight (`tls_root_certs`) trust: ``ca_file``'s certificates."""
        self.url = checks.check_url(url)
        self.token = checks.check_token(token)
        self.transport: Transport = check_transport(transport)
        self.host = host
        self.timeout = checks.check_timeout(timeout)
        self._http = httpx.Client(base_url=self.url, headers=bearer_header(self.token), timeout=self.timeout,
                                  verify=self.trust.verify)
        self._flight: dict[str, TrajectoryClient] = {}
        self.pushed_versions: dict[str, int] = {}
        """model id -> the weights_version of the latest weights or LoRA change this client made."""

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One REST call; ApiError (NotFound, Unauthorized) for a refusal, ServerUnreachable when
        nothing at `url` answers HTTP (httpx's transport errors never reach the caller)."""
        return self._call(rest.Call(method, path, lambda r: r, kwargs))

    def _call(self, call: rest.Call[rest.T]) -> rest.T:
        """Send one shared REST call (sigmaflight/rest.py) and read its answer."""
        return rest.send(self._http, call, url=self.url, timeout=self.timeout, pushed=self.pushed_versions)

    def close(self) -> None:
        self._http.close()
        for c in self._flight.values():
            c.close()
        self._flight.clear()

    def __enter__(self) -> Client:
        return self

    def __repr__(self) -> str:  # the token never shows
        return f"<{type(self).__name__} {self.url} token={'***' if self.token else None} timeout={self.timeout}>"

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- REST ----------------------------------------------------------------------------
    def submit(self, *, idempotency_key: str | None = None, **request: Any) -> Ticket:
        """POST /v1/rollouts with the RolloutRequest fields given as keywords; the 202 Ticket."""
        return self._call(rest.submit(request, idempotency_key))

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
        body = rest.branch_body(parent, step, samples, branches, sampler, request)
        return self.submit(idempotency_key=idempotency_key, **body)

    def status(self, rollout_id: str | Ticket, *, wait_s: float | None = None) -> RolloutStatus:
        """GET /v1/rollouts/{id}; NotFound for an unknown id or a string that cannot be one.
        `wait_s` (at most 60): the server holds the answer until the rollout has ended or for
        that many seconds, whichever is first (an older server answers at once)."""
        return self._call(rest.status(rollout_id, wait_s, self.timeout))

    def rollouts(self, status: str | None = None, limit: int = 100, *, ticket: str | None = None,
                 after: str | None = None) -> list[RolloutStatus]:
        """GET /v1/rollouts, newest first (optionally only one status, or only the rollout that a
        Flight ticket belongs to). At most `limit` (1..1000); `after`: the page after that rollout
        (the last id of the page before). ValueError naming `status` or `after` when it cannot be
        one (not one of the six states; not a rollout id), before any request."""
        return self.rollout_page(status, limit, ticket=ticket, after=after).rollouts

    def rollout_page(self, status: str | None = None, limit: int = 100, *, ticket: str | None = None,
                     after: str | None = None) -> RolloutList:
        """As `rollouts`, with the answer's `next`: the id to pass as `after` for the next page, None
        on the last page."""
        call = rest.rollout_page(status, limit, ticket, after)  # status and after checked here
        if ticket is not None and not rest.could_be_ticket(ticket):
            return RolloutList(rollouts=[])  # no rollout holds a ticket the server would not even look up
        return self._call(call)

    def wait(
        self, ticket: str | Ticket, timeout: float | None = 300.0, *, poll_s: float = 0.05, max_poll_s: float = 1.0,
        raise_on_failure: bool = True,
    ) -> RolloutStatus:
        """Wait until the rollout is finished; TimeoutError after `timeout` seconds (None: no
        limit; a NaN or negative timeout is a ValueError naming it, one of another type a TypeError).

        Each status read is held by the server until the rollout ends (`status(wait_s=20)`): a
        wait costs the server a read every 20 s and returns as the rollout ends. A server that
        answers a read early (an older one, or one holding --max-held-reads reads already) is
        polled after `poll_s`, the pause doubling up to `max_poll_s`. Raises RolloutFailed
        (RolloutCancelled when cancelled) when it ended other than succeeded, unless
        `raise_on_failure=False`."""
        waiting = rest.Waiting(timeout, poll_s, max_poll_s, raise_on_failure)
        while True:
            st = self.status(ticket, wait_s=waiting.hold_s())
            pause = waiting.pause_after(st)
            if pause is None:
                return st
            time.sleep(pause)

    def cancel(self, rollout_id: str | Ticket) -> RolloutStatus:
        """DELETE: cancel a queued/running rollout, or release a finished one's result."""
        return self._call(rest.cancel(rollout_id))

    def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: id, family, dtype, device, digest, defaults, ... per model."""
        return self._call(rest.models())

    def push_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor], *, only_changed: bool = True,
                     partial: bool = False, chunk_bytes: int = 8 << 20, progress: bool | None = None,
                     retries: int = 3, push_id: str | None = None) -> PushResult:
        """Stream the transformer's state dict to the server (Flight do_put, checked, atomic,
        resumed after a cut); by default only the tensors whose checksum differs from the served
        ones. Returns the new digest (a str) with weights_version and bytes sent/skipped;
        WeightsPushError when the server refuses it. `chunk_bytes` (weights.DEFAULT_CHUNK_BYTES),
        `progress`, `retries`, `push_id`: see sigmaflight.weights.push_weights."""
        from sigmaflight.weights import push_weights

        result = push_weights(self, model_id, state_dict, only_changed=only_changed, partial=partial,
                              chunk_bytes=chunk_bytes, progress=progress, retries=retries, push_id=push_id)
        self.pushed_versions[model_id] = result.weights_version  # a Flight commit: rest.check_answer never sees it
        return result

    def push_weights_file(self, model_id: str, path: str, *, partial: bool = False) -> PushResult:
        """Same host: the server reads the safetensors file at `path` (inside its --weights-file-dir
        or --shm-dir), checked and swapped in as a streamed push. See sigmaflight.weights."""
        from sigmaflight.weights import push_weights_file

        result = push_weights_file(self, model_id, path, partial=partial)
        self.pushed_versions[model_id] = result.weights_version
        return result

    def weights_manifest(self, model_id: str) -> dict[str, str]:
        """{tensor key: CRC32C hex} of the served transformer (GET .../weights/manifest)."""
        from sigmaflight.weights import weights_manifest

        return dict(weights_manifest(self, model_id)["tensors"])

    def push_lora(self, model_id: str, adapter: Mapping[str, torch.Tensor], lora_config: Any) -> dict[str, Any]:
        """PUT a LoRA adapter: `adapter` as `peft.get_peft_model_state_dict` gives it, `lora_config`
        a peft LoraConfig (or its `to_dict()`). Returns {"id", "digest", "weights_version", ...}."""
        from safetensors.torch import save

        config = lora_config.to_dict() if hasattr(lora_config, "to_dict") else dict(lora_config)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}
        body = save(tensors, metadata={"lora_config": json.dumps(config, default=sorted)})
        r = self._send("PUT", rest.model_path(model_id, "lora"), content=body,
                       headers={"content-type": "application/octet-stream"})
        return dict(r.json())

    def delete_lora(self, model_id: str) -> dict[str, Any]:
        """DELETE the model's LoRA adapter (ApiError 404 "lora_not_loaded" when there is none)."""
        return self._call(rest.delete_lora(model_id))

    def stream(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        in_flight: int = 8,
        outputs: bool = False,
        max_staleness: int | None = None,
        progress: bool | None = None,
    ) -> Stream:
        """Run `requests` (request dicts, a list or a generator) and yield each finished rollout
        as it completes (sigmaflight.stream.Rollout: request, ticket, trajectory, outputs,
        weights_version, digest, error), keeping at most `in_flight` submitted and unfinished.
        `outputs=True` pulls the decoded outputs too (the requests ask `return.outputs`);
        `max_staleness=k` resubmits a rollout more than k weights versions behind this client's
        latest push; `progress` draws a tqdm bar (default: when stderr is a terminal). Closing
        it (or Ctrl-C) cancels what is queued or running. See sigmaflight/stream.py."""
        from sigmaflight.stream import Stream

        return Stream(self, requests, in_flight=in_flight, outputs=outputs, max_staleness=max_staleness,
                      progress=progress)

    # -- Flight --------------------------------------------------------------------------
    def flight(self, location: str) -> TrajectoryClient:
        """The (cached) data-plane client for one Flight location."""
        from sigmaflight.dataplane.client import TrajectoryClient

        if location not in self._flight:
            self._flight[location] = TrajectoryClient(
                location, token=self.token, transport=self.transport, host=self.host,
                idle_timeout=self.pull_idle_timeout, tls_root_certs=self.trust.root_certs,
            )
        return self._flight[location]

    def locate(self, ticket: str | Ticket) -> tuple[str, str]:
        """(Flight location, Flight ticket) of a Ticket, a rollout id or a Flight ticket string.

        Tickets are opaque here: a string is looked up as a rollout id first; one the server
        does not know as an id is looked up as a Flight ticket (GET /v1/rollouts?ticket=), whose
        rollout names the Flight location that holds it (under Ray, its worker's)."""
        if isinstance(ticket, Ticket):
            return self._location(ticket.flight.locations, ticket), ticket.flight.ticket
        ticket = rest.ref(ticket, "ticket")
        st = self._status_by_id_or_ticket(ticket)
        # a ticket string is kept as given: it may name one of the rollout's extra streams
        return self._location(st.flight.locations, ticket), (ticket if ticket != st.id else st.flight.ticket)

    def _location(self, locations: list[str], ticket: str | Ticket) -> str:
        """The first Flight location; none (a Ray server names none for a rollout no worker holds,
        e.g. one that failed at a shutdown) is RolloutFailed for a rollout that ended so, else NotFound."""
        if locations:
            return locations[0]
        st = self._status_of(ticket)
        if st is not None and st.status in TERMINAL and st.status != "succeeded":
            raise RolloutFailed.from_status(st)
        raise NotFound(None, "not_found", f"rollout {_id(ticket)}: no Flight location holds its trajectory")

    def _status_by_id_or_ticket(self, ref: str) -> RolloutStatus:
        """The status of the rollout `ref` names, as a rollout id or else as a Flight ticket."""
        st = self._status_of(ref)
        if st is None:
            raise rest.no_rollout(ref, self.url)
        return st

    def pull(self, ticket: str | Ticket) -> Trajectory:
        """The whole trajectory as torch tensors (waits for a running rollout; see sigmaflight.dataplane.client).

        A rollout that ended failed raises RolloutFailed, a cancelled one RolloutCancelled, an
        unknown ticket NotFound, a refused token Unauthorized: each with the server's message.
        Any of the rollout's tickets will do (its "outputs" or "conditioning" stream's too)."""
        location, flight_ticket = self.stream_ticket(ticket, "trajectory")
        try:
            return self.flight(location).pull(flight_ticket)
        except flight.FlightError as exc:
            raise self.flight_error(ticket, exc) from None

    def stream_ticket(self, ticket: str | Ticket, stream: str) -> tuple[str, str]:
        """(Flight location, Flight ticket) of one named stream of a rollout ("trajectory",
        "outputs", "conditioning"); NotFound naming it when the rollout did not ask for it."""
        if isinstance(ticket, Ticket):
            flight_ticket = ticket.flight
        else:  # a rollout id or a Flight ticket, as `pull` takes
            flight_ticket = self._status_by_id_or_ticket(rest.ref(ticket, "ticket")).flight
        found = flight_ticket.streams.get(stream)
        if found is None:
            ask = (f"ask for it with return.{stream}" if stream in STREAMS
                   else f"the streams are {', '.join(STREAMS)}")
            raise NotFound(None, "not_found", f"rollout {_id(ticket)} has no {stream!r} stream (streams: "
                           f"{', '.join(flight_ticket.streams) or 'none'}); {ask}")
        return self._location(flight_ticket.locations, ticket), found.ticket

    def pull_stream(self, ticket: str | Ticket, stream: str) -> pa.Table:
        """One stream of a rollout as a pyarrow Table (waits while the rollout runs)."""
        from sigmaflight.dataplane.idle import flight_batches

        location, flight_ticket = self.stream_ticket(ticket, stream)
        try:
            client = self.flight(location)
            reader = client.reader(flight_ticket)
            return pa.Table.from_batches(list(flight_batches(reader, client.idle_timeout)), schema=reader.schema)
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
        than succeeded is RolloutFailed (RolloutCancelled) from its REST status when REST answers;
        an unknown ticket NotFound. The message is the server's, for people."""
        from sigmaflight.dataplane.cancel import cancelled as pull_cancelled
        from sigmaflight.dataplane.errors import error_info, server_message

        info = error_info(exc) or {}
        kind = info.get("type")
        if kind == "not_found" and info.get("ended"):  # a ticket gone because its rollout ended
            kind = info["ended"]
        message = server_message(exc)  # the server's own words, without gRPC's debug context
        if kind == "unauthenticated" or isinstance(exc, flight.FlightUnauthenticatedError):
            return Unauthorized(401, "unauthorized", message)
        try:
            st = self._status_of(ticket)
        except ServerUnreachable:  # REST closes as a shutdown has ended the rollouts: Flight said how
            if kind is None:
                raise
            st = None
        if kind is None and st is not None and st.status not in TERMINAL and not pull_cancelled():
            # an untyped error is the connection (a worker that died under Ray; not the cancel of an
            # AsyncClient pull): the server may not know yet; hold a read until the rollout ends
            with contextlib.suppress(ApiError):
                st = self.status(st.id, wait_s=LOST_STREAM_WAIT_S)
        if st is not None and st.status in TERMINAL and st.status != "succeeded":
            return RolloutFailed.from_status(st, message)
        if kind == "failed":
            return RolloutFailed(message)
        if kind == "cancelled":
            return RolloutCancelled(message)
        if kind in ("not_found", "released", "expired") and st is None:
            return NotFound(None, "not_found", message)
        return ApiError(None, kind or "flight_error", message)

    def _status_of(self, ticket: str | Ticket) -> RolloutStatus | None:
        """The REST status of the rollout `ticket` names (a Ticket, a rollout id or a bare Flight
        ticket, as `locate` takes them), None when REST does not know it: a pull answers the
        same whichever handle the trainer holds. ServerUnreachable when nothing answers there."""
        try:
            return self.status(ticket)
        except ApiError as exc:
            if not _unknown(exc):
                raise
            if not isinstance(ticket, str):
                return None
            try:
                owners = self.rollouts(limit=1, ticket=ticket)
            except ApiError as again:
                if not _unknown(again):
                    raise
                return None
            return owners[0] if owners else None


def _unknown(exc: ApiError) -> bool:
    """A refusal that says REST does not know the handle (404, or 422: no rollout id, perhaps a
    Flight ticket); not a refused token, a server that is gone or busy, which are raised as they are."""
    return exc.status in (404, 422)


def _id(ticket: str | Ticket) -> str:
    return rest.ref(ticket, "ticket")


