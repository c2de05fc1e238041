#!/usr/bin/env bash
# mypy over the packages under their installed names. pyproject.toml maps the repository's
# control/, dataplane/ and pipeline/ to sigmaflight.control, sigmaflight.dataplane and
# sigmaflight.pipeline (setuptools package-dir); mypy cannot follow that mapping, so this
# builds the installed layout as a tree of symbolic links in build/typecheck and checks it
# there. Errors name files by their installed path (sigmaflight/control/... is control/...).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree/sigmaflight" "$tree/tests"
mkdir -p "$tree/sigmaflight"
for f in sigmaflight/*; do
  case "$f" in */__pycache__) continue ;; esac
  ln -s "../../../$f" "$tree/sigmaflight/"
done
for pkg in control dataplane pipeline; do
  ln -s "../../../$pkg" "$tree/sigmaflight/$pkg"
done
ln -s ../../tests "$tree/tests"
cd "$tree"
exec ../../.venv/bin/mypy --config-file ../../pyproject.toml -p sigmaflight -p tests "$@"
