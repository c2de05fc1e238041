"""The TempFlow branches example against a real server: rewards recomputed from the outputs with
PIL, advantages by the formula written out here, the branches really branch at step k."""

from __future__ import annotations

import importlib.util
import io
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sigmaflight import Client
from tests.servers import InProcessServer

EXAMPLE = Path(__file__).resolve().parents[2] / "ops" / "examples" / "tempflow_branches.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("tempflow_branches", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tempflow_branches_prints_per_step_advantages():
    ex = _load_example()
    lines: list[str] = []
    with InProcessServer() as server:
        t0 = time.monotonic()
        res = ex.step_advantages(server.rest_url, step=2, branches=3, steps=4, log=lines.append)
        took = time.monotonic() - t0
        with Client(server.rest_url) as client:
            images = client.pull_outputs(res.branch)
            parent = client.pull(res.parent)
            branch = client.pull(res.branch)
    assert took < 60
    assert images.shape[0] == 2 * 3
    sizes = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(im)).save(buf, format="JPEG", quality=90)
        sizes.append(len(buf.getvalue()))
    want_r = torch.tensor(sizes, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(res.rewards, want_r)
    for j in range(2):
        r = [float(x) for x in sizes[3 * j:3 * j + 3]]
        m = sum(r) / 3
        sd = (sum((x - m) ** 2 for x in r) / 3) ** 0.5
        want = torch.tensor([(x - m) / (sd + 1e-4) for x in r])
        assert torch.allclose(res.advantages[j], want, atol=1e-5)
    assert torch.equal(branch.latent(2), parent.latent(2).repeat_interleave(3, dim=0))  # x_k of the parent
    assert torch.isfinite(res.log_probs).all()
    x3 = branch.latent(3)
    assert not torch.equal(x3[0], x3[1])  # stochastic at k
    assert len(lines) == 3 and "advantages" in lines[1]
