"""sigmaflight.group_advantages against the test's own transcription of the reference formulas.

The reference below is a loop over groups written from the published definitions, not from the
code under test: Flow-GRPO's per-prompt stat tracker (float64 rewards; per prompt the group's
mean, `np.std` (ddof 0) + 1e-4, advantage `(r - mean) / std`; with `global_std` the whole batch's
`np.std` + 1e-4 instead) and Dr. GRPO (`r - mean`, no division).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sigmaflight
from sigmaflight import group_advantages

ROOT = Path(__file__).resolve().parents[2]


def reference(rewards, keys, std="group", eps=1e-4):
    r = np.array(rewards, dtype=np.float64)
    keys = list(keys)
    out = np.zeros(len(r), dtype=np.float64)
    for key in dict.fromkeys(keys):
        mask = np.array([k == key for k in keys])
        group = r[mask]
        mean = np.mean(group)
        if std == "none":
            out[mask] = group - mean
        elif std == "global":
            out[mask] = (group - mean) / (np.std(r) + eps)
        else:
            out[mask] = (group - mean) / (np.std(group) + eps)
    return out


def test_flow_grpo_worked_example():
    """The tracker's own example: prompts a,b,a,c,b,a with rewards 1..6, by hand."""
    got = group_advantages(np.array([1.0, 2, 3, 4, 5, 6]), ["a", "b", "a", "c", "b", "a"])
    a_std = np.sqrt(((1 - 10 / 3) ** 2 + (3 - 10 / 3) ** 2 + (6 - 10 / 3) ** 2) / 3)
    want = [(1 - 10 / 3) / (a_std + 1e-4), (2 - 3.5) / (1.5 + 1e-4), (3 - 10 / 3) / (a_std + 1e-4), 0.0,
            (5 - 3.5) / (1.5 + 1e-4), (6 - 10 / 3) / (a_std + 1e-4)]
    np.testing.assert_allclose(got, want, rtol=1e-14)
    assert got[3] == 0.0  # "c": a group of one


@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_matches_the_reference_exactly(std):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24)
    keys = [f"prompt {i % 5}" for i in rng.permutation(24)]  # interleaved, unequal groups
    got = group_advantages(rewards, keys, std=std)
    want = reference(rewards, keys, std)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


def test_eps_is_added_to_the_std():
    """(r - mean) / (std + eps), not / sqrt(var + eps) nor / max(std, eps)."""
    r = np.array([0.0, 1.0])  # mean 0.5, population std 0.5
    for eps in (1e-4, 0.5, 0.0):
        np.testing.assert_array_equal(group_advantages(r, [0, 0], eps=eps), [-0.5 / (0.5 + eps), 0.5 / (0.5 + eps)])
    # a constant group: 0 / eps
    assert np.array_equal(group_advantages(np.array([3.0, 3.0]), ["p", "p"]), [0.0, 0.0])


def test_global_std_is_the_whole_batch():
    r = np.array([0.0, 2.0, 10.0, 20.0])
    got = group_advantages(r, ["x", "x", "y", "y"], std="global", eps=0.0)
    s = np.std(r)
    np.testing.assert_array_equal(got, [-1 / s, 1 / s, -5 / s, 5 / s])


def test_group_of_one_is_zero_in_every_mode():
    for std in ("group", "global", "none"):
        got = group_advantages(np.array([5.0, 1.0, 2.0]), ["solo", "pair", "pair"], std=std, eps=0.0)
        assert got[0] == 0.0 and got[1] < 0 < got[2], std


def test_torch_in_torch_out_same_values_dtype_and_device():
    rng = np.random.default_rng(1)
    r64 = rng.normal(size=12)
    keys = [i // 4 for i in range(12)]
    for dtype in (torch.float32, torch.float64):
        t = torch.tensor(r64, dtype=dtype, requires_grad=True)
        got = group_advantages(t, keys)
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == t.device
        assert not got.requires_grad
        want = reference(t.detach().double().numpy(), keys)  # float64 arithmetic, cast at the end
        assert torch.equal(got, torch.from_numpy(want).to(dtype))
    # numpy float32 stays float32, integers become float64
    assert group_advantages(r64.astype(np.float32), keys).dtype == np.float32
    assert group_advantages(np.arange(12), keys).dtype == np.float64
    assert group_advantages(torch.arange(12), keys).dtype == torch.float64


def test_keys_of_any_hashable_kind():
    rng = np.random.default_rng(2)
    r = rng.normal(size=8)
    idx = [0, 1, 0, 1, 2, 2, 0, 1]
    want = reference(r, idx)
    for keys in (idx, np.array(idx), torch.tensor(idx), [("p", i) for i in idx], [f"t{i}" for i in idx]):
        np.testing.assert_array_equal(group_advantages(r, keys), want)


def test_each_call_stands_alone():
    r1 = np.array([0.0, 1.0, 5.0, 9.0])
    first = group_advantages(r1, ["a", "a", "b", "b"])
    group_advantages(np.array([100.0, -100.0]), ["a", "a"])
    assert np.array_equal(group_advantages(r1, ["a", "a", "b", "b"]), first)
    assert np.array_equal(group_advantages(np.array([2.0, 4.0]), ["a", "a"]),
                          group_advantages(np.array([2.0, 4.0]), ["z", "z"]))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"rewards": np.zeros(3), "groups": [0, 0]}, "groups"),
    ({"rewards": np.zeros((2, 2)), "groups": [0, 0]}, "rewards"),
    ({"rewards": np.array([0.0, np.nan]), "groups": [0, 0]}, "rewards"),
    ({"rewards": np.zeros(2), "groups": [0, 0], "std": "batch"}, "std"),
    ({"rewards": np.zeros(2), "groups": [0, 0], "eps": -1.0}, "eps"),
])
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        group_advantages(**kwargs)
    with pytest.raises(TypeError, match="groups"):
        group_advantages(np.zeros(2), [[0], [0]])
    with pytest.raises(TypeError, match="rewards"):
        group_advantages([1.0, 2.0], [0, 0])


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(finite, st.integers(0, 4)), min_size=1, max_size=30),
       st.sampled_from(["group", "global", "none"]),
       st.sampled_from([1e-4, 1e-2, 0.0]))
def test_property_matches_the_reference(pairs, std, eps):
    rewards = np.array([p[0] for p in pairs])
    keys = [p[1] for p in pairs]
    got = group_advantages(rewards, keys, std=std, eps=eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = reference(rewards, keys, std, eps)
    want = np.where(np.isfinite(want), want, 0.0)  # eps=0 and no spread: 0 where the reference divides by 0
    np.testing.assert_array_equal(got, want)


def test_group_advantages_loads_no_torch():
    probe = ("import json, sys, numpy as np\nfrom sigmaflight import group_advantages\n"
             "group_advantages(np.zeros(2), [0, 0])\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    mods = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" not in mods and "sigmaflight.advantages" in mods
    assert "group_advantages" in sigmaflight.__all__


def test_numpy_scalar_eps_is_a_number_and_rewards_must_be_real_numbers():
    """eps=np.float32(1e-4) was refused ("must be a finite number"); string rewards were parsed as
    numbers and complex ones lost their imaginary part with only a ComplexWarning."""
    rewards, groups = np.array([1.0, 2.0, 4.0, 8.0]), [0, 0, 1, 1]
    want = group_advantages(rewards, groups, eps=1e-4)
    np.testing.assert_allclose(group_advantages(rewards, groups, eps=np.float32(1e-4)), want, rtol=1e-6)
    np.testing.assert_array_equal(group_advantages(rewards, groups, eps=np.float64(1e-4)), want)
    np.testing.assert_array_equal(group_advantages(rewards, groups, eps=np.int64(0)),
                                  group_advantages(rewards, groups, eps=0))
    for eps in (np.float32("nan"), np.float64(-1.0), np.bool_(True), "1e-4"):
        with pytest.raises(ValueError, match="eps"):
            group_advantages(rewards, groups, eps=eps)  # type: ignore[arg-type]
    for bad in (np.array(["1", "2"]), np.array([1 + 0j, 2 + 0j]), np.array([1.0, 2.0], dtype=object),
                np.array([b"1", b"2"]), torch.tensor([1 + 0j, 2 + 0j])):
        with pytest.raises(TypeError, match="rewards"):
            group_advantages(bad, [0, 0])


def test_each_nan_key_is_a_group_of_its_own_even_the_same_nan_object_twice():
    """A dict finds a key by identity before equality, so one NaN object used twice (math.nan,
    np.nan) made one group of two, where the docs say each NaN key is a group of its own."""
    rewards = np.array([1.0, 3.0, 5.0, 7.0])
    for nan in (math.nan, np.nan, float("nan")):
        out = group_advantages(rewards, [nan, nan, "g", "g"], std="none")
        assert out.tolist() == [0.0, 0.0, -1.0, 1.0], (nan, out)
