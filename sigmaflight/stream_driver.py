"""The work behind `Client.stream` (sigmaflight/stream.py): one thread submits the requests,
pull threads follow each submitted rollout's Flight stream to its end, and a queue hands the
finished ones to the trainer. `Rollout` is what the trainer gets."""

from __future__ import annotations

import collections
import hashlib
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sigmaflight import rest
from sigmaflight.errors import ApiError, ServerUnreachable, Unauthorized
from sigmaflight.wire import Ticket

if TYPE_CHECKING:
    import numpy as np

    from sigmaflight.client import Client
    from sigmaflight.dataplane.client import Trajectory

__all__ = ["END", "FATAL", "LIVE_PULLS", "Driver", "Rollout", "cancel_or_release", "rerun_key"]

LIVE_PULLS = 32
"""At most this many pull threads, each following one rollout's Flight stream live (a Flight
stream slot each on the server, of its --max-flight-streams, default 64)."""
PULLS_END_S = 2.0
"""How long `close` waits for the pull threads, which end with the cancels it sends."""
FATAL = (Unauthorized, ServerUnreachable)
"""Errors that end the whole stream: no later request could do better."""


@dataclass
class Rollout:
    """One finished rollout of a stream.

    `request`: the request dict as given; `ticket`: its Ticket (None when the server refused the
    request); `trajectory`: the pulled Trajectory (None when the rollout failed or was refused, kept
    when only its outputs could not be pulled); `outputs`: the decoded outputs
    (`Client.pull_outputs`) when the stream was asked for them, else None; `weights_version` and
    `digest`: the weights it ran with (from the trajectory's metadata); `error`: None, or the
    typed error (RolloutFailed, RolloutCancelled, ApiError, ...) of a rollout that did not succeed;
    `resubmits`: how often the request was resubmitted as stale (`max_staleness`)."""

    request: Mapping[str, Any]
    ticket: Ticket | None
    trajectory: Trajectory | None = None
    outputs: np.ndarray[Any, Any] | None = None
    weights_version: int | None = None
    digest: str | None = None
    error: Exception | None = None
    resubmits: int = 0

    def __repr__(self) -> str:  # the rollout's id, not its whole ticket; the outputs by shape and dtype
        outputs = None if self.outputs is None else f"<{self.outputs.dtype} array {tuple(self.outputs.shape)}>"
        rollout = f"id={self.ticket.id!r}" if self.ticket is not None else "ticket=None (refused)"
        return (f"Rollout({rollout}, trajectory={self.trajectory!r}, outputs={outputs}, "
                f"weights_version={self.weights_version}, error={self.error!r}, resubmits={self.resubmits})")


@dataclass
class Entry:
    """A submitted request: its rollout's ticket and how often it was run again as stale."""

    request: Mapping[str, Any]
    ticket: Ticket
    resubmits: int


END = object()


class Driver:
    """The stream's work: one thread submits, `min(in_flight, LIVE_PULLS)` threads each take the
    oldest submitted rollout nobody follows yet and pull it (the pull follows the running rollout
    live and ends when it does: that is how the stream learns a rollout finished, without
    polling). Holds no reference to the Stream, so dropping the Stream can close it."""

    def __init__(self, client: Client, requests: Iterable[Mapping[str, Any]], *, in_flight: int, outputs: bool,
                 max_staleness: int | None) -> None:
        self.client = client
        self.requests = iter(requests)
        self.in_flight = in_flight
        self.outputs = outputs
        self.max_staleness = max_staleness
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """Finished rollouts for the consumer. SimpleQueue: its get is one C call, so a Ctrl-C while
        the consumer waits raises KeyboardInterrupt cleanly (queue.Queue's Python Condition can be
        interrupted between its lock operations: "release unlocked lock")."""
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.unfinished: dict[str, Entry] = {}  # submitted, its pull not done
        self.pending: collections.deque[Entry] = collections.deque()  # submitted, no pull thread on it yet
        self.retry: collections.deque[tuple[Mapping[str, Any], int]] = collections.deque()
        self.held = 0  # finished rollouts waiting in `out` for the consumer
        self.done = False  # the submitter has ended: pull threads end once `pending` is empty
        self.submitted = 0
        self.resubmitted = 0
        self.peak_in_flight = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name="sigmaflight-stream", daemon=True)
        self.pullers = [threading.Thread(target=self.follow, name=f"sigmaflight-pull-{k}", daemon=True)
                        for k in range(min(in_flight, LIVE_PULLS))]
        self.closed = False
        self.in_requests = False  # the submitter is in next(requests), which nothing can interrupt

    def start(self) -> None:
        self.thread.start()
        for t in self.pullers:
            t.start()

    # -- the submitting thread -------------------------------------------------------------------
    def run(self) -> None:
        exhausted = False
        try:
            while True:
                with self.cond:
                    while not (self.stop.is_set() or self.can_submit(exhausted) or (exhausted and self.idle())):
                        self.cond.wait(0.5)
                    if self.stop.is_set() or (exhausted and self.idle()):
                        break
                    nxt = self.retry.popleft() if self.retry else None
                if nxt is None:
                    self.in_requests = True  # a close does not wait for a slow generator
                    try:
                        request = next(self.requests)
                    except StopIteration:
                        exhausted = True
                        continue
                    finally:
                        self.in_requests = False
                    if self.stop.is_set():  # closed while the generator worked: submit nothing more
                        break
                    if not isinstance(request, Mapping):
                        raise TypeError(f"each request of a stream must be a dict of RolloutRequest fields, "
                                        f"not {type(request).__name__}")
                    nxt = (request, 0)
                self.submit(*nxt)
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, raised there)
            self.error = exc
            self.stop.set()
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()
            for t in self.pullers:
                if t.is_alive() and not self.stop.is_set():
                    t.join()
            self.out.put(END)

    def can_submit(self, exhausted: bool) -> bool:
        # the unfinished ones land on top of those waiting: together at most in_flight
        room = len(self.unfinished) + self.held < self.in_flight
        return room and (bool(self.retry) or not exhausted)

    def idle(self) -> bool:
        """Nothing left to run, and the trainer has taken every item: one it takes may be found
        stale then and run again, so the submitter lives until then."""
        return not self.unfinished and not self.retry and self.held == 0

    def submit(self, request: Mapping[str, Any], resubmits: int) -> None:
        body = dict(request)
        key = body.pop("idempotency_key", None)  # submit's keyword: the header, not a body field
        if key is not None and resubmits:  # the same key would answer with the stale rollout again
            key = rerun_key(str(key), resubmits)
        attempt = 0
        while True:
            try:
                ticket = self.client._call(rest.submit(body, key))
                break
            except FATAL:
                raise
            except ApiError as exc:
                if rest.worth_retrying(exc.status, exc.type) and not self.stop.is_set():  # not now: back off,
                    self.stop.wait(rest.backoff(attempt))  # but a close ends the wait at once
                    attempt += 1
                    if not self.stop.is_set():
                        continue
                    return
                self.emit(Rollout(request, None, error=exc, resubmits=resubmits))  # refused: its item's error
                return
            except ValueError as exc:
                self.emit(Rollout(request, None, error=exc, resubmits=resubmits))
                return
        entry = Entry(request, ticket, resubmits)
        self.client.flight(ticket.flight.locations[0])  # made here, once: Client's cache is not for threads
        with self.cond:
            self.submitted += 1
            closed = self.stop.is_set()  # closed while the POST was under way: close() has not seen it
            if not closed:
                self.unfinished[ticket.id] = entry
                self.pending.append(entry)
                self.peak_in_flight = max(self.peak_in_flight, len(self.unfinished))
                self.cond.notify_all()
        if closed:
            cancel_or_release(self.client, ticket)

    def emit(self, item: Rollout) -> None:
        with self.cond:
            self.held += 1
            self.out.put(item)

    # -- pull threads --------------------------------------------------------------------------
    def follow(self) -> None:
        while True:
            with self.cond:
                while not (self.pending or self.stop.is_set() or self.done):
                    self.cond.wait(0.5)
                if self.stop.is_set() or not self.pending:
                    return
                entry = self.pending.popleft()
            try:
                item = self.pull(entry)
            except BaseException as exc:  # noqa: BLE001 (not an item's error: the stream ends with it)
                self.error = exc
                self.stop.set()
                with self.cond:
                    self.cond.notify_all()
                return
            with self.cond:
                if item is not None and not self.stop.is_set():
                    self.held += 1
                    self.out.put(item)
                self.unfinished.pop(entry.ticket.id, None)
                self.cond.notify_all()

    def pull(self, entry: Entry) -> Rollout | None:
        """The finished rollout of `entry` (waits while it runs), or None when it was resubmitted."""
        item = Rollout(entry.request, entry.ticket, resubmits=entry.resubmits)
        try:
            item.trajectory = self.retrying(self.client.pull, entry.ticket)
            made = item.trajectory.metadata.get("model") or {}
            version = made.get("weights_version")
            item.weights_version = int(version) if version is not None else None
            item.digest = made.get("digest")
            if self.stale(str(made.get("id", "")), item.weights_version, item.digest):
                self.resubmit(entry)
                return None
            if self.outputs:
                item.outputs = self.retrying(self.client.pull_outputs, entry.ticket)
        except FATAL:
            raise
        except ApiError as exc:
            item.error = exc
        except (TimeoutError, ValueError) as exc:  # the pull gave up (pull_idle_timeout), not the rollout:
            item.error = exc  # its item's error, and the rollout is not left running or held
            try:
                self.client.cancel(entry.ticket)
            except ApiError:
                pass
        return item

    def retrying(self, pull: Any, ticket: Ticket) -> Any:
        """`pull(ticket)`, retried while the Flight server has no stream slot free."""
        attempt = 0
        while True:
            try:
                return pull(ticket)
            except ApiError as exc:
                if exc.type != "too_many_streams" or self.stop.is_set():
                    raise
            self.stop.wait(rest.backoff(attempt))
            attempt += 1

    def stale(self, model_id: str, version: int | None, digest: str | None) -> bool:
        """More than `max_staleness` versions behind this client's latest push, and the server now
        serves other weights than the rollout ran with: a rerun would run on newer ones. (A server
        restarted since the push serves version 0 again: its rollouts are not newer for a rerun,
        and rerunning them would never end.)"""
        if self.max_staleness is None or version is None:
            return False
        latest = self.client.pushed_versions.get(model_id)
        if latest is None or latest - version <= self.max_staleness:
            return False
        try:
            served = next((m for m in self.client.models() if m.get("id") == model_id), None)
        except ApiError:
            return True  # the server did not say: run it again, as the push asks
        return served is not None and served.get("digest") != digest and int(served.get("weights_version", 0)) > version

    def stale_when_taken(self, item: Rollout) -> bool:
        """A finished rollout that waited for the trainer while it pushed: stale now, it is released
        and its request run again (the submitter lives until every item is taken, `idle`)."""
        if item.trajectory is None or item.ticket is None:
            return False
        made = item.trajectory.metadata.get("model") or {}
        if not self.stale(str(made.get("id", "")), item.weights_version, item.digest):
            return False
        self.resubmit(Entry(item.request, item.ticket, item.resubmits))
        return True

    def resubmit(self, entry: Entry) -> None:
        """A rollout too far behind the latest push: release its result and run the request again."""
        cancel_or_release(self.client, entry.ticket)
        with self.cond:
            self.resubmitted += 1
            self.retry.append((entry.request, entry.resubmits + 1))
            self.cond.notify_all()

    # -- the consumer's side -------------------------------------------------------------------
    def taken(self) -> None:
        with self.cond:
            self.held -= 1
            self.cond.notify_all()

    def close(self) -> None:
        """Stop and cancel what is still queued or running (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            # a POST under way registers its rollout for the cancels below (or, past this wait,
            # cancels it itself); the generator is not waited for: what it yields now is dropped
            deadline = time.monotonic() + (self.client.timeout or 30.0) + 5  # None: no REST limit
            while self.thread.is_alive() and not self.in_requests and time.monotonic() < deadline:
                self.thread.join(timeout=0.05)
        with self.cond:
            left = [entry.ticket for entry in self.unfinished.values()]
            self.unfinished.clear()
            self.pending.clear()
        while True:  # finished rollouts nobody took: their results are released, not left to the TTL
            try:
                item = self.out.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Rollout) and item.ticket is not None:
                left.append(item.ticket)
        for ticket in left:  # the pulls following them end with the cancel
            if not cancel_or_release(self.client, ticket):
                break
        until = time.monotonic() + PULLS_END_S  # so none still reads when the caller closes its Client
        for t in self.pullers:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, until - time.monotonic()))
        self.out.put(END)  # whoever still waits on the queue sees the end


def rerun_key(key: str, reruns: int) -> str:
    """The idempotency key a stale request is submitted again under: the request's own key would
    answer with the stale rollout. Derived, so a rerun sent twice still runs once; at most 255
    characters, as every key."""
    suffix = f"~rerun{reruns}"
    if len(key) + len(suffix) > 255:
        key = hashlib.sha256(key.encode()).hexdigest()
    return key + suffix


def cancel_or_release(client: Client, ticket: Ticket) -> bool:
    """Cancel a queued or running rollout, release a finished one; False once the Client is closed."""
    try:
        client.cancel(ticket)
    except ApiError:
        pass  # it ended meanwhile, or the server is gone: nothing left to stop
    except RuntimeError:  # the Client was closed before this stream (closed at garbage collection)
        return False
    return True
