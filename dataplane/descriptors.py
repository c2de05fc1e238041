"""What a Flight call names: the descriptor paths and action bodies FlightDataServer accepts.

- ``for_path("rollouts", id)``: a whole rollout (its id or ticket);
- ``for_path("rollouts", id, "partitions", n)``: the same in n interleaved partitions;
- ``for_path("rollouts", id, "outputs" | "conditioning")``: one extra stream;
- an action body: the rollout id (UTF-8) or JSON ``{"id": ...}``.

Anything else is a "bad_request" Flight error whose message echoes the input, clipped.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow.flight as flight
from sigmaflight.dataplane.errors import flight_error
from sigmaflight.dataplane.streams import EXTRA_STREAMS
from sigmaflight.dataplane.tickets import is_minted

from sigmaflight.records import ROLLOUT_ID

DESCRIPTOR_ROOT = "rollouts"


def path_rollout(descriptor: flight.FlightDescriptor) -> str:
    """The rollout id (or ticket) of a ``for_path("rollouts", id)`` descriptor."""
    if descriptor.descriptor_type != flight.DescriptorType.PATH:
        raise flight_error(
            "bad_request", f"unsupported descriptor type {descriptor.descriptor_type.name}: "
            f"use FlightDescriptor.for_path({DESCRIPTOR_ROOT!r}, <rollout id>)"
        )
    try:
        path = [p.decode("utf-8") if isinstance(p, bytes) else str(p) for p in descriptor.path]
    except UnicodeDecodeError:
        raise flight_error("bad_request", "descriptor path is not UTF-8") from None
    if len(path) != 2 or path[0] != DESCRIPTOR_ROOT or not path[1]:
        raise flight_error(
            "bad_request", _clip(f"bad descriptor path {path[:4]!r}", 300) + f": expected [{DESCRIPTOR_ROOT!r}, <rollout id>] or "
            f"[{DESCRIPTOR_ROOT!r}, <rollout id>, <stream>]"
        )
    return path[1]


def path_stream(descriptor: flight.FlightDescriptor) -> tuple[str, str | None]:
    """(id, stream) for ``for_path("rollouts", id, "outputs" | "conditioning")``; ("", None) for any other."""
    if descriptor.descriptor_type != flight.DescriptorType.PATH or len(descriptor.path) != 3:
        return "", None
    parts = [bytes(p) for p in descriptor.path]
    if parts[0] != DESCRIPTOR_ROOT.encode():
        return "", None
    name = parts[2].decode("utf-8", errors="replace")
    if name not in EXTRA_STREAMS:
        shown = [p.decode("utf-8", errors="replace") for p in parts]
        raise flight_error(
            "bad_request", _clip(f"bad descriptor path {shown!r}: unknown stream {name!r}", 300)
            + f"; expected [{DESCRIPTOR_ROOT!r}, <rollout id>] or [{DESCRIPTOR_ROOT!r}, <rollout id>, "
            f"{' | '.join(repr(n) for n in EXTRA_STREAMS)}]"
        )
    return parts[1].decode("utf-8", errors="replace"), name


def path_partitions(descriptor: flight.FlightDescriptor) -> tuple[str | None, int]:
    """(id, n) for ``for_path("rollouts", id, "partitions", n)``; (None, 1) for any other."""
    if descriptor.descriptor_type != flight.DescriptorType.PATH or len(descriptor.path) != 4:
        return None, 1
    parts = [bytes(p) for p in descriptor.path]
    if parts[0] != DESCRIPTOR_ROOT.encode() or parts[2] != b"partitions":
        return None, 1
    # plain decimal digits only: int() would also take "2_0" (20), " 3 ", "+4" and "05"
    if re.fullmatch(rb"[1-9][0-9]?", parts[3]) is None or not 1 <= (n := int(parts[3])) <= 64:
        raise flight_error("bad_request", f"bad partition count {parts[3][:20]!r}: expected an integer in 1..64")
    return parts[1].decode("utf-8", errors="replace"), n


def _clip(message: str, limit: int) -> str:
    """Error messages echo client input: keep them short. A long message (some KiB) makes the
    client lose the Flight error type (pyarrow raises a bare OSError instead)."""
    return message if len(message) <= limit else message[:limit] + f"... ({len(message)} chars)"


def action_rollout(body: bytes) -> str:
    """The rollout id or whole-rollout ticket a "cancel" or "release" action's body names."""
    try:
        text = body.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise flight_error("bad_request", "action body must be a rollout id (UTF-8) or JSON {\"id\": ...}") from None
    if text.startswith("{"):
        try:
            obj: Any = json.loads(text)
        except (ValueError, RecursionError):  # nested past Python's stack: refused as any bad JSON is
            raise flight_error("bad_request", "action body is not valid JSON") from None
        text = obj.get("id", "") if isinstance(obj, dict) else ""
        if not isinstance(text, str):
            text = ""
    if not text:
        raise flight_error("bad_request", "action body names no rollout id")
    if not (is_minted(text) or ROLLOUT_ID.fullmatch(text)):
        raise flight_error("bad_request", f"action body {_clip(text, 80)!r} is neither a rollout id "
                           f"({ROLLOUT_ID.pattern}) nor a rollout's ticket")
    return text
