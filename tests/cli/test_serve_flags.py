"""`sigmaflight serve` flags come from pydantic-settings' CLI source: every flag of before, its help
line, its environment variable and its default are still there, and a flag beats its variable,
which beats the default."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from pydantic import ValidationError
from sigmaflight.control.serve import build_parser, settings_from_args, settings_from_argv
from sigmaflight.control.settings import Settings

from sigmaflight.launcher import ROOT

# The flags and help lines of `sigmaflight serve --help` as the hand-built argparse printed them
# (captured before it was replaced).
BEFORE = {
    "--host HOST": "Address both planes bind to. [env SIGMAFLIGHT_HOST; default 127.0.0.1]",
    "--port PORT": "REST port (0 = pick a free one). [env SIGMAFLIGHT_PORT; default 8000]",
    "--flight-port FLIGHT_PORT": "Arrow Flight port (0 = pick a free one). [env SIGMAFLIGHT_FLIGHT_PORT; default 8815]",
    "--advertise-host ADVERTISE_HOST": "Host name put in Flight locations when bound to 0.0.0.0 (default: the "
    "machine's host name). [env SIGMAFLIGHT_ADVERTISE_HOST; default none]",
    "--model MODEL": "Default model id, loaded at start-up. [env SIGMAFLIGHT_MODEL; default tiny-sd3]",
    "--model-dir MODEL_DIR": "Directory of local diffusers pipelines: each subdirectory is served under its name. "
    "[env SIGMAFLIGHT_MODEL_DIR; default none]",
    "--device DEVICE": "Torch device for the models (cpu, cuda, cuda:1, ...). [env SIGMAFLIGHT_DEVICE; default cpu]",
    "--dtype {float32,bfloat16,float16}": "Model dtype. [env SIGMAFLIGHT_DTYPE; default float32]",
    "--batch-invariant, --no-batch-invariant": "Run the model row by row so a sample's trajectory is bit-identical "
    "whatever its batch (slower). [env SIGMAFLIGHT_BATCH_INVARIANT; default False]",
    "--workers WORKERS": "Rollout worker threads (local backend) or Ray worker actors (--backend ray). "
    "[env SIGMAFLIGHT_WORKERS; default 1]",
    "--backend {local,ray}": "Where rollouts run: this process (local) or Ray actors, one device each (ray). "
    "[env SIGMAFLIGHT_BACKEND; default local]",
    "--ray-address RAY_ADDRESS": "Ray cluster to join with --backend ray: auto (the running one), ray://..., or "
    "local. [env SIGMAFLIGHT_RAY_ADDRESS; default auto]",
    "--ray-num-cpus RAY_NUM_CPUS": "CPUs each Ray worker actor reserves (plus 1 GPU on cuda). "
    "[env SIGMAFLIGHT_RAY_NUM_CPUS; default 1.0]",
    "--queue-size QUEUE_SIZE": "Rollouts that may wait; beyond it POST answers 429. [env SIGMAFLIGHT_QUEUE_SIZE; "
    "default 64]",
    "--ttl-s TTL_S": "Seconds a finished result is kept; then a succeeded rollout expires, a failed or cancelled "
    "one keeps its status and error. [env SIGMAFLIGHT_TTL_S; default 3600.0]",
    "--max-records MAX_RECORDS": "Records of ended rollouts kept (their status, error, idempotency key); past it "
    "the oldest are dropped and what they hold is released, before their --ttl-s if need be. "
    "[env SIGMAFLIGHT_MAX_RECORDS; default 10000]",
    "--data-dir DATA_DIR": "Directory for durable trajectories and job records; survives restarts. None = memory "
    "only. [env SIGMAFLIGHT_DATA_DIR; default none]",
    # the files live in a private DIR/sigmaflight-<uid>/, and the help says so
    "--shm-dir SHM_DIR": "Directory in shared memory (e.g. /dev/shm) for finished trajectories as Arrow IPC files, "
    "kept in the private DIR/sigmaflight-<uid>/: served memory-mapped, read directly by trainers on this host (with "
    "--backend ray, each worker uses DIR/worker-N/sigmaflight-<uid>/ on its own node). None = off. "
    "[env SIGMAFLIGHT_SHM_DIR; default none]",
    "--store-budget-bytes STORE_BUDGET_BYTES": "Bytes of trajectories held in memory; beyond it they spill to "
    "--data-dir. [env SIGMAFLIGHT_STORE_BUDGET_BYTES; default 4294967296]",
    "--token-file TOKEN_FILE": "File of bearer tokens, one a line (# comments, blank lines ignored). "
    "[env SIGMAFLIGHT_TOKEN_FILE; default none]",
    "--token TOKEN": "A bearer token (comma-separated for several); prefer --token-file. Never logged. "
    "[env SIGMAFLIGHT_TOKEN; default none]",
    "--tls-cert TLS_CERT": "PEM certificate: serve REST over https and Flight over grpc+tls. "
    "[env SIGMAFLIGHT_TLS_CERT; default none]",
    "--tls-key TLS_KEY": "PEM private key for --tls-cert. [env SIGMAFLIGHT_TLS_KEY; default none]",
    "--max-body-bytes MAX_BODY_BYTES": "Largest accepted request body (413 beyond). [env SIGMAFLIGHT_MAX_BODY_BYTES; "
    "default 1048576]",
    "--max-weights-bytes MAX_WEIGHTS_BYTES": "Largest accepted PUT /v1/models/{id}/weights or /lora body "
    "(safetensors; 413 beyond). [env SIGMAFLIGHT_MAX_WEIGHTS_BYTES; default 536870912]",
    "--max-prompts MAX_PROMPTS": "Prompts per request. [env SIGMAFLIGHT_MAX_PROMPTS; default 64]",
    "--max-prompt-chars MAX_PROMPT_CHARS": "Characters of one prompt or negative_prompt (the text encoders keep "
    "their first 77 to 512 tokens; a longer text only costs tokenizer time and log lines). "
    "[env SIGMAFLIGHT_MAX_PROMPT_CHARS; default 4096]",
    "--max-samples MAX_SAMPLES": "Samples (prompts x outputs) per request. [env SIGMAFLIGHT_MAX_SAMPLES; default 256]",
    "--max-steps MAX_STEPS": "num_inference_steps per request. [env SIGMAFLIGHT_MAX_STEPS; default 200]",
    "--max-rollout-bytes MAX_ROLLOUT_BYTES": "Estimated captured latent bytes per rollout, and the latents its loop "
    "holds (one x_i of every sample), refused up front beyond it. [env SIGMAFLIGHT_MAX_ROLLOUT_BYTES; default 2147483648]",
    "--max-flight-streams MAX_FLIGHT_STREAMS": "Concurrent Flight do_get streams. [env SIGMAFLIGHT_MAX_FLIGHT_STREAMS; "
    "default 64]",
    "--log-level {debug,info,warning,error}": "Log level. [env SIGMAFLIGHT_LOG_LEVEL; default info]",
    "--log-format {json,text}": "Log line format. [env SIGMAFLIGHT_LOG_FORMAT; default json]",
}


def _serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sigmaflight.cli", "serve", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.e2e
def test_serve_help_keeps_every_flag_its_help_its_variable_and_its_default():
    done = _serve("--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps and indents; the words and their order stay
    for flag, help_ in BEFORE.items():  # a bounded flag's bounds follow its default, inside the brackets
        assert f" {flag} {help_.removesuffix(']')}" in text, (flag, done.stdout)
    for name in Settings.model_fields:  # flags added since keep the same form
        assert f"[env SIGMAFLIGHT_{name.upper()}; default " in text, name


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("SIGMAFLIGHT_PORT", "9123")
    monkeypatch.setenv("SIGMAFLIGHT_WORKERS", "3")
    monkeypatch.setenv("SIGMAFLIGHT_BATCH_INVARIANT", "true")
    s = settings_from_argv(["--port", "9200", "--no-batch-invariant", "--dtype", "bfloat16"])
    assert (s.port, s.workers, s.batch_invariant, s.dtype, s.flight_port) == (9200, 3, False, "bfloat16", 8815)
    s = settings_from_argv([])
    assert (s.port, s.workers, s.batch_invariant, s.dtype) == (9123, 3, True, "float32")
    s = settings_from_args(build_parser().parse_args(["--batch-invariant", "--data-dir", ""]))
    assert (s.port, s.batch_invariant, s.data_dir) == (9123, True, None)


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (["--workers", "0"], {}, "sigmaflight serve: --workers (SIGMAFLIGHT_WORKERS) '0': Input should be greater than or equal to 1"),
        (["--dtype", "int8"], {}, "sigmaflight serve: --dtype (SIGMAFLIGHT_DTYPE) 'int8': Input should be"),
        ([], {"SIGMAFLIGHT_QUEUE_SIZE": "many"}, "sigmaflight serve: --queue-size (SIGMAFLIGHT_QUEUE_SIZE) 'many': "),
    ],
)
@pytest.mark.e2e
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(argv, env, line):
    done = _serve(*argv, env=env)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(line), done.stderr


def test_serve_help_states_each_bound_that_start_up_then_enforces():
    """Every bound the help gives (`; >= 1024]`) is the edge of what `serve` takes: the bound itself
    (or the number just past it) is taken, the number on the wrong side refused naming the flag."""
    text = " ".join(build_parser().format_help().split())
    for flag, needed in (("--max-body-bytes", ">= 1024"), ("--batch-wait-ms", ">= 0 and <= 10000"),
                         ("--port", ">= 0 and <= 65535"), ("--ttl-s", "> 0")):
        name = flag.removeprefix("--").replace("-", "_").upper()
        assert f"[env SIGMAFLIGHT_{name}; default " in text
        assert text.split(f"[env SIGMAFLIGHT_{name}; default ", 1)[1].split("]", 1)[0].endswith(f"; {needed}"), flag
    stated = re.findall(r"\[env SIGMAFLIGHT_(\w+); default [^;\]]*; ([^\]]+)\]", text)
    assert len(stated) >= 20, stated
    for name, rules in stated:
        flag = "--" + name.lower().replace("_", "-")
        for op, edge in (rule.split(" ") for rule in rules.split(" and ")):
            bound = float(edge)
            step = 1 if bound == int(bound) and "." not in edge else 1e-3
            taken = {">=": bound, "<=": bound, ">": bound + step, "<": bound - step}[op]
            refused = {">=": bound - step, "<=": bound + step, ">": bound, "<": bound}[op]
            settings_from_argv([flag, _number(taken)])
            with pytest.raises(ValidationError) as err:
                settings_from_argv([flag, _number(refused)])
            assert err.value.errors()[0]["loc"] == (name.lower(),), (flag, refused)


def _number(x: float) -> str:
    return str(int(x)) if x == int(x) else repr(x)
