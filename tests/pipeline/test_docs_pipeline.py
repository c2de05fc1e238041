"""The Python code blocks of docs/pipeline.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "pipeline.md"


def test_python_blocks_of_docs_pipeline_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/pipeline.md has no python block"
    for n, block in enumerate(blocks):
        exec(compile(block, f"{DOC}:block{n}", "exec"), {"__name__": "docs_pipeline"})
