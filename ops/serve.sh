#!/usr/bin/env bash
# Set everything up (.venv, pinned dependencies) and serve the built-in default model:
# REST on http://127.0.0.1:8000, Arrow Flight on grpc+tcp://127.0.0.1:8815, CPU, no downloads.
# Extra arguments go to `sigmaflight serve` (see `sigmaflight serve --help`).
# Usage: ops/serve.sh [sigmaflight serve flags, e.g. --port 9000]
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
ops/setup.sh server
exec .venv/bin/sigmaflight serve "$@"
