"""What the tools tell a user from the diffusion-RL field: step_log_prob and the sampler it reads,
`inspect --strict`, an unreachable server or the wrong port, limits that name their flag, a cancel
of a finished rollout, Ctrl-C during a pull, no stray notices, and the docs page; on a real server
with the real client and CLI."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import pyarrow.flight as flight
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from sigmaflight.pipeline.models import ModelRegistry

from sigmaflight import ApiError, Client, ServerUnreachable, step_log_prob
from tests.cli.conftest import cli
from tests.servers import InProcessServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    # Limits a test can reach: a rollout of 2000 steps (to interrupt a pull), 256 MiB of latents at most.
    with InProcessServer("--max-steps", "2000", "--max-rollout-bytes", str(256 << 20)) as s:
        yield s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- 3: step_log_prob takes the trajectory's own sampler metadata ---------------------------------


def _velocities(ticket, step: int, samples: int) -> torch.Tensor:
    """The `velocity` column at `step`, [B, ...], read with plain pyarrow."""
    with flight.FlightClient(ticket.flight.locations[0]) as fc:
        table = fc.do_get(flight.Ticket(ticket.flight.ticket.encode())).read_all()
    rows = table.filter(np.asarray(table.column("step")) == step)
    assert rows.column("sample").to_pylist() == list(range(samples))
    return torch.from_numpy(rows.column("velocity").combine_chunks().to_numpy_ndarray().copy())


def test_step_log_prob_takes_the_trajectorys_own_sampler_metadata(server):
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["a red cube"], num_outputs_per_prompt=2, num_inference_steps=4, seed=3,
                          sampler={"type": "sde", "noise_level": 0.7, "sde_steps": [1, 2]},
                          return_={"velocities": True})
        traj = c.pull(ticket)
    sampler = traj.metadata["sampler"]
    assert isinstance(sampler, dict)
    for i in (1, 2):
        got = step_log_prob(traj.latent(i), traj.latent(i + 1), _velocities(ticket, i, 2), traj.sigmas, i,
                            sampler=sampler)  # was: AttributeError: 'dict' object has no attribute 'noise_level'
        assert torch.equal(got, traj.log_probs[:, i])


def test_step_log_prob_says_what_to_pass_for_a_sampler_it_cannot_read():
    x = torch.zeros(1, 2, 4, 4)
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    for bad in ({"type": "sde"}, "sde", {"type": "sde", "noise_level": 0.7, "sde_steps": None, "log_prob": "density",
                                         "window": 2}):
        with pytest.raises(TypeError) as e:
            step_log_prob(x, x, x, sigmas, 0, sampler=bad)  # type: ignore[arg-type]
        assert "traj.metadata['sampler']" in str(e.value)


# ---- 4: inspect --strict: the t/1000 drift is a hint ---------------------------------------------


def test_inspect_strict_passes_a_valid_trajectory_whose_t_over_1000_drifts(server, tmp_path, capsys):
    # Find a step count whose stock diffusers schedule has float32(t / 1000) != sigma somewhere.
    config = ModelRegistry().get("tiny-sd3").pipeline.scheduler.config
    drift: dict[int, list[int]] = {}
    for steps in range(2, 40):
        sched = FlowMatchEulerDiscreteScheduler.from_config(config)
        sched.set_timesteps(steps)
        t, s = sched.timesteps.to(torch.float32).numpy(), sched.sigmas.numpy()
        drift[steps] = [i for i in range(steps) if np.float32(t[i]) / np.float32(1000) != s[i]]
    steps = min(n for n, where in drift.items() if where)
    rc, out, _ = cli(capsys, "submit", "--url", server.rest_url, "-p", "x", "--steps", str(steps), "--seed", "1",
                     "--return-steps", f"0,{steps}", "--wait")
    assert rc == 0
    path = tmp_path / "drift.arrow"
    assert cli(capsys, "pull", json.loads(out)["id"], "--url", server.rest_url, "-o", str(path))[0] == 0
    rc, out, _ = cli(capsys, "inspect", str(path), "--json", "--strict")
    report = json.loads(out)
    assert report["flags"] == [] and rc == 0  # was: exit 1, the drift listed as a flag
    assert [h.split(":")[0] for h in report["hints"]] == [f"i={i}" for i in drift[steps]]
    rc, out, _ = cli(capsys, "inspect", str(path))
    assert "hints (" in out and "--strict ignores them" in out


# ---- 5, 9: a server that is down, the Flight port, a bad --json ------------------------------------


def test_client_against_a_down_server_raises_server_unreachable(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    with Client(url) as c:
        with pytest.raises(ServerUnreachable) as e:  # was: httpx.ConnectError
            c.status("x")
        with pytest.raises(ApiError):  # a documented class: one `except ApiError` covers it
            c.submit(prompts=["a"])
    assert isinstance(e.value.__cause__, httpx.ConnectError) and not isinstance(e.value, httpx.HTTPError)
    assert e.value.type == "unreachable" and e.value.status is None and str(e.value).startswith(f"cannot reach {url}:")
    rc, _, err = cli(capsys, "status", "x", "--url", url)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and f"cannot reach {url}" in err


def test_the_cli_pointed_at_the_flight_port_says_so(server, capsys):
    url = "http://127.0.0.1:" + server.flight_url.rsplit(":", 1)[1]
    rc, _, err = cli(capsys, "status", "x", "--url", url)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "is this the Flight port?" in err and "--port" in err  # was: "illegal request line" alone


def test_a_server_that_drops_the_connection_is_not_called_the_flight_port(capsys):
    """A REST server killed under a request (a held status read, a submit) closes the connection
    with no answer: that was "is this the Flight port?", sending the user to check a right URL."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def drop_every_connection() -> None:  # reads the request, then closes with no answer
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=drop_every_connection, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with Client(url) as c, pytest.raises(ServerUnreachable) as e:
            c.status("x")
        text = str(e.value)
        assert "Flight port" not in text and "did the server stop or restart" in text, text
    finally:
        listener.close()


def test_a_bad_json_file_is_named(tmp_path, capsys):
    not_json, a_list = tmp_path / "bad.json", tmp_path / "list.json"
    not_json.write_text("{prompts: [")
    a_list.write_text('["a red cube"]')
    for path, why in ((tmp_path / "missing.json", "cannot read it"), (not_json, "not JSON"),
                      (a_list, "a RolloutRequest is a JSON object")):
        rc, _, err = cli(capsys, "submit", "--json", str(path), "--url", f"http://127.0.0.1:{_free_port()}")
        assert rc == 2 and err.strip().splitlines() == [err.strip()], err
        assert f"--json {path}: {why}" in err  # was: "Expecting value: line 1 column 2 (char 1)", no file named


# ---- 9: limits name their flag ------------------------------------------------------------------


def test_limit_errors_name_the_flag_that_raises_the_limit(server):
    serve_help = subprocess.run([sys.executable, "-m", "sigmaflight.cli", "serve", "--help"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120, check=True).stdout
    with server.client() as http:
        r = http.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 5000})
        err = r.json()["error"]
        assert r.status_code == 422 and err["type"] == "validation_error"
        assert err["message"] == "num_inference_steps: 5000 exceeds the limit of 2000 (--max-steps)"
        assert err["details"] == [{"loc": ["body", "num_inference_steps"],
                                   "msg": "5000 exceeds the limit of 2000 (--max-steps)", "type": "value_error"}]
        cases = [
            ({"prompts": ["a"] * 65}, 422, "(--max-prompts)"),
            ({"prompts": ["a"], "num_outputs_per_prompt": 257}, 422, "(--max-samples)"),
            ({"prompts": ["a"], "num_outputs_per_prompt": 256, "num_inference_steps": 2000}, 413,
             "(--max-rollout-bytes)"),
        ]
        for body, status, flag in cases:
            r = http.post("/v1/rollouts", json=body)
            assert r.status_code == status and flag in r.json()["error"]["message"], r.text
            assert flag.strip("()") in serve_help
        r = http.post("/v1/rollouts", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["message"].endswith("(--max-body-bytes)")
        assert "--max-body-bytes" in serve_help and "--max-steps" in serve_help


# ---- 9: cancel on a finished rollout ----------------------------------------------------------


def test_cancel_on_a_finished_rollout_is_refused_unless_release(server, capsys):
    url = server.rest_url
    rc, out, _ = cli(capsys, "submit", "--url", url, "-p", "done", "--steps", "2", "--seed", "1", "--wait")
    rid = json.loads(out)["id"]
    rc, out, err = cli(capsys, "cancel", rid, "--url", url)
    assert rc == 1 and out == "" and err.strip() == (
        f"sigmaflight cancel: rollout {rid} already succeeded: nothing to cancel "
        "(--release frees a finished rollout's stored result)")
    with Client(url) as c:
        assert c.status(rid).status == "succeeded" and c.pull(rid).latents.shape[1] == 3  # nothing was lost
    rc, out, err = cli(capsys, "cancel", rid, "--url", url, "--release")
    assert rc == 0 and json.loads(out)["status"] == "expired" and "released" in err


# ---- 6: Ctrl-C during pull ----------------------------------------------------------------------


def test_ctrl_c_during_pull_exits_130_without_a_traceback(server, tmp_path):
    out = tmp_path / "long.arrow"
    partial = tmp_path / "long.arrow.partial"
    with Client(server.rest_url) as c:
        # Long to run (2000 steps), streamed step by step: the pull is mid-stream when it is interrupted.
        ticket = c.submit(prompts=["long"], num_outputs_per_prompt=4, num_inference_steps=2000, seed=1)
        pull = subprocess.Popen([sys.executable, "-m", "sigmaflight.cli", "pull", ticket.id, "-o", str(out),
                                 "--url", server.rest_url], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not partial.exists():  # the pull has its writer open
                assert pull.poll() is None and time.monotonic() < deadline, pull.communicate()
                time.sleep(0.05)
            assert c.status(ticket).status == "running"
            pull.send_signal(signal.SIGINT)
            _, err = pull.communicate(timeout=60)
        finally:
            if pull.poll() is None:
                pull.kill()
            c.cancel(ticket)
    assert pull.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err  # was: a KeyboardInterrupt traceback
    assert err.strip().splitlines()[-1] == "sigmaflight pull: interrupted"
    assert not partial.exists() and not out.exists()  # the cleanup: no half file left


# ---- 9: replay and plot print no torchvision notice ----------------------------------------------


REPLAY_AND_PLOT = """
import sys
from sigmaflight import Client, replay_log_probs
from sigmaflight.cli import main
from sigmaflight.pipeline.models import ModelRegistry
url, rollout, path, png = sys.argv[1:]
with Client(url) as c:
    traj = c.pull(rollout)
logp = replay_log_probs(ModelRegistry().get("tiny-sd3"), traj)
print("replayed", tuple(logp.shape))
assert main(["pull", rollout, "-o", path, "--url", url]) == 0
print("pulled", file=sys.stderr)
assert main(["plot", path, "-o", png]) == 0
"""


def test_replay_and_plot_print_no_torchvision_notice(server, tmp_path):
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["a red cube"], num_inference_steps=3, seed=2)
        c.wait(ticket)
    png = tmp_path / "t.png"
    done = subprocess.run([sys.executable, "-c", REPLAY_AND_PLOT, server.rest_url, ticket.id, str(tmp_path / "t.arrow"),
                           str(png)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "replayed (1, 3)" in done.stdout and png.stat().st_size > 0, done.stderr
    assert "torchvision" not in done.stderr, done.stderr  # was: two "requires torchvision" notices
    assert done.stderr.strip().splitlines()[-2:] == ["pulled", f"wrote {png}: 1400x900 PNG"]


# ---- 10: GET /docs, from a packaged copy ----------------------------------------------------------


class _Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.scripts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]

    def handle_data(self, data: str) -> None:
        if data.strip():
            self.scripts.append(data)


def test_docs_serves_swagger_ui_from_local_assets_only(server):
    with server.client() as http:
        r = http.get("/docs")  # was: 404
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        page = _Assets()
        page.feed(r.text)
        assert "://" not in r.text  # no CDN, no absolute URL of any host
        assert page.urls and all(u.startswith("/docs/static/") for u in page.urls), page.urls
        for url in page.urls:
            asset = http.get(url)
            assert asset.status_code == 200 and len(asset.content) > 100, url
        assert "/docs/static/swagger-ui-bundle.js" in page.urls and "/docs/static/swagger-ui.css" in page.urls
        init = " ".join(page.scripts)
        assert 'url: "/openapi.json"' in init and "validatorUrl: null" in init  # no online validator badge
        assert "SwaggerUIBundle" in http.get("/docs/static/swagger-ui-bundle.js").text
        assert http.get("/openapi.json").json()["paths"]["/docs"]["get"]["operationId"] == "docs"


def test_docs_serves_only_the_files_its_page_loads(server):
    """The bundle also ships a demo page (index.html, swagger-initializer.js) that loads the petstore
    example from petstore.swagger.io: none of the bundle's other files is served."""
    with server.client() as http:
        for name in ("index.html", "swagger-initializer.js", "oauth2-redirect.html", "oauth2-redirect.js",
                     "index.css", "swagger-ui.js", "swagger-ui-standalone-preset.js", "swagger-ui-bundle.js.map",
                     "favicon-16x16.png", "", "./index.html", "../static/index.html"):
            r = http.get(f"/docs/static/{name}")
            assert r.status_code == 404 and "petstore" not in r.text, (name, r.status_code)
            assert r.json()["error"]["type"] == "not_found", r.text
        for name in ("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png"):
            assert http.get(f"/docs/static/{name}").status_code == 200, name
