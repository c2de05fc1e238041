"""`Client.stream`: a dataset of requests through the service, each finished rollout as it completes.

    with client.stream(({"prompts": [p], "num_outputs_per_prompt": 4} for p in prompts), in_flight=8) as rollouts:
        for r in rollouts:          # in the order they finish
            if r.error is None:
                train_on(r.trajectory)

One thread keeps at most `in_flight` rollouts submitted and unfinished: it submits the next
request as soon as one finishes (a 429, or a 503 that says "not now", is backed off, never
raised). Pull threads (up to LIVE_PULLS) each follow the oldest submitted rollout's Flight stream
while it runs, so a rollout is known finished the moment its stream ends (no polling) and its
trajectory is already here; its outputs are pulled after it when asked. Rollouts keep running while the trainer works on what it
has; at most `in_flight` finished rollouts wait for the trainer (the unfinished ones count, as
they will land on top), beyond that nothing more is submitted until the trainer takes one. With
`max_staleness`, a rollout is checked when it finishes and again when the trainer takes it, and run
again only when the server serves other weights than it ran with.

A rollout that failed, a request the server refused (a 422, a 409 stale_policy, a 503
weights_failed: a model failed closed, which no wait gets past) or a pull that failed (its idle
timeout: the rollout is cancelled) comes out as that item's `error` (the typed error,
sigmaflight/errors.py), and the iteration goes on. What stops it is raised from the
iteration: a refused token (Unauthorized), a server that is gone (ServerUnreachable), an exception
from the requests iterable itself.

Closing the stream (`close()`, leaving its `with` block, breaking out of a `for` over it, Ctrl-C
while it waits, or the stream being garbage collected) cancels the rollouts still queued or running
and releases the finished ones nobody took. It does not wait for the requests iterable (a generator
reading a dataset cannot be interrupted): what it yields after the close is not sent.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from sigmaflight.stream_driver import END, LIVE_PULLS, Driver, Rollout, rerun_key

if TYPE_CHECKING:
    from sigmaflight.client import Client

__all__ = ["LIVE_PULLS", "Rollout", "Stream", "rerun_key"]


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
        self._driver = Driver(client, requests, in_flight=in_flight, outputs=bool(outputs),
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
            if item is END:
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

    def __repr__(self) -> str:
        return (f"<Stream submitted={self.submitted} resubmitted={self.resubmitted} "
                f"{'closed' if self._done else 'open'}>")

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(driver: Driver, bar: Any) -> None:
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

