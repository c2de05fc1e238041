"""The client installs into a trainer's environment: docs/trainers.md's install block, run as written
in a fresh folder, gives an environment (the wheel with [train], no server extra) that imports
sigmaflight next to another package owning the `control` import name, pulls a trajectory from a real
server and scores it exactly, and runs every other block of docs/trainers.md.

It needs pip and the package index (or pip's cache): CI runs it. The trainer's torch is the lock's
torch 2.13.0, installed once per machine into a cache folder (`pip install --target`, ~1.5 min) that the
fresh environment sees through a .pth file, as a trainer's environment has its torch already: the
block's `pip install torch==2.13.0` then finds it satisfied, and the rest of the block runs as written
(the [train] extra's packages from pip's cache or the index). Then it installs the oldest numpy and pyarrow pyproject.toml claims on top and
runs the same check again: the lower bounds stay true. SIGMAFLIGHT_TEST_CLIENT_PINS (e.g.
"pyarrow==X numpy==Y") installs those versions instead, to try another corner.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from tests.docs.markdown import CODE, blocks
from tests.servers import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Install the client into your trainer's environment"

pytestmark = [pytest.mark.pip, pytest.mark.timeout(900)]


def install_block() -> str:
    """The first code block of docs/trainers.md, which must open with the install section."""
    page = ROOT / "docs" / "trainers.md"
    headings = [line for line in page.read_text().splitlines() if line.startswith("## ")]
    assert headings[0] == HEADING, headings[:1]
    first = blocks(page)[0]
    assert first.lang == "bash" and "tests/cli/test_install.py" in (first.not_run or "")
    return first.code


def lower_bounds(*names: str) -> list[str]:
    """`name==X` for each `name>=X` of pyproject.toml's [project] dependencies: the oldest claimed."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = dict(d.split(">=", 1) for d in deps if ">=" in d and "," not in d)
    return [f"{name}=={bounds[name]}" for name in names]


def locked(name: str) -> str:
    """The version requirements.lock pins for `name`."""
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.lower().startswith(name + "=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not in requirements.lock")


def cached_torch() -> Path:
    """A folder holding the lock's torch and its dependencies, made once per machine."""
    version = locked("torch")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sigmaflight" / f"trainer-torch-{version}"
    if not (cache / ".complete").exists():
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target", str(tmp),
                        f"torch=={version}"], check=True, timeout=900)
        (tmp / ".complete").touch()
        try:
            tmp.rename(cache)
        except OSError:  # another run made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def run_block(code: str, cwd: Path, env: dict[str, str], after_venv: Path) -> list[str]:
    """Run the block's commands one by one in bash; after the one that makes the venv, give it the
    cached torch (a .pth file naming `after_venv`). Returns the last command's stdout lines."""
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    out = ""
    for line in lines:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
        out = done.stdout
        if " -m venv " in f" {line} ":
            (site,) = (cwd / "trainer-env" / "lib").glob("python3*/site-packages")
            (site / "trainer-torch.pth").write_text(f"{after_venv}\n")
    return out.strip().splitlines()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def control_standin_wheel(folder: Path) -> Path:
    """A minimal distribution that owns the top-level import name `control`, as python-control does."""
    info = "control_standin-1.0.dist-info"
    files = {
        "control/__init__.py": b'OWNER = "control-standin"\n',
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: control-standin\nVersion: 1.0\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sigmaflight-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/top_level.txt": b"control\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    path = folder / "control_standin-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            whl.writestr(name, data)
    return path


def run_trainers_page(src: Path, server: InProcessServer, env: dict[str, str], work: Path) -> str:
    """Every runnable block of docs/trainers.md, in order, with the fresh environment as `.venv`
    (tests/docs/run_page.py run by its python, the checkout not on the path): the page needs nothing
    beyond the wheel with [train]. Returns run_page's `ran PAGE:LINE` lines."""
    work.mkdir()
    (work / ".venv").symlink_to(src / "trainer-env", target_is_directory=True)
    (work / "ops").symlink_to(src / "ops", target_is_directory=True)
    todo = [{"page": b.page, "line": b.line, "lang": b.lang,
             "code": b.code.replace("http://127.0.0.1:8000", server.rest_url)}
            for b in blocks(ROOT / "docs" / "trainers.md") if b.lang in CODE and b.not_run is None]
    (work / "blocks.json").write_text(json.dumps(todo))
    page_env = {**env, "SIGMAFLIGHT_URL": server.rest_url, "MPLBACKEND": "Agg"}
    proc = subprocess.run([str(src / "trainer-env" / "bin" / "python"), str(ROOT / "tests" / "docs" / "run_page.py"),
                           "blocks.json"], cwd=work, env=page_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"docs/trainers.md in the [train] environment:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("ran docs/trainers.md:") == len(todo), proc.stdout
    return proc.stdout


CHECK = r"""
import importlib.metadata as md, json, sys
import control
import numpy, pyarrow, pyarrow.compute as pc, torch
import sigmaflight
from sigmaflight import Client, step_log_prob, replay_log_probs

dist = md.distribution("sigmaflight")
tops = sorted({f.parts[0] for f in dist.files} - {"..", dist._path.name})
with Client(sys.argv[1]) as c:
    ticket = c.submit(prompts=["a red cube"], num_outputs_per_prompt=2, num_inference_steps=4, seed=3,
                      sampler={"type": "sde", "noise_level": 0.7}, return_={"velocities": True})
    traj = c.pull(ticket)
    table = c.pull_stream(ticket, "trajectory")
exact = []
for i in traj.sde_steps:
    rows = table.filter(pc.equal(table["step"], i))
    v = torch.from_numpy(rows["velocity"].combine_chunks().to_numpy_ndarray().copy())
    got = step_log_prob(traj.latent(i), traj.latent(i + 1), v, traj.sigmas, i, sampler=traj.metadata["sampler"])
    exact.append(bool(torch.equal(got, traj.log_probs[:, i])))
print(json.dumps({
    "control": [control.OWNER, control.__file__], "tops": tops, "owners": md.packages_distributions().get("control"),
    "exact": exact, "loaded": sorted(m for m in ("diffusers", "transformers", "starlette")
                                                       if m in sys.modules),
    "versions": {"numpy": numpy.__version__, "pyarrow": pyarrow.__version__, "torch": torch.__version__},
}))
"""


@pytest.mark.e2e
def test_the_client_installs_into_a_trainers_environment_as_the_docs_say(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(InProcessServer)  # the server starts while pip works
        try:
            _install_and_check(tmp_path, starting)
        finally:
            if starting.done() and starting.exception() is None:
                starting.result().terminate()  # already terminated on success; a no-op then


def _install_and_check(tmp_path: Path, starting: concurrent.futures.Future[InProcessServer]) -> None:
    src = tmp_path / "sigmaflight"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():  # a file deleted in the work tree is not part of it
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}
    env["PIP_NO_COMPILE"] = "1"  # no .pyc for every installed file: the same install, faster
    printed = run_block(install_block(), src, env, after_venv=cached_torch())
    assert printed[-1] == "sigmaflight 0.1.0"
    bin_ = src / "trainer-env" / "bin"

    (wheel,) = (src / "dist").glob("sigmaflight-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = {n.split("/")[0] for n in whl.namelist()}
    assert names == {"sigmaflight", "sigmaflight-0.1.0.dist-info"}  # no `control`, `dataplane`, `pipeline`

    subprocess.run([str(bin_ / "pip"), "install", "--quiet", str(control_standin_wheel(tmp_path))], env=env,
                   check=True, timeout=600)
    # First as installed (the newest versions the ranges admit), then the oldest numpy and pyarrow
    # pyproject.toml claims, installed on top (SIGMAFLIGHT_TEST_CLIENT_PINS: other versions instead).
    given = os.environ.get("SIGMAFLIGHT_TEST_CLIENT_PINS", "").split()
    corners = [[], given] if given else [[], lower_bounds("numpy", "pyarrow")]
    server = starting.result(timeout=300)
    checked = []
    try:
        for pins in corners:
            if pins:
                subprocess.run([str(bin_ / "pip"), "install", "--quiet", *pins], env=env, check=True, timeout=600)
            check = subprocess.run([str(bin_ / "python"), "-c", CHECK, server.rest_url], cwd=tmp_path, env=env,
                                   capture_output=True, text=True, timeout=300)
            assert check.returncode == 0, f"{pins}: {check.stderr[-3000:]}"
            checked.append((pins, json.loads(check.stdout.strip().splitlines()[-1])))
            if not pins:  # the versions the ranges admit: the page's blocks, as a trainer runs them
                ran = run_trainers_page(src, server, env, tmp_path / "page")
        status = subprocess.run([str(bin_ / "sigmaflight"), "list", "--limit", "1", "--url", server.rest_url],
                                env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.terminate()
    for pins, got in checked:
        assert got["control"][0] == "control-standin" and "/site-packages/control/" in got["control"][1]
        assert got["owners"] == ["control-standin"]  # sigmaflight claims no `control`
        assert got["tops"] == ["sigmaflight"]
        assert got["exact"] == [True, True, True, True], pins  # the rollout's own log-probs, bit for bit, torch only
        assert got["loaded"] == []  # the client loads no model stack until it runs a model
        for pin in pins:
            name, version = pin.split("==")
            assert Version(got["versions"][name]) == Version(version), got["versions"]
    assert status.returncode == 0 and len(json.loads(status.stdout)["rollouts"]) == 1, status.stderr

    serve = subprocess.run([str(bin_ / "sigmaflight"), "serve"], env=env, capture_output=True, text=True, timeout=120)
    assert serve.returncode == 2 and serve.stdout == ""
    (line,) = serve.stderr.strip().splitlines()
    assert line.startswith("sigmaflight serve: the server extra is not installed (missing: ")
    assert line.endswith("pip install 'sigmaflight[server]'") and "starlette" in line
    print(ran)
    print(json.dumps([got["versions"] for _, got in checked]))
