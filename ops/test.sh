#!/usr/bin/env bash
# Set everything up (.venv, pinned dependencies) and run the whole test suite:
# ruff, mypy, then pytest. Extra arguments go to pytest (e.g. ops/test.sh -k flight -x).
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh test,ray  # ray: tests/ray start a local 2-CPU Ray cluster (~30 s)
echo "== ruff" >&2
.venv/bin/ruff check control dataplane pipeline sigmaflight tests ops
echo "== mypy" >&2
.venv/bin/mypy
echo "== pytest" >&2
exec .venv/bin/python -m pytest "$@"
