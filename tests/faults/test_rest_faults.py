"""Issue 12, items 16-19: wrong answers of the REST plane (query parameters, a client that
leaves mid-body, a --model-dir model the sampler cannot run, DELETE of a cancelled rollout)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.faults.conftest import LONG, LONG_FLAGS, SMALL, wait_running
from tests.servers import ServerProcess, wait_for_status


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--workers", "1", *LONG_FLAGS) as s:
        yield s


def _details_name(body: dict, where: list[str]) -> bool:
    return any(d["loc"] == where for d in body["error"].get("details") or [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw", ["%C2%B2", "%C2%B9%E2%81%B0", "%E2%91%A0"], ids=["superscript-2", "superscript-10",
                                                                              "circled-1"])
def test_limit_unicode_digits_are_422_naming_limit(server: ServerProcess, raw: str) -> None:
    with server.client() as c:
        r = c.get(f"/v1/rollouts?limit={raw}")
    assert r.status_code == 422, r.text
    assert _details_name(r.json(), ["query", "limit"]), r.text


@pytest.mark.parametrize("query,name", [("limit=abc", "limit"), ("limit=0", "limit"), ("limit=-1", "limit"),
                                        ("limit=1001", "limit"), ("status=nope", "status"),
                                        ("limit=%EF%BC%95", "limit"), ("limit=+5", "limit"), ("limit=", "limit"),
                                        ("status=", "status"), ("offset=5", "offset"), ("limit=5&sort=id", "sort")])
def test_plain_bad_query_parameters_are_422(server: ServerProcess, query: str, name: str) -> None:
    """ASCII garbage (held before the fix), a full-width digit, an empty value and unknown parameters:
    each a 422 naming the parameter."""
    with server.client() as c:
        r = c.get(f"/v1/rollouts?{query}")
    assert r.status_code == 422, r.text
    assert _details_name(r.json(), ["query", name]), r.text


def _http_500s(server: ServerProcess) -> float:
    """POST 500s so far, read with prometheus-client's own parser (whatever the label order)."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as c:
        text = c.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text) if f.name == "sigmaflight_http_responses"
               for s in f.samples if s.name == "sigmaflight_http_responses_total"]
    assert samples, "no sigmaflight_http_responses_total samples: the metric was renamed?"
    return sum(s.value for s in samples if s.labels == {"method": "POST", "code": "500"})


@pytest.mark.timeout(60)
def test_client_disconnect_mid_body_is_not_a_server_error(server: ServerProcess) -> None:
    url = urlsplit(server.rest_url)
    before_500 = _http_500s(server)
    before_log = len(server.logs)
    body = json.dumps(SMALL).encode()
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port), timeout=5) as s:
            head = (f"POST /v1/rollouts HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body) + 1000}\r\n\r\n").encode()
            s.sendall(head + body[:10])
            time.sleep(0.2)
        # closed with 1000+ bytes of the body still owed
    time.sleep(1.0)
    new = server.logs[before_log:]
    assert not [line for line in new if "unhandled error" in line], "\n".join(new)[-2000:]
    assert _http_500s(server) == before_500
    with server.client() as c:
        assert c.post("/v1/rollouts", json=SMALL).status_code == 202  # and it keeps serving


@pytest.mark.timeout(120)
def test_delete_of_a_cancelled_rollout_keeps_it_cancelled(server: ServerProcess) -> None:
    with server.client() as c:
        blocker = c.post("/v1/rollouts", json=LONG).json()
        wait_running(c, blocker["id"], steps=1)
        queued = c.post("/v1/rollouts", json=SMALL).json()
        assert c.delete(f"/v1/rollouts/{queued['id']}").json()["status"] == "cancelled"
        again = c.delete(f"/v1/rollouts/{queued['id']}")
        assert again.status_code in (200, 409), again.text
        assert c.get(f"/v1/rollouts/{queued['id']}").json()["status"] == "cancelled"
        c.delete(f"/v1/rollouts/{blocker['id']}")
        wait_for_status(c, blocker["id"], {"cancelled", "failed", "succeeded"})


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


@pytest.mark.timeout(180)
def test_model_dir_with_a_non_flow_match_scheduler_is_refused(ddim_model_dir: Path) -> None:
    try:
        s = ServerProcess("--model-dir", str(ddim_model_dir), timeout=90)
    except RuntimeError as exc:  # refused at start: one line naming the directory and the scheduler
        assert "ddim-sd3" in str(exc) and "DDIMScheduler" in str(exc), str(exc)
        assert "Traceback" not in str(exc)
        return
    with s, s.client() as c:
        r = c.post("/v1/rollouts", json={**SMALL, "model": "ddim-sd3"})
        if r.status_code == 202:
            status = wait_for_status(c, r.json()["id"], {"succeeded", "failed"}, timeout=60)
            pytest.fail(f"a 202 for a model that cannot run: it ended {status['status']} {status['error']}")
        assert r.status_code == 422, r.text
        assert _details_name(r.json(), ["body", "model"]), r.text
        assert "DDIMScheduler" in r.json()["error"]["message"]
