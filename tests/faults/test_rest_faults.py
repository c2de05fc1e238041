"""Wrong answers of the REST plane (query parameters, a client that
leaves mid-body, a --model-dir model the sampler cannot run, DELETE of a cancelled rollout)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.flight as flight
import pytest

from tests.faults.conftest import LONG, LONG_FLAGS, SMALL, wait_running
from tests.servers import InProcessServer, wait_for, wait_for_status


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--workers", "1", *LONG_FLAGS) as s:
        yield s


def _details_name(body: dict, where: list[str]) -> bool:
    return any(d["loc"] == where for d in body["error"].get("details") or [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw", ["%C2%B2", "%C2%B9%E2%81%B0", "%E2%91%A0"], ids=["superscript-2", "superscript-10",
                                                                              "circled-1"])
def test_limit_unicode_digits_are_422_naming_limit(server: InProcessServer, raw: str) -> None:
    with server.client() as c:
        r = c.get(f"/v1/rollouts?limit={raw}")
    assert r.status_code == 422, r.text
    assert _details_name(r.json(), ["query", "limit"]), r.text


@pytest.mark.parametrize("query,name", [("limit=abc", "limit"), ("limit=0", "limit"), ("limit=-1", "limit"),
                                        ("limit=1001", "limit"), ("status=nope", "status"),
                                        ("limit=%EF%BC%95", "limit"), ("limit=+5", "limit"), ("limit=", "limit"),
                                        ("status=", "status"), ("offset=5", "offset"), ("limit=5&sort=id", "sort")])
def test_plain_bad_query_parameters_are_422(server: InProcessServer, query: str, name: str) -> None:
    """ASCII garbage (held before the fix), a full-width digit, an empty value and unknown parameters:
    each a 422 naming the parameter."""
    with server.client() as c:
        r = c.get(f"/v1/rollouts?{query}")
    assert r.status_code == 422, r.text
    assert _details_name(r.json(), ["query", name]), r.text


@pytest.mark.parametrize(("method", "query", "name"), [
    ("GET", "limit=5&limit=abc", "limit"), ("GET", "status=queued&status=running", "status"),
    ("DELETE", "force=1", "force"),
])
def test_repeated_and_unknown_parameters_of_other_routes_are_422(server: InProcessServer, method: str, query: str,
                                                                name: str) -> None:
    """A parameter given twice was taken as its last value (`?wait_s=abc&wait_s=1` held the read);
    DELETE took any parameter. Nothing is cancelled by a refused DELETE."""
    with server.client() as c:
        rid = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 1}).json()["id"]
        path = "/v1/rollouts" if method == "GET" else f"/v1/rollouts/{rid}"
        r = c.request(method, f"{path}?{query}")
        assert r.status_code == 422, r.text
        assert _details_name(r.json(), ["query", name]), r.text
        held = c.get(f"/v1/rollouts/{rid}?wait_s=abc&wait_s=1")
        assert held.status_code == 422 and _details_name(held.json(), ["query", "wait_s"]), held.text
        assert c.get(f"/v1/rollouts/{rid}").json()["status"] != "cancelled"


def _http_500s(server: InProcessServer) -> float:
    """POST 500s so far, read with prometheus-client's own parser (whatever the label order)."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as c:
        text = c.get("/metrics").text
    # A labelled counter exports its family (HELP and TYPE) before its first sample: on a fresh
    # server no response may have been counted yet, and none is then 0.
    families = [f for f in text_string_to_metric_families(text) if f.name == "sigmaflight_http_responses"]
    assert families, "no sigmaflight_http_responses family in /metrics: the metric was renamed?"
    return sum(s.value for f in families for s in f.samples
               if s.name == "sigmaflight_http_responses_total" and s.labels == {"method": "POST", "code": "500"})


@pytest.mark.timeout(60)
def test_client_disconnect_mid_body_is_not_a_server_error(server: InProcessServer) -> None:
    url = urlsplit(server.rest_url)
    before_500 = _http_500s(server)
    before_log = len(server.logs)
    body = json.dumps(SMALL).encode()
    ids = [f"mid-body-{uuid.uuid4().hex[:8]}-{n}" for n in range(3)]
    for rid in ids:
        with socket.create_connection((url.hostname, url.port), timeout=5) as s:
            head = (f"POST /v1/rollouts HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
                    f"X-Request-Id: {rid}\r\nContent-Length: {len(body) + 1000}\r\n\r\n").encode()
            s.sendall(head + body[:10])
        # closed with 1000+ bytes of the body still owed
    # The event: the server has handled each request (its one log line, found by request id), or
    # failed it ("unhandled error" is logged before the 500 would be sent).
    def handled() -> list[str]:
        new = server.logs[before_log:]
        if any("unhandled error" in line for line in new):
            return new
        return new if all(any(rid in line for line in new) for rid in ids) else []

    new = wait_for(handled, "a log line for each of the 3 disconnected requests")
    assert not [line for line in new if "unhandled error" in line], "\n".join(new)[-2000:]
    for rid in ids:
        (line,) = [line for line in new if rid in line]
        assert "client disconnected before its request body arrived" in line, line
    assert _http_500s(server) == before_500
    with server.client() as c:
        assert c.post("/v1/rollouts", json=SMALL).status_code == 202  # and it keeps serving


@pytest.mark.timeout(120)
def test_delete_of_a_cancelled_rollout_keeps_it_cancelled(server: InProcessServer) -> None:
    """docs/operations.md: DELETE of a failed or cancelled rollout keeps its status; a repeated
    DELETE answers 200 with the same status, and Flight still names how it ended."""
    with server.client() as c:
        blocker = c.post("/v1/rollouts", json=LONG).json()
        wait_running(c, blocker["id"], steps=1)
        queued = c.post("/v1/rollouts", json=SMALL).json()
        assert c.delete(f"/v1/rollouts/{queued['id']}").json()["status"] == "cancelled"
        again = c.delete(f"/v1/rollouts/{queued['id']}")
        assert again.status_code == 200, again.text
        assert again.json()["status"] == "cancelled", again.text
        assert c.get(f"/v1/rollouts/{queued['id']}").json()["status"] == "cancelled"
        c.delete(f"/v1/rollouts/{blocker['id']}")
        assert wait_for_status(c, blocker["id"], {"cancelled", "failed", "succeeded"})["status"] == "cancelled"
        assert c.delete(f"/v1/rollouts/{blocker['id']}").json()["status"] == "cancelled"  # frees its steps
        for rollout in (queued, blocker):  # cancelled while queued, and while running
            with flight.FlightClient(server.flight_url) as fc, pytest.raises(flight.FlightError) as gone:
                fc.do_get(flight.Ticket(rollout["flight"]["ticket"].encode())).read_all()
            assert "not found (cancelled: " in str(gone.value)  # Flight agrees with REST, not "released"


@pytest.fixture(scope="module")
def ddim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local diffusers pipeline whose scheduler is not flow-match: the tiny SD3 built by the
    registry, saved with a stock diffusers DDIMScheduler in place of its FlowMatch one."""
    from diffusers import DDIMScheduler
    from sigmaflight.pipeline.models import ModelRegistry

    root = tmp_path_factory.mktemp("models")
    pipe = ModelRegistry().get("tiny-sd3").pipeline
    pipe.register_modules(scheduler=DDIMScheduler())
    pipe.save_pretrained(root / "ddim-sd3")
    assert json.loads((root / "ddim-sd3" / "scheduler" / "scheduler_config.json").read_text())[
        "_class_name"] == "DDIMScheduler"
    return root


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_model_dir_with_a_non_flow_match_scheduler_is_refused(ddim_model_dir: Path) -> None:
    """docs/control.md: start-up mistakes are refused before uvicorn starts, with one line on
    stderr naming the directory and the scheduler, and exit status 2."""
    cmd = [sys.executable, "-m", "sigmaflight.cli", "serve", "--port", "0", "--flight-port", "0",
           "--model-dir", str(ddim_model_dir)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:  # it is serving: killed by subprocess.run
        pytest.fail(f"sigmaflight serve started with a DDIM pipeline instead of refusing it:\n{exc.stderr!r}"[-2000:])
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    refusal = [line for line in done.stderr.splitlines() if line.startswith("sigmaflight serve:")]
    assert len(refusal) == 1, done.stderr[-2000:]
    assert "ddim-sd3" in refusal[0] and "DDIMScheduler" in refusal[0] and "flow-match" in refusal[0], refusal[0]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
