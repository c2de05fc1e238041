#!/usr/bin/env bash
# Create .venv (Python 3.11 or newer) and install sigmaflight into it, editable, with every
# version exactly as requirements.lock says (the package itself declares ranges).
# Usage: ops/setup.sh [extras]   e.g. ops/setup.sh server,test,ray   (default: server,test)
#   server: `sigmaflight serve` and its model stack; test: the test tools (includes server);
#   ray: --backend ray; plot: `sigmaflight plot`; none: the client alone.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-server,test}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
if [ "$extras" = none ]; then target="."; else target=".[${extras}]"; fi
.venv/bin/python -m pip install --quiet --constraint requirements.lock -e "$target"
echo "sigmaflight installed in .venv ($(.venv/bin/python --version), extras: ${extras})" >&2
