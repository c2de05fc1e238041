"""`Client.stream` and `AsyncClient` on a real co-batching server: rollouts come out as they
finish, at most `in_flight` are ever submitted and unfinished (seen in the server's own rollout
list), a 429 is backed off, a failed request is that item's error, closing or Ctrl-C cancels what
is queued or running, and `max_staleness` resubmits a rollout that ran on weights older than the
client's last push.

A blocker (a rollout no request can join: 256 samples, more than --max-batch-samples) keeps a
worker busy while the stream's requests queue, so what the server holds can be observed."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight import ApiError, AsyncClient, Client, NotFound, RolloutCancelled
from sigmaflight.stream import Rollout
from sigmaflight.wire import Ticket
from tests.servers import InProcessServer, wait_for

QUEUE = 4
BLOCKER_STEPS = 10_000
"""A blocker's steps: far more than any test waits (a busy CI box once finished 200-step blockers
before the test's interrupt arrived; 256 samples take about 0.3 s a step here, so this is most
of an hour); every test cancels its blockers. Not more: a rollout's set-up costs tens of
microseconds per step (the sampler's per-step noise check), seconds at 100,000 steps."""
FAST: dict[str, Any] = {"num_inference_steps": 2, "guidance_scale": 4.5}


@pytest.fixture(scope="module")
def server():
    """Two workers, co-batching on (the defaults), a queue of 4: a fifth queued request is a 429."""
    with InProcessServer("--workers", "2", "--queue-size", str(QUEUE), "--max-batch-samples", "64",
                       "--batch-wait-ms", "0", "--max-steps", str(BLOCKER_STEPS)) as s:
        yield s


@pytest.fixture(autouse=True)
def nothing_left_running(server):
    """After each test, cancel whatever it left queued or running (its blockers above all), so a
    failing test cannot hold the module's workers for the tests after it."""
    yield
    with Client(server.rest_url) as c:
        for s in c.rollouts(limit=1000):
            if s.status in ("queued", "running"):
                with contextlib.suppress(ApiError):
                    c.cancel(s.id)


def requests(n: int, tag: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"prompts": [f"{tag} {i}"], "seed": i, **FAST, **extra} for i in range(n)]


def blockers(c: Client, n: int = 2) -> list[str]:
    """`n` rollouts that keep the `n` workers busy until cancelled (none can join another)."""
    ids = [c.submit(prompts=["blocker"] * 8, num_outputs_per_prompt=32, num_inference_steps=BLOCKER_STEPS, seed=k,
                    return_={"steps": [0]}).id for k in range(n)]
    for i in ids:
        _runs(c, i)
    return ids


def _runs(c: Client, rollout_id: str) -> None:
    wait_for(lambda: c.status(rollout_id).progress.steps_done >= 1, f"{rollout_id} runs", timeout=120)


class Watch:
    """Counts, in a thread, the rollouts the server holds queued or running other than `exclude`
    (the server is this module's alone: they are the stream's); keeps the most seen."""

    def __init__(self, c: Client, exclude: set[str]) -> None:
        self.c, self.exclude, self.most, self.stop = c, exclude, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def count(self) -> int:
        snapshot = self.c.rollouts(limit=1000)  # one list: a rollout moving from queued to running counts once
        return len([s for s in snapshot if s.status in ("queued", "running") and s.id not in self.exclude])

    def run(self) -> None:
        while not self.stop.is_set():
            self.most = max(self.most, self.count())
            self.stop.wait(0.01)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.most


def stream_ids(c: Client, before: set[str]) -> set[str]:
    return {s.id for s in c.rollouts(limit=1000) if s.id not in before}


def test_rollouts_come_out_as_they_finish(server):
    """A slow request first and a fast one second: the fast one comes out first (two workers run
    them side by side); the order is the server's finished_at order."""
    with Client(server.rest_url) as c:
        slow = {"prompts": ["slow"], "num_outputs_per_prompt": 32, "num_inference_steps": 100, "seed": 1}
        fast = {"prompts": ["fast"], "seed": 2, **FAST}
        got = list(c.stream([slow, fast], in_flight=2, progress=False))
        assert [r.request for r in got] == [fast, slow]
        assert all(r.error is None and isinstance(r, Rollout) for r in got)
        finished = [str(c.status(_ticket(r).id).finished_at) for r in got]
        assert finished == sorted(finished)
        for r in got:
            assert r.trajectory is not None
            assert r.trajectory.metadata["request"]["prompts"] == r.request["prompts"]
            assert r.weights_version == r.trajectory.metadata["model"]["weights_version"] == 0
            assert r.digest == r.trajectory.metadata["model"]["digest"] and r.outputs is None


def test_in_flight_is_never_exceeded_and_a_full_queue_is_backed_off(server):
    """in_flight=3 behind two blockers: the server holds exactly 3 of the stream's rollouts queued,
    and never more over the whole run. Then in_flight=6 with a queue of 4: the 429s are backed off,
    every rollout comes out."""
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)
        watch = Watch(c, before | set(block))
        stream = c.stream(requests(9, "bound"), in_flight=3, progress=False)
        wait_for(lambda: len(stream_ids(c, before | set(block))) == 3, "the stream fills its 3 slots", timeout=60)
        assert wait_for(watch.count, "3 queued") == 3
        assert stream.peak_in_flight == 3 and stream.submitted == 3  # nothing more while 3 are unfinished
        for b in block:
            c.cancel(b)
        done = list(stream)
        most = watch.close()
        assert len(done) == 9 and all(r.error is None for r in done)
        assert most == 3 and stream.peak_in_flight == 3 and stream.submitted == 9

        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)
        refused = _responses_429(c)
        stream = c.stream(requests(6, "full"), in_flight=6, progress=False)
        wait_for(lambda: len(stream_ids(c, before | set(block))) == QUEUE, "the queue is full", timeout=60)
        wait_for(lambda: _responses_429(c) > refused, "a 429 queue_full", timeout=60)
        for b in block:
            c.cancel(b)
        done = list(stream)
        assert len(done) == 6 and all(r.error is None for r in done), [r.error for r in done]


def _responses_429(c: Client) -> float:
    """POSTs answered 429 so far (the server's own counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = c._http.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.labels.get("code") == "429" and s.labels.get("method") == "POST")


def test_a_failed_request_is_that_items_error_and_the_rest_go_on(server):
    """A request the server refuses (422) and a rollout cancelled while it queues come out as items
    with their typed errors; the others succeed."""
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)
        reqs = requests(3, "fail")
        reqs.insert(1, {"prompts": ["bad"], "num_inference_steps": 0})
        stream = c.stream(reqs, in_flight=4, progress=False)  # the refused one's item waits: 3 slots left
        ids = wait_for(lambda: (lambda s: s if len(s) == 3 else None)(stream_ids(c, before | set(block))),
                       "three queued", timeout=60)
        victim = sorted(ids, key=lambda i: c.status(i).created_at)[0]
        c.cancel(victim)
        for b in block:
            c.cancel(b)
        got = {r.request["prompts"][0]: r for r in stream}
        assert set(got) == {"fail 0", "bad", "fail 1", "fail 2"}
        bad = got["bad"]
        assert isinstance(bad.error, ApiError) and bad.error.status == 422 and bad.ticket is None
        assert bad.trajectory is None and "num_inference_steps" in bad.error.message
        cancelled = got["fail 0"]
        assert isinstance(cancelled.error, RolloutCancelled) and _ticket(cancelled).id == victim
        assert all(got[k].error is None and got[k].trajectory is not None for k in ("fail 1", "fail 2"))


def test_a_tqdm_bar_when_asked_and_none_when_stderr_is_no_terminal(server, capsys):
    with Client(server.rest_url) as c:
        assert len(list(c.stream(requests(3, "bar"), in_flight=3, progress=True))) == 3
        err = capsys.readouterr().err
        assert "rollouts: 100%" in err and "3/3" in err and "failed=0" in err
        assert len(list(c.stream(requests(2, "nobar"), in_flight=2))) == 2  # stderr is captured: no terminal
        assert capsys.readouterr().err == ""


def test_an_error_of_the_requests_iterable_ends_the_stream_and_cancels_its_rollouts(server):
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)

        def dataset():
            yield from requests(2, "broken")
            wait_for(lambda: len(stream_ids(c, before | set(block))) == 2, "two submitted")
            raise RuntimeError("the dataset broke")

        with pytest.raises(RuntimeError, match="the dataset broke"):
            list(c.stream(dataset(), in_flight=4, progress=False))
        ids = stream_ids(c, before | set(block))
        assert len(ids) == 2 and all(c.status(i).status == "cancelled" for i in ids)
        for b in block:
            c.cancel(b)
        with pytest.raises(ValueError, match="in_flight"):
            c.stream([], in_flight=0)
        with pytest.raises(ValueError, match="max_staleness"):
            c.stream([], max_staleness=-1)
        with pytest.raises(TypeError, match="requests"):
            c.stream({"prompts": ["a"]})  # type: ignore[dict-item]


_CTRL_C_CHILD = """
import sys, threading, time
from sigmaflight import Client
from sigmaflight.stream import Stream

def waits_in_next() -> None:  # tell the parent once the main thread waits in Stream.__next__
    while True:
        frame = sys._current_frames()[threading.main_thread().ident]
        while frame is not None and frame.f_code is not Stream.__next__.__code__:
            frame = frame.f_back
        if frame is not None:
            print("WAITING", flush=True)
            return
        time.sleep(0.01)

with Client(sys.argv[1]) as c:
    stream = c.stream([{"prompts": [f"close-ctrl-c {i}"], "seed": i, "num_inference_steps": 2}
                       for i in range(8)], in_flight=3, progress=False)
    threading.Thread(target=waits_in_next, daemon=True).start()
    try:
        next(stream)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(130)
"""


@pytest.mark.parametrize("how", ["close", "break", "ctrl-c"])
def test_closing_cancels_what_is_queued_or_running(server, how, tmp_path):
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)
        child = None
        if how == "ctrl-c":
            # a trainer's own process (a real SIGINT to a pytest worker would also reach its
            # execnet channel): Ctrl-C while it waits for the next rollout cancels what the
            # stream submitted and lets the KeyboardInterrupt through
            script = tmp_path / "trainer.py"
            script.write_text(_CTRL_C_CHILD)
            child = subprocess.Popen([sys.executable, str(script), server.rest_url], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            stream = None
        else:
            stream = c.stream(requests(8, f"close-{how}"), in_flight=3, progress=False)
        ids = wait_for(lambda: (lambda s: s if len(s) == 3 else None)(stream_ids(c, before | set(block))),
                       "three queued", timeout=60)
        if how == "close":
            assert stream is not None
            stream.close()
        elif how == "break":  # the first rollout out (one cancelled from outside), then break
            assert stream is not None
            c.cancel(sorted(ids)[0])
            for r in stream:
                assert isinstance(r.error, RolloutCancelled)
                break
            del stream  # a `for` over `c.stream(...)` drops it as the loop ends; here the test held it
        else:
            assert child is not None and child.stdout is not None
            assert child.stdout.readline() == "WAITING\n"
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=60)
            assert (child.returncode, out) == (130, "INTERRUPTED\n"), (child.returncode, out, err)
            assert "Traceback" not in err, err
        ended = wait_for(lambda: (lambda st: st if all(s.status in ("cancelled", "succeeded", "expired") for s in st)
                                  else None)([c.status(i) for i in stream_ids(c, before | set(block))]),
                         "the stream's rollouts end", timeout=60)
        assert ids <= {s.id for s in ended} and len(ended) <= 4  # at most one refill, on "break"
        assert all(s.status == "cancelled" for s in ended), [s.status for s in ended]
        for b in block:
            c.cancel(b)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ticket(r: Rollout) -> Ticket:
    assert r.ticket is not None
    return r.ticket


def _nudged(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in state.items()}


def test_max_staleness_resubmits_a_rollout_behind_the_last_push(server):
    """A rollout running while this client pushes weights finishes on the old weights: with
    max_staleness=0 it is released and run again on the new ones, counted on the item and the
    stream; the item that comes out ran on the pushed version."""
    base = ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict()
    with Client(server.rest_url) as c:
        long = {"prompts": ["stale"], "num_outputs_per_prompt": 32, "num_inference_steps": 60, "seed": 3}
        before = {s.id for s in c.rollouts(limit=1000)}
        stream = c.stream([long], in_flight=1, max_staleness=0, progress=False)
        (first,) = wait_for(lambda: stream_ids(c, before) or None, "the rollout is submitted")
        wait_for(lambda: c.status(first).progress.steps_done >= 1, "it runs", timeout=60)
        c.push_weights("tiny-sd3", _nudged(base, 1))
        pushed = c.pushed_versions["tiny-sd3"]
        assert c.status(first).status == "running"  # the push came while it ran: it ends on the old weights
        (item,) = list(stream)
        assert item.error is None and item.resubmits == 1 and stream.resubmitted == 1
        assert item.weights_version == pushed and _ticket(item).id != first
        assert c.status(first).status == "expired"  # the stale result was released
        c.push_weights("tiny-sd3", base)  # the base weights again for what follows


def test_max_staleness_holds_for_a_rollout_that_waited_while_the_trainer_pushed(server):
    """Staleness was checked when a rollout finished, not when the trainer took it: two finished
    rollouts waiting in the stream while the trainer pushed came out a version behind. Each item
    taken is now checked again: a stale one is released and run again on the new weights."""
    base = ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict()
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        stream = c.stream(requests(2, "waits"), in_flight=2, max_staleness=0, progress=False)
        wait_for(lambda: len([s for s in c.rollouts(limit=1000) if s.id not in before and s.status == "succeeded"])
                 == 2 or None, "both finished, waiting to be taken", timeout=60)
        c.push_weights("tiny-sd3", _nudged(base, 2))
        pushed = c.pushed_versions["tiny-sd3"]
        got = list(stream)
        assert [r.weights_version for r in got] == [pushed, pushed] and stream.resubmitted == 2
        assert all(r.error is None and r.resubmits == 1 for r in got)
        c.push_weights("tiny-sd3", base)


def test_at_most_in_flight_finished_rollouts_wait_for_the_trainer(server):
    """The stream submitted while fewer than in_flight finished ones waited, not counting the
    running ones that would land on top: up to 2 x in_flight - 1 could wait."""
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        stream = c.stream(requests(6, "held"), in_flight=2, progress=False)
        wait_for(lambda: len([s for s in c.rollouts(limit=1000) if s.id not in before and s.status == "succeeded"])
                 >= 2 or None, "two finished", timeout=60)
        time.sleep(1.0)  # the trainer is busy: before, a third rollout was submitted meanwhile
        assert stream.submitted == 2
        assert len(list(stream)) == 6 and stream.submitted == 6


def test_a_failed_pull_is_its_items_error_and_the_others_come_out(server):
    """A pull's idle timeout (a rollout silent for longer than pull_idle_timeout) raised out of the
    iteration and cancelled every other rollout; it is that item's error now, its rollout cancelled."""
    with Client(server.rest_url, pull_idle_timeout=2.0) as c:  # far above a quick rollout's gaps on a busy box
        silent = {"prompts": ["silent"], "num_outputs_per_prompt": 32, "num_inference_steps": 1000, "seed": 5,
                  "return": {"steps": [1000]}}  # nothing streamed until its last step, far past 2 s (cancelled then)
        got = list(c.stream([silent, *requests(3, "quick")], in_flight=4, progress=False))
        errors = [r for r in got if r.error is not None]
        assert len(got) == 4 and [r.request for r in errors] == [silent], [r.error for r in got]
        assert isinstance(errors[0].error, TimeoutError)
        assert wait_for(lambda: c.status(_ticket(errors[0])).status in ("cancelled", "expired") or None,
                        "the silent rollout is cancelled, not left running")


def test_closing_while_a_full_queue_is_backed_off_is_prompt_and_submits_nothing(server):
    """close() waited out the client's timeout plus 5 s for a submit that was backing off 429s,
    and the request was submitted once the queue drained: a rollout nobody would take or cancel."""
    with Client(server.rest_url, timeout=5) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)
        fill = [c.submit(prompts=["fill"], num_inference_steps=2, seed=k).id for k in range(QUEUE)]
        refused = _responses_429(c)
        stream = c.stream(requests(1, "after close"), in_flight=1, progress=False)
        wait_for(lambda: _responses_429(c) > refused or None, "the stream's submit is refused 429", timeout=30)
        t0 = time.monotonic()
        stream.close()
        assert time.monotonic() - t0 < 5  # before: the client's timeout plus 5 s, 10 s here
        for rollout_id in block + fill:
            c.cancel(rollout_id)
        time.sleep(1.0)  # before: the submit went on backing off, and got in once the queue had room
        assert stream_ids(c, before | set(block) | set(fill)) == set() and stream.submitted == 0


def test_an_idempotency_key_in_a_request_is_sent_as_the_header(server):
    """It went into the body: a 422 "idempotency_key: Extra inputs are not permitted"."""
    with Client(server.rest_url) as c:
        key = f"stream-{time.time_ns()}"
        (first,) = list(c.stream([{**requests(1, "idem")[0], "idempotency_key": key}], progress=False))
        (again,) = list(c.stream([{**requests(1, "idem")[0], "idempotency_key": key}], progress=False))
        assert first.error is None and again.error is None, (first.error, again.error)
        assert _ticket(first).id == _ticket(again).id  # the same key and body: the first rollout


def test_async_client_same_surface_same_errors(server):
    """AsyncClient: submit / wait / pull / pull_outputs / cancel / models / push_lora / delete_lora /
    stream as coroutines, with the answers and typed errors of Client."""
    base = ModelRegistry().get("tiny-sd3")
    config = LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=["attn.to_q"])
    adapter = get_peft_model_state_dict(get_peft_model(copy.deepcopy(base.pipeline.transformer), config))

    async def main() -> None:
        async with AsyncClient(server.rest_url) as ac:
            tickets = await asyncio.gather(*(ac.submit(prompts=[f"async {i}"], seed=i, return_={"outputs": True},
                                                       **FAST) for i in range(3)))
            statuses = await asyncio.gather(*(ac.wait(t, timeout=120) for t in tickets))
            assert [s.status for s in statuses] == ["succeeded"] * 3
            traj = await ac.pull(tickets[0].id)
            images = await ac.pull_outputs(tickets[0])
            with Client(server.rest_url) as c:  # the same bits as the blocking client's
                assert torch.equal(c.pull(tickets[0]).latents, traj.latents)
                assert np.array_equal(c.pull_outputs(tickets[0]), images)
            assert (await ac.cancel(tickets[0])).status == "expired"
            for hostile in ("../models/tiny-sd3/lora", "?status=succeeded", "x" * 100_000):
                with pytest.raises(NotFound):
                    await ac.cancel(hostile)
                with pytest.raises(NotFound):
                    await ac.pull(hostile)
            with pytest.raises(ApiError) as info:
                await ac.submit(prompts=["a"], num_inference_steps=0)
            assert info.value.status == 422
            put = await ac.push_lora("tiny-sd3", adapter, config)
            assert ac.pushed_versions["tiny-sd3"] == put["weights_version"]
            (m,) = [m for m in await ac.models() if m["id"] == "tiny-sd3"]
            assert m["digest"] == put["digest"]
            gone = await ac.delete_lora("tiny-sd3")
            assert gone["weights_version"] == put["weights_version"] + 1 == ac.pushed_versions["tiny-sd3"]
            got = []
            reqs = requests(4, "astream", return_={"outputs": True})
            async with ac.stream(reqs, in_flight=2, outputs=True, progress=False) as rollouts:
                async for r in rollouts:
                    got.append(r)
            assert sorted(r.request["prompts"][0] for r in got) == [f"astream {i}" for i in range(4)]
            assert all(r.error is None and r.weights_version == gone["weights_version"] for r in got)
            with Client(server.rest_url) as c:  # outputs=True: each item's decoded outputs, as pull_outputs gives them
                for r in got:
                    assert r.outputs is not None and r.ticket is not None
                    assert np.array_equal(r.outputs, c.pull_outputs(r.ticket))

    asyncio.run(main())


# A socket of the Client this stream runs on was once collected unclosed after the cancel (a
# ResourceWarning, in one CI run of many; not reproduced in ten runs since): noted, not what this checks.
@pytest.mark.filterwarnings("ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning")
def test_cancelling_the_task_that_iterates_an_async_stream_cancels_its_rollouts(server):
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        block = blockers(c)

        async def consume(ac: AsyncClient) -> None:
            async for _ in ac.stream(requests(5, "acancel"), in_flight=2, progress=False):
                pass

        async def main() -> None:
            async with AsyncClient(server.rest_url) as ac:
                task = asyncio.create_task(consume(ac))
                while len(await asyncio.to_thread(stream_ids, c, before | set(block))) < 2:
                    await asyncio.sleep(0.02)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        ids = stream_ids(c, before | set(block))
        assert len(ids) == 2
        wait_for(lambda: all(c.status(i).status == "cancelled" for i in ids), "both cancelled", timeout=60)
        for b in block:
            c.cancel(b)


def test_a_model_failed_closed_is_the_items_error_not_a_refusal_backed_off_forever():
    """A model an in-place push failed closed refuses its rollouts with 503 "weights_failed" until
    a push of every tensor commits: the stream backed that 503 off like a full queue's, silently,
    and came out only after someone reopened the model. It is the item's error now."""
    with InProcessServer("--workers", "1", "--weights-swap", "in-place") as s, Client(s.rest_url) as c:
        state = {k: v + 0.001 for k, v in ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict().items()}
        last = sorted(state)[-1]
        state[last] = state[last].clone()
        state[last].view(-1)[0] = float("nan")  # refused at the last tensor, after the others were written in place
        with pytest.raises(ApiError):
            c.push_weights("tiny-sd3", state, progress=False)
        got: list[Rollout] = []
        reader = threading.Thread(target=lambda: got.extend(c.stream(requests(2, "closed"), progress=False)),
                                  daemon=True)
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive(), "the stream still backs off a model failed closed"
        assert [(type(r.error), getattr(r.error, "type", None), r.ticket) for r in got] == \
            [(ApiError, "weights_failed", None)] * 2


def test_a_stale_request_with_an_idempotency_key_is_run_again_under_a_key_of_its_own(server):
    """The rerun sent the request's own key again, so the server answered with the stale rollout,
    already released: each item came out as RolloutFailed "not found (released)". A rerun's key is
    derived from the request's (stream.rerun_key): a new rollout, on the pushed weights."""
    base = ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict()
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        keyed = [{**r, "idempotency_key": f"row-{k}-{time.time_ns()}"} for k, r in enumerate(requests(2, "keyed"))]
        stream = c.stream(keyed, in_flight=2, max_staleness=0, progress=False)
        wait_for(lambda: len([s for s in c.rollouts(limit=1000) if s.id not in before and s.status == "succeeded"])
                 == 2 or None, "both finished, waiting to be taken", timeout=60)
        c.push_weights("tiny-sd3", _nudged(base, 3))
        pushed = c.pushed_versions["tiny-sd3"]
        got = list(stream)
        c.push_weights("tiny-sd3", base)
    assert [(r.error, r.resubmits, r.weights_version) for r in got] == [(None, 1, pushed)] * 2


def test_a_server_restarted_since_the_push_yields_its_rollouts_instead_of_rerunning_them_forever():
    """A restart serves version 0 again while the client's pushed_versions keeps the version it
    pushed: every rollout looked stale, and the stream released and reran them without end (no item;
    hundreds of rollouts in seconds). A rerun happens only when the server serves other weights than
    the rollout ran with."""
    ports = ("--port", str(_free_port()), "--flight-port", str(_free_port()), "--workers", "1")
    base = ModelRegistry().get("tiny-sd3").pipeline.transformer.state_dict()
    first = InProcessServer(*ports)
    with Client(first.rest_url) as c:
        try:
            for seed in (4, 5):
                c.push_weights("tiny-sd3", _nudged(base, seed), progress=False)
        finally:
            first.terminate()
        assert c.pushed_versions["tiny-sd3"] == 2
        with InProcessServer(*ports):
            got: list[Rollout] = []
            stream = c.stream(requests(2, "restarted"), in_flight=2, max_staleness=1, progress=False)
            reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
            reader.start()
            reader.join(timeout=60)
            stream.close()
            assert not reader.is_alive(), f"no item; {stream.resubmitted} rollouts rerun"
    assert [(r.error, r.weights_version, r.resubmits) for r in got] == [(None, 0, 0)] * 2


def test_closing_while_the_requests_generator_works_returns_at_once_and_submits_nothing_after(server):
    """close() waited for the generator (up to the client's timeout plus 5 s, a generator reading a
    dataset cannot be interrupted), and the request it yielded afterwards was submitted: a rollout
    nobody took or cancelled. Now close returns, and what the generator yields later is dropped."""
    release = threading.Event()

    def dataset():
        yield requests(1, "before close")[0]
        release.wait(60)  # reading the next row takes long
        yield requests(1, "after close")[0]

    with Client(server.rest_url, timeout=5) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        stream = c.stream(dataset(), in_flight=2, progress=False)
        (first,) = wait_for(lambda: stream_ids(c, before) or None, "the first request is submitted")
        t0 = time.monotonic()
        stream.close()
        took = time.monotonic() - t0
        release.set()
        stream._driver.thread.join(timeout=30)  # the submitter ends once the generator has yielded
        assert not stream._driver.thread.is_alive()
        assert took < 5  # before: 10 s, the client's timeout plus 5 (close waits up to PULLS_END_S for its pulls)
        assert stream_ids(c, before) == {first} and stream.submitted == 1  # before: "after close" ran too
        assert wait_for(lambda: c.status(first).status in ("cancelled", "succeeded", "expired") or None, "it ended")


def test_closing_releases_the_finished_rollouts_the_trainer_never_took(server):
    """They stayed in the stream with their trajectories, and on the server until their TTL."""
    with Client(server.rest_url) as c:
        before = {s.id for s in c.rollouts(limit=1000)}
        stream = c.stream(requests(3, "untaken"), in_flight=3, progress=False)
        wait_for(lambda: len([s for s in c.rollouts(limit=1000) if s.id not in before and s.status == "succeeded"])
                 == 3 or None, "all three finished", timeout=60)
        taken = next(stream)
        stream.close()
        statuses = {s.id: s.status for s in c.rollouts(limit=1000) if s.id not in before}
    assert statuses.pop(_ticket(taken).id) == "succeeded"  # the one taken is the trainer's to release
    assert sorted(statuses.values()) == ["expired", "expired"]


def test_cancelling_an_async_streams_task_leaves_the_event_loop_running_while_its_submit_ends():
    """The cancel ran the stream's close on the event loop, which waits for a submit under way (up
    to the client's timeout plus 5 s): every other task of the trainer stopped meanwhile. Here the
    submit is a POST to a server that never answers (a bare socket)."""
    def posted(server: socket.socket) -> socket.socket:
        """The stream's connection, once its POST has arrived (never answered)."""
        server.settimeout(30)
        conn, _ = server.accept()
        conn.settimeout(30)
        seen = b""
        while b"POST /v1/rollouts" not in seen:
            chunk = conn.recv(4096)
            assert chunk, f"the connection closed before the POST: {seen!r}"
            seen += chunk
        return conn

    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"

        async def main() -> float:
            async with AsyncClient(url, timeout=3) as ac:
                async def consume() -> None:
                    async for _ in ac.stream(requests(1, "silent"), progress=False):
                        pass

                task = asyncio.create_task(consume())
                conn = await asyncio.to_thread(posted, silent)  # the POST is under way, unanswered
                gaps, last = [], time.monotonic()

                async def tick() -> None:
                    nonlocal last
                    while True:
                        await asyncio.sleep(0.05)
                        gaps.append(time.monotonic() - last)
                        last = time.monotonic()

                ticker = asyncio.create_task(tick())
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                gaps.append(time.monotonic() - last)  # up to the task's end, whether or not the ticker ran since
                ticker.cancel()
                conn.close()
                return max(gaps, default=0.0)

        longest = asyncio.run(main())
    assert longest < 1.0, f"the event loop stood still for {longest:.1f} s"  # before: about 3 s (the timeout)
