"""Round-trip over a real FlightDataServer and a real FlightClient."""

import itertools
import json

import pyarrow.flight as flight
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
from sigmaflight.dataplane.server import FlightDataServer
from sigmaflight.dataplane.store import ResultStore

from tests.dataplane.helpers import build_header, expected_log_prob, fill

_ids = itertools.count()


@pytest.fixture(scope="module")
def shared_server():
    with ResultStore(memory_budget_bytes=1 << 30, data_dir=None) as store, FlightDataServer(store) as srv:
        yield srv


@st.composite
def rollouts(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    video = draw(st.booleans())
    c = draw(st.integers(1, 4))
    hw = draw(st.integers(1, 6))
    shape = (c, draw(st.integers(1, 3)), hw, hw) if video else (c, hw, hw)
    T = draw(st.integers(1, 6))
    n = draw(st.integers(1, 3))
    B = n * draw(st.integers(1, 3))
    steps = tuple(sorted(draw(st.sets(st.integers(0, T), min_size=1))))
    sde = tuple(sorted(draw(st.sets(st.integers(0, T - 1)))))
    log_probs = draw(st.booleans())
    max_batch = draw(st.sampled_from([1, 100, 1 << 22]))
    return dict(T=T, B=B, n_per_prompt=n, shape=shape, dtype=dtype, steps=steps, sde_steps=sde, log_probs=log_probs), max_batch


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rollouts())
def test_roundtrip_exact(shared_server, case):
    kw, max_batch = case
    store = shared_server.store
    store.max_batch_bytes = max_batch
    h = build_header(f"rt{next(_ids)}", **kw)
    steps = fill(store, h, seed=len(h.rollout_id))
    with TrajectoryClient(shared_server.locations[0]) as c:
        traj = c.pull(h.rollout_id)
        streamed = list(c.iter_steps(store.ticket_for(h.rollout_id)))
    B, T, K = h.num_samples, h.num_steps, len(h.steps)
    assert traj.latents.shape == (B, K, *h.latent_shape) and traj.latents.dtype == h.latent_dtype
    assert traj.steps.tolist() == list(h.steps)
    assert torch.equal(traj.sigmas.view(torch.int32), h.sigmas.view(torch.int32))  # full schedule, bit-exact
    assert torch.equal(traj.timesteps.view(torch.int32), h.timesteps.view(torch.int32))
    assert traj.seeds.tolist() == list(h.seeds)
    assert traj.prompt_index.tolist() == [s // kw["n_per_prompt"] for s in range(B)]
    assert traj.sde_steps == tuple(sorted(h.sde_steps))
    assert traj.log_probs.shape == (B, T)
    for i in h.steps:
        assert torch.equal(traj.latent(i), steps[i].latent)
        if i < T:
            torch.testing.assert_close(traj.log_probs[:, i], expected_log_prob(h, steps, i), equal_nan=True, rtol=0, atol=0)
    for i in set(range(T)) - set(h.steps):
        assert torch.isnan(traj.log_probs[:, i]).all()
    assert [s.step for s in streamed] == list(h.steps)
    for s in streamed:
        assert torch.equal(s.latent, steps[s.step].latent) and s.sample.tolist() == list(range(B))
    meta = traj.metadata
    assert meta["id"] == h.rollout_id and meta["seeds"] == list(h.seeds) and meta["sampler"] == {"type": "sde"}
    schema = traj.schema.metadata
    assert json.loads(schema[b"sigmaflight.steps"]) == list(h.steps)
    assert store.release(h.rollout_id)


def test_step_selection_keeps_absolute_indices_and_full_sigmas(server, store):
    h = build_header("sel", T=10, steps=(3, 4, 10), B=2)
    steps = fill(store, h)
    with TrajectoryClient(server.locations[0]) as c:
        t = c.pull("sel")
    assert t.steps.tolist() == [3, 4, 10]
    assert t.sigmas.shape == (11,) and t.timesteps.shape == (10,)
    assert torch.equal(t.latent(10), steps[10].latent)
    with pytest.raises(KeyError):
        t.latent(0)
    (tr,) = list(t.transitions())
    i, x, x1, s, s1, lp = tr
    assert i == 3 and torch.equal(x, steps[3].latent) and torch.equal(x1, steps[4].latent)
    assert s == float(h.sigmas[3]) and s1 == float(h.sigmas[4])
    assert steps[3].log_prob is not None and torch.equal(lp, steps[3].log_prob)
    assert list(t.transitions(steps=[4, 9])) == []


def test_b_equals_t_plus_one(server, store):
    """A per-sample slicer keyed on shape[0] == B would cut the [T+1] schedule."""
    h = build_header("bt", T=3, B=4)
    steps = fill(store, h)
    with TrajectoryClient(server.locations[0]) as c:
        t = c.pull("bt")
    assert t.sigmas.shape == (4,) and t.latents.shape[:2] == (4, 4) and t.log_probs.shape == (4, 3)
    assert torch.equal(t.sigmas, h.sigmas)
    assert all(torch.equal(t.latent(i), steps[i].latent) for i in range(4))


def test_plain_pyarrow_client_and_flight_info(server, store):
    h = build_header("plain", T=2, B=2)
    fill(store, h)
    with flight.FlightClient(("127.0.0.1", server.port)) as c:
        info = c.get_flight_info(flight.FlightDescriptor.for_path("rollouts", "plain"))
        assert info.schema.equals(store.get("plain").schema, check_metadata=True)
        assert info.total_records == 6 and info.total_bytes > 0
        (ep,) = info.endpoints
        assert ep.ticket.ticket.decode() == store.ticket_for("plain")
        assert [loc.uri.decode() for loc in ep.locations] == server.locations == [f"grpc+tcp://127.0.0.1:{server.port}"]
        table = c.do_get(ep.ticket).read_all()
        assert table.num_rows == 6 and table.schema.metadata == info.schema.metadata
        assert Trajectory.from_table(table).latents.shape == (2, 3, 2, 3, 3)
        assert c.get_schema(flight.FlightDescriptor.for_path("rollouts", "plain")).schema.equals(info.schema)
        assert [f.descriptor.path for f in c.list_flights()] == [[b"rollouts", b"plain"]]
        actions = dict((a.type, a.description) for a in c.list_actions())
        assert set(actions) == {"cancel", "release", "weights_push_status"} and all(actions.values())


def test_parallel_partitions_reassemble(server, store):
    h = build_header("par", T=5, B=4, shape=(4, 8, 8))
    store.max_batch_bytes = 2 * 4 * 8 * 8 * 4  # 2 samples a batch: 12 batches
    steps = fill(store, h)
    with TrajectoryClient(server.locations[0]) as c:
        got = list(c.iter_steps_parallel("par", streams=3))
    assert [s.step for s in got] == list(range(6))
    assert all(torch.equal(s.latent, steps[s.step].latent) for s in got)


def test_release_action_and_ids(server, store):
    fill(store, build_header("rel"))
    with TrajectoryClient(server.locations[0]) as c:
        assert c.info("rel")["total_records"] == 15
        assert c.release("rel") is True
        assert c.release("rel") is False
        with pytest.raises(flight.FlightServerError, match="released"):
            c.pull("rel")


def test_pull_into_a_callers_buffer(store, server, tmp_path):
    """pull(out=buffer) fills that tensor (over gRPC, and from a same-host shm file) with the
    values a fresh pull gives; a buffer of the wrong shape or dtype is refused naming both."""
    from tests.dataplane.helpers import build_header, fill

    h = build_header("into", T=3, B=2)
    steps = fill(store, h)
    with TrajectoryClient(server.locations[0]) as c:
        fresh = c.pull("into")
        buf = torch.full_like(fresh.latents, float("nan"))
        got = c.pull("into", out=buf)
        assert got.latents is buf and torch.equal(buf, fresh.latents)
        assert torch.equal(buf[:, 1], steps[h.steps[1]].latent)
        with pytest.raises(ValueError, match="out must be"):
            c.pull("into", out=torch.empty(2, 3, dtype=fresh.latents.dtype))
    with ResultStore(memory_budget_bytes=1 << 30, shm_dir=tmp_path / "shm") as s2, FlightDataServer(s2) as srv:
        fill(s2, h)
        with TrajectoryClient(srv.locations[0]) as c:
            assert c.local_file("into") is not None  # the file path, not a stream
            buf.fill_(float("nan"))
            assert c.pull("into", out=buf).latents is buf and torch.equal(buf, fresh.latents)


def test_a_trajectory_is_indexed_by_its_own_steps_tensor(server, store):
    """`traj.steps` is an int64 tensor: its elements are 0-d tensors, which hash by identity, so
    `latent(traj.steps[k])` said "step 3 is not in this trajectory (steps [3, 4, 10])" and
    `transitions(steps=traj.steps)` silently yielded nothing, a training step on no data."""
    h = build_header("own", T=10, steps=(3, 4, 10), B=2)
    steps = fill(store, h)
    with TrajectoryClient(server.locations[0]) as c:
        t = c.pull("own")
    for k, i in enumerate(t.steps):
        assert t.has_step(i) and torch.equal(t.latent(i), steps[int(i)].latent) and torch.equal(t.latent(i), t.latents[:, k])
    assert [tr.i for tr in t.transitions(steps=t.steps)] == [3]
    with pytest.raises(TypeError, match="step index"):
        t.latent(3.0)  # type: ignore[arg-type]
