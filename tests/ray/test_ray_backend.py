"""RayBackend on a local Ray cluster started here: two CPU worker actors behind one JobManager.

One `ray.init(num_cpus=2)` and one backend for the whole module (starting Ray and two
actors costs ~10 s on the 2-core machine); the test that kills a worker runs last.
"""

from __future__ import annotations

import time

import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.control.backends.local import LocalBackend
from sigmaflight.control.backends.ray import RayBackend, trajectory_ref
from sigmaflight.control.backends.worker import WorkerConfig
from sigmaflight.control.branches import branch_spec, find_parent
from sigmaflight.control.jobs import JobManager, JobView
from sigmaflight.dataplane.client import Trajectory
from sigmaflight.dataplane.store import ResultStore
from sigmaflight.dataplane.streams import column_tensor
from sigmaflight.pipeline.models import ModelRegistry, StaleWeights
from sigmaflight.pipeline.spec import RolloutSpec, SamplerSpec

ray = pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, namespace="sigmaflight", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def backend(cluster):
    b = RayBackend(WorkerConfig(index=0, torch_threads=1), workers=2, num_cpus=1)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def jobs(backend):
    m = JobManager(backend, workers=2)
    m.start()
    try:
        yield m
    finally:
        m.stop()


def spec(**kw) -> RolloutSpec:
    base = dict(model="tiny-sd3", prompts=("a red cube", "a blue ball"), num_inference_steps=4, seed=7,
                sampler=SamplerSpec(type="sde", noise_level=0.7), guidance_scale=4.5)
    return RolloutSpec(**{**base, **kw})


def long_spec() -> RolloutSpec:
    # thousands of tiny steps, capturing only x_0: runs for seconds, holds almost nothing
    return spec(prompts=("a slow one",), num_inference_steps=3000, return_steps=(0,))


def known(job: JobView | None) -> JobView:
    assert job is not None
    return job


def wait(jobs: JobManager, job_id: str, statuses: set[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while (status := known(jobs.get(job_id)).status) not in statuses:
        assert time.monotonic() < deadline, f"{job_id} still {status}"
        time.sleep(0.02)
    return status


def wait_progress(jobs: JobManager, job_id: str, steps: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while known(jobs.get(job_id)).steps_done < steps:
        assert time.monotonic() < deadline, jobs.get(job_id)
        time.sleep(0.02)


def pull(location: str, ticket: str) -> Trajectory:
    with flight.FlightClient(location) as fc:
        return Trajectory.from_reader(fc.do_get(flight.Ticket(ticket.encode())))


def test_rollouts_spread_across_workers_and_each_is_pulled_from_its_own_worker(jobs, backend):
    submitted = [jobs.submit(spec(seed=s))[0] for s in range(4)]
    where = {j.id: backend.locations_for(j.id) for j in submitted}
    assert len({loc[0] for loc in where.values()}) == 2  # both workers got rollouts
    for job in submitted:
        assert wait(jobs, job.id, {"succeeded", "failed"}) == "succeeded", job.error
        (location,) = where[job.id]
        traj = pull(location, job.ticket)  # plain pyarrow.flight against the worker that ran it
        assert traj.rollout_id == job.id and traj.latents.shape[:2] == (2, 5)
        with flight.FlightClient(location) as fc:
            info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", job.id))
        assert [loc.uri.decode() for loc in info.endpoints[0].locations] == [location]
        done = known(jobs.get(job.id))
        assert done.result is not None and info.total_records == done.result.num_rows == 10
        other = next(loc[0] for loc in where.values() if loc[0] != location)
        with flight.FlightClient(other) as fc, pytest.raises(flight.FlightError, match="not found"):
            fc.do_get(flight.Ticket(job.ticket.encode())).read_all()  # bytes live only where they were made
        assert done.steps_done == done.steps_total == 4


def test_trajectory_is_bit_identical_to_the_local_backend(jobs, backend):
    request = spec(seed=1234, sampler=SamplerSpec(type="sde", noise_level=0.8, sde_steps=(1, 2)))
    job, _ = jobs.submit(request)
    assert wait(jobs, job.id, {"succeeded", "failed"}) == "succeeded", job.error
    remote = pull(backend.locations_for(job.id)[0], job.ticket)

    store = ResultStore(memory_budget_bytes=1 << 30)
    local_jobs = JobManager(LocalBackend(ModelRegistry(), store, locations=lambda: []), workers=1)
    local_jobs.start()
    try:
        ljob, _ = local_jobs.submit(request)
        assert wait(local_jobs, ljob.id, {"succeeded", "failed"}) == "succeeded", ljob.error
        entry = store.get(ljob.id)
        local = Trajectory.from_batches(entry.schema, entry.iter_batches())
    finally:
        local_jobs.stop()
        store.close()
    assert torch.equal(remote.latents, local.latents)
    assert torch.equal(remote.log_probs.nan_to_num(-1.0), local.log_probs.nan_to_num(-1.0))
    assert torch.equal(remote.sigmas, local.sigmas) and torch.equal(remote.seeds, local.seeds)
    assert remote.metadata["model"] == local.metadata["model"]
    assert unordered(remote.metadata["scheduler"]) == unordered(local.metadata["scheduler"])


def unordered(scheduler: dict) -> dict:
    # diffusers' config `_use_default_values` is a list built from a set: its order follows the
    # process's string hash seed, so it differs between any two processes (local ones too)
    config = dict(scheduler["config"])
    config["_use_default_values"] = sorted(config.get("_use_default_values", []))
    return {**scheduler, "config": config}


def test_object_store_path_gives_the_same_table_as_flight(jobs, backend):
    job, _ = jobs.submit(spec(seed=5))
    assert wait(jobs, job.id, {"succeeded", "failed"}) == "succeeded", job.error
    with flight.FlightClient(backend.locations_for(job.id)[0]) as fc:
        over_flight = fc.do_get(flight.Ticket(job.ticket.encode())).read_all()
    assert ray.get(backend.trajectory_ref(job.id)).equals(over_flight, check_metadata=True)
    assert ray.get(trajectory_ref(job.id)).equals(over_flight)  # by id, from any process in the cluster
    with pytest.raises(KeyError):
        trajectory_ref("no-such-rollout")


def test_a_parent_on_a_worker_brings_its_conditioning_stream_to_the_branch(jobs, backend):
    job, _ = jobs.submit(spec(seed=11, return_conditioning=True))
    plain, _ = jobs.submit(spec(seed=12))
    for j in (job, plain):
        assert wait(jobs, j.id, {"succeeded", "failed"}) == "succeeded", j.error
    with flight.FlightClient(backend.locations_for(job.id)[0]) as fc:  # plain Flight, from its worker
        info = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", job.id, "conditioning"))
        want = fc.do_get(info.endpoints[0].ticket).read_all()
    parent = find_parent(backend, job.id)  # through the Ray object store: the control plane holds nothing
    assert parent.conditioning is not None and parent.conditioning.equals(want)
    branch = branch_spec(parent, spec(seed=13), step=1, samples=[1]).branch_from
    assert branch is not None and branch.conditioning is not None
    assert set(branch.conditioning) == {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                                        "negative_pooled_prompt_embeds"}
    for name, rows in branch.conditioning.items():  # parent sample 1's rows, bit for bit
        assert torch.equal(rows, column_tensor(want, name)[[1]]), name
    assert find_parent(backend, plain.id).conditioning is None  # none asked for: encode again


def test_progress_crosses_the_actor_boundary_and_cancel_stops_the_rollout(jobs):
    job, _ = jobs.submit(long_spec())
    wait_progress(jobs, job.id, 5)
    assert jobs.get(job.id).status == "running"
    jobs.cancel(job.id)
    assert wait(jobs, job.id, {"cancelled", "failed", "succeeded"}, timeout=30) == "cancelled"
    assert 5 <= jobs.get(job.id).steps_done < 3000
    again, _ = jobs.submit(spec(seed=9))
    assert wait(jobs, again.id, {"succeeded", "failed"}) == "succeeded", again.error


def test_flight_cancel_action_on_the_worker_cancels_its_rollout(jobs, backend):
    job, _ = jobs.submit(long_spec())
    wait_progress(jobs, job.id, 3)
    with flight.FlightClient(backend.locations_for(job.id)[0]) as fc:
        (answer,) = fc.do_action(flight.Action("cancel", job.id.encode()))
    assert b'"cancelled": true' in answer.body.to_pybytes()
    assert wait(jobs, job.id, {"cancelled", "failed", "succeeded"}, timeout=30) == "cancelled"


def test_compatible_rollouts_batch_on_the_worker_they_were_placed_on(backend):
    """Co-batching on Ray: the manager batches per worker (placement keeps a batch on one worker);
    each trajectory says with whom it ran, and the members of one call are those of one worker. The
    manager's batch hook (the /metrics histograms) gets each call's size as the worker reports it."""
    from sigmaflight.pipeline.batch import batch_key

    model = ModelRegistry().get("tiny-sd3")
    calls: list[tuple[int, int]] = []
    batching = JobManager(backend, workers=2, batch_wait_s=3.0, on_batch=lambda *size: calls.append(size))
    try:
        specs = [spec(seed=400 + k, prompts=(f"prompt {k}",)) for k in range(4)]
        submitted = [batching.submit(s, batch_key=batch_key(model, s))[0] for s in specs]
        batching.start()
        metas = {}
        for j in submitted:
            assert wait(batching, j.id, {"succeeded", "failed"}) == "succeeded", batching.get(j.id)
            metas[j.id] = pull(backend.locations_for(j.id)[0], j.ticket).metadata["batch"]
    finally:
        batching.stop()
    by_worker: dict[str, list[dict]] = {}
    for job_id, meta in metas.items():
        by_worker.setdefault(backend.locations_for(job_id)[0], []).append(meta)
    assert len(by_worker) == 2  # least-loaded placement spread them over both workers
    for members in by_worker.values():
        assert len({m["id"] for m in members}) == 1 and {m["requests"] for m in members} == {len(members)}
        rows = sorted(tuple(m["rows"]) for m in members)
        assert rows[0][0] == 0 and rows[-1][1] == members[0]["samples"] == len(members)  # one sample each
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    assert sorted(calls) == sorted((len(m), len(m)) for m in by_worker.values())  # (samples, members) a call


def _noisy(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v.clone()
            for k, v in state.items()}


def test_a_weights_push_one_worker_refuses_changes_no_worker_and_a_good_one_then_commits_on_both(backend):
    """All or none: worker 1 serves other weights (pushed to it alone), so a push made against the
    cluster's base is refused by worker 1 after worker 0 staged it: both serve what they served
    before and hold nothing staged. Once worker 1 is back on the base, the same push commits on
    both. Reference digests: a plain in-process ModelRegistry given the same state dicts."""
    reference = ModelRegistry()
    base = {k: v.clone() for k, v in reference.get("tiny-sd3").pipeline.transformer.state_dict().items()}
    d_base = reference.replace_weights("tiny-sd3", base).digest
    diverged, new = _noisy(base, 21), _noisy(base, 22)
    d_diverged = ModelRegistry().replace_weights("tiny-sd3", diverged).digest
    d_new = ModelRegistry().replace_weights("tiny-sd3", new).digest
    assert len({d_base, d_diverged, d_new}) == 3

    assert backend.load_weights("tiny-sd3", base) == [d_base, d_base]
    w0, w1 = (s.handle for s in backend._slots)
    assert ray.get(w1.load_weights.remote("tiny-sd3", diverged)) == d_diverged
    before = [ray.get(w.weights_of.remote("tiny-sd3")) for w in (w0, w1)]

    with pytest.raises(StaleWeights):
        backend.load_weights("tiny-sd3", new, expected_base=d_base, expected_digest=d_new)
    after = [ray.get(w.weights_of.remote("tiny-sd3")) for w in (w0, w1)]
    assert after == before
    assert [a["digest"] for a in after] == [d_base, d_diverged] and [a["staged"] for a in after] == [0, 0]

    assert ray.get(w1.load_weights.remote("tiny-sd3", base)) == d_base
    assert backend.load_weights("tiny-sd3", new, expected_base=d_base, expected_digest=d_new) == [d_new, d_new]
    served = [ray.get(w.weights_of.remote("tiny-sd3")) for w in (w0, w1)]
    assert [s["digest"] for s in served] == [d_new, d_new] and [s["staged"] for s in served] == [0, 0]


def test_stored_ids_names_what_the_workers_hold_and_a_release_then_reaches_the_holder(jobs, backend):
    """After a restart the control plane does not know which worker adopted a file: `stored_ids`
    asks them all (the restart scan frees what the journal has no row for), and remembers the
    holder, so the release it sends frees the trajectory there."""
    job, _ = jobs.submit(spec(num_inference_steps=2))
    wait(jobs, job.id, {"succeeded"})
    with backend._lock:
        backend._where.pop(job.id)  # as after a restart: nobody knows where it is held
    assert job.id in backend.stored_ids()
    backend.release(job.id)
    assert job.id not in backend.stored_ids() and backend.result_info(job.id) is None


def test_a_killed_worker_fails_its_rollout_naming_it_and_a_replacement_takes_new_ones(jobs, backend):
    before = {w["actor"] for w in backend.workers()}
    job, _ = jobs.submit(long_spec())
    victim = next(w for w in backend.workers() if w["locations"] == backend.locations_for(job.id))
    wait_progress(jobs, job.id, 3)
    ray.kill(backend.worker_for(job.id))
    assert wait(jobs, job.id, {"failed", "succeeded", "cancelled"}, timeout=60) == "failed"
    error = known(jobs.get(job.id)).error
    assert error is not None
    kind, message = error.type, error.message
    assert kind == "worker_died"
    assert message.startswith(f"worker {victim['index']} (actor {victim['actor']}) died: ")

    after = [jobs.submit(spec(seed=100 + k))[0] for k in range(3)]  # served by the rest meanwhile
    for j in after:
        assert wait(jobs, j.id, {"succeeded", "failed"}) == "succeeded", j.error
        assert pull(backend.locations_for(j.id)[0], j.ticket).num_samples == 2

    deadline = time.monotonic() + 120
    while len(backend.workers()) < 2 or victim["actor"] in {w["actor"] for w in backend.workers()}:
        assert time.monotonic() < deadline, backend.workers()
        time.sleep(0.1)
    replacement = next(w for w in backend.workers() if w["actor"] not in before)
    assert replacement["index"] == victim["index"]
    placed = [jobs.submit(spec(seed=200 + k))[0] for k in range(2)]
    assert any(backend.locations_for(j.id) == replacement["locations"] for j in placed)
    for j in placed:
        assert wait(jobs, j.id, {"succeeded", "failed"}) == "succeeded", j.error


def test_pushed_weights_reach_every_worker_and_a_replacement_loads_them(jobs, backend):
    """load_weights returns once each live worker has the new weights; a worker started
    later (replacing a killed one) loads the committed ones (not a refused push's) before it
    takes rollouts. Reference digest:
    the same state dict loaded by a plain in-process ModelRegistry."""
    reference = ModelRegistry()
    state = reference.get("tiny-sd3").pipeline.transformer.state_dict()
    for seed in (10, 11):  # two pushes: the replacement loads the last at once, as its first change
        new = _noisy(state, seed)
        digest = reference.replace_weights("tiny-sd3", new).digest
        assert backend.load_weights("tiny-sd3", new) == [digest, digest]
    with pytest.raises(StaleWeights):  # refused by every worker: the replacement must not get it
        backend.load_weights("tiny-sd3", _noisy(state, 12), expected_base="0" * 64)

    before = {w["actor"] for w in backend.workers()}
    victim = backend.workers()[0]
    ray.kill(backend._slots[0].handle)
    deadline = time.monotonic() + 120
    while len(backend.workers()) < 2 or victim["actor"] in {w["actor"] for w in backend.workers()}:
        if victim["actor"] in {w["actor"] for w in backend.workers()}:
            backend.result_info("nothing")  # a call notices the dead worker and starts a replacement
        assert time.monotonic() < deadline, backend.workers()
        time.sleep(0.2)
    replacement = next(w for w in backend.workers() if w["actor"] not in before)
    placed = [jobs.submit(spec(seed=300 + k))[0] for k in range(4)]
    on_replacement = [j for j in placed if backend.locations_for(j.id) == replacement["locations"]]
    assert on_replacement
    versions: dict[str, int] = {}
    for j in placed:
        assert wait(jobs, j.id, {"succeeded", "failed"}) == "succeeded", j.error
        traj = pull(backend.locations_for(j.id)[0], j.ticket)
        assert traj.metadata["model"]["digest"] == digest
        versions[backend.locations_for(j.id)[0]] = traj.metadata["model"]["weights_version"]
    # the contract's weights_version: 0 at load, +1 per accepted push, as the worker that lived
    # through both pushes counts it; the replacement counted its one load as 1
    assert len(versions) == 2 and len(set(versions.values())) == 1 and min(versions.values()) >= 2, versions
