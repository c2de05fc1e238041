#!/usr/bin/env bash
# Set everything up (.venv, pinned dependencies) and run the whole test suite:
# ruff, mypy, then pytest. Extra arguments go to pytest (e.g. ops/test.sh -k flight -x).
# Usage: ops/test.sh [pytest arguments]
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
ops/setup.sh server,test,ray  # ray: tests/ray start a local 2-CPU Ray cluster (~30 s)
echo "== ruff" >&2
.venv/bin/ruff check control dataplane pipeline sigmaflight tests ops
echo "== mypy" >&2
ops/typecheck.sh
# One pytest worker more than the CPUs (at most 4; SIGMAFLIGHT_TEST_WORKERS overrides, 0 runs in this
# process): many tests wait on a timer, a child process's start-up or a socket, and the extra worker
# fills those waits (docs/operations.md, "The test suite"). Most tests run the server inside the
# pytest worker (tests/servers.py, InProcessServer); those marked e2e start `sigmaflight serve` as a
# child process (-m "not e2e" leaves them out of a quick run). --dist loadfile keeps a file's tests on
# one worker: its module-scoped servers start once; files are handed out in the order
# tests/conftest.py sets, the long ones first.
workers="${SIGMAFLIGHT_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(4, len(os.sched_getaffinity(0)) + 1))')}"
echo "== pytest ($workers workers)" >&2
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
