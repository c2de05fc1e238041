#!/usr/bin/env bash
# Set everything up (.venv, pinned dependencies) and serve the built-in default model:
# REST on http://127.0.0.1:8000, Arrow Flight on grpc+tcp://127.0.0.1:8815, CPU, no downloads.
# Extra arguments go to `sigmaflight serve` (see `sigmaflight serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh server
exec .venv/bin/sigmaflight serve "$@"
