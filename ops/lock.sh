#!/usr/bin/env bash
# Remake requirements.lock: resolve every extra of pyproject.toml's ranges in a fresh venv and
# write down exactly what was installed. torch stays the 2.13.0 CPU wheel of these machines (a
# plain range may pull a multi-GB CUDA build). Review the diff, then run ops/test.sh on it.
# Usage: ops/lock.sh [pip install arguments, e.g. an upgrade: 'pyarrow==27.0.0']
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
"$tmp/venv/bin/python" -m pip install --quiet "torch==2.13.0" ".[server,test,ray,plot]" "$@"
{
  echo "# Exact versions of the served and tested environment: ops/setup.sh, ops/serve.sh, ops/test.sh"
  echo "# and CI install with this file as pip constraints. Remake it with ops/lock.sh, not by hand."
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -viE '^sigmaflight( |=|@)' | sed 's/^torch==\(.*\)+cpu$/torch==\1/'
} > "$tmp/requirements.lock"
# Replaced only by a whole environment: an install that did nothing (pip's own --help, say) must not
# empty the lock every command installs from.
for pkg in torch diffusers starlette pyarrow pytest ray; do
  grep -qiE "^${pkg}==" "$tmp/requirements.lock" || { echo "ops/lock.sh: no ${pkg} was installed; requirements.lock left as it was" >&2; exit 1; }
done
mv "$tmp/requirements.lock" requirements.lock
echo "requirements.lock: $(grep -vc '^#' requirements.lock) packages" >&2
