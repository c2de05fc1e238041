"""The server recipes (docs/scaling.md, ops/deploy/) install extras that can run `sigmaflight
serve`: they installed `sigmaflight[ray]`, which was Ray alone, and `serve` then exited 2 naming
the missing server extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [ROOT / "docs" / "scaling.md", *sorted((ROOT / "ops" / "deploy").glob("*.yaml"))]


def _closure(extras: set[str], table: dict[str, list[str]]) -> set[str]:
    """The extras `extras` brings in, following `sigmaflight[...]` entries of pyproject.toml."""
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in table.get(name, []):
            m = re.fullmatch(r"sigmaflight\[([a-z,]+)\]", requirement.strip())
            if m:
                todo.extend(m.group(1).split(","))
    return seen


def test_every_server_recipe_installs_the_server() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = 0
    for path in RECIPES:
        for m in re.finditer(r"sigmaflight\[([a-z,]+)\]", path.read_text()):
            found += 1
            extras = set(m.group(1).split(","))
            assert extras <= set(table), (path.name, m.group(0))
            assert "server" in _closure(extras, table), f"{path.name}: {m.group(0)} cannot run `sigmaflight serve`"
    assert found >= 4
