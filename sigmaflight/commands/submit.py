"""`sigmaflight submit`: a RolloutRequest from --json FILE and one flag per wire field.

The flags are derived from `sigmaflight.wire.RolloutRequest` (name, type, choices, help), so a
field added to the wire model is a flag here without an edit; FLAG_NAMES gives the few that
have shorter names than their field path.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

from sigmaflight.commands.common import (
    UsageError,
    add_client_arguments,
    add_parser,
    connect,
    exit_status,
    print_rollout,
    seconds,
)
from sigmaflight.fields import bounds

FLAG_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("prompts",): ("--prompt", "-p"),
    ("num_outputs_per_prompt",): ("--num-outputs-per-prompt", "-n"),
    ("num_inference_steps",): ("--steps", "--num-inference-steps"),
    ("sampler", "type"): ("--sampler",),
    ("sampler", "noise_level"): ("--noise-level",),
    ("sampler", "sde_steps"): ("--sde-steps",),
    ("sampler", "log_prob"): ("--log-prob",),
    ("return", "log_probs"): ("--log-probs",),
    ("return", "latent_dtype"): ("--latent-dtype",),
}
"""Flags whose names are shorter than the field path; every other RolloutRequest field `a.b_c` is
`--a-b-c` (e.g. return.outputs is --return-outputs, branch_from.step is --branch-from-step)."""

METAVARS: dict[tuple[str, ...], str] = {("num_outputs_per_prompt",): "G", ("num_inference_steps",): "T", ("seed",): "S"}

DEST = "request:"
"""argparse dest prefix of a request flag: "request:sampler.noise_level"."""


def _number(kind: type, metadata: typing.Iterable[Any]) -> Any:
    """An argparse type for an int or float wire field: the number within the field's own bounds, else bad
    usage naming them before any request (a NaN or inf, which JSON cannot carry, included)."""
    limits = bounds(metadata)
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if not all(test(value, bound) for _, test, bound in limits):
            rule = " and ".join(f"{op} {bound}" for op, _, bound in limits)
            raise argparse.ArgumentTypeError(f"must be {what} {rule}, got {text}")
        return value

    return parse


def _ints(item: Any) -> Any:
    """An argparse type for a list of integers, comma-separated, each one `item` (`_number(int, ...)`)."""
    def parse(text: str) -> list[int]:
        words = [x.strip() for x in text.split(",") if x.strip()]
        if not all(w.lstrip("+-").isdigit() for w in words):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return [item(w) for w in words]

    return parse


def _optional(annotation: Any) -> Any:
    """`X` of `X | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else annotation


def request_fields(model: Any = None, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(wire path, pydantic FieldInfo) of every leaf field of RolloutRequest, nested models walked."""
    from pydantic import BaseModel

    from sigmaflight.wire import RolloutRequest

    out = []
    for name, field in (model or RolloutRequest).model_fields.items():
        path = (*prefix, field.alias or name)
        inner = _optional(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out += request_fields(inner, path)
        else:
            out.append((path, field))
    return out


def _add_request_flag(p: argparse.ArgumentParser, path: tuple[str, ...], field: Any) -> None:
    """One flag for one wire field, its type, choices and help taken from the field."""
    names = FLAG_NAMES.get(path, ("--" + "-".join(path).replace("_", "-"),))
    where = ".".join(path)
    kind = _optional(field.annotation)
    help_ = f"{field.description} [{where}{_default(field, kind)}]" if field.description else f"RolloutRequest field {where}"
    kw: dict[str, Any] = {"dest": DEST + where, "default": None, "help": help_}
    if typing.get_origin(kind) is typing.Literal:
        kw["choices"] = list(typing.get_args(kind))
    elif kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is list and _bare(typing.get_args(kind)[0]) is int:  # seeds' items carry bounds
        kw.update(type=_ints(_number(int, typing.get_args(typing.get_args(kind)[0])[1:])), metavar="I,J,...")
    elif typing.get_origin(kind) is list:  # list[str]: the flag repeats
        kw.update(action="append", metavar=path[-1].upper().rstrip("S"))
    elif kind in (int, float):
        kw.update(type=_number(kind, field.metadata), metavar=METAVARS.get(path, path[-1].upper()))
    else:
        kw.update(type=kind, metavar=METAVARS.get(path, path[-1].upper()))
    p.add_argument(*names, **kw)


def _default(field: Any, kind: Any) -> str:
    """"; default X" for a field the server fills with a fixed value when the request leaves it out
    (the ones that default to the model's or the server's say so in their description)."""
    value = field.get_default()
    if value is None or field.is_required():
        return ""
    shown = ("on" if value else "off") if kind is bool else value
    return f"; default {shown}"


def _bare(kind: Any) -> Any:
    """The type under `Annotated[type, ...]` (a field's bounds), else the type itself."""
    return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind


def _request_file(path: str) -> dict[str, Any]:
    """The --json FILE request: a JSON object, else UsageError naming the file and why."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--json {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        req = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json {path}: not JSON ({exc})") from None
    if not isinstance(req, dict):
        raise UsageError(f"--json {path}: a RolloutRequest is a JSON object, this file holds a {type(req).__name__}")
    where = _non_finite(req)
    if where is not None:  # Python's json reads NaN and Infinity, which JSON has not
        raise UsageError(f"--json {path}: {where[0]} is {where[1]}, not a JSON number")
    return req


def _non_finite(value: Any, at: str = "") -> tuple[str, str] | None:
    """(where, the literal) of the first NaN or Infinity in a parsed JSON value."""
    if isinstance(value, float) and not math.isfinite(value):
        return at or "the value", "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{at}[{key}]" if isinstance(key, int) else f"{at}.{key}" if at else str(key)
        found = _non_finite(item, where)
        if found is not None:
            return found
    return None


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The RolloutRequest body: --json FILE first, then every flag given on top of it."""
    req: dict[str, Any] = _request_file(args.json) if args.json else {}
    for dest, value in vars(args).items():
        if not dest.startswith(DEST) or value is None:
            continue
        *parents, leaf = dest.removeprefix(DEST).split(".")
        node = req
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise UsageError(f"--json {args.json}: {key} must be an object to take {'.'.join((*parents, leaf))}")
        node[leaf] = list(value) if isinstance(value, list) else value
    return req


def run_submit(args: argparse.Namespace) -> int:
    req = request_from_args(args)
    if "prompts" not in req:
        print("sigmaflight submit: give --prompt (repeatable) or --json FILE with prompts", file=sys.stderr)
        return 2
    with connect(args) as client:
        ticket = client.submit(idempotency_key=args.idempotency_key, **req)
        if not args.wait:
            print_rollout(ticket, quiet=args.quiet)
            return 0
        st = client.wait(ticket, timeout=args.timeout, raise_on_failure=False)
    print_rollout(st, quiet=args.quiet)
    return exit_status(st.status)


def add_submit(sub: Any) -> None:
    p = add_parser(sub, "submit", help="Submit a rollout; print its ticket (JSON).",
                   description="Submit a rollout request built from --json FILE and/or flags (flags win) "
                   "and print the 202 ticket as JSON (-q: the rollout id alone).")
    add_client_arguments(p)
    p.add_argument("--json", metavar="FILE", help="a RolloutRequest JSON file (the base the flags override)")
    for path, field in request_fields():  # one flag per wire field, derived from sigmaflight.wire.RolloutRequest
        _add_request_flag(p, path, field)
    p.add_argument("--idempotency-key", help="Idempotency-Key header")
    p.add_argument("--wait", action="store_true",
                   help="wait until the rollout has finished, print its final status and exit like `status --wait`")
    p.add_argument("--timeout", type=seconds, default=600.0,
                   help="seconds --wait waits, >= 0 (inf: no limit) [default %(default)s]")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only the rollout id (e.g. `id=$(sigmaflight submit -q -p ...)`)")
    p.set_defaults(run=run_submit)
