"""`AsyncClient`: the trainer's client as coroutines, for asyncio trainers and orchestrators.

    async with AsyncClient("http://127.0.0.1:8000") as client:
        ticket = await client.submit(prompts=["a red cube"], num_inference_steps=8, seed=7)
        await client.wait(ticket)
        traj = await client.pull(ticket)
        async with client.stream(requests, in_flight=8) as rollouts:
            async for r in rollouts:
                ...

The REST calls are the very `Call`s `Client` sends (sigmaflight/rest.py: paths, bodies, error
mapping, retries), sent with httpx.AsyncClient, so a thousand `wait`s cost no threads. Flight
pulls, weights and LoRA pushes (serialising tensors, reading Arrow) run the blocking `Client`'s
own methods in a thread (`asyncio.to_thread`); `stream` runs `Client.stream` and hands its
rollouts over as an async iterator. The errors are the same typed errors (sigmaflight/errors.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from sigmaflight import rest
from sigmaflight.client import Client
from sigmaflight.dataplane.auth import bearer_header
from sigmaflight.dataplane.cancel import PullScope, pull_scope
from sigmaflight.dataplane.transport import Transport
from sigmaflight.errors import ApiError
from sigmaflight.wire import RolloutList, RolloutStatus, Ticket

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import torch

    from sigmaflight.dataplane.client import Trajectory
    from sigmaflight.stream import Rollout, Stream
    from sigmaflight.weights import PushResult

__all__ = ["AsyncClient", "AsyncStream"]

R = TypeVar("R")
QUEUED_POLL_S = (0.05, 0.5)
"""An AsyncClient pull of a queued rollout reads its status this often (doubling from the first to
the second) until it runs."""


class AsyncClient:
    """`Client`'s surface as coroutines: submit, branch, status, rollouts, rollout_page, wait,
    cancel, models, pull, pull_outputs, pull_conditioning, pull_stream, locate, stream_ticket,
    push_weights, push_weights_file, weights_manifest, push_lora, delete_lora, and `stream` as an
    async iterator. Same arguments, same answers, same typed errors (tests/control/test_async_surface.py
    compares the two signatures)."""

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
        """As `Client`'s: ``timeout`` is REST's, ``pull_idle_timeout`` the pulls' (None: no limit),
        ``ca_file`` the PEM certificate(s) an https:// server is trusted by (REST and Flight)."""
        self.sync = Client(url, token, timeout=timeout, transport=transport, host=host,
                           pull_idle_timeout=pull_idle_timeout, ca_file=ca_file)
        """The blocking Client that pulls, pushes and streams run on (in a thread)."""
        self.url, self.token, self.timeout = self.sync.url, self.sync.token, self.sync.timeout
        self.pull_idle_timeout, self.ca_file = pull_idle_timeout, self.sync.ca_file
        self.transport, self.host, self.trust = self.sync.transport, self.sync.host, self.sync.trust
        self._http = httpx.AsyncClient(base_url=self.url, headers=bearer_header(self.token), timeout=self.timeout,
                                       verify=self.sync.trust.verify)

    @property
    def pushed_versions(self) -> dict[str, int]:
        """model id -> the weights_version of the latest weights or LoRA change this client made."""
        return self.sync.pushed_versions

    async def _call(self, call: rest.Call[rest.T]) -> rest.T:
        return await rest.send_async(self._http, call, url=self.url, timeout=self.timeout,
                                     pushed=self.sync.pushed_versions)

    async def aclose(self) -> None:
        await self._http.aclose()
        await asyncio.to_thread(self.sync.close)

    def __repr__(self) -> str:  # the token never shows
        return f"<{type(self).__name__} {self.url} token={'***' if self.token else None} timeout={self.timeout}>"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- REST ----------------------------------------------------------------------------
    async def submit(self, *, idempotency_key: str | None = None, **request: Any) -> Ticket:
        return await self._call(rest.submit(request, idempotency_key))

    async def branch(self, parent: str | Ticket, step: int, samples: list[int] | None = None, *, branches: int = 1,
                     sampler: Mapping[str, Any] | None = None, idempotency_key: str | None = None,
                     **request: Any) -> Ticket:
        body = rest.branch_body(parent, step, samples, branches, sampler, request)
        return await self.submit(idempotency_key=idempotency_key, **body)

    async def status(self, rollout_id: str | Ticket, *, wait_s: float | None = None) -> RolloutStatus:
        return await self._call(rest.status(rollout_id, wait_s, self.timeout))

    async def rollouts(self, status: str | None = None, limit: int = 100, *,
                       ticket: str | None = None, after: str | None = None) -> list[RolloutStatus]:
        return (await self.rollout_page(status, limit, ticket=ticket, after=after)).rollouts

    async def rollout_page(self, status: str | None = None, limit: int = 100, *,
                           ticket: str | None = None, after: str | None = None) -> RolloutList:
        call = rest.rollout_page(status, limit, ticket, after)  # status and after checked here
        if ticket is not None and not rest.could_be_ticket(ticket):
            return RolloutList(rollouts=[])
        return await self._call(call)

    async def wait(self, ticket: str | Ticket, timeout: float | None = 300.0, *, poll_s: float = 0.05,
                   max_poll_s: float = 1.0, raise_on_failure: bool = True) -> RolloutStatus:
        waiting = rest.Waiting(timeout, poll_s, max_poll_s, raise_on_failure)
        while True:
            st = await self.status(ticket, wait_s=waiting.hold_s())
            pause = waiting.pause_after(st)
            if pause is None:
                return st
            await asyncio.sleep(pause)

    async def cancel(self, rollout_id: str | Ticket) -> RolloutStatus:
        return await self._call(rest.cancel(rollout_id))

    async def models(self) -> list[dict[str, Any]]:
        return await self._call(rest.models())

    async def delete_lora(self, model_id: str) -> dict[str, Any]:
        return await self._call(rest.delete_lora(model_id))

    # -- in a thread: Flight pulls, tensor pushes -----------------------------------------
    async def push_weights(self, model_id: str, state_dict: Mapping[str, torch.Tensor], *, only_changed: bool = True,
                           partial: bool = False, chunk_bytes: int = 8 << 20, progress: bool | None = None,
                           retries: int = 3, push_id: str | None = None) -> PushResult:
        return await asyncio.to_thread(self.sync.push_weights, model_id, state_dict, only_changed=only_changed,
                                       partial=partial, chunk_bytes=chunk_bytes, progress=progress, retries=retries,
                                       push_id=push_id)

    async def push_weights_file(self, model_id: str, path: str, *, partial: bool = False) -> PushResult:
        return await asyncio.to_thread(self.sync.push_weights_file, model_id, path, partial=partial)

    async def weights_manifest(self, model_id: str) -> dict[str, str]:
        return await asyncio.to_thread(self.sync.weights_manifest, model_id)

    async def push_lora(self, model_id: str, adapter: Mapping[str, torch.Tensor], lora_config: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.push_lora, model_id, adapter, lora_config)

    async def pull(self, ticket: str | Ticket) -> Trajectory:
        await self._until_served(ticket, "trajectory")
        return await _pulled(self.sync.pull, ticket)

    async def pull_outputs(self, ticket: str | Ticket) -> np.ndarray[Any, np.dtype[np.uint8]]:
        await self._until_served(ticket, "outputs")
        return await _pulled(self.sync.pull_outputs, ticket)

    async def pull_conditioning(self, ticket: str | Ticket) -> dict[str, torch.Tensor]:
        await self._until_served(ticket, "conditioning")
        return await _pulled(self.sync.pull_conditioning, ticket)

    async def pull_stream(self, ticket: str | Ticket, stream: str) -> pa.Table:
        await self._until_served(ticket, stream)
        return await _pulled(self.sync.pull_stream, ticket, stream)

    async def _until_served(self, ticket: str | Ticket, stream: str) -> None:
        """Wait here, where cancelling the task reaches, for what the Flight call would wait for out
        of its reach (pyarrow's do_get returns only once the server starts the stream): a trajectory
        is served once its rollout runs, the other streams once it has ended. Anything REST cannot
        say (a bare Flight ticket, a refusal) is left to the pull, which says what is wrong."""
        try:
            st = await self.status(ticket)
            if stream != "trajectory":  # one the rollout does not have is the pull's NotFound, at once
                if stream in st.flight.streams and st.status.active:
                    await self.wait(st.id, timeout=None, raise_on_failure=False)
                return
            pause = QUEUED_POLL_S[0]
            while st.status == "queued":  # no read is held until a rollout starts: poll
                await asyncio.sleep(pause)
                pause = min(2 * pause, QUEUED_POLL_S[1])
                st = await self.status(st.id)
        except ApiError:
            return

    async def locate(self, ticket: str | Ticket) -> tuple[str, str]:
        return await asyncio.to_thread(self.sync.locate, ticket)

    async def stream_ticket(self, ticket: str | Ticket, stream: str) -> tuple[str, str]:
        return await asyncio.to_thread(self.sync.stream_ticket, ticket, stream)

    def stream(self, requests: Iterable[Mapping[str, Any]], *, in_flight: int = 8, outputs: bool = False,
               max_staleness: int | None = None, progress: bool | None = None) -> AsyncStream:
        """`Client.stream` as an async iterator (`async for r in client.stream(...)`); leaving its
        `async with` block, `aclose()` or cancelling the task that iterates cancels what is queued
        or running."""
        return AsyncStream(self.sync.stream(requests, in_flight=in_flight, outputs=outputs,
                                            max_staleness=max_staleness, progress=progress))


async def _pulled(pull: Callable[..., R], *args: Any) -> R:
    """``pull(*args)`` in a thread; cancelling the awaiting task cancels the Flight streams it has
    open (dataplane/cancel.py), so the server frees them at once instead of when the rollout ends."""
    with pull_scope(PullScope()) as scope:  # this task's context; to_thread hands the thread a copy
        try:
            return await asyncio.to_thread(pull, *args)
        except asyncio.CancelledError:
            scope.cancel()
            raise


_DONE = object()


class AsyncStream:
    """A `sigmaflight.stream.Stream` as an async iterator of `Rollout`s."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Rollout:
        try:
            item = await asyncio.to_thread(_next, self.stream)
        except BaseException:  # the task was cancelled (or Ctrl-C): stop what still runs, in a thread
            # (a close waits for a POST under way) so the event loop goes on meanwhile
            await asyncio.shield(asyncio.to_thread(self.stream.close))
            raise
        if item is _DONE:
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        await asyncio.to_thread(self.stream.close)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def submitted(self) -> int:
        return self.stream.submitted

    @property
    def resubmitted(self) -> int:
        return self.stream.resubmitted

    @property
    def peak_in_flight(self) -> int:
        return self.stream.peak_in_flight


def _next(stream: Stream) -> Any:
    """next() for a thread: StopIteration cannot travel through a Future."""
    return next(stream, _DONE)
