"""GET /metrics on the real server, parsed with prometheus-client's own text parser."""

from __future__ import annotations

import pyarrow.flight as flight
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import InProcessServer, wait_for_status

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
