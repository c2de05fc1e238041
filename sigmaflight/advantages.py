"""Group-relative advantages for GRPO: `group_advantages`.

Needs only numpy; a torch tensor in gives a torch tensor out, and torch is never imported here
(it is recognised through `sys.modules`, so plain numpy use does not load it).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Iterable
from typing import Any, Literal, TypeVar

import numpy as np

__all__ = ["group_advantages"]

R = TypeVar("R")

_STDS = ("group", "global", "none")


def group_advantages(
    rewards: R,
    groups: Iterable[Hashable] | Any,
    *,
    std: Literal["group", "global", "none"] = "group",
    eps: float | np.floating[Any] | np.integer[Any] = 1e-4,
) -> R:
    """The advantage of each sample against the other samples of its group (a GRPO group: the
    outputs of one prompt), as `(r - mean) / (std + eps)`.

    rewards: numpy array or torch tensor [B], one reward per sample; the result has the same type,
    shape, float dtype and (torch) device; integer or boolean rewards give float64. The result
    carries no autograd graph (advantages are constants of the policy loss).
    groups: B keys, any hashable values (the prompt text, the prompt index; a numpy array or
    torch tensor of keys works too); samples with equal keys form a group, wherever they are.
    std: "group": the group's mean and population standard deviation (ddof=0), as Flow-GRPO's
    per-prompt stat tracker; "global": the group's mean and the standard deviation of the whole
    batch (Flow-GRPO's `global_std`); "none": `r - mean`, no division (Dr. GRPO).
    eps: added to the standard deviation (ignored by "none"); a finite Python or numpy number >= 0.
    Rewards of another dtype (strings, complex, objects) are a TypeError naming `rewards`; a NaN or
    infinite reward is a ValueError.

    A group of one sample gets 0, as in Flow-GRPO (its reward is its own mean). Each call stands
    alone: nothing is remembered across calls. Arithmetic is in float64, cast back at the end.
    """
    if std not in _STDS:
        raise ValueError(f"std must be one of {', '.join(map(repr, _STDS))}, got {std!r}")
    if (isinstance(eps, bool | np.bool_) or not isinstance(eps, int | float | np.integer | np.floating)
            or not np.isfinite(eps) or eps < 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    eps = float(eps)
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(rewards, torch.Tensor)
    if is_torch:
        assert torch is not None
        if rewards.is_complex():  # type: ignore[attr-defined]
            raise TypeError(f"rewards must be real numbers (bool, integer or float), got {rewards.dtype}")  # type: ignore[attr-defined]
        values = rewards.detach().to("cpu", torch.float64).numpy()  # type: ignore[attr-defined]
    elif isinstance(rewards, np.ndarray):
        if rewards.dtype.kind not in "biuf":  # strings would be parsed, complex numbers lose their imaginary part
            raise TypeError(f"rewards must be real numbers (bool, integer or float), got dtype {rewards.dtype}")
        values = rewards.astype(np.float64)
    else:
        raise TypeError(f"rewards must be a numpy array or a torch tensor, got {type(rewards).__name__}")
    if values.ndim != 1:
        raise ValueError(f"rewards must be one-dimensional [B], got shape {tuple(values.shape)}")
    if not np.all(np.isfinite(values)):
        raise ValueError("rewards must be finite (got NaN or inf)")
    keys = _keys(groups, torch)
    if len(keys) != len(values):
        raise ValueError(f"groups must have one key per reward ({len(values)}), got {len(keys)}")

    index: dict[Hashable, int] = {}
    # a NaN key is a group of its own: a fresh object for each, as a dict finds one NaN object used
    # twice by identity
    keys = [object() if isinstance(k, (float, np.floating)) and math.isnan(k) else k for k in keys]
    try:
        inverse = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=len(keys))
    except TypeError as exc:
        raise TypeError(f"groups must hold hashable keys: {exc}") from None
    out = np.zeros_like(values)
    if len(values):
        # Each group's samples in their order (a stable sort), so its mean and std are numpy's own.
        order = np.argsort(inverse, kind="stable")
        bounds = np.flatnonzero(np.diff(inverse[order])) + 1
        batch_std = float(np.std(values)) if std == "global" else 0.0
        for rows in np.split(order, bounds):
            if len(rows) < 2:
                continue  # a group of one: 0
            r = values[rows]
            dev = r - np.mean(r)
            if std == "none":
                out[rows] = dev
                continue
            denom = (np.std(r) if std == "group" else batch_std) + eps
            out[rows] = dev / denom if denom > 0 else 0.0
    if is_torch:
        assert torch is not None
        dtype = rewards.dtype if rewards.is_floating_point() else torch.float64  # type: ignore[attr-defined]
        return torch.from_numpy(out).to(device=rewards.device, dtype=dtype)  # type: ignore[attr-defined, no-any-return]
    dtype = rewards.dtype if np.issubdtype(rewards.dtype, np.floating) else np.float64  # type: ignore[attr-defined]
    return out.astype(dtype, copy=False)  # type: ignore[return-value]


def _keys(groups: Any, torch: Any) -> list[Hashable]:
    if isinstance(groups, str | bytes):
        raise TypeError("groups must be a sequence of keys, one per reward, not a single string")
    if torch is not None and isinstance(groups, torch.Tensor) or isinstance(groups, np.ndarray):
        return list(groups.tolist())  # plain Python values: a tensor's elements hash by identity
    try:
        return list(groups)
    except TypeError:
        raise TypeError(f"groups must be a sequence of keys, one per reward, got {type(groups).__name__}") from None
