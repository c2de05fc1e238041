"""The errors a user meets following the docs, typed in Python and one line on the CLI: a cancelled
or failed pull, a replay on other weights, a missing or truncated file, a refused connection or
token, start-up mistakes; on a real server with the real client and CLI."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.pipeline.models import ModelRegistry, weights_digest

from sigmaflight import Client, RolloutCancelled, RolloutFailed, replay_log_probs
from sigmaflight.cli import build_parser
from sigmaflight.errors import NotFound, WeightsMismatch
from tests.cli.conftest import cli
from tests.servers import InProcessServer, ServerProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--workers", "1") as s:
        yield s


def _cancel_next_queued(url: str, blocker: str, found: list[str]) -> threading.Thread:
    """Cancel the first queued rollout other than `blocker` as soon as the server lists it."""

    def run() -> None:
        with Client(url) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not found:
                for st in c.rollouts(status="queued", limit=10):
                    if st.id != blocker:
                        c.cancel(st.id)
                        found.append(st.id)
                        return
                time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _blocker(c: Client) -> str:
    """A long rollout that keeps the single worker busy, so the next one waits queued."""
    return c.submit(prompts=["blocker"] * 8, num_outputs_per_prompt=4, num_inference_steps=200, seed=1).id


def test_submit_wait_prints_the_final_status_and_exits_like_status_wait(server, capsys):
    url = server.rest_url
    rc, out, _ = cli(capsys, "submit", "--url", url, "-p", "fine", "--steps", "2", "--seed", "3", "--wait")
    done = json.loads(out)
    assert rc == 0 and done["status"] == "succeeded" and done["progress"]["steps_done"] == 2

    with Client(url) as c:
        blocker = _blocker(c)
        found: list[str] = []
        t = _cancel_next_queued(url, blocker, found)
        rc, out, err = cli(capsys, "submit", "--url", url, "-p", "to be cancelled", "--steps", "2", "--wait")
        t.join(5)
        c.cancel(blocker)
    final = json.loads(out)
    assert found == [final["id"]]
    assert final["status"] == "cancelled" and rc == 1  # was: the stale "queued" ticket and exit 0
    rc2, out2, _ = cli(capsys, "status", final["id"], "--url", url, "--wait")
    assert rc2 == rc and json.loads(out2)["status"] == final["status"]


def test_pull_of_a_cancelled_rollout_raises_rollout_cancelled_with_the_servers_message(server, tmp_path, capsys):
    url = server.rest_url
    with Client(url) as c:
        blocker = _blocker(c)
        ticket = c.submit(prompts=["never runs"], num_inference_steps=2, seed=4)
        c.cancel(ticket)
        c.cancel(blocker)
        st = c.wait(ticket, raise_on_failure=False)
        assert st.status == "cancelled"
        for ref in (ticket, ticket.id, ticket.flight.ticket):
            with pytest.raises(RolloutCancelled) as e:
                c.pull(ref)
            assert isinstance(e.value, RolloutFailed)
            text = str(e.value)
            # the Flight server's own words, nothing of gRPC's debug context
            assert text.endswith("(cancelled: cancelled by client)"), text
            assert not any(junk in text for junk in ("gRPC", "debug context", "Detail", "Flight returned")), text
        with pytest.raises(RolloutCancelled) as e:
            c.wait(ticket)
        assert e.value.rollout is not None and e.value.rollout.status == "cancelled"
        assert str(e.value) == f"rollout {ticket.id} cancelled"
        with pytest.raises(NotFound):
            c.pull("no-such-rollout")
        # a Ray server names no Flight location for a rollout no worker holds (one failed at a
        # shutdown): pull and locate raised IndexError
        nowhere = ticket.model_copy(update={"flight": ticket.flight.model_copy(update={"locations": []})})
        for call in (c.pull, c.locate):
            with pytest.raises(RolloutCancelled):
                call(nowhere)
    rc, _, err = cli(capsys, "pull", ticket.id, "--url", url, "-o", str(tmp_path / "c.arrow"))
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("sigmaflight pull: ") and "cancelled by client" in err
    assert "debug context" not in err and "Flight" not in err and "Detail" not in err


def test_a_typed_flight_error_keeps_its_type_when_rest_cannot_answer(server):
    """A pull that follows a rollout across SIGTERM gets the rollout's end over Flight ("failed",
    "server shutting down"), but REST stops listening as the rollouts end, and the client asked REST
    for the status first: it raised ServerUnreachable. When REST cannot answer, the Flight error's own
    type decides (a refused connection on Flight, untyped, stays ServerUnreachable: the test below)."""
    with Client(server.rest_url) as c:
        blocker = _blocker(c)
        ticket = c.submit(prompts=["never runs"], num_inference_steps=2, seed=5)
        c.cancel(ticket)
        c.cancel(blocker)
        c.wait(ticket, raise_on_failure=False)
        location, flight_ticket = c.stream_ticket(ticket, "trajectory")
        with pytest.raises(flight.FlightError) as refused:
            c.flight(location).pull(flight_ticket)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", timeout=5) as gone:
        err = gone.flight_error(ticket, refused.value)
    assert isinstance(err, RolloutCancelled) and str(err).endswith("(cancelled: cancelled by client)"), repr(err)


def test_replay_warns_when_the_trajectory_was_made_with_other_weights(server):
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["a"], num_inference_steps=3, seed=5)
        c.wait(ticket)
        traj = c.pull(ticket)
    model = ModelRegistry().get("tiny-sd3")
    assert traj.metadata["model"]["digest"] == weights_digest(model.pipeline)
    same = replay_log_probs(model, traj)  # same weights: no warning (warnings are errors here)
    assert torch.equal(same[:, 0], traj.log_probs[:, 0])
    with torch.no_grad():
        next(model.pipeline.transformer.parameters()).add_(1e-3)  # an in-place change, as an optimizer step
    assert weights_digest(model.pipeline) != traj.metadata["model"]["digest"]
    with pytest.warns(WeightsMismatch, match="made with other weights .*: transformer "):
        replay_log_probs(model, traj)
    with pytest.raises(ValueError, match="made with other weights"):
        replay_log_probs(model, traj, strict=True)
    replay_log_probs(model, traj, check_weights=False)  # an off-policy replay on purpose: silent


def test_inspect_names_a_missing_file_and_a_truncated_one(server, tmp_path, capsys):
    rc, _, err = cli(capsys, "inspect", "custom.arrow", "--url", server.rest_url)
    assert rc == 1 and "custom.arrow: no such file" in err and "404" not in err
    rc, _, err = cli(capsys, "inspect", "no-such-thing", "--url", server.rest_url)
    assert rc == 1 and "no such file" in err and "no rollout or ticket" in err
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["t"], num_inference_steps=2, seed=6)
        c.wait(ticket)
    whole = tmp_path / "whole.arrow"
    assert cli(capsys, "pull", ticket.id, "--url", server.rest_url, "-o", str(whole))[0] == 0
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(whole.read_bytes()[:5000])
    rc, _, err = cli(capsys, "inspect", str(cut))
    assert rc == 1 and "not a complete Arrow IPC file" in err and "truncated" in err
    assert "Expected to read" not in err.split("(", 1)[0]  # the clear part comes first


def test_connection_refused_names_the_url(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    url = f"http://127.0.0.1:{port}"
    rc, _, err = cli(capsys, "status", "x", "--url", url)
    assert rc == 1 and url in err and len(err.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_a_pull_from_a_server_that_is_gone_is_server_unreachable():
    """A server gone mid-stream: the pull's Flight error came out as a plain ApiError "flight_error"
    (the REST status it looked for was unreachable too, and that was swallowed), so Client.stream
    ended normally with items in error instead of raising ServerUnreachable."""
    from sigmaflight.errors import ServerUnreachable

    server = InProcessServer()
    with Client(server.rest_url, timeout=5) as c:
        ticket = c.submit(prompts=["gone"], num_inference_steps=2, seed=1)
        c.wait(ticket, timeout=60)
        server.terminate()
        with pytest.raises(ServerUnreachable) as gone:
            c.pull(ticket)
        assert server.rest_url in str(gone.value)


def test_submit_help_has_text_for_every_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    submit = sub.choices["submit"]
    missing = [a.option_strings for a in submit._actions if a.option_strings and not a.help]
    assert missing == []


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sigmaflight.cli", "serve", "--port", "0", "--flight-port", "0",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
def test_startup_mistakes_are_one_line_and_exit_2(tmp_path):
    saved = tmp_path / "models" / "mine"
    ModelRegistry().get("tiny-sd3").pipeline.save_pretrained(saved)
    (saved / "scheduler" / "scheduler_config.json").unlink()
    cases = [
        (("--model", "nope"), "--model 'nope': unknown model"),
        (("--model-dir", str(tmp_path / "missing")), "no such directory"),
        (("--model-dir", str(tmp_path / "models"), "--model", "mine"), "mine/scheduler/scheduler_config.json is missing"),
    ]
    for flags, message in cases:
        done = _serve(*flags)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr


@pytest.mark.e2e
def test_model_dir_logs_are_all_json_with_a_model_loaded_line(tmp_path):
    ModelRegistry().get("tiny-sd3").pipeline.save_pretrained(tmp_path / "models" / "mine")
    with ServerProcess("--model-dir", str(tmp_path / "models"), "--model", "mine") as s:
        with Client(s.rest_url) as c:
            ticket = c.submit(model="mine", prompts=["a"], num_inference_steps=2, seed=1)
            c.wait(ticket)
        logs = list(s.logs)
    records = [json.loads(line) for line in logs if line.strip()]  # every line parses as JSON
    loaded = [r for r in records if r["msg"] == "model loaded" and r.get("model") == "mine"]
    assert loaded and loaded[0]["path"].endswith("mine")


@pytest.mark.e2e
def test_pull_of_a_failed_rollout_raises_rollout_failed_not_cancelled(tmp_path, capsys):
    data = tmp_path / "data"
    with ServerProcess("--workers", "1", "--data-dir", str(data)) as first:
        with Client(first.rest_url) as c:
            _blocker(c)
            lost = c.submit(prompts=["lost"], num_inference_steps=2, seed=8)
        first.kill()  # the process dies with `lost` still queued
    with InProcessServer("--data-dir", str(data)) as second, Client(second.rest_url) as c:
        st = c.status(lost.id)
        assert st.status == "failed" and st.error is not None and st.error.type == "server_restarted"
        with pytest.raises(RolloutFailed) as e:
            c.pull(lost.id)
        assert not isinstance(e.value, RolloutCancelled)
        assert str(e.value) == f"rollout {lost.id} failed: server_restarted: {st.error.message}"
        assert e.value.rollout is not None and e.value.rollout.status == "failed"
        rc, _, err = cli(capsys, "pull", lost.id, "--url", second.rest_url, "-o", str(tmp_path / "f.arrow"))
    assert rc == 1 and err == f"sigmaflight pull: {e.value}\n"


def test_refused_token_and_unknown_rollout_are_typed(tmp_path):
    from sigmaflight import Unauthorized

    with InProcessServer("--token", "s3cret") as s:
        with Client(s.rest_url) as anonymous, pytest.raises(Unauthorized) as e:
            anonymous.models()
        assert e.value.status == 401 and "token" in e.value.message
        with Client(s.rest_url, token="s3cret") as c:
            with pytest.raises(NotFound) as nf:
                c.status("no-such-rollout")
            assert nf.value.status == 404 and "no-such-rollout" in nf.value.message
            ticket = c.submit(prompts=["a"], num_inference_steps=2, seed=1)
            c.wait(ticket)
            with Client(s.rest_url, token="wrong") as bad:  # the Flight plane refuses it too
                with pytest.raises(Unauthorized) as fe:
                    bad.pull(ticket)  # a Ticket names its Flight location: no REST call
                # by id or Flight ticket the rollout is looked up over REST first: a refused token
                # said "404 no rollout or ticket", as if the rollout did not exist
                for ref in (ticket.id, ticket.flight.ticket):
                    for call in (bad.pull, bad.locate):
                        with pytest.raises(Unauthorized):
                            call(ref)
    assert "debug context" not in str(fe.value)


def test_the_cli_says_a_token_is_refused_not_that_the_rollout_is_unknown(capsys, tmp_path):
    with InProcessServer("--token", "s3cret") as s:
        with Client(s.rest_url, token="s3cret") as c:
            ticket = c.submit(prompts=["a"], num_inference_steps=2, seed=1)
            c.wait(ticket)
        for argv in (["pull", ticket.id, "-o", str(tmp_path / "t.arrow")], ["inspect", ticket.id], ["cancel", ticket.id]):
            rc, _, err = cli(capsys, *argv, "--url", s.rest_url)
            assert rc == 1 and "401" in err and "--token" in err, (argv, err)
