"""JobManager with the real local backend: real tiny model, real result store."""

from __future__ import annotations

import json
import math
import sqlite3
import time

import pytest
from sigmaflight.control.backends.local import LocalBackend
from sigmaflight.control.jobs import IdempotencyConflict, JobManager, JobView, NotFinished, QueueFull
from sigmaflight.control.jobs.backend import RunContext
from sigmaflight.dataplane.store import ResultStore
from sigmaflight.pipeline.models import ModelRegistry
from sigmaflight.pipeline.spec import RolloutSpec

from sigmaflight.records import RolloutState


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry()


def manager(registry, tmp_path=None, **kw) -> tuple[JobManager, ResultStore]:
    store = ResultStore(memory_budget_bytes=1 << 30, data_dir=tmp_path)
    backend = LocalBackend(registry, store, locations=lambda: ["grpc+tcp://127.0.0.1:1"])
    return JobManager(backend, data_dir=tmp_path, **kw), store


def spec(**kw) -> RolloutSpec:
    base = dict(model="tiny-sd3", prompts=("a cat",), num_inference_steps=2, seed=1)
    return RolloutSpec(**{**base, **kw})


def known(job: JobView | None) -> JobView:
    assert job is not None
    return job


def wait(jobs: JobManager, job_id: str, statuses: set[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (status := known(jobs.get(job_id)).status) not in statuses:
        assert time.monotonic() < deadline, status
        time.sleep(0.01)
    return status


def test_a_failing_rollout_is_marked_failed_and_the_next_one_runs(registry):
    jobs, store = manager(registry)
    jobs.start()
    try:
        bad, _ = jobs.submit(spec(return_steps=(0, 99)))  # bypasses request validation on purpose
        good, _ = jobs.submit(spec())
        assert wait(jobs, bad.id, {"failed", "succeeded"}) == "failed"
        bad = known(jobs.get(bad.id))
        assert bad.error is not None and bad.error.message
        assert bad.error.type == "validation_error"  # the contract's word, not the exception's class
        assert wait(jobs, good.id, {"failed", "succeeded"}) == "succeeded"
        good = known(jobs.get(good.id))
        assert good.result is not None
        # num_bytes against pyarrow's own count of the batches the store serves, and at least
        # the raw float32 latents of 3 captured steps (shape from the trajectory's own column).
        batches = list(store.get(good.id).iter_batches())
        served = sum(b.nbytes for b in batches)
        latent = batches[0].column("latent")
        per_row = math.prod(latent.type.shape) * 4
        assert good.result.to_json() == {"num_rows": 3, "num_bytes": served, "steps": [0, 1, 2]}
        assert sum(b.num_rows for b in batches) == 3 and served >= 3 * per_row > 0
        assert good.steps_done == good.steps_total == 2
    finally:
        jobs.stop()


def test_ttl_expires_results_and_releases_the_store(registry):
    jobs, store = manager(registry, ttl_s=60)
    jobs.start()
    try:
        job, _ = jobs.submit(spec())
        wait(jobs, job.id, {"succeeded"})
        assert store.get(job.id).state == "succeeded"
        jobs.reap(now=time.time() + 30)
        assert known(jobs.get(job.id)).status == "succeeded"
        jobs.reap(now=time.time() + 61)
        assert known(jobs.get(job.id)).status == "expired"
        with pytest.raises(KeyError):
            store.get(job.id)
    finally:
        jobs.stop()


def test_ttl_frees_a_failed_or_cancelled_rollout_and_keeps_its_status_and_error(registry):
    """Past the TTL only a succeeded rollout becomes expired, as with DELETE: a failed one keeps
    its error (all a trainer has to go on), a cancelled one stays cancelled; what they held goes."""
    jobs, store = manager(registry, ttl_s=60)
    jobs.start()
    try:
        bad, _ = jobs.submit(spec(return_steps=(0, 99)))  # bypasses request validation on purpose
        assert wait(jobs, bad.id, {"failed", "succeeded"}) == "failed"
        cancelled, _ = jobs.submit(spec())
        jobs.cancel(cancelled.id)
        assert wait(jobs, cancelled.id, {"cancelled", "succeeded"}) == "cancelled"
        error = known(jobs.get(bad.id)).error
        assert error is not None and error.type == "validation_error"
        for later in (61, 62):  # a second pass of the reaper changes nothing more
            jobs.reap(now=time.time() + later)
            failed = known(jobs.get(bad.id))
            assert (failed.status, failed.error) == ("failed", error)
            assert known(jobs.get(cancelled.id)).status == "cancelled"
        with pytest.raises(KeyError):
            store.get(bad.id)
        assert jobs.release(bad.id) is False  # Flight release: nothing left to free, as for an expired one
        assert known(jobs.get(bad.id)).status == "failed"
        assert known(jobs.cancel(bad.id)).status == "failed"  # a DELETE after it answers its status
    finally:
        jobs.stop()


def test_a_stop_during_the_last_step_is_either_taken_or_refused(registry):
    """Flight's cancel answered `cancelled: true` while the last step ran, and the rollout then
    succeeded: the engine made no stop check after it. A stop asked before the engine's last
    check now ends the rollout cancelled; one asked after it is refused (False), and it succeeds."""
    store = ResultStore(memory_budget_bytes=1 << 30)
    backend = LocalBackend(registry, store, locations=lambda: ["grpc+tcp://127.0.0.1:1"])
    answers: list[bool] = []

    def stop_at_the_last_step(contexts, done, total):  # reported before the engine checks for a stop
        if done == total:
            answers.extend(c.stop() for c in contexts)

    late = RunContext("late", spec(), on_progress=stop_at_the_last_step)
    backend.reserve(late.job_id)
    backend.run([late])
    assert answers == [True] and late.outcome is not None and late.outcome.state is RolloutState.CANCELLED
    done = RunContext("done", spec())
    backend.reserve(done.job_id)
    backend.run([done])
    assert done.outcome is not None and done.outcome.state is RolloutState.SUCCEEDED
    assert done.stop() is False  # refused: it has ended as it was
    assert done.outcome.state is RolloutState.SUCCEEDED


def test_queue_bound_and_idempotency(registry):
    jobs, _ = manager(registry, queue_size=2)  # not started: everything stays queued
    a, created = jobs.submit(spec(), idempotency_key="k", body_digest="d1")
    again, created_again = jobs.submit(spec(), idempotency_key="k", body_digest="d1")
    assert created and not created_again and again.id == a.id
    with pytest.raises(IdempotencyConflict):
        jobs.submit(spec(), idempotency_key="k", body_digest="d2")
    jobs.submit(spec())
    with pytest.raises(QueueFull):
        jobs.submit(spec())
    assert jobs.queue_depth() == 2
    assert known(jobs.cancel(a.id)).status == "cancelled"
    assert jobs.queue_depth() == 1
    jobs.stop()


def test_restart_marks_unfinished_rollouts_failed_and_keeps_finished_ones(registry, tmp_path):
    jobs, store = manager(registry, tmp_path)
    jobs.start()
    done, _ = jobs.submit(spec())
    wait(jobs, done.id, {"succeeded"})
    jobs.stop()
    store.close()
    crashed, _ = manager(registry, tmp_path)  # never started: its rollout stays queued
    lost, _ = crashed.submit(spec())
    # The process "dies" here: no stop(), nothing cleaned up; a new one opens the same directory.
    again, store2 = manager(registry, tmp_path)
    assert known(again.get(done.id)).status == "succeeded"
    assert store2.get(done.id).state == "succeeded"
    failed = known(again.get(lost.id))
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.type == "server_restarted" and "queued" in failed.error.message
    again.stop()


def test_cancel_only_cancels_and_release_refuses_unfinished(registry):
    """Flight's `cancel` keeps a finished rollout; its `release` refuses a queued one."""
    jobs, store = manager(registry)
    queued, _ = jobs.submit(spec())  # not started yet: stays queued
    with pytest.raises(NotFinished, match="queued; cancel it first"):
        jobs.release(queued.id)
    assert known(jobs.get(queued.id)).status == "queued"
    jobs.start()
    try:
        wait(jobs, queued.id, {"succeeded"})
        assert jobs.cancel_active(queued.id) is False
        assert known(jobs.get(queued.id)).status == "succeeded"
        assert store.get(queued.id).state == "succeeded"
        assert jobs.release(queued.id) is True
        assert known(jobs.get(queued.id)).status == "expired"
        assert jobs.release(queued.id) is False
    finally:
        jobs.stop()


def test_a_release_reported_while_the_rollout_still_runs_here_is_done_as_it_ends(registry):
    """A Ray worker reports a release (`released_elsewhere`), or a Flight release finds the trajectory
    whole (`release_when_finished`), before the control plane has recorded the rollout's end: the
    rollout is released as it succeeds, so REST says expired and nothing is left held."""
    jobs, store = manager(registry)
    jobs.start()
    try:
        for release in (jobs.released_elsewhere, jobs.release_when_finished):
            job, _ = jobs.submit(spec(num_inference_steps=60))
            wait(jobs, job.id, {"running"})
            release(job.id)
            now = known(jobs.get(job.id))
            assert now.status == "running" and now.steps_done < 60, now  # it was running at the release
            assert wait(jobs, job.id, {"expired", "succeeded"}) == "expired"
            assert job.id not in store.ids()
    finally:
        jobs.stop()


def test_delete_of_a_cancelled_rollout_keeps_it_cancelled(registry):
    jobs, _ = manager(registry)  # not started
    job, _ = jobs.submit(spec())
    assert known(jobs.cancel(job.id)).status == "cancelled"
    assert known(jobs.cancel(job.id)).status == "cancelled"  # the second DELETE releases it
    assert jobs.release(job.id) is False  # Flight release: nothing left to free
    assert known(jobs.get(job.id)).status == "cancelled"
    other, _ = jobs.submit(spec(seed=2))
    jobs.cancel(other.id)
    assert jobs.release(other.id) is True and jobs.release(other.id) is False
    jobs.stop()


@pytest.mark.parametrize("was", ["running", "queued"])
def test_restart_reconciles_a_finished_file_the_journal_calls_unfinished(registry, tmp_path, was):
    """kill -9 between the trajectory's rename and the journal's success row: the row (edited
    with plain sqlite3) says running, the file is complete, so the rollout is succeeded. Queued:
    the journal could not write the running row either (a full disk); the file is as complete."""
    jobs, store = manager(registry, tmp_path)
    jobs.start()
    done, _ = jobs.submit(spec())
    wait(jobs, done.id, {"succeeded"})
    jobs.stop()
    store.close()
    db = sqlite3.connect(str(tmp_path / "jobs.sqlite3"))
    record = json.loads(db.execute("SELECT record FROM jobs WHERE id = ?", (done.id,)).fetchone()[0])
    record.update(status=was, result=None, finished_at=None, steps_done=0)
    if was == "queued":
        record.update(started_at=None)
    db.execute("UPDATE jobs SET record = ? WHERE id = ?", (json.dumps(record), done.id))
    db.commit()
    db.close()
    again, store2 = manager(registry, tmp_path)
    job = known(again.get(done.id))
    assert job.status == "succeeded" and job.error is None
    info = store2.result(done.id)
    assert info is not None
    assert job.result is not None
    assert job.result.to_json() == {"num_rows": info.num_rows, "num_bytes": info.num_bytes, "steps": [0, 1, 2]}
    assert job.steps_done == job.steps_total
    assert job.started_at is not None and job.finished_at is not None
    again.stop()
    store2.close()


def test_restart_sets_aside_a_trajectory_file_the_journal_has_no_row_for(registry, tmp_path):
    """A file with no journal row (a journal put back from a backup, or moved away) is no rollout
    REST knows: the restart scan sets it aside (`.orphan`, kept, never served) rather than Flight
    serving it for good; the rollouts the journal knows stay served."""
    jobs, store = manager(registry, tmp_path)
    jobs.start()
    kept, _ = jobs.submit(spec())
    orphan, _ = jobs.submit(spec())
    wait(jobs, kept.id, {"succeeded"})
    wait(jobs, orphan.id, {"succeeded"})
    jobs.stop()
    store.close()
    db = sqlite3.connect(str(tmp_path / "jobs.sqlite3"))
    db.execute("DELETE FROM jobs WHERE id = ?", (orphan.id,))
    db.commit()
    db.close()
    assert (tmp_path / "trajectories" / f"{orphan.id}.arrow").exists()
    again, store2 = manager(registry, tmp_path)
    try:
        assert again.get(orphan.id) is None
        assert orphan.id not in store2.ids()
        assert not (tmp_path / "trajectories" / f"{orphan.id}.arrow").exists()
        assert (tmp_path / "trajectories" / f"{orphan.id}.arrow.orphan").exists()
        assert known(again.get(kept.id)).status == "succeeded" and store2.result(kept.id) is not None
    finally:
        again.stop()
        store2.close()


def test_a_reader_never_sees_a_failed_rollout_without_its_error(registry):
    """Status readers get immutable snapshots: hammering get/list while rollouts fail, a reader
    that takes the fields one at a time, as the REST status does (status first, then the rest,
    with calls in between), never sees a state without what belongs to it: a failed rollout
    without its error, a running one with an error or a finish time, a succeeded one without its
    result. The GIL switches threads every microsecond here, so a reader lands between any two
    writes of a change made field by field."""
    import sys
    import threading

    from sigmaflight.control.jobs import iso

    jobs, _ = manager(registry)
    jobs.start()
    seen: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            for view in jobs.list(limit=1000)[0]:
                status = view.status
                iso(view.created_at)  # the REST status formats times between its reads
                error, result, finished = view.error, view.result, view.finished_at
                if status == "failed" and (error is None or finished is None):
                    seen.append(f"{view.id} failed without an error or a finish time")
                if status in ("queued", "running") and (error is not None or finished is not None):
                    seen.append(f"{view.id} {status} with an error or a finish time")
                if status == "succeeded" and result is None:
                    seen.append(f"{view.id} succeeded without a result")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    readers = [threading.Thread(target=read) for _ in range(2)]
    try:
        for r in readers:
            r.start()
        # bypasses request validation on purpose: each fails in its first step
        ids = [jobs.submit(spec(return_steps=(0, 99), seed=k))[0].id for k in range(40)]
        ids.append(jobs.submit(spec())[0].id)
        for job_id in ids:
            wait(jobs, job_id, {"failed", "succeeded"})
    finally:
        stop.set()
        for r in readers:
            r.join()
        sys.setswitchinterval(old)
        jobs.stop()
    assert [known(jobs.get(j)).status for j in ids] == ["failed"] * 40 + ["succeeded"]
    assert seen == []


def test_every_change_of_state_is_one_of_the_table():
    """The transition table against the contract's lifecycle: a finished rollout never runs
    again, an expired one never changes, and only a succeeded one can fail later (its result lost)."""
    from sigmaflight.control.jobs import Job

    from sigmaflight.records import STATES, TRANSITIONS, InvalidTransition, RolloutState

    assert [s.value for s in STATES] == ["queued", "running", "succeeded", "failed", "cancelled", "expired"]
    assert set(TRANSITIONS) == set(STATES)
    assert TRANSITIONS[RolloutState.EXPIRED] == frozenset()
    for done in (RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.CANCELLED):
        assert RolloutState.RUNNING not in TRANSITIONS[done] and RolloutState.QUEUED not in TRANSITIONS[done]
    assert {s for s in STATES if RolloutState.FAILED in TRANSITIONS[s]} == {
        RolloutState.QUEUED, RolloutState.RUNNING, RolloutState.SUCCEEDED}

    job = Job(id="j", model="m", request=None, spec_json={}, streams=("trajectory",), steps_total=1, created_at=0.0)
    job.move(RolloutState.CANCELLED)
    with pytest.raises(InvalidTransition, match="cancelled -> running"):
        job.move(RolloutState.RUNNING)


def test_error_type_is_a_contract_word_and_an_unexpected_exception_is_internal_error():
    """`error.type` never carries a Python class name: an exception the contract has no word for
    is "internal_error" with the class in the message; a known one keeps its word; an outcome with
    any other word is refused where it is made."""
    from sigmaflight.control.jobs.backend import Outcome, outcome_of
    from sigmaflight.pipeline.spec import RolloutNonFinite

    from sigmaflight.records import ERROR_TYPES

    unexpected = outcome_of(KeyError("boom"), None).error
    assert unexpected is not None and unexpected.type == "internal_error"
    assert unexpected.message == "KeyError: 'boom'"
    odd_word = type("Odd", (RuntimeError,), {"error_type": "SomethingElse"})("odd")
    assert (odd := outcome_of(odd_word, None).error) is not None and odd.type == "internal_error"
    non_finite = outcome_of(RolloutNonFinite(2, "latent"), None).error
    assert non_finite is not None and non_finite.type == "non_finite" and "absolute step 2" in non_finite.message
    stopped = outcome_of(RuntimeError("x"), "server shutting down").error
    assert stopped is not None and (stopped.type, stopped.message) == ("shutdown", "server shutting down")
    assert {"internal_error", "non_finite", "shutdown", "worker_died", "server_restarted"} <= ERROR_TYPES
    with pytest.raises(ValueError, match="not one of the contract's words"):
        Outcome.failure("WorkerDied", "worker 1 died")


def _batch_of(store: ResultStore, job_id: str) -> dict:
    entry = store.get(job_id)
    return json.loads(entry.schema.metadata[b"sigmaflight.rollout"])["batch"]


def test_a_worker_waiting_for_a_batch_takes_the_requests_that_arrive_meanwhile(registry):
    """--batch-wait-ms: the first request waits (up to 5 s here) for compatible ones; the second,
    submitted right after, joins it, and an incompatible one runs in a batch of its own."""
    from sigmaflight.pipeline.batch import batch_key

    model = registry.get("tiny-sd3")
    jobs, store = manager(registry, max_batch_samples=2, batch_wait_s=5.0)
    jobs.start()
    try:
        specs = [spec(seed=1), spec(seed=2), spec(seed=3, num_inference_steps=3)]
        ids = [jobs.submit(s, batch_key=batch_key(model, s))[0].id for s in specs]
        for job_id in ids:
            assert wait(jobs, job_id, {"failed", "succeeded"}) == "succeeded"
        first, second, third = (_batch_of(store, j) for j in ids)
    finally:
        jobs.stop()
    assert first["id"] == second["id"] and first["requests"] == 2 and first["samples"] == 2  # full: no more wait
    assert third["requests"] == 1 and third["id"] != first["id"]


def _burst(jobs: JobManager, model, n: int, gap_s: float, seed: int) -> list[str]:
    """`n` compatible requests `gap_s` apart, each then waited for until it succeeded: their ids."""
    from sigmaflight.pipeline.batch import batch_key

    ids: list[str] = []
    for k in range(n):
        s = spec(seed=seed + k)
        ids.append(jobs.submit(s, batch_key=batch_key(model, s))[0].id)
        time.sleep(gap_s)
    for job_id in ids:
        assert wait(jobs, job_id, {"failed", "succeeded"}) == "succeeded"
    return ids


def test_a_burst_longer_than_the_wait_lands_in_one_batch_and_a_steady_stream_is_cut_at_8_waits(registry):
    """--batch-wait-ms W: a request that joins keeps the batch open W/2 past its arrival, so eight
    requests 0.1 s apart (0.7 s in all, 1.75 times W = 0.4 s) share one batch. A stream that
    never pauses is cut at BATCH_WAIT_ROUNDS x W after the head was taken."""
    from sigmaflight.control.jobs import BATCH_WAIT_ROUNDS
    from sigmaflight.pipeline.batch import batch_key

    model = registry.get("tiny-sd3")
    wait_s, gap_s = 0.4, 0.1
    jobs, store = manager(registry, max_batch_samples=64, batch_wait_s=wait_s, queue_size=128)
    jobs.start()
    try:
        burst = _burst(jobs, model, 8, gap_s, seed=10)
        assert {_batch_of(store, j)["id"] for j in burst} == {_batch_of(store, burst[0])["id"]}
        assert _batch_of(store, burst[0])["requests"] == 8
        stream: list[str] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < BATCH_WAIT_ROUNDS * wait_s + 1.0:  # never pauses for W
            s = spec(seed=100 + len(stream))
            stream.append(jobs.submit(s, batch_key=batch_key(model, s))[0].id)
            time.sleep(gap_s)
        for job_id in stream:
            assert wait(jobs, job_id, {"failed", "succeeded"}) == "succeeded"
        first = _batch_of(store, stream[0])
        assert 1 < first["requests"] < len(stream)  # it waited for several, not for the whole stream
        started = known(jobs.get(stream[0])).started_at
        assert started is not None and started - known(jobs.get(stream[0])).created_at < BATCH_WAIT_ROUNDS * wait_s + 0.5
    finally:
        jobs.stop()


def test_a_quick_burst_starts_one_wait_after_its_head_not_one_wait_after_its_last_request(registry):
    """Five requests 0.1 s apart with W = 1 s share one batch, which starts W after the head was
    taken: the last one keeps it open only W/2 past its arrival (0.9 s), not a whole W (1.4 s)."""
    model = registry.get("tiny-sd3")
    jobs, store = manager(registry, max_batch_samples=64, batch_wait_s=1.0)
    jobs.start()
    try:
        burst = _burst(jobs, model, 5, 0.1, seed=50)
        assert _batch_of(store, burst[0])["requests"] == 5
        head = known(jobs.get(burst[0]))
        assert head.started_at is not None
        assert 0.95 <= head.started_at - head.created_at < 1.35  # the old rule: at least 0.4 + 1.0
    finally:
        jobs.stop()


def test_one_member_turning_non_finite_fails_alone_through_the_manager(registry):
    """Two branches of one parent batched by the manager: the one that starts from an overflowing
    x_k fails non_finite naming its first step; the other succeeds with the batch it ran in."""
    import dataclasses

    from sigmaflight.pipeline.batch import batch_key
    from sigmaflight.pipeline.rollout import run_rollout
    from sigmaflight.pipeline.spec import BranchStart

    model = registry.get("tiny-sd3")
    parent = run_rollout(model, spec(num_inference_steps=4))
    (x2,) = [c.latent for c in parent.captures if c.step == 2]

    def branch(seed: int, scale: float) -> RolloutSpec:
        start = BranchStart(step=2, latents=x2 * scale, sigmas=parent.snapshot.sigmas,
                            timesteps=parent.snapshot.timesteps, set_timesteps_kwargs=parent.snapshot.set_timesteps_kwargs,
                            samples=(0,), prompt_index=(0,), rollout="parent")
        return dataclasses.replace(spec(num_inference_steps=4, seed=seed), branch_from=start)

    jobs, store = manager(registry)  # not started: both queue, then start as one batch
    specs = [branch(5, 1e38), branch(6, 1.0)]
    bad, good = (jobs.submit(s, batch_key=batch_key(model, s))[0] for s in specs)
    jobs.start()
    try:
        assert wait(jobs, bad.id, {"failed", "succeeded"}) == "failed"
        assert wait(jobs, good.id, {"failed", "succeeded"}) == "succeeded"
        error = known(jobs.get(bad.id)).error
        assert error is not None and error.type == "non_finite" and "absolute step 2" in error.message
        assert _batch_of(store, good.id)["requests"] == 2
    finally:
        jobs.stop()


def test_a_rollout_whose_step_outlasts_the_shutdowns_budget_is_journaled_as_shut_down(registry, tmp_path):
    """SIGTERM gives a running step a bounded wait; one still running past it was left `running` in
    the journal and read after a restart as `server_restarted`, with no line saying it was given up."""
    jobs, store = manager(registry, tmp_path)
    jobs.start()
    slow, _ = jobs.submit(spec(prompts=("a",) * 64, height=128, width=128, num_inference_steps=3))
    wait(jobs, slow.id, {"running"})
    jobs.stop(timeout=0.05)  # well inside its first step (about a second here)
    assert known(jobs.get(slow.id)).status == "failed"
    jobs.stop(timeout=120)  # now wait for that step: a worker still inside torch when pytest exits aborts it
    assert known(jobs.get(slow.id)).status == "failed"
    store.close()
    again, _ = manager(registry, tmp_path)
    failed = known(again.get(slow.id))
    assert failed.status == "failed" and failed.error is not None and failed.error.type == "shutdown", failed
    assert "server shutting down" in failed.error.message
    again.stop()


def test_ended_records_do_not_keep_their_prompts_in_memory_and_the_journal_keeps_them(registry, tmp_path):
    """Each ended rollout's record kept its whole request: 64 prompts of 4000 characters are about
    a quarter MiB a record, some 2.5 GiB at --max-records' 10000, reached by POST and DELETE alone.
    The prompts stay in the journal (and in the trajectory's metadata), through later rows too."""
    import gc
    import tracemalloc

    jobs, store = manager(registry, tmp_path)
    prompts = tuple(f"{i} " + "x" * 4000 for i in range(64))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        ids = []
        for i in range(40):  # never started (the manager is not): cancelled while queued
            job, _ = jobs.submit(spec(prompts=tuple(p + str(i) for p in prompts)))
            assert known(jobs.cancel(job.id)).status == "cancelled"
            ids.append(job.id)
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 2 * 2**20, f"{grown / 2**20:.1f} MiB held for 40 ended records of 64 x 4000 characters"
    jobs.cancel(ids[0])  # a later row (the release) is written without the spec in memory
    db = sqlite3.connect(str(tmp_path / "jobs.sqlite3"))
    rows = dict(db.execute("SELECT id, record FROM jobs").fetchall())
    db.close()
    for rid in ids:
        assert json.loads(rows[rid])["spec"]["prompts"][0] == "0 " + "x" * 4000 + str(ids.index(rid))
    jobs.stop()
    store.close()
    again, store2 = manager(registry, tmp_path)  # the restart reads them back as they were
    assert known(again.get(ids[0])).status == "cancelled"
    again.stop()
    store2.close()


def test_a_rollout_is_counted_once_as_it_ends_and_expired_only_when_it_succeeded_in_this_process(registry, tmp_path):
    """rollouts_finished_total: a succeeded rollout that later turned failed (result_unavailable)
    was counted failed as well; one that succeeded before a restart and was released after it
    counted expired with no succeeded (expired <= succeeded, as docs/control.md says, broke)."""
    jobs, store = manager(registry, tmp_path)
    jobs.start()
    kept, lost = (jobs.submit(spec(seed=s))[0] for s in (1, 2))
    for job in (kept, lost):
        wait(jobs, job.id, {"succeeded"})
    assert jobs.result_lost(lost.id, "its file changed") is True
    assert known(jobs.get(lost.id)).status == "failed"
    assert (jobs.counters["rollouts_succeeded"], jobs.counters["rollouts_failed"]) == (2, 0)
    jobs.stop()
    store.close()
    again, store2 = manager(registry, tmp_path)
    try:
        assert known(again.cancel(kept.id)).status == "expired"  # released after the restart
        assert again.counters["rollouts_expired"] <= again.counters["rollouts_succeeded"] == 0
        done, _ = again.submit(spec(seed=3))
        again.start()
        wait(again, done.id, {"succeeded"})
        assert known(again.cancel(done.id)).status == "expired"
        assert (again.counters["rollouts_succeeded"], again.counters["rollouts_expired"]) == (1, 1)
    finally:
        again.stop()
        store2.close()


def test_a_released_failed_or_cancelled_rollout_stays_released_across_a_restart(registry, tmp_path):
    """Flight release answers false once nothing is left to free; the journal did not keep that a
    cancelled (or failed) rollout was released, so after a restart it answered true again."""
    jobs, store = manager(registry, tmp_path)
    job, _ = jobs.submit(spec())
    assert known(jobs.cancel(job.id)).status == "cancelled"
    assert jobs.release(job.id) is True and jobs.release(job.id) is False
    jobs.stop()
    store.close()
    again, store2 = manager(registry, tmp_path)
    try:
        assert known(again.get(job.id)).status == "cancelled"
        assert again.release(job.id) is False
    finally:
        again.stop()
        store2.close()
