"""The order files run in (the long ones first), and one torch thread per test process.

`--dist loadfile` (ops/test.sh) hands whole files to the workers in collection order, each worker
taking the next file when it is nearly done. A long file handed out last runs alone while the
other workers have finished: the suite waits for it. So files that take tens of seconds each come
first (a `pip` install, Ray clusters, `sigmaflight serve` children, the ops scripts' runs), and the many files of quick
in-process tests fill in behind them, most tests first (pytest-xdist's own order, which this
replaces: it put the one-test files, the longest of all, last).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# One OpenMP thread for torch in each pytest worker and in every process it starts (servers, their
# Ray workers, scripts): the workers already use every core, and an op spread over two threads
# waits for a core the other worker holds (about 15% more wall time for the same tests here).
# Set before any test module imports torch; a value given from outside stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


def _rank(item: pytest.Item) -> int:
    """0: installs with pip; 1: starts a Ray cluster; 2: starts `sigmaflight serve` children or runs
    an ops script (tests/ops); 3: the rest; 4: needs the Ray clusters of ranks 1-2 gone (after_ray)."""
    if item.get_closest_marker("after_ray"):
        return 4
    if item.get_closest_marker("pip"):
        return 0
    if item.path.parent.name == "ray" or item.path.name.startswith("test_ray_"):
        return 1
    if item.get_closest_marker("e2e") or item.path.parent.name == "ops":
        return 2
    return 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder whole files (a file's tests stay together, in their order)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    ranked = sorted(files.values(), key=lambda tests: (min(_rank(t) for t in tests), -len(tests)))
    items[:] = [t for tests in ranked for t in tests]


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost, made with the openssl command line
    (tests/faults TLS tests, tests/cli/test_client_ca_file.py)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key
