"""A same-host client reading `--shm-dir` files.

A real `sigmaflight serve --shm-dir`; the client is the public TrajectoryClient. The references
are plain pyarrow reads of the same rollouts over gRPC. Forged `file://` locations come from a
lying Flight server written here with plain pyarrow: its FlightInfo names the forged place, its
do_get relays the real server's stream (so a clean fallback returns the real data).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import torch
from sigmaflight.dataplane.client import TrajectoryClient
from sigmaflight.dataplane.files import CorruptTrajectoryFile
from sigmaflight.dataplane.shm import file_location, host_id

from tests.servers import InProcessServer, wait_for_status

pytestmark = pytest.mark.timeout(240)

REQUEST = {"prompts": ["a red cube", "a blue ball"], "num_inference_steps": 3}
PULL_DEADLINE_S = 30.0  # generous on a loaded box; the bug is a pull that never returns


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessServer, Path]]:
    shm = tmp_path_factory.mktemp("samehost") / "shm"
    with InProcessServer("--shm-dir", str(shm)) as s:
        yield s, shm / f"sigmaflight-{os.geteuid()}"  # the files live in <shm-dir>/sigmaflight-<uid>/


def _finished(server: InProcessServer, seeds: list[int]) -> dict[str, Any]:
    with server.client() as c:
        t = c.post("/v1/rollouts", json={**REQUEST, "seeds": seeds}).json()
        wait_for_status(c, t["id"], {"succeeded"})
    return dict(t)


def _plain_table(location: str, ticket: str) -> pa.Table:
    with flight.FlightClient(location) as c:
        return c.do_get(flight.Ticket(ticket.encode()), flight.FlightCallOptions(timeout=60)).read_all()


def _plain_latents(table: pa.Table) -> torch.Tensor:
    """[B, K, *shape] from a plain pyarrow table: row (step, sample) -> [sample, position of step]."""
    steps = sorted(set(table.column("step").to_pylist()))
    sample = np.asarray(table.column("sample").to_numpy())
    k = np.searchsorted(steps, np.asarray(table.column("step").to_numpy()))
    x = table.column("latent").combine_chunks().to_numpy_ndarray()  # [rows, *shape]
    out = np.empty((int(sample.max()) + 1, len(steps), *x.shape[1:]), x.dtype)
    out[sample, k] = x
    return torch.from_numpy(out)


def _pull_with_deadline(client: TrajectoryClient, ticket: str, **kwargs: Any) -> Any:
    """client.pull on a thread; fails the test if it has not returned within PULL_DEADLINE_S."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["traj"] = client.pull(ticket, **kwargs)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(PULL_DEADLINE_S)
    if t.is_alive():
        box["blocked"] = True
    return box


def _unblock_fifo(path: Path) -> None:
    """Let a reader stuck in open() of the FIFO go (a writer opens and closes it)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _fifo(path: Path) -> Path:
    tmp = path.with_name(path.name + ".fifo-tmp")
    os.mkfifo(tmp)
    os.replace(tmp, path)
    return path


def test_a_fifo_moved_onto_the_served_file_never_blocks_a_pull(server: tuple[InProcessServer, Path]) -> None:
    """A FIFO at DIR/<id>.arrow made pull() hang in openat; now it falls back to gRPC."""
    srv, shm = server
    a = _finished(srv, [101, 102])
    want = _plain_latents(_plain_table(srv.flight_url, a["flight"]["ticket"]))
    path = _fifo(shm / f"{a['id']}.arrow")
    try:
        with TrajectoryClient(srv.flight_url) as tc:
            box = _pull_with_deadline(tc, a["flight"]["ticket"])
        assert not box.get("blocked"), f"pull blocked on a FIFO at {path} for {PULL_DEADLINE_S} s"
        assert "error" not in box, box.get("error")
        assert torch.equal(box["traj"].latents, want)  # the server still serves what it verified
    finally:
        _unblock_fifo(path)


class LyingFlight(flight.FlightServerBase):
    """FlightInfo naming `forged` after its own grpc location; do_get relays the real server."""

    def __init__(self, real: str) -> None:
        super().__init__("grpc+tcp://127.0.0.1:0")
        self.real = real
        self.forged = ""
        self.streams = 0

    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        with flight.FlightClient(self.real) as c:
            info = c.get_flight_info(descriptor)
        here = flight.Location(f"grpc+tcp://127.0.0.1:{self.port}")
        ep = flight.FlightEndpoint(info.endpoints[0].ticket, [here, flight.Location(self.forged)])
        return flight.FlightInfo(info.schema, descriptor, [ep], info.total_records, info.total_bytes)

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        self.streams += 1
        return flight.RecordBatchStream(_plain_table(self.real, ticket.ticket.decode()))


def _forged(kind: str, shm: Path, a: dict[str, Any], b: dict[str, Any], fifo: Path) -> str:
    me = host_id()
    a_path, b_path = shm / f"{a['id']}.arrow", shm / f"{b['id']}.arrow"
    return {
        "fifo": file_location(fifo, me),
        "other-host-id": file_location(a_path, "0123456789abcdef"),
        "etc-passwd": file_location(Path("/etc/passwd"), me),
        "directory": file_location(shm, me),
        "dev-zero": file_location(Path("/dev/zero"), me),
        "missing": file_location(shm / "no-such-rollout.arrow", me),
        "another-rollouts-file": file_location(b_path, me),
        "dotdot": file_location(Path(f"{shm}/../../../../../../../etc/passwd"), me),
        "another-host-name": f"file://trainer-elsewhere{a_path}?host={me}",
    }[kind]


@pytest.fixture(scope="module")
def two(server: tuple[InProcessServer, Path]) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """Two finished rollouts A, B whose files have the same size (as first reported; each
    batch's checksum is written in decimal, so sizes differ now and then by a few bytes), and A's
    latents read with plain pyarrow."""
    srv, shm = server
    by_size: dict[int, dict[str, Any]] = {}
    for seed in range(11, 31, 2):
        t = _finished(srv, [seed, seed + 1])
        size = (shm / f"{t['id']}.arrow").stat().st_size
        if size in by_size:
            a = by_size[size]
            return a, t, _plain_latents(_plain_table(srv.flight_url, a["flight"]["ticket"]))
        by_size[size] = t
    raise AssertionError(f"no two rollout files of the same size: {sorted(by_size)}")


@pytest.mark.parametrize("kind", ["fifo", "other-host-id", "etc-passwd", "directory", "dev-zero", "missing",
                                  "another-rollouts-file", "dotdot", "another-host-name"])
def test_a_forged_file_location_falls_back_to_grpc_with_the_right_data(
    server: tuple[InProcessServer, Path], two: tuple[dict[str, Any], dict[str, Any], torch.Tensor], tmp_path: Path,
    kind: str,
) -> None:
    """A FIFO named with this host's id blocked the client) and the 8 other forgeries."""
    srv, shm = server
    a, b, want = two
    fifo = tmp_path / "forged.fifo"
    os.mkfifo(fifo)
    liar = LyingFlight(srv.flight_url)
    liar.forged = _forged(kind, shm, a, b, fifo)
    try:
        with TrajectoryClient(f"grpc+tcp://127.0.0.1:{liar.port}") as tc:
            box = _pull_with_deadline(tc, a["flight"]["ticket"])
        assert not box.get("blocked"), f"pull blocked on the forged location {liar.forged}"
        assert "error" not in box, box.get("error")
        assert torch.equal(box["traj"].latents, want), kind
        assert liar.streams == 1, f"{kind}: the forged location was read instead of falling back to gRPC"
    finally:
        _unblock_fifo(fifo)
        liar.shutdown()


def test_hard_links_of_two_rollouts_swapped_under_pulls_never_hand_over_the_other_one(
    server: tuple[InProcessServer, Path], two: tuple[dict[str, Any], dict[str, Any], torch.Tensor]
) -> None:
    """The client checked one file and read another opened by path: B's latents under A's
    metadata. Every pull must now be A's (read from A's file, or a clean fallback to gRPC)."""
    srv, shm = server
    a, b, want = two
    target = shm / f"{a['id']}.arrow"
    keep_a, keep_b = shm / "keep-a.link", shm / "keep-b.link"
    os.link(target, keep_a)
    os.link(shm / f"{b['id']}.arrow", keep_b)
    stop = threading.Event()
    swaps = [0]

    def swap() -> None:
        tmp = shm / "swap.tmp"
        while not stop.is_set():
            for src in (keep_b, keep_a):
                tmp.unlink(missing_ok=True)
                os.link(src, tmp)
                os.replace(tmp, target)
                swaps[0] += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    wrong, pulls = 0, 0
    try:
        with TrajectoryClient(srv.flight_url) as tc:
            deadline = time.monotonic() + 6.0
            while time.monotonic() < deadline or pulls < 40:
                got = tc.pull(a["flight"]["ticket"])
                pulls += 1
                wrong += not torch.equal(got.latents, want)
                assert got.rollout_id == a["id"]
    finally:
        stop.set()
        swapper.join(10)
        os.replace(keep_a, target)  # A's own file back at its name
        keep_b.unlink()
    assert swaps[0] > pulls, "the swapper did not run while the pulls did"
    assert wrong == 0, f"{wrong} of {pulls} pulls of {a['id']} returned another rollout's latents"


def test_verify_true_refuses_a_byte_changed_in_the_served_file_and_verify_false_does_not_look(
    server: tuple[InProcessServer, Path],
) -> None:
    """By design a same-host read trusts the file (docs/dataplane.md says what it
    does not detect); pull(verify=True) checks each batch's checksum over the bytes it read."""
    srv, shm = server
    c = _finished(srv, [201, 202])
    want = _plain_latents(_plain_table(srv.flight_url, c["flight"]["ticket"]))
    path = shm / f"{c['id']}.arrow"
    with pa.memory_map(str(path)) as src:
        whole = src.read_buffer()
        first = pa.ipc.open_file(src).get_batch(0).column("latent").storage.values.buffers()[1]
        at = first.address - whole.address + 4  # the second float32 of sample 0 at the first step
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x40]))
    with TrajectoryClient(srv.flight_url) as tc:
        trusted = tc.pull(c["flight"]["ticket"])  # verify=False: the changed byte comes through
        changed = (trusted.latents != want).nonzero().tolist()
        assert changed == [[0, 0, 0, 0, 1]], changed
        with pytest.raises(CorruptTrajectoryFile, match=r"checksum mismatch in batch 0 .*verify=True"):
            tc.pull(c["flight"]["ticket"], verify=True)
