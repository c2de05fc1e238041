"""What the command-line tests share: a real server in process (one per module; a module that needs
other flags defines its own `server`), a finished rollout on it, and `cli`, the real `sigmaflight`
command line (`sigmaflight.cli.main`) run in this process."""

from __future__ import annotations

import pytest

from sigmaflight import Client
from sigmaflight.cli import main
from tests.servers import InProcessServer


@pytest.fixture(scope="module")
def server():
    with InProcessServer() as s:
        yield s


@pytest.fixture(scope="module")
def finished(server) -> str:
    """A finished rollout's id (two steps, seed 1)."""
    with Client(server.rest_url) as c:
        ticket = c.submit(prompts=["a red cube"], num_inference_steps=2, seed=1)
        c.wait(ticket)
    return ticket.id


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`sigmaflight ARGV`: its exit status (argparse's own exit included), stdout, stderr."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err
