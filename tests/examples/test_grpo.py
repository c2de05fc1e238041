"""The GRPO example's first iteration against a real server: ratio == 1 exactly, then a weights push."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

from tests.servers import ServerProcess

EXAMPLE = Path(__file__).resolve().parents[2] / "ops" / "examples" / "grpo_train.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("grpo_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_grpo_first_iteration_is_on_policy_and_pushes_weights():
    grpo = _load_example()
    lines: list[str] = []
    with ServerProcess() as server:
        history = grpo.train(server.rest_url, iterations=1, inner_steps=2, log=lines.append)
    (first,) = history
    assert first.ratio_on_policy_is_one  # torch.equal(exp(logp_new - logp_old), ones) before the update
    assert first.new_digest != first.digest and math.isfinite(first.loss)
    assert first.ratio_min != 1.0 or first.ratio_max != 1.0  # the second inner step is off-policy
    assert "on-policy ratio == 1: True" in lines[0]
    assert lines[-1].endswith("(the last pushed weights)")


def test_group_advantages_and_clipped_loss():
    grpo = _load_example()
    adv = grpo.group_advantages(torch.tensor([1.0, 3.0, 10.0, 10.0]), group=2)
    # group [1, 3]: mean 2, std sqrt(2) -> -+1/sqrt(2); group [10, 10]: std 0 -> 0 (no signal, no NaN).
    assert torch.allclose(adv, torch.tensor([-(0.5**0.5), 0.5**0.5, 0.0, 0.0]), atol=1e-4)
    old = torch.zeros(2, 1)
    loss, ratio = grpo.policy_loss(torch.full((2, 1), 0.5), old, torch.tensor([1.0, -1.0]), clip=0.1)
    # ratio e^0.5 > 1 + clip: the positive-advantage sample is clipped, the negative one is not.
    assert torch.equal(ratio, torch.full((2, 1), math.exp(0.5), dtype=torch.float32))
    assert math.isclose(float(loss), (-(1.1) + math.exp(0.5)) / 2, rel_tol=1e-6)
