"""Each package page opens with a table of its modules (docs/control.md, dataplane.md, pipeline.md):
every module in the package has a row there, every row names a module that exists, and every name a
row cites is defined in the module it names or one it imports, so neither a new module nor a rename
leaves the table behind."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT

PAGES = {"control": "control.md", "dataplane": "dataplane.md", "pipeline": "pipeline.md"}


def _table(page: str) -> list[list[str]]:
    """The cells of the page's first table (header and rule left out)."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("| "))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _row_modules(package: str, cell: str) -> list[Path]:
    """The module files one row's first cell names: `control/x/y.py`, `store.py` (in dataplane/) or
    `sigmaflight.pipeline.spec`."""
    out = []
    for name in re.findall(r"`([^`]+)`", cell):
        if name.startswith("sigmaflight.pipeline."):
            out.append(ROOT / "pipeline" / (name.split(".", 2)[2].replace(".", "/") + ".py"))
        elif name.endswith(".py"):
            out.append(ROOT / (name if "/" in name else f"{package}/{name}"))
    return out


def _defined(path: Path) -> set[str]:
    """Every name a module defines, imports or takes as a parameter, and every attribute or field its
    classes define."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


@pytest.mark.parametrize("package", sorted(PAGES))
def test_every_module_has_a_row_and_every_row_a_module(package):
    rows = _table(PAGES[package])
    listed = [p for row in rows for p in _row_modules(package, row[0])]
    assert listed, f"docs/{PAGES[package]}: no module rows found"
    missing_files = sorted(str(p.relative_to(ROOT)) for p in listed if not p.is_file())
    assert not missing_files, f"docs/{PAGES[package]} lists modules that do not exist: {missing_files}"
    root = ROOT / package
    modules = {p for p in root.rglob("*.py") if p.name != "__init__.py"}
    unlisted = sorted(str(p.relative_to(ROOT)) for p in modules - set(listed))
    assert not unlisted, f"docs/{PAGES[package]}'s module table has no row for {unlisted}"


NOT_OURS = {"PUT", "preadv", "extra_info"}  # an HTTP method, an os call, pyarrow's FlightError field


@pytest.mark.parametrize("package", sorted(PAGES))
def test_every_name_a_row_cites_is_defined_in_the_code(package):
    """Each `Name`, `name(...)`, `.method(...)` or `Class.attr` a row cites is defined (def, class,
    assignment, field or import) somewhere in the server's or the users' code: a rename or a removal
    cannot leave the table naming what no longer exists. Paths, flags and literals are left out."""
    defined = set().union(*(_defined(p) for d in ("control", "dataplane", "pipeline", "sigmaflight")
                            for p in (ROOT / d).rglob("*.py")))
    missing = []
    for row in _table(PAGES[package]):
        for cell in row[1:]:
            for code in re.findall(r"`([^`]+)`", cell):
                name = re.fullmatch(r"(\.?)([A-Za-z_]\w*)(?:\.(\w+))?(\(.*\))?(?: -> .*)?", code)
                if not name or (name.group(1) and not name.group(4)):  # not a name, or a suffix (`.arrow`)
                    continue
                cited = name.group(3) or name.group(2)
                if cited not in defined | NOT_OURS:
                    missing.append(f"{row[0]}: `{code}`")
    assert not missing, f"docs/{PAGES[package]}'s module table cites names the code does not define: {missing}"
