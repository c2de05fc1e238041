"""A file-backed trajectory is verified (CRC) once per mapping and afterwards
checked cheaply before each serve (inode, size, mtime, ctime of the file at its name; verified
again when any of them moved), so a same-size overwrite is still caught, a touch costs one more
verification, and a file replaced under its name does not stop the server serving what it
mapped and verified.

A real `sigmaflight serve --shm-dir`; plain httpx and pyarrow.flight clients."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from tests.faults.conftest import SMALL, latent_bytes, pull
from tests.servers import InProcessServer, wait_for_status

pytestmark = pytest.mark.timeout(180)
PRIVATE = f"sigmaflight-{os.geteuid()}"  # the files live in <shm-dir>/sigmaflight-<uid>/


def _latent_offset(path: Path) -> int:
    """File offset of the first batch's latent values (plain pyarrow over a memory map)."""
    with pa.memory_map(str(path)) as src:
        whole = src.read_buffer()
        batch = pa.ipc.open_file(src).get_batch(0)
        return batch.column("latent").storage.values.buffers()[1].address - whole.address


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(at)
        old = f.read(4)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old))


def test_a_same_size_overwrite_after_the_first_serve_is_still_caught(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    with InProcessServer("--shm-dir", str(shm)) as server, server.client() as c:
        t = c.post("/v1/rollouts", json=SMALL).json()
        wait_for_status(c, t["id"], {"succeeded"})
        ticket, path = t["flight"]["ticket"], shm / PRIVATE / f"{t['id']}.arrow"
        first = pull(server.flight_url, ticket)  # verified here, once
        os.utime(path)  # moves mtime and ctime, not the bytes: verified again, still served
        assert latent_bytes(pull(server.flight_url, ticket)) == latent_bytes(first)
        size = path.stat().st_size
        _flip(path, _latent_offset(path) + 8)
        assert path.stat().st_size == size
        with pytest.raises(flight.FlightInternalError, match="checksum mismatch in batch 0"):
            pull(server.flight_url, ticket)
        body = c.get(f"/v1/rollouts/{t['id']}").json()
        assert body["status"] == "failed" and body["error"]["type"] == "result_unavailable", body
        assert not path.exists(), "a file found corrupt is still offered to same-host readers"
        again = c.post("/v1/rollouts", json=SMALL).json()  # the server goes on
        assert wait_for_status(c, again["id"], {"succeeded", "failed"})["status"] == "succeeded"


def test_a_file_replaced_under_its_name_leaves_the_verified_mapping_served(tmp_path: Path) -> None:
    """The served file's name now holds another file (of another size): the server goes on
    serving the bytes it mapped, checked against their checksums before each stream."""
    shm = tmp_path / "shm"
    with InProcessServer("--shm-dir", str(shm)) as server, server.client() as c:
        t = c.post("/v1/rollouts", json=SMALL).json()
        wait_for_status(c, t["id"], {"succeeded"})
        ticket, path = t["flight"]["ticket"], shm / PRIVATE / f"{t['id']}.arrow"
        first = pull(server.flight_url, ticket)
        os.link(path, tmp_path / "kept.arrow")  # the mapped inode, kept alive outside the dir
        other = shm / PRIVATE / "other.tmp"
        other.write_bytes(b"not a trajectory")
        os.replace(other, path)
        for _ in range(2):
            assert latent_bytes(pull(server.flight_url, ticket)) == latent_bytes(first)
        _flip(tmp_path / "kept.arrow", _latent_offset(tmp_path / "kept.arrow") + 8)  # the mapped bytes change
        with pytest.raises(flight.FlightInternalError, match="checksum mismatch in batch 0"):
            pull(server.flight_url, ticket)
        assert c.get(f"/v1/rollouts/{t['id']}").json()["status"] == "failed"
