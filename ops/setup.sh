#!/usr/bin/env bash
# Create .venv (Python 3.11 or newer) and install sigmaflight into it, editable, with every
# version exactly as requirements.lock says (the package itself declares ranges).
# Usage: ops/setup.sh [extras]   e.g. ops/setup.sh server,test,ray   (default: server,test)
#   server: `sigmaflight serve` and its model stack; test: the test tools (includes server);
#   ray: --backend ray (the server with Ray); plot: `sigmaflight plot`; none: the client alone.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;; esac
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
# The editable install finds `sigmaflight` through a finder that Python asks after its path search,
# so a script run beside a folder named `sigmaflight` (a clone of this repository, say) would get
# that folder as an empty namespace package: "cannot import name 'Client' from 'sigmaflight'
# (unknown location)". Asking the editable finder first gives such a script the installed package,
# as a regular (non-editable) install does.
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$site/_sigmaflight_editable_first.py" <<'PY'
"""Written by ops/setup.sh: ask sigmaflight's editable finder before the path search."""
import sys
from importlib.machinery import PathFinder

_editable = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("__editable___sigmaflight_")]
if _editable and PathFinder in sys.meta_path:
    sys.meta_path[:] = [f for f in sys.meta_path if f not in _editable]
    _at = sys.meta_path.index(PathFinder)
    sys.meta_path[_at:_at] = _editable
PY
echo "import _sigmaflight_editable_first" > "$site/_sigmaflight_editable_first.pth"  # after __editable__.*.pth
echo "sigmaflight installed in .venv ($(.venv/bin/python --version), extras: ${extras})" >&2
