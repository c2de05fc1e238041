"""Planted symlinks and a world-writable --shm-dir, on the real server.

With `--shm-dir` a 1777 directory (as /dev/shm is), another local user could create
`<dir>/<id>.arrow.partial` as a symlink to a file of the server's user before the rollout
finished: the server wrote the trajectory through it (the victim overwritten and chmod'ed) and
served `<id>.arrow` as a symlink to it. The same for --data-dir's temporary and stream files.
Now the server keeps its shared-memory files in a private `<dir>/sigmaflight-<uid>/` that it
creates and checks it owns, and creates every file with O_CREAT | O_EXCL | O_NOFOLLOW.

A second local user is not available here, so the links are planted as the server's own user
(root), wherever the server might write, private directory included: the effect of the attack.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tests.faults.conftest import LONG, LONG_FLAGS, SMALL, latent_bytes, pull, wait_running
from tests.servers import InProcessServer, ServerProcess, wait_for_status

SECRET = b"the victim's own bytes\n"
PRIVATE = f"sigmaflight-{os.geteuid()}"


def _victim(tmp_path: Path, name: str) -> Path:
    v = tmp_path / "victims" / name
    v.parent.mkdir(exist_ok=True)
    v.write_bytes(SECRET)
    os.chmod(v, 0o600)
    return v


def _plant(where: Path, name: str, victim: Path) -> Path:
    link = where / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    os.symlink(victim, link)
    return link


def _file_locations(flight_url: str, rollout_id: str) -> list[str]:
    with flight.FlightClient(flight_url) as fc:
        fi = fc.get_flight_info(flight.FlightDescriptor.for_path("rollouts", rollout_id))
    return [loc.uri.decode() for loc in fi.endpoints[0].locations if loc.uri.startswith(b"file:")]


def _queued_behind_a_long_one(c, body: dict) -> tuple[dict, dict]:
    """(long, target): the target waits in the queue while the one worker runs the long rollout."""
    long = c.post("/v1/rollouts", json=LONG).json()
    wait_running(c, long["id"])
    target = c.post("/v1/rollouts", json=body).json()
    assert c.get(f"/v1/rollouts/{target['id']}").json()["status"] == "queued"
    return long, target


@pytest.mark.timeout(240)
def test_symlinks_planted_at_every_name_the_server_writes_are_never_followed(tmp_path: Path) -> None:
    shm, data = tmp_path / "shm", tmp_path / "data"
    shm.mkdir()
    os.chmod(shm, 0o1777)  # as /dev/shm
    flags = ("--workers", "1", "--shm-dir", str(shm), "--data-dir", str(data), *LONG_FLAGS)
    body = {**SMALL, "return": {"outputs": True}}
    with InProcessServer(*flags) as server, server.client() as c:
        long, target = _queued_behind_a_long_one(c, body)
        rid = target["id"]
        # every directory the server may write this rollout into, and every name it may use there
        names = [(shm, f"{rid}.arrow.partial"), (shm, f"{rid}.arrow"),
                 (shm / PRIVATE, f"{rid}.arrow.partial"), (shm / PRIVATE, f"{rid}.arrow"),
                 (data / "trajectories", f"{rid}.arrow.partial"), (data / "trajectories", f"{rid}.arrow"),
                 (data / "streams", f"{rid}.outputs.arrow.partial"), (data / "streams", f"{rid}.outputs.arrow")]
        victims = {}
        for where, name in names:
            v = _victim(tmp_path, f"{where.name}-{name}")
            victims[v] = _plant(where, name, v)
        assert c.delete(f"/v1/rollouts/{long['id']}").status_code == 200  # the target starts now
        done = wait_for_status(c, rid, {"succeeded", "failed"}, timeout=120)
        assert done["status"] == "succeeded", done
        for v in victims:
            assert v.read_bytes() == SECRET, f"{v} was written through the link {victims[v]}"
            assert stat.S_IMODE(v.stat().st_mode) == 0o600, f"{v} was chmod'ed through {victims[v]}"
        streamed = pull(server.flight_url, target["flight"]["ticket"])
        # the same request again, where nothing was planted: the same trajectory, bit for bit
        again = c.post("/v1/rollouts", json=body).json()
        assert wait_for_status(c, again["id"], {"succeeded"})["status"] == "succeeded"
        assert latent_bytes(streamed) == latent_bytes(pull(server.flight_url, again["flight"]["ticket"]))
        # what the server offers same-host clients is a regular file in its private directory
        for uri in _file_locations(server.flight_url, rid):
            path = Path(unquote(urlsplit(uri).path))
            assert path.parent == shm / PRIVATE, uri
            assert stat.S_ISREG(os.lstat(path).st_mode), f"{path} is not a regular file"
            assert pa.ipc.open_file(pa.memory_map(str(path))).read_all().equals(streamed)
        durable = data / "trajectories" / f"{rid}.arrow"
        assert stat.S_ISREG(os.lstat(durable).st_mode)
        assert pa.ipc.open_file(pa.memory_map(str(durable))).read_all().equals(streamed)
        assert stat.S_ISREG(os.lstat(data / "streams" / f"{rid}.outputs.arrow").st_mode)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "tokens"), [(0o1777, False), (0o1777, True), (0o777, False)],
                         ids=["sticky", "sticky-tokens", "no-sticky"])
def test_files_live_in_a_private_subdirectory_and_a_writable_shm_dir_is_reported(
    tmp_path: Path, mode: int, tokens: bool
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, mode)
    flags: tuple[str, ...] = ("--shm-dir", str(shm))
    token = "sfk-shm-security-0123456789abcdef"
    if tokens:
        (tmp_path / "tokens").write_text(token + "\n")
        os.chmod(tmp_path / "tokens", 0o600)
        flags += ("--token-file", str(tmp_path / "tokens"))
    with InProcessServer(*flags) as server, server.client(token if tokens else None) as c:
        t = c.post("/v1/rollouts", json=SMALL).json()
        assert wait_for_status(c, t["id"], {"succeeded"})["status"] == "succeeded"
        private = shm / PRIVATE
        st = os.lstat(private)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        # with tokens only the server's user may even look inside; without, others may open the
        # 0644 files they are given a location for, but never list or create anything
        assert stat.S_IMODE(st.st_mode) == (0o700 if tokens else 0o711)
        assert (private / f"{t['id']}.arrow").is_file()
        assert not list(shm.glob("*.arrow"))  # nothing in the shared directory itself
        records = [json.loads(line) for line in server.logs if line.startswith("{")]
        said = [r for r in records if "writable by others" in r.get("msg", "")]
        assert len(said) == 1, [r.get("msg") for r in records]
        assert said[0]["private"] == str(private)
        assert said[0]["level"] == ("warning" if mode == 0o777 else "info")


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("planted", ["symlink", "other-owner"])
def test_a_private_directory_someone_else_made_is_refused(tmp_path: Path, planted: str) -> None:
    """`<dir>/sigmaflight-<uid>` made by someone else beforehand (a symlink to a directory of
    theirs, or a directory they own): the server does not start on it and writes nothing there."""
    shm, theirs = tmp_path / "shm", tmp_path / "theirs"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    theirs.mkdir()
    if planted == "symlink":
        os.symlink(theirs, shm / PRIVATE)
    else:
        (shm / PRIVATE).mkdir()
        os.chown(shm / PRIVATE, 12345, 12345)  # we run as root: hand it to another uid
    try:
        server = ServerProcess("--shm-dir", str(shm), timeout=60)
    except RuntimeError as exc:
        out = str(exc)
    else:
        server.kill()
        pytest.fail("the server started on a private directory it does not own")
    assert str(shm / PRIVATE) in out
    assert ("symlink" in out) if planted == "symlink" else ("uid 12345" in out)
    assert list(theirs.iterdir()) == [] and list((shm / PRIVATE).iterdir()) == []
