"""`Client.stream`: a dataset of requests through the service, each finished rollout as it completes.

    with client.stream(({"prompts": [p], "num_outputs_per_prompt": 4} for p in prompts), in_flight=8) as rollouts:
        for r in rollouts:          # in the order they finish
            if r.error is None:
                train_on(r.trajectory)

One thread keeps at most `in_flight` rollouts submitted and unfinished: it submits the next
request as soon as one finishes (a 429, or a 503 that says "not now", is backed off, never raised). Pull threads (up to
LIVE_PULLS) each follow the oldest submitted rollout's Flight stream while it runs, so a rollout
is known finished the moment its stream ends (no polling) and its trajectory is already here; its
outputs are pulled after it when asked. Rollouts keep running while the trainer works on what it
has; at most `in_flight` finished rollouts wait for the trainer (the unfinished ones count, as
they will land on top), beyond that nothing more is submitted until the trainer takes one. With
`max_staleness`, a rollout is checked when it finishes and again when the trainer takes it, and run
again only when the server serves other weights than it ran with.

A rollout that failed, a request the server refused (a 422, a 409 stale_policy, a 503 weights_failed:
a model failed closed, which no wait gets past) or a pull that
failed (its idle timeout: the rollout is cancelled) comes out as that item's `error` (the typed
error, sigmaflight/errors.py), and the iteration goes on. What stops it is raised from the
iteration: a refused token (Unauthorized), a server that is gone (ServerUnreachable), an exception
from the requests iterable itself.

Closing the stream (`close()`, leaving its `with` block, breaking out of a `for` over it, Ctrl-C
while it waits, or the stream being garbage collected) cancels the rollouts still queued or running
and releases the finished ones nobody took. It does not wait for the requests iterable (a generator
reading a dataset cannot be interrupted): what it yields after the close is not sent.
"""

from __future__ import annotations

import collections
import hashlib
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sigmaflight import rest
from sigmaflight.errors import ApiError, ServerUnreachable, Unauthorized
from sigmaflight.wire import Ticket

if TYPE_CHECKING:
    import numpy as np

    from sigmaflight.client import Client
    from sigmaflight.dataplane.client import Trajectory

__all__ = ["Rollout", "Stream"]

LIVE_PULLS = 32
"""At most this many pull threads, each following one rollout's Flight stream live (a Flight
stream slot each on the server, of its --max-flight-streams, default 64)."""
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


@dataclass
class _Entry:
    request: Mapping[str, Any]
    ticket: Ticket
    resubmits: int


_END = object()


class _Driver:
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
        self.unfinished: dict[str, _Entry] = {}  # submitted, its pull not done
        self.pending: collections.deque[_Entry] = collections.deque()  # submitted, no pull thread on it yet
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
            self.out.put(_END)

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
        entry = _Entry(request, ticket, resubmits)
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
            _cancel(self.client, ticket)

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

    def pull(self, entry: _Entry) -> Rollout | None:
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
        self.resubmit(_Entry(item.request, item.ticket, item.resubmits))
        return True

    def resubmit(self, entry: _Entry) -> None:
        """A rollout too far behind the latest push: release its result and run the request again."""
        _cancel(self.client, entry.ticket)
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
            deadline = time.monotonic() + self.client.timeout + 5
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
            if not _cancel(self.client, ticket):
                break
        self.out.put(_END)  # whoever still waits on the queue sees the end


class Stream(Iterator[Rollout]):
    """The iterator `Client.stream` returns: finished rollouts in the order they complete.

    `submitted`: rollouts submitted so far (resubmissions included); `resubmitted`: rollouts run
    again for being more than `max_staleness` versions behind; `peak_in_flight`: the most rollouts
    it had submitted and unfinished at once (never above `in_flight`)."""

    def __init__(self, client: Client, requests: Iterable[Mapping[str, Any]], *, in_flight: int = 8,
                 outputs: bool = False, max_staleness: int | None = None, progress: bool | None = None) -> None:
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"in_flight: must be an integer >= 1 (got {in_flight!r})")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness: must be None or an integer >= 0 (got {max_staleness!r})")
        if isinstance(requests, Mapping):
            raise TypeError("requests: an iterable of request dicts (a list or a generator), not one dict")
        self._driver = _Driver(client, requests, in_flight=in_flight, outputs=bool(outputs),
                               max_staleness=max_staleness)
        self._bar = _progress_bar(requests, progress)
        self._failed = 0
        self._done = False
        self._close = weakref.finalize(self, _close, self._driver, self._bar)
        self._driver.start()

    @property
    def submitted(self) -> int:
        return self._driver.submitted

    @property
    def resubmitted(self) -> int:
        return self._driver.resubmitted

    @property
    def peak_in_flight(self) -> int:
        return self._driver.peak_in_flight

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Rollout:
        while True:
            if self._done:
                raise StopIteration
            try:
                item = self._driver.out.get()
            except BaseException:  # Ctrl-C while waiting: cancel what runs, then let it through
                self.close()
                raise
            if item is _END:
                self._done = True
                error = self._driver.error
                self.close()
                if error is not None:
                    raise error
                raise StopIteration
            stale = self._driver.stale_when_taken(item)  # before `taken`: the submitter is still there
            self._driver.taken()
            if not stale:
                break
        if self._bar is not None:
            self._failed += item.error is not None
            self._bar.set_postfix(failed=self._failed, refresh=False)
            self._bar.update(1)
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        """Cancel the rollouts still queued or running and stop; the iteration ends."""
        self._done = True
        self._close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rerun_key(key: str, reruns: int) -> str:
    """The idempotency key a stale request is submitted again under: the request's own key would
    answer with the stale rollout. Derived, so a rerun sent twice still runs once; at most 255
    characters, as every key."""
    suffix = f"~rerun{reruns}"
    if len(key) + len(suffix) > 255:
        key = hashlib.sha256(key.encode()).hexdigest()
    return key + suffix


def _cancel(client: Client, ticket: Ticket) -> bool:
    """Cancel a queued or running rollout, release a finished one; False once the Client is closed."""
    try:
        client.cancel(ticket)
    except ApiError:
        pass  # it ended meanwhile, or the server is gone: nothing left to stop
    except RuntimeError:  # the Client was closed before this stream (closed at garbage collection)
        return False
    return True


def _close(driver: _Driver, bar: Any) -> None:
    driver.close()
    if bar is not None:
        bar.close()


def _progress_bar(requests: Iterable[Any], progress: bool | None) -> Any:
    """A tqdm bar on stderr when asked, or (progress=None) when stderr is a terminal."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm

    total = len(requests) if hasattr(requests, "__len__") else None  # type: ignore[arg-type]
    return tqdm(total=total, desc="rollouts", unit="rollout", file=sys.stderr)

