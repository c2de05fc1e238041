#!/usr/bin/env bash
# Create .venv (Python 3.11) and install sigmaflight with pinned dependencies.
# Usage: ops/setup.sh [extras]   e.g. ops/setup.sh test,ray   (default: test; "none" = the service alone)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if [ "$extras" = none ]; then target="."; else target=".[${extras}]"; fi
.venv/bin/python -m pip install --quiet -e "$target"
echo "sigmaflight installed in .venv ($(.venv/bin/python --version))" >&2
