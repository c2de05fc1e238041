"""Start-up mistakes on the real `sigmaflight serve`: one line on stderr naming the flag, exit
status 2, before any model loads; and a SIGHUP during start-up does not kill the server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from sigmaflight.launcher import ROOT, ServerProcess
from tests.faults.conftest import SERVE, serve_refused
from tests.servers import InProcessServer

pytestmark = pytest.mark.e2e


@contextmanager
def _listening() -> Iterator[int]:
    """A port some other program listens on (a plain TCP socket on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------- ports

def test_serving_twice_on_the_same_ports_is_refused_naming_both_flags():
    port, flight_port = _free_port(), _free_port()
    # the first server runs in this process (the second, refused one is the real command)
    with InProcessServer("--port", str(port), "--flight-port", str(flight_port)) as first:
        line = serve_refused("--port", str(port), "--flight-port", str(flight_port))
        assert f"--port {port}" in line and f"--flight-port {flight_port}" in line and "already in use" in line
        with first.client() as c:
            assert c.get("/readyz").status_code == 200  # the first server is untouched


def test_a_rest_port_in_use_is_refused_before_the_model_loads():
    with _listening() as port:
        line = serve_refused("--port", str(port), "--flight-port", "0")
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in line and "--flight-port" not in line


def test_a_flight_port_in_use_is_refused_before_the_model_loads():
    with _listening() as port:
        line = serve_refused("--port", "0", "--flight-port", str(port))
    assert f"--flight-port {port}: 127.0.0.1:{port} is already in use" in line and "--port " not in line


def test_the_same_port_for_both_planes_is_refused():
    port = _free_port()
    line = serve_refused("--port", str(port), "--flight-port", str(port))
    assert f"--port and --flight-port are both {port}" in line


# ---------------------------------------------------------------------------------------- --shm-dir

def test_a_shm_dir_whose_parent_is_missing_is_refused_and_nothing_is_created(tmp_path):
    target = tmp_path / "no-such-parent" / "shm"
    line = serve_refused("--port", "0", "--flight-port", "0", "--shm-dir", str(target))
    assert f"--shm-dir {target}: its parent {target.parent} does not exist" in line
    assert not target.parent.exists()


def test_a_shm_dir_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("not a directory")
    line = serve_refused("--port", "0", "--flight-port", "0", "--shm-dir", str(target))
    assert f"--shm-dir {target}: not a directory" in line
    assert target.read_text() == "not a directory"


def test_a_shm_dir_that_is_a_dangling_symlink_is_refused(tmp_path):
    target = tmp_path / "link"
    target.symlink_to(tmp_path / "gone")
    line = serve_refused("--port", "0", "--flight-port", "0", "--shm-dir", str(target))
    assert f"--shm-dir {target}: a symbolic link to {tmp_path / 'gone'}, which does not exist" in line
    assert not (tmp_path / "gone").exists()


def test_a_shm_dir_in_use_by_a_live_server_is_refused_before_the_model_loads(tmp_path):
    shm = tmp_path / "shm"
    with InProcessServer("--shm-dir", str(shm)):  # holds the dir's lock, as a `sigmaflight serve` does
        line = serve_refused("--port", "0", "--flight-port", "0", "--shm-dir", str(shm))
    assert f"--shm-dir {shm}: in use by another live server" in line


def test_a_missing_last_component_is_created_private_and_flags_beat_variables(tmp_path):
    """Only the last component of --shm-dir is made (mode 0700), and logged. The same server shows
    the CLI source's precedence on the real process: flag > SIGMAFLIGHT_<NAME> > default."""
    shm = tmp_path / "shm"
    env = {"SIGMAFLIGHT_MAX_PROMPTS": "9", "SIGMAFLIGHT_MAX_STEPS": "3"}
    with ServerProcess("--shm-dir", str(shm), "--max-prompts", "2", env=env) as server:
        assert shm.is_dir() and stat.S_IMODE(shm.stat().st_mode) == 0o700
        assert '"created --shm-dir"' in server.log_text
        with server.client() as c:
            too_many = c.post("/v1/rollouts", json={"prompts": ["a", "b", "c"], "num_inference_steps": 1})
            too_long = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 4})
            samples = c.post("/v1/rollouts", json={"prompts": ["a"], "num_outputs_per_prompt": 257,
                                                   "num_inference_steps": 1})
    assert too_many.status_code == 422 and "exceed the limit of 2" in too_many.text  # the flag, not the variable
    assert too_long.status_code == 422 and "exceeds the limit of 3" in too_long.text  # the variable
    assert samples.status_code == 422 and "exceed the limit of 256" in samples.text  # the default


# ---------------------------------------------------------------------------------------- --backend ray

def test_backend_ray_without_ray_installed_names_the_extra_before_the_model_loads(tmp_path):
    """Ray is made absent for this process alone: a `ray` package on PYTHONPATH whose import fails
    exactly as a missing one does."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    line = serve_refused("--port", "0", "--flight-port", "0", "--backend", "ray",
                    env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert "--backend ray:" in line and "pip install 'sigmaflight[ray]'" in line


# ---------------------------------------------------------------------------------------- SIGHUP

def _listens(pid: int) -> bool:
    """Whether the process listens on a TCP port: its Flight server is up, its models are not yet
    loaded (the REST port is bound after them), and its SIGHUP handler is not installed yet."""
    try:
        return any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections("tcp"))
    except psutil.Error:
        return False


def test_sighup_while_starting_does_not_kill_the_server_and_rereads_the_tokens_once_ready(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("old-token-0123456789\n")
    tokens.chmod(0o600)
    # small-sd3 takes seconds to build: SIGHUP lands while the model loads.
    proc = subprocess.Popen([*SERVE, "--port", "0", "--flight-port", "0", "--token-file", str(tokens),
                             "--model", "small-sd3"], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    logs: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            logs.append(line)
            if '"sigmaflight ready"' in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not _listens(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(logs)
            time.sleep(0.01)
        tokens.write_text("new-token-9876543210\n")
        proc.send_signal(signal.SIGHUP)
        assert ready.wait(120) and proc.poll() is None, f"rc={proc.poll()}\n" + "".join(logs)
        rest_url = next(line for line in logs if '"sigmaflight ready"' in line).split('"rest_url": "')[1].split('"')[0]
        deadline = time.monotonic() + 60
        while not any('"tokens reloaded"' in line for line in logs):  # the deferred reload runs once ready
            assert time.monotonic() < deadline, "".join(logs)
            time.sleep(0.05)
        assert any('"SIGHUP received while starting' in line for line in logs)  # it landed before ready
        new = httpx.get(f"{rest_url}/v1/models", headers={"authorization": "Bearer new-token-9876543210"})
        old = httpx.get(f"{rest_url}/v1/models", headers={"authorization": "Bearer old-token-0123456789"})
        assert (new.status_code, old.status_code) == (200, 401)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(5)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    """A RAY_ADDRESS of the caller's must not reach these servers."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


# ---------------------------------------------------------------------------------------- --host

@pytest.mark.parametrize("flags, env", [
    (("--host", "10.9.9.9"), {}),  # an address, but not one of this machine's
    ((), {"SIGMAFLIGHT_HOST": "not a host name!"}),
    ((), {"SIGMAFLIGHT_HOST": "x" * 300}),  # longer than a DNS name can be
], ids=["foreign-address", "junk-variable", "too-long"])
def test_a_host_that_cannot_be_bound_is_refused_with_free_ports_too(flags, env):
    """--port 0 / --flight-port 0 leave nothing to check about the ports, but the host still is."""
    host = flags[1] if flags else env["SIGMAFLIGHT_HOST"]
    line = serve_refused(*flags, "--port", "0", "--flight-port", "0", env=env)
    assert line.startswith(f"sigmaflight serve: --host {host}: not an address of this machine ("), line


# ---------------------------------------------------------------------------------------- TLS

def test_tls_files_that_do_not_exist_are_refused_naming_the_flag(tmp_path, certificate):
    cert, key = certificate
    line = serve_refused("--port", "0", "--flight-port", "0", "--tls-cert", str(tmp_path / "no-cert.pem"),
                         "--tls-key", str(key))
    assert f"--tls-cert {tmp_path / 'no-cert.pem'}: no such file" in line
    line = serve_refused("--port", "0", "--flight-port", "0", "--tls-cert", str(cert),
                         "--tls-key", str(tmp_path / "no-key.pem"))
    assert f"--tls-key {tmp_path / 'no-key.pem'}: no such file" in line


def test_tls_files_that_are_not_a_certificate_and_its_key_are_refused(tmp_path, certificate):
    cert, key = certificate
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    line = serve_refused("--port", "0", "--flight-port", "0", "--tls-cert", str(junk), "--tls-key", str(key))
    assert f"--tls-cert {junk} --tls-key {key}: not a PEM certificate and its private key" in line
    line = serve_refused("--port", "0", "--flight-port", "0", "--tls-cert", str(cert), "--tls-key", str(cert))
    assert f"--tls-cert {cert} --tls-key {cert}: not a PEM certificate and its private key" in line


def test_a_key_that_asks_for_a_passphrase_is_refused_naming_the_flag(tmp_path, certificate):
    """OpenSSL asked for the passphrase on the terminal (twice: the check, then uvicorn); with none
    the refusal said only "[Errno 22] Invalid argument", and with one typed, start-up went on to a
    Flight traceback (exit 3)."""
    cert, key = certificate
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(encrypted), "-aes256", "-passout", "pass:s3cret"],
                   check=True, capture_output=True)
    line = serve_refused("--port", "0", "--flight-port", "0", "--tls-cert", str(cert), "--tls-key", str(encrypted))
    assert f"--tls-key {encrypted}: the key is encrypted (it asks for a passphrase)" in line, line


@pytest.mark.parametrize("given, missing", [("--tls-cert", "--tls-key"), ("--tls-key", "--tls-cert")])
def test_half_a_tls_pair_is_refused_instead_of_serving_plain_http(certificate, given, missing):
    cert, key = certificate
    path = cert if given == "--tls-cert" else key
    line = serve_refused("--port", "0", "--flight-port", "0", given, str(path))
    assert f"{given} {path}: needs {missing} too" in line


def test_half_a_tls_pair_from_the_environment_is_refused(certificate):
    cert, _ = certificate
    line = serve_refused("--port", "0", "--flight-port", "0", env={"SIGMAFLIGHT_TLS_CERT": str(cert)})
    assert f"--tls-cert {cert}: needs --tls-key too" in line


# ---------------------------------------------------------------------------------------- --token

@pytest.mark.parametrize("flags, env", [
    ((), {"SIGMAFLIGHT_TOKEN": " , ,"}),
    (("--token", ",,"), {}),
    (("--token", ""), {}),
], ids=["variable-of-separators", "flag-of-commas", "empty-flag"])
def test_a_token_setting_that_holds_no_token_fails_closed(flags, env):
    line = serve_refused(*flags, "--port", "0", "--flight-port", "0", env=env)
    assert "--token (SIGMAFLIGHT_TOKEN): holds no token" in line and "refusing to start without auth" in line


@pytest.mark.parametrize("flags, env, flag", [
    (("--token-file", ""), {}, "--token-file"),
    ((), {"SIGMAFLIGHT_TOKEN_FILE": ""}, "--token-file"),
    (("--tls-cert", ""), {"SIGMAFLIGHT_TLS_KEY": ""}, "--tls-"),
], ids=["empty-token-file-flag", "empty-token-file-variable", "empty-tls-pair"])
def test_a_file_setting_given_empty_fails_closed(flags, env, flag):
    """`--token-file "$TOKENS"` with TOKENS unset names no file: it asked for auth (or TLS), so the
    server refuses to start instead of serving open (or plain http)."""
    done = subprocess.run([*SERVE, *flags, "--port", "0", "--flight-port", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env={**os.environ, **env})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines and all(flag in line and "is empty: it names no file" in line for line in lines), lines


# ---------------------------------------------------------------------------------------- --device

def test_a_device_torch_cannot_parse_is_refused_naming_the_flag():
    line = serve_refused("--port", "0", "--flight-port", "0", "--device", "nope")
    assert "--device nope: not a torch device" in line, line


def test_a_cuda_device_where_torch_has_no_cuda_is_refused_before_the_model_loads():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: --device cuda is a device here")
    line = serve_refused("--port", "0", "--flight-port", "0", "--device", "cuda")
    assert "--device cuda: torch has no CUDA here" in line, line


# ---------------------------------------------------------------------------------------- --data-dir

def test_a_data_dir_that_is_a_file_or_cannot_be_made_is_refused_and_no_parent_is_created(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    line = serve_refused("--port", "0", "--flight-port", "0", "--data-dir", str(afile))
    assert f"--data-dir {afile}: not a directory" in line, line
    assert afile.read_text() == "not a directory"

    line = serve_refused("--port", "0", "--flight-port", "0", "--data-dir", "/proc/sigmaflight-data")
    assert "--data-dir /proc/sigmaflight-data: cannot be created" in line, line

    typo = tmp_path / "no-such-parent" / "a" / "data"
    line = serve_refused("--port", "0", "--flight-port", "0", "--data-dir", str(typo))
    assert f"--data-dir {typo}: its parent {typo.parent} does not exist" in line, line
    assert not (tmp_path / "no-such-parent").exists()


@pytest.fixture(scope="module")
def used_data_dir(tmp_path_factory) -> Path:
    """A data dir a server left: its journal with one succeeded rollout, and that trajectory."""
    data = tmp_path_factory.mktemp("used") / "data"
    with InProcessServer("--data-dir", str(data)) as s, s.client() as c:
        rid = c.post("/v1/rollouts", json={"prompts": ["a"], "num_inference_steps": 1, "seed": 1}).json()["id"]
        while c.get(f"/v1/rollouts/{rid}").json()["status"] != "succeeded":
            time.sleep(0.02)
    return data


def _row(db: Path, row_id: str, record: str) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO jobs (id, record) VALUES (?, ?)", (row_id, record))


def _status(db: Path, status: str) -> None:
    with sqlite3.connect(db) as conn:
        (rid, text), = conn.execute("SELECT id, record FROM jobs").fetchall()
        conn.execute("INSERT INTO jobs (id, record) VALUES (?, ?)", ("newer", text.replace('"succeeded"', f'"{status}"')))


def _replace(path: Path, *, directory: bool) -> None:
    """`path` (a file or a directory) becomes an empty directory, or a small file."""
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    if directory:
        path.mkdir()
    else:
        path.write_text("x")


DAMAGE = {
    "row-not-json": (lambda d: _row(d / "jobs.sqlite3", "bad", "{{{not json"), "row 'bad': JSONDecodeError"),
    "row-missing-fields": (lambda d: _row(d / "jobs.sqlite3", "bad", '{"id": "bad"}'), "row 'bad': KeyError"),
    "row-of-an-unknown-status": (lambda d: _status(d / "jobs.sqlite3", "archived"), "row 'newer': ValueError"),
    "not-a-database": (lambda d: (d / "jobs.sqlite3").write_bytes(b"not sqlite at all " * 100), "not a database"),
    "journal-a-directory": (lambda d: _replace(d / "jobs.sqlite3", directory=True), "is not a file"),
    "trajectories-a-file": (lambda d: _replace(d / "trajectories", directory=False), "trajectories is not a directory"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_data_dir_whose_journal_or_layout_cannot_be_read_is_refused_in_one_line_and_left_as_it_is(
        used_data_dir, tmp_path, damage):
    """Each ended start-up in a traceback (exit 3) from the restart scan, and no trajectory was
    served again: refused before anything loads, naming the journal row or the path, and what to do."""
    data = tmp_path / "data"
    shutil.copytree(used_data_dir, data)
    (data / ".sigmaflight.lock").unlink(missing_ok=True)
    make, says = DAMAGE[damage]
    make(data)
    def files() -> dict[Path, bytes]:  # sqlite's shared-memory index (-shm) changes on any read
        return {p.relative_to(data): p.read_bytes() for p in data.rglob("*")
                if p.is_file() and not p.name.endswith("-shm") and p.name != ".sigmaflight.lock"}

    before = files()
    line = serve_refused("--port", "0", "--flight-port", "0", "--data-dir", str(data))
    assert f"--data-dir {data}: " in line and says in line, line
    assert "jobs.sqlite3" in line or "trajectories" in line, line
    assert files() == before  # nothing changed


@pytest.mark.parametrize("name", ["run%41", "run?mode=rw", "run#1"])
def test_the_journal_check_reads_a_data_dir_whose_name_holds_uri_characters(used_data_dir, tmp_path, name):
    """The check opened the journal by a file: URI built by hand: "%41" in the path was a good
    data dir refused, "?" and "#" cut the path short (sqlite made an empty file beside it and a bad
    row went through)."""
    from sigmaflight.control.startup import StartupError, check_data_dir_contents

    data = tmp_path / name / "data"
    shutil.copytree(used_data_dir, data)
    check_data_dir_contents(data)  # a good one
    _row(data / "jobs.sqlite3", "bad", "{{{not json")
    with pytest.raises(StartupError, match="row 'bad': JSONDecodeError"):
        check_data_dir_contents(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing made beside it


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="drops root's DAC override with setpriv")
def test_a_trajectory_file_the_server_cannot_read_is_refused_not_set_aside_as_corrupt(used_data_dir, tmp_path):
    """A good file this user cannot read (mode 000; root without CAP_DAC_OVERRIDE, so the mode
    bits count) was taken for corrupt: renamed .corrupt and its rollout journaled expired, for
    good. Start-up is refused naming it, and it stays where it is."""
    data = tmp_path / "data"
    shutil.copytree(used_data_dir, data)
    (data / ".sigmaflight.lock").unlink(missing_ok=True)
    (traj,) = (data / "trajectories").glob("*.arrow")
    traj.chmod(0)
    drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
    done = subprocess.run([*drop, *SERVE, "--port", "0", "--flight-port", "0", "--data-dir", str(data)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"cannot read {traj} (Permission denied)" in done.stderr, done.stderr
    assert traj.exists() and not list((data / "trajectories").glob("*.corrupt"))


def test_a_weights_file_dir_that_is_missing_or_not_a_directory_is_refused(tmp_path):
    missing = tmp_path / "no-such-dir"
    line = serve_refused("--port", "0", "--flight-port", "0", "--weights-file-dir", str(missing))
    assert f"--weights-file-dir {missing}: no such directory" in line, line
    afile = tmp_path / "afile"
    afile.write_text("")
    line = serve_refused("--port", "0", "--flight-port", "0", "--weights-file-dir", str(afile))
    assert f"--weights-file-dir {afile}: not a directory" in line, line


# ---------------------------------------------------------------------------------------- --ray-address

@pytest.mark.parametrize("address", ["bogus::x", "localhost", "http://127.0.0.1:6379"])
def test_a_ray_address_ray_cannot_take_is_one_line_naming_the_forms_it_takes(address):
    """ray.init raised ValueError("Invalid address format") for these: a traceback and exit 3,
    after 3 s of starting Ray."""
    pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")
    line = serve_refused("--port", "0", "--flight-port", "0", "--backend", "ray", "--ray-address", address)
    assert f"--backend ray --ray-address {address}: not an address Ray joins" in line, line
    assert "host:port" in line and "ray://host:port" in line, line


def test_backend_ray_with_no_cluster_to_join_names_the_address_and_how_to_start_one():
    pytest.importorskip("ray", reason="the Ray backend needs `pip install sigmaflight[ray]`")
    nobody = f"127.0.0.1:{_free_port()}"  # an address where nothing listens: whatever else runs here
    line = serve_refused("--port", "0", "--flight-port", "0", "--backend", "ray", "--ray-address", nobody)
    assert f"--backend ray --ray-address {nobody}: no Ray cluster answers at {nobody}" in line, line
    assert "ray start --head" in line, line
