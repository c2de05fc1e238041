"""The command line as a first-time user meets it, on a real server with the real `sigmaflight`
command: quiet submits, pulls that name their own file, tables on a terminal, pipes that close
early, a `models` command, mistaken URLs and flags, refused tokens, and a missing plot extra."""

from __future__ import annotations

import argparse
import json
import os
import pty
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from sigmaflight import Client
from sigmaflight.cli import build_parser
from tests.cli.conftest import cli
from tests.docs.markdown import blocks
from tests.servers import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
SIGMAFLIGHT = [sys.executable, "-m", "sigmaflight.cli"]


def on_a_terminal(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `sigmaflight ARGV` with stdout on a real pseudo-terminal; its exit status and what it showed."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([*SIGMAFLIGHT, *argv], cwd=ROOT, stdout=follower, stderr=subprocess.PIPE,
                                env={**os.environ, **(env or {})})
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side closed (the process ended)
                break
            if not chunk:
                break
            shown += chunk
        _, err = proc.communicate(timeout=120)
    finally:
        os.close(leader)
    assert not err.strip(), err.decode()
    return proc.returncode, shown.decode().replace("\r\n", "\n")


def piped(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SIGMAFLIGHT, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_command_line_guide_in_trainers_md_runs_as_written(server, tmp_path):
    """docs/trainers.md's CLI session, run as written in a fresh folder (tests/docs/ counts it as not run there)."""
    (guide,) = [b for b in blocks(ROOT / "docs" / "trainers.md") if b.code.startswith("source .venv/bin/activate")]
    assert guide.not_run is not None and "tests/cli/test_cli_usability.py" in guide.not_run
    venv = ROOT / ".venv" if (ROOT / ".venv" / "bin" / "activate").exists() else Path(sys.prefix)
    (tmp_path / ".venv").symlink_to(venv, target_is_directory=True)
    env = {**os.environ, "SIGMAFLIGHT_URL": server.rest_url}
    env.pop("SIGMAFLIGHT_TOKEN", None)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", guide.code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (pulled,) = tmp_path.glob("*.arrow")  # the file `pull` named after the rollout
    assert f"writing {pulled.name}" in done.stderr and pulled.stem in done.stdout  # and `list` shows the rollout
    assert "tiny-sd3 *" in done.stdout  # `models`: the default marked


def test_submit_quiet_prints_only_the_rollout_id(server, capsys):
    url = server.rest_url
    rc, out, err = cli(capsys, "submit", "-q", "--url", url, "-p", "a dog", "--steps", "2", "--seed", "2")
    assert rc == 0 and out.count("\n") == 1, out
    with httpx.Client(base_url=url) as http:  # the id of the rollout just made, the newest
        assert http.get("/v1/rollouts", params={"limit": 1}).json()["rollouts"][0]["id"] == out.strip()
    rc, out, _ = cli(capsys, "submit", "--quiet", "--wait", "--url", url, "-p", "a cat", "--steps", "2")
    assert rc == 0 and out.count("\n") == 1
    with httpx.Client(base_url=url) as http:
        assert http.get(f"/v1/rollouts/{out.strip()}").json()["status"] == "succeeded"


def _served(ticket: dict) -> pa.Table:
    with flight.FlightClient(ticket["flight"]["locations"][0]) as fc:
        return fc.do_get(flight.Ticket(ticket["flight"]["ticket"].encode())).read_all()


def _read(path: Path) -> pa.Table:
    with open(path, "rb") as f:
        return pa.ipc.open_file(pa.BufferReader(f.read())).read_all()


def test_pull_takes_the_ticket_file_submit_wrote_and_names_the_file_it_writes(server, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = server.rest_url
    rc, out, _ = cli(capsys, "submit", "--url", url, "-p", "a red cube", "--steps", "3", "--seed", "4", "--wait")
    assert rc == 0
    (tmp_path / "ticket.json").write_text(out)  # what `sigmaflight submit ... > ticket.json` leaves
    ticket = json.loads(out)
    rc, _, err = cli(capsys, "pull", "ticket.json", "--url", url)  # no -o: the rollout names the file
    name = f"{ticket['id']}.arrow"
    assert rc == 0, err
    assert err.splitlines()[0] == f"sigmaflight pull: no -o given; writing {name}"
    assert err.splitlines()[-1].startswith(f"wrote {name}: rollout {ticket['id']}, 4 steps")
    served = _served(ticket)
    assert _read(tmp_path / name).equals(served)
    # The Flight ticket and the id work as well; an existing complete file is kept.
    rc, _, err = cli(capsys, "pull", ticket["flight"]["ticket"], "--url", url, "-o", "by-ticket.arrow")
    assert rc == 0 and _read(tmp_path / "by-ticket.arrow").equals(served)
    rc, _, err = cli(capsys, "pull", ticket["id"], "--url", url)
    assert rc == 0 and f"writing {name}" in err and "kept" in err
    # `status` and `inspect` read the ticket file too.
    rc, out, _ = cli(capsys, "status", "ticket.json", "--url", url)
    assert rc == 0 and json.loads(out)["id"] == ticket["id"]
    rc, out, _ = cli(capsys, "inspect", "ticket.json", "--url", url, "--json")
    assert rc == 0 and [r["i"] for r in json.loads(out)["schedule"]] == [0, 1, 2, 3]
    (tmp_path / "notes.txt").write_text("not a ticket")
    rc, _, err = cli(capsys, "pull", "notes.txt", "--url", url)
    assert rc == 2 and err.startswith("sigmaflight pull: notes.txt: a file, but not the JSON ticket")


def test_list_prints_a_table_on_a_terminal_and_json_into_a_pipe(server, finished):
    url = server.rest_url
    rc, shown = on_a_terminal("list", "--url", url)
    lines = shown.strip().splitlines()
    assert rc == 0 and lines[0].split() == ["ID", "STATUS", "MODEL", "STEPS", "CREATED", "ERROR"], shown
    mine = next(line.split() for line in lines[1:] if line.startswith(finished))
    assert mine[1:4] == ["succeeded", "tiny-sd3", "2/2"]
    rc, shown = on_a_terminal("list", "--json", "--url", url)
    assert rc == 0 and finished in [r["id"] for r in json.loads(shown)["rollouts"]]

    with httpx.Client(base_url=url) as http:
        listed = http.get("/v1/rollouts", params={"limit": 100}).json()
    into_pipe = piped("list", "--url", url)
    assert into_pipe.returncode == 0 and json.loads(into_pipe.stdout) == listed
    table = piped("list", "--table", "--url", url)
    assert table.stdout.splitlines()[0].startswith("ID ") and finished in table.stdout


def test_list_into_a_pipe_closed_early_ends_quietly(server, finished):
    proc = subprocess.Popen([*SIGMAFLIGHT, "list", "--url", server.rest_url], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head` that has read what it wanted: every write now fails with EPIPE
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(120) == 141 and err == ""  # was: a BrokenPipeError traceback


def test_models_lists_the_servers_models(server):
    with httpx.Client(base_url=server.rest_url) as http:
        models = http.get("/v1/models").json()["models"]
    as_json = piped("models", "--url", server.rest_url)
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == {"models": models}
    rc, shown = on_a_terminal("models", "--url", server.rest_url)
    rows = {line.split()[0]: line.split() for line in shown.strip().splitlines()[1:]}
    assert rc == 0 and sorted(rows) == sorted(m["id"] for m in models)
    default = next(m for m in models if m["default"])
    assert rows[default["id"]][1:5] == ["*", default["family"], default["dtype"], default["device"]]
    assert default["digest"][:12] in rows[default["id"]]


def test_a_url_without_scheme_at_the_flight_plane_or_with_a_query_says_so(server, capsys):
    host_port = server.rest_url.removeprefix("http://")
    rc, _, err = cli(capsys, "status", "x", "--url", host_port)
    assert rc == 2 and err == (f"sigmaflight status: --url {host_port}: no scheme; the REST URL is http://HOST:PORT "
                               f"(e.g. http://{host_port})\n")
    rc, _, err = cli(capsys, "list", "--url", server.flight_url)
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"sigmaflight list: --url {server.flight_url}: that is the Flight location; --url takes "
                          "the REST URL")
    for extra in ("/?x=1", "/#top"):  # the client adds its own paths: a query or fragment cannot be kept
        rc, _, err = cli(capsys, "list", "--url", server.rest_url + extra)
        assert rc == 2 and err == (f"sigmaflight list: --url {server.rest_url + extra}: a REST URL takes no query "
                                   "string or fragment; give http://HOST:PORT\n"), err


def test_an_unknown_flag_prints_the_usage_of_its_subcommand():
    done = piped("submit", "-p", "a", "--bogus")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: sigmaflight submit ")  # was: the top level's "usage: sigmaflight [-h]"
    assert done.stderr.splitlines()[-1] == "sigmaflight submit: error: unrecognized arguments: --bogus"


def test_a_bad_choice_lists_the_words_to_type():
    done = piped("list", "--status", "bogus")
    assert done.returncode == 2 and done.stdout == ""
    last = done.stderr.splitlines()[-1]  # the words quoted or not, as the Python version prints them
    assert last.startswith("sigmaflight list: error: argument --status: invalid choice: 'bogus' (choose from ")
    assert last.replace("'", "").endswith("queued, running, succeeded, failed, cancelled, expired)"), last


def test_no_flag_takes_an_abbreviation():
    done = piped("submit", "-p", "a", "--step", "3", "--url", "http://127.0.0.1:9")
    assert done.returncode == 2 and "unrecognized arguments: --step 3" in done.stderr  # was: taken as --steps 3

    from sigmaflight.control.serve import build_parser as serve_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: p for name, p in sub.choices.items() if name != "serve"} | {"serve": serve_parser()}
    checked = 0
    for name, p in parsers.items():
        for action in p._actions:  # nothing required: what is left over is what the parser did not take
            action.required = False
        options = {o for a in p._actions for o in a.option_strings}
        for option in sorted(options):
            cut = option[:-1]
            if not option.startswith("--") or len(cut) < 4 or cut in options:
                continue
            try:
                _, extra = p.parse_known_args([cut])
            except SystemExit:  # taken as `option`, which then wanted a value
                extra = []
            assert extra == [cut], f"sigmaflight {name}: {cut} was taken as {option}"
            checked += 1
    assert checked > 50


@pytest.fixture(scope="module")
def secured():
    with InProcessServer("--token", "s3cret") as s:
        yield s


def test_a_refused_token_says_how_to_give_one(secured, capsys):
    rc, _, none = cli(capsys, "list", "--url", secured.rest_url)
    rc2, _, wrong = cli(capsys, "list", "--url", secured.rest_url, "--token", "wrong")
    assert rc == rc2 == 1 and len(none.splitlines()) == len(wrong.splitlines()) == 1
    assert none.startswith("sigmaflight list: 401 unauthorized: missing bearer token")
    assert none.rstrip().endswith("(the server wants a token: give it with --token or SIGMAFLIGHT_TOKEN)")
    assert "invalid bearer token" in wrong and "--token or SIGMAFLIGHT_TOKEN was refused" in wrong


def test_the_data_plane_clients_refusal_carries_no_grpc_debug_context(secured):
    from sigmaflight.dataplane.client import TrajectoryClient

    with Client(secured.rest_url, token="s3cret") as c:
        ticket = c.submit(prompts=["a"], num_inference_steps=2, seed=1)
        c.wait(ticket)
    with TrajectoryClient(ticket.flight.locations[0], token="wrong") as tc:
        for call in (lambda: tc.pull(ticket.flight.ticket), lambda: tc.flight_info(ticket.id),
                     lambda: tc.cancel(ticket.id), lambda: list(tc.iter_steps(ticket.id))):
            with pytest.raises(flight.FlightUnauthenticatedError) as e:
                call()
            assert str(e.value) == "missing or wrong bearer token (send the header 'authorization: Bearer <token>')"
            assert json.loads(e.value.extra_info)["type"] == "unauthenticated"  # the typed error is kept


PLOT_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as in an environment without it: importing it raises ModuleNotFoundError
from sigmaflight.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_plot_without_matplotlib_names_the_extra_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", PLOT_WITHOUT_MATPLOTLIB, "plot", str(tmp_path / "t.arrow"),
                           "-o", str(tmp_path / "t.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "sigmaflight plot: matplotlib is not installed; pip install 'sigmaflight[plot]'\n"


def test_the_ready_line_says_where_docs_are_and_a_command_that_works(server, capsys):
    ready = next(json.loads(line) for line in server.logs if '"sigmaflight ready"' in line)
    assert ready["docs"] == f"{server.rest_url}/docs"
    assert httpx.get(ready["docs"]).status_code == 200
    argv = shlex.split(ready["try"])
    assert argv[0] == "sigmaflight"
    rc, out, err = cli(capsys, *argv[1:])  # the command it suggests, run as given
    assert rc == 0, err
    assert json.loads(out)["status"] == "succeeded"


def test_the_root_url_is_an_index_of_links(server):
    with httpx.Client(base_url=server.rest_url) as http:
        r = http.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        links = r.json()["links"]
        assert {"docs", "openapi", "models", "rollouts", "healthz", "readyz", "metrics"} <= set(links)
        for name, path in links.items():  # each one answers
            assert http.get(path).status_code == 200, (name, path)


BESIDE_A_CLONE = """
import sigmaflight
from sigmaflight import Client
print(sigmaflight.__file__)
"""


def test_a_script_beside_a_folder_named_sigmaflight_imports_the_installed_package(tmp_path):
    (tmp_path / "sigmaflight").mkdir()  # a clone of this repository, say: a folder without __init__.py
    (tmp_path / "sigmaflight" / "README.md").write_text("# sigmaflight\n")
    (tmp_path / "train.py").write_text(BESIDE_A_CLONE)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # was: cannot import name 'Client' from 'sigmaflight' (unknown location)
    assert Path(done.stdout.strip()).name == "__init__.py"


def test_build_outputs_are_ignored_by_git():
    paths = ["dist/sigmaflight-0.1.0-py3-none-any.whl", "build/lib/sigmaflight/__init__.py",
             "sigmaflight.egg-info/PKG-INFO"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    if done.returncode == 128:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == paths
