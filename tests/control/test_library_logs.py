"""diffusers' and transformers' own log records (a tokenizer's "input was truncated" warning, on
every prompt longer than a text encoder keeps) go through the server's logging, as JSON lines,
and never to stderr as plain text beside them. Real server, in process."""

from __future__ import annotations

import json

from tests.servers import InProcessServer, wait_for_status

LONG = "a red cube on a wooden table next to a blue ball under soft morning light, high detail"


def test_a_truncated_prompt_warning_is_a_json_log_line_not_plain_stderr(capfd) -> None:
    with InProcessServer() as server, server.client() as c:
        t = c.post("/v1/rollouts", json={"prompts": [LONG], "num_inference_steps": 1, "seed": 1}).json()
        assert wait_for_status(c, t["id"], {"succeeded", "failed"})["status"] == "succeeded"
        logged = [json.loads(line) for line in server.logs]
    truncated = [e for e in logged if "truncated" in e["msg"]]
    assert truncated and {e["logger"].split(".")[0] for e in truncated} <= {"diffusers", "transformers"}, logged
    assert all(e["level"] == "warning" for e in truncated)
    assert "truncated" not in capfd.readouterr().err  # no plain-text copy from the libraries' own handlers
