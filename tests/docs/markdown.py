"""Fenced code blocks of the docs (README.md, docs/*.md), with their run/not-run marks.

Every fence must name its language. `python` and `bash` blocks are code: they run, unless the
line right before the fence is `<!-- not run: REASON -->` (a server that serves forever, a
deployment recipe, a benchmark of minutes). `text` blocks are output samples and diagrams.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = ("python", "bash")
KINDS = (*CODE, "text")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    page: str
    """Path relative to the repository root."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    not_run: str | None
    """The reason given in the `<!-- not run: ... -->` mark, or None."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    lines = path.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: unclosed fence")
        mark = _NOT_RUN.match(lines[i - 1].strip()) if i > 0 else None
        code = "\n".join(line[indent:] for line in lines[i + 1 : j])
        out.append(Block(str(path.relative_to(root)), i + 1, m.group(2), code, mark.group(1) if mark else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]
