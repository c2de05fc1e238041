"""End to end: `sigmaflight serve --backend ray` (its own local Ray cluster), REST in, Flight from the workers.

One server for the module (a Ray cluster and two workers take ~20 s to start), in this order: the
rollouts and their shared-memory files on each worker, the outputs stream and a token reload that
reaches the workers, a worker killed under a trainer's pull, then SIGTERM, which must stop every
process of the Ray instance it started.
"""

from __future__ import annotations

import json
import os
import re
import time

import psutil
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import Trajectory, TrajectoryClient
from sigmaflight.dataplane.shm import host_id, parse_file_location

from sigmaflight import Client
from tests.dataplane.helpers import mapped_ranges
from tests.faults.test_token_reload import NEW, OLD, _flight_ok, _hup_and_wait, _write
from tests.servers import ServerProcess, wait_for, wait_for_status

pytestmark = pytest.mark.e2e

pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server, its --shm-dir and its --token-file (holding OLD until the token test rotates it)."""
    root = tmp_path_factory.mktemp("serve-on-ray")
    shm, tokens = root / "shm", root / "tokens.txt"
    _write(tokens, OLD + "\n")
    flags = ("--backend", "ray", "--ray-address", "local", "--workers", "2", "--ray-num-cpus", "1",
             "--shm-dir", str(shm), "--token-file", str(tokens), "--max-steps", "3000")
    with ServerProcess(*flags, timeout=180) as server:
        yield server, shm, tokens


def _auth(token: str) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])


def test_serve_with_ray_workers_hands_out_worker_locations_and_their_shared_memory_files(served):
    server, shm, _ = served
    with server.client(OLD) as client:
        tickets = []
        for seed in (1, 2):
            r = client.post("/v1/rollouts", json={"prompts": ["a red cube"], "num_inference_steps": 3, "seed": seed})
            assert r.status_code == 202, r.text
            tickets.append(r.json())
        locations = {t["flight"]["locations"][0] for t in tickets}
        assert len(locations) == 2 and server.flight_url not in locations  # one per worker, not the control plane
        for t in tickets:
            done = wait_for_status(client, t["id"], {"succeeded", "failed"}, timeout=120)
            assert done["status"] == "succeeded", done
            with flight.FlightClient(t["flight"]["locations"][0]) as fc:
                table = fc.do_get(flight.Ticket(t["flight"]["ticket"].encode()), options=_auth(OLD)).read_all()
            assert table.num_rows == done["result"]["num_rows"] == 4
            # each worker keeps its finished rollouts in its own DIR/worker-N/sigmaflight-<uid> and offers the file;
            # a client on this host reads it: iter_chunks gives views into this process's mapping of it
            with TrajectoryClient(t["flight"]["locations"][0], token=OLD) as tc:
                info = tc.info(t["id"])
                files = [parse_file_location(u) for u in info["locations"][1:]]
                assert len(files) == 1 and files[0] is not None
                path, host = files[0]
                assert path.parent.name == f"sigmaflight-{os.geteuid()}" and host == host_id()
                assert path.parent.parent.parent == shm and path.parent.parent.name.startswith("worker-")
                local = tc.pull(t["flight"]["ticket"])
                chunks = list(tc.iter_chunks(t["id"]))
                ranges = mapped_ranges(path)
                assert ranges and all(any(lo <= c.latent.data_ptr() < hi for lo, hi in ranges) for c in chunks)
            assert torch.equal(local.latents, Trajectory.from_table(table).latents)
        assert {p.parent.parent.name for p in shm.glob("worker-*/sigmaflight-*/*.arrow")} == {"worker-0", "worker-1"}
        # a bare Flight ticket is found on the worker that holds it, whichever rollout is newest
        with Client(server.rest_url, token=OLD) as c:
            for t in tickets:
                assert c.locate(t["flight"]["ticket"]) == (t["flight"]["locations"][0], t["flight"]["ticket"])
                assert c.pull(t["flight"]["ticket"]).header.rollout_id == t["id"]
        released = next(shm.glob(f"worker-*/sigmaflight-*/{tickets[0]['id']}.arrow"))
        assert client.delete(f"/v1/rollouts/{tickets[0]['id']}").status_code == 200
        gone = flight.Ticket(tickets[0]["flight"]["ticket"].encode())
        with flight.FlightClient(tickets[0]["flight"]["locations"][0]) as fc, pytest.raises(flight.FlightError):
            fc.do_get(gone, options=_auth(OLD)).read_all()  # released on the worker
        assert not released.exists()  # and its file removed


def _expired(metrics: str) -> float:
    m = re.search(r'^sigmaflight_rollouts_finished_total\{status="expired"\} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_flight_release_at_the_worker_goes_through_the_control_plane(served):
    """The ticket points at the worker, so a trainer's Flight release goes there. The worker freed
    its copy alone: REST said succeeded until --ttl-s, /metrics counted no expiry, and a running
    rollout's release answered released: false, not the control plane's "cancel it first"."""
    server, _, _ = served
    with server.client(OLD) as c:
        long = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 3000, "seed": 3,
                                            "return": {"steps": [0]}}).json()
        done = c.post("/v1/rollouts", json={"prompts": ["b"], "num_inference_steps": 2, "seed": 4}).json()
        assert wait_for_status(c, done["id"], {"succeeded"}, timeout=120)["status"] == "succeeded"
        wait_for_status(c, long["id"], {"running"}, timeout=120)
        expired = _expired(c.get("/metrics").text)
        for ticket, body in ((long, None), (done, True)):
            worker = ticket["flight"]["locations"][0]
            assert worker != server.flight_url
            with flight.FlightClient(worker) as fc:
                action = flight.Action("release", ticket["id"].encode())
                if body is None:
                    with pytest.raises(flight.FlightServerError, match=f"rollout {ticket['id']} is running; cancel it first"):
                        list(fc.do_action(action, options=_auth(OLD)))
                else:
                    (answer,) = fc.do_action(action, options=_auth(OLD))
                    assert json.loads(answer.body.to_pybytes())["released"] is True
        assert wait_for_status(c, done["id"], {"expired"}, timeout=10)["status"] == "expired"
        assert _expired(c.get("/metrics").text) == expired + 1
        assert c.get(f"/v1/rollouts/{long['id']}").json()["status"] == "running"  # refused, still running
        assert c.delete(f"/v1/rollouts/{long['id']}").status_code == 200
        wait_for_status(c, long["id"], {"cancelled"}, timeout=60)


def test_ray_workers_serve_the_outputs_stream_the_policy_version_and_reloaded_tokens(served):
    """return.outputs on a Ray worker: the worker's Flight server holds the stream, equal to the stock
    pipeline's own decode of the same latents; the metadata carries digest and weights_version.
    With --token-file, a SIGHUP after editing it reaches the worker's Flight server."""

    import numpy as np
    from sigmaflight.pipeline.models import ModelRegistry

    from tests.control.test_outputs_stream import CASES, _stock_outputs

    server, _, tokens = served
    case = CASES["tiny-sd3"]
    model = ModelRegistry().get("tiny-sd3")
    with Client(server.rest_url, token=OLD) as client:
        ticket = client.submit(num_inference_steps=2, seed=4, sampler={"type": "ode"}, expected_digest=model.digest,
                               return_={"outputs": True, "steps": [0, 2]}, **case)
        worker, outputs = ticket.flight.locations[0], ticket.flight.streams["outputs"].ticket
        assert worker != server.flight_url  # the worker's Flight server
        client.wait(ticket, timeout=120)
        with flight.FlightClient(worker) as fc:
            table = fc.do_get(flight.Ticket(outputs.encode()), options=_auth(OLD)).read_all()
        traj = client.pull(ticket)

        _write(tokens, NEW + "\n")  # rotate: the worker's Flight server follows the control plane
        _hup_and_wait(server, '"tokens reloaded"', 0)
        assert '"tokens pushed to ray workers"' in server.log_text
        assert _flight_ok(worker, NEW, outputs) and not _flight_ok(worker, OLD, outputs)
    want, x_t = _stock_outputs(model, case, 2, traj.latent(0))
    assert torch.equal(x_t, traj.latent(2))
    assert np.array_equal(table.column("image").combine_chunks().to_numpy_ndarray(), want)
    meta = json.loads(table.schema.metadata[b"sigmaflight.rollout"])["model"]
    assert meta["digest"] == model.digest and meta["weights_version"] == 0


def _tree(pid: int) -> dict[int, str]:
    """Every process under `pid` now, by pid, with its command line (Ray names its own ray::...)."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out[p.pid] = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
    return out


def _alive(pid: int, since: float) -> bool:
    """Still running, and the same process (a pid reused after it died has a later start time)."""
    try:
        p = psutil.Process(pid)
        return p.create_time() <= since and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_pull_following_a_rollout_whose_worker_dies_raises_rollout_failed_worker_died(served):
    """The trainer follows the rollout on its worker's Flight; the worker is killed. The stream breaks
    off untyped ("Socket closed") before the control plane knows, and Client.pull raised that as
    ApiError flight_error; trainers.md: a pull of a rollout that ended failed raises RolloutFailed."""
    import threading

    from sigmaflight import RolloutFailed

    server, _, _ = served
    with Client(server.rest_url, token=NEW) as c, server.client(NEW) as http:  # the token test rotated it
        done = [c.submit(prompts=["b"], num_inference_steps=2, seed=6 + k) for k in range(2)]  # one on each worker
        for t in done:
            c.wait(t, timeout=120)
        ticket = c.submit(prompts=["a"], num_inference_steps=3000, seed=5, return_={"steps": [0, 3000]})
        wait_for_status(http, ticket.id, {"running"}, timeout=120)
        port = int(ticket.flight.locations[0].rsplit(":", 1)[1])
        listening = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
                     for cn in _listening(p) if cn.laddr.port == port}
        assert len(listening) == 1, listening
        got: dict[str, BaseException | None] = {}

        def follow() -> None:
            try:
                c.pull(ticket)
                got["error"] = None
            except BaseException as exc:  # for the asserting thread
                got["error"] = exc

        follower = threading.Thread(target=follow)
        follower.start()
        worker = psutil.Process(listening.pop())
        wait_for(lambda: any(cn.status == "ESTABLISHED" and cn.laddr.port == port
                             for cn in worker.net_connections(kind="tcp")), "the follower's stream is open on the worker")
        os.kill(worker.pid, 9)
        follower.join(timeout=60)
        error = got.get("error")
        assert isinstance(error, RolloutFailed), repr(error)
        assert error.rollout is not None and error.rollout.error is not None
        assert error.rollout.error.type == "worker_died"
        # what the dead worker had finished is gone with it (no --data-dir): once its replacement is
        # up, REST stops saying succeeded (it did until the TTL, while every pull failed)
        held = [t for t in done if t.flight.locations == ticket.flight.locations]
        assert held, (done, ticket)
        gone = wait_for_status(http, held[0].id, {"failed"}, timeout=120)
        assert gone["error"]["type"] == "result_unavailable" and "--data-dir" in gone["error"]["message"]


def _listening(p: psutil.Process) -> list:
    try:
        return [cn for cn in p.net_connections(kind="tcp") if cn.status == "LISTEN"]
    except psutil.Error:
        return []


def test_sigterm_stops_every_process_of_the_ray_instance_the_server_started(served):
    """`--ray-address local` starts its own Ray instance; SIGTERM must stop all of it. Before,
    ray::DashboardAgent and ray::RuntimeEnvAgent (about 85 MB each, deaf to SIGTERM) outlived the
    server as orphans. Last in the module: it ends the module's server."""
    server, _, _ = served
    started = time.time()
    tree = _tree(server.proc.pid)
    agents = [cmd for cmd in tree.values() if "DashboardAgent" in cmd or "RuntimeEnvAgent" in cmd
              or "raylet" in cmd or "gcs_server" in cmd]
    assert agents, f"the probe sees no Ray process under the server: {sorted(tree.values())}"
    assert server.terminate(timeout=60) in (0, -15)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert '"stopped"' in server.log_text  # the graceful path ran: ray.init must not steal SIGTERM
    assert "Finished server process" in server.log_text
    deadline = time.monotonic() + 30
    while (left := {pid: cmd for pid, cmd in tree.items() if _alive(pid, started)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == {}, f"outlived the server: {sorted(left.values())}"
