"""A pydantic field's numeric bounds (its `ge=`, `gt=`, `le=`, `lt=`), as the CLI's refusals and help
lines write them: `sigmaflight submit`'s flags (the wire model's fields) and `sigmaflight serve --help`
(the server's settings) read them here, so what a help line or a refusal states is what pydantic checks."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["RULES", "bounds"]

RULES: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}
"""annotated_types' bound attributes: how a message writes each, and its test."""


def bounds(metadata: Iterable[Any]) -> list[tuple[str, Callable[[Any, Any], bool], Any]]:
    """(">=", test, 1), ... of a field's constraints (also inside `Annotated[int, Field(ge=0)]`'s FieldInfo)."""
    out = []
    for m in metadata:
        out += bounds(m.metadata) if isinstance(getattr(m, "metadata", None), list) else []
        out += [(op, test, getattr(m, name)) for name, (op, test) in RULES.items() if getattr(m, name, None) is not None]
    return out
