"""GET /metrics on the real server, parsed with prometheus-client's own text parser."""

from __future__ import annotations

import pyarrow.flight as flight
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import InProcessServer, wait_for, wait_for_status

DOCUMENTED = {  # docs/control.md, "Logs and metrics": family name -> (type, label names)
    "sigmaflight_queue_depth": ("gauge", set()),
    "sigmaflight_rollouts": ("gauge", {"status"}),
    "sigmaflight_rollouts_finished": ("counter", {"status"}),
    "sigmaflight_steps": ("counter", set()),
    "sigmaflight_flight_bytes_served": ("counter", set()),
    "sigmaflight_flight_streams": ("gauge", set()),
    "sigmaflight_store_bytes": ("gauge", {"where"}),
    "sigmaflight_store_entries": ("gauge", set()),
    "sigmaflight_http_responses": ("counter", {"method", "code"}),
}


@pytest.fixture(scope="module")
def server():
    with InProcessServer() as s:
        yield s


def scrape(client) -> tuple[str, dict]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return r.headers["content-type"], {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    for fam in families.values():
        for s in fam.samples:
            if s.name == sample_name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"no sample {sample_name}{labels}")


def test_metrics_parse_and_follow_a_rollout(server):
    with server.client() as c:
        content_type, before = scrape(c)
        assert content_type == CONTENT_TYPE_LATEST
        for name, (kind, labels) in DOCUMENTED.items():
            fam = before[name]
            assert fam.type == kind, name
            for s in fam.samples:
                assert set(s.labels) == labels, (name, s)
        # The process collector is in the service's registry.
        assert value(before, "process_resident_memory_bytes") > 10 << 20
        assert value(before, "process_cpu_seconds_total") > 0
        assert value(before, "sigmaflight_steps_total") == 0

        r = c.post("/v1/rollouts", json={"prompts": ["a red cube", "a dog"], "num_inference_steps": 3, "seed": 1})
        assert r.status_code == 202
        ticket = r.json()
        assert wait_for_status(c, ticket["id"], {"succeeded", "failed"})["status"] == "succeeded"
        with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
            table = fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all()
        pulled = sum(b.nbytes for b in table.to_batches())

        # counted once the server's call has ended well, a moment after the client read the end
        wait_for(lambda: value(scrape(c)[1], "sigmaflight_flight_bytes_served_total") == pulled, "the bytes counted")
        _, after = scrape(c)
    assert value(after, "sigmaflight_steps_total") == 3
    assert value(after, "sigmaflight_rollouts", status="succeeded") == 1
    assert value(after, "sigmaflight_rollouts_finished_total", status="succeeded") == 1
    assert value(after, "sigmaflight_queue_depth") == 0
    assert value(after, "sigmaflight_store_entries") == 1
    assert value(after, "sigmaflight_store_bytes", where="memory") > 0
    assert value(after, "sigmaflight_flight_bytes_served_total") == pulled > 0
    assert value(after, "sigmaflight_http_responses_total", method="POST", code="202") == 1
    assert value(after, "sigmaflight_http_responses_total", method="GET", code="200") >= 2


def test_a_stream_cancelled_before_the_server_wrote_it_all_is_not_counted_as_served(server):
    """A finished rollout's whole table was counted as served the moment its do_get began: a
    consumer that read one batch and went away showed as the whole rollout streamed."""
    with server.client() as c:
        # about 23 MiB: far past what gRPC buffers for a consumer that has read one batch
        r = c.post("/v1/rollouts", json={"prompts": [f"p{i}" for i in range(16)], "num_outputs_per_prompt": 2,
                                         "num_inference_steps": 10, "height": 128, "width": 128, "seed": 2})
        ticket = r.json()
        assert wait_for_status(c, ticket["id"], {"succeeded", "failed"})["status"] == "succeeded"
        before = value(scrape(c)[1], "sigmaflight_flight_bytes_served_total")
        with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
            reader = fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode()))
            first = reader.read_chunk().data
            reader.cancel()
        wait_for(lambda: value(scrape(c)[1], "sigmaflight_flight_streams") == 0, "the stream ended")
        served = value(scrape(c)[1], "sigmaflight_flight_bytes_served_total") - before
        assert served == 0, (served, first.nbytes, ticket["id"])
        with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
            whole = fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all()
        assert whole.num_rows > first.num_rows  # there was more than one batch to stop after
        pulled = sum(b.nbytes for b in whole.to_batches())
        wait_for(lambda: value(scrape(c)[1], "sigmaflight_flight_bytes_served_total") - before == pulled, "counted whole")
