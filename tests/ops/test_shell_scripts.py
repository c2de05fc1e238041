"""ops/'s shell scripts answer --help with their usage and touch nothing: `ops/lock.sh --help`
handed --help to pip, which printed its own help and installed nothing, and the script then wrote
the empty environment's `pip freeze` over requirements.lock (108 packages down to 0);
`ops/setup.sh --help` made .venv and ended in pip's InvalidRequirement traceback. Each runs in a
scratch copy of the files it reads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["setup.sh", "serve.sh", "test.sh", "lock.sh"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_touches_nothing(tmp_path: Path, script: str, flag: str) -> None:
    (tmp_path / "ops").mkdir()
    for name in ("pyproject.toml", "requirements.lock", f"ops/{script}"):
        shutil.copy2(ROOT / name, tmp_path / name)
    before = (tmp_path / "requirements.lock").read_bytes()
    done = subprocess.run(["bash", f"ops/{script}", flag], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"ops/{script}" in done.stdout or "Usage" in done.stdout, done.stdout
    assert done.stdout.splitlines()[0] == ROOT.joinpath("ops", script).read_text().splitlines()[1].removeprefix("# ")
    assert (tmp_path / "requirements.lock").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ops", "pyproject.toml", "requirements.lock"]  # no .venv
