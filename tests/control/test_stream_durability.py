"""The outputs and conditioning streams of a rollout survive kill -9 with --data-dir, as its
trajectory does (contract: every finished rollout is served again under the same id and
ticket). Real server, sigmaflight.Client and plain pyarrow."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch

from sigmaflight import Client
from tests.servers import InProcessServer, ServerProcess, log_entries

pytestmark = pytest.mark.e2e


def test_extra_streams_survive_kill_9_and_go_with_their_rollout(tmp_path):
    data = tmp_path / "data"
    server = ServerProcess("--data-dir", str(data))
    try:
        with Client(server.rest_url) as client:
            t = client.submit(prompts=["a red cube", "a dog"], num_inference_steps=2, seed=5,
                              sampler={"type": "sde"}, return_={"outputs": True, "conditioning": True})
            client.wait(t, timeout=120)
            outputs, cond = client.pull_outputs(t), client.pull_conditioning(t)
            table = client.pull_stream(t, "conditioning")
        files = {p.name for p in (data / "streams").iterdir()}
        assert files == {f"{t.id}.outputs.arrow", f"{t.id}.conditioning.arrow"}
        assert pa.ipc.open_file(pa.memory_map(str(data / "streams" / f"{t.id}.conditioning.arrow"))).read_all() \
            .equals(table)
    finally:
        server.kill()  # SIGKILL: no shutdown code runs
    with InProcessServer("--data-dir", str(data)) as again:  # the restart may run in this process
        assert log_entries(again, "serving stream again", rollout=t.id, stream="conditioning")
        with Client(again.rest_url) as client:
            assert np.array_equal(client.pull_outputs(t.id), outputs)
            again_cond = client.pull_conditioning(t.id)
            assert set(again_cond) == set(cond)
            for name, value in cond.items():
                assert torch.equal(again_cond[name], value), name
        with flight.FlightClient(again.flight_url) as fc:  # the ticket handed out before the crash
            assert fc.do_get(flight.Ticket(t.flight.streams["conditioning"].ticket.encode())).read_all().equals(table)
        with again.client() as c:
            assert c.delete(f"/v1/rollouts/{t.id}").status_code == 200
        assert not list((data / "streams").iterdir())
