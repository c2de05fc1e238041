"""What the client subcommands share: the connection flags, the output formats, a rollout
named on the command line, and the exit status a rollout's state gives."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


class UsageError(Exception):
    """Bad usage found after parsing (an unreadable --json file): one line on stderr, exit 2."""


def add_parser(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """One subcommand's parser; like every sigmaflight parser, it takes no abbreviated flags."""
    return sub.add_parser(name, formatter_class=argparse.HelpFormatter, allow_abbrev=False, **kwargs)  # type: ignore[no-any-return]


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("SIGMAFLIGHT_URL", DEFAULT_URL),
                   help="REST URL of the server [env SIGMAFLIGHT_URL; default %(default)s]")
    p.add_argument("--token", default=os.environ.get("SIGMAFLIGHT_TOKEN"),
                   help="bearer token (of a comma-separated list, as serve takes, the first) [env SIGMAFLIGHT_TOKEN; default none]")
    p.add_argument("--ca-file", metavar="PEM",
                   help="CA certificate(s) to trust for an https:// server and its grpc+tls:// Flight plane (a "
                   "self-signed `serve --tls-cert`: that cert.pem) [env SIGMAFLIGHT_CA_FILE; default: the system's]")


def seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0 (inf: no limit); NaN and negatives are bad usage."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (inf: no limit), got {text!r}")
    return value


def int_in(low: int, high: int) -> Any:
    """An argparse type: an integer in low..high."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {value}")
        return value

    return parse


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """--json / --table: the format of a listing (default: a table on a terminal, else JSON)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", dest="format", action="store_const", const="json",
                   help="print JSON [default when stdout is not a terminal]")
    g.add_argument("--table", dest="format", action="store_const", const="table",
                   help="print a table [default on a terminal]")


def check_url(url: str) -> str:
    """`url` if it can be the REST URL (http:// or https://); UsageError naming what it is instead:
    a URL without a scheme, the Flight location (grpc+tcp://, the other port), or one with a query
    string or fragment."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise UsageError(f"--url {url}: no scheme; the REST URL is http://HOST:PORT (e.g. http://{url})")
    if scheme.lower().startswith("grpc"):
        raise UsageError(f"--url {url}: that is the Flight location; --url takes the REST URL, http://HOST:PORT "
                         "(`sigmaflight serve --port`, default 8000; Flight listens on --flight-port)")
    if scheme.lower() not in ("http", "https"):
        raise UsageError(f"--url {url}: {scheme}:// is not a REST URL; use http://HOST:PORT or https://HOST:PORT")
    if "?" in rest or "#" in rest:  # the client appends /v1/...: a query or fragment would swallow it
        raise UsageError(f"--url {url}: a REST URL takes no query string or fragment; give http://HOST:PORT")
    return url


def first_token(value: str | None) -> str | None:
    """The token to send: SIGMAFLIGHT_TOKEN may hold the comma-separated list `serve` takes (one
    variable for both sides); a request carries one bearer token, the first."""
    if value is None or "," not in value:
        return value
    return next((t.strip() for t in value.split(",") if t.strip()), value)


def connect(args: argparse.Namespace) -> Any:
    """A Client for --url, --token and --ca-file (imported here: `sigmaflight --help` needs no
    httpx); a CA file that cannot be read or holds no certificate is bad usage, named."""
    from sigmaflight.checks import SettingError
    from sigmaflight.client import Client
    from sigmaflight.rest import CAFileError

    url = check_url(args.url)
    ca_file, given_as = args.ca_file, "--ca-file"
    if ca_file is None:
        ca_file, given_as = os.environ.get("SIGMAFLIGHT_CA_FILE") or None, "SIGMAFLIGHT_CA_FILE"
    try:
        return Client(url, token=first_token(args.token), ca_file=ca_file)
    except CAFileError as exc:
        raise UsageError(f"{given_as} {exc.path}: {exc.reason}") from None
    except SettingError as exc:  # a URL httpx cannot parse, a token no header can carry
        flag = {"url": "--url", "token": "--token"}.get(exc.name, exc.name)
        raise UsageError(f"{flag} {exc.shown}: {exc.reason}" if exc.shown is not None else f"{flag}: {exc.reason}") \
            from None


def is_file(text: str) -> bool:
    """Whether `text` names a file here; False for what cannot be a path (a name over the
    system's limit, a NUL), so a long rollout id is asked of the server."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def rollout_ref(text: str) -> str:
    """A rollout as `status`, `cancel` and `pull` take it: a rollout id, a Flight ticket, or the
    file that `sigmaflight submit > FILE` (or `status`) wrote, whose "id" is used."""
    path = Path(text)
    if not is_file(text):
        return text
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{text}: a file, but not the JSON ticket `sigmaflight submit` prints ({exc})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        raise UsageError(f"{text}: a file, but it holds no rollout \"id\" (expected the JSON ticket "
                         "`sigmaflight submit` prints)")
    return str(obj["id"])


def print_json(obj: Any) -> None:
    """`obj` as JSON that every parser reads: a NaN or infinite float (a broken file's sigma, say)
    is null, not the bare NaN that Python's json writes and jq, JavaScript and DuckDB refuse."""
    print(json.dumps(_finite(obj), indent=2, sort_keys=False, allow_nan=False))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def print_rollout(ticket_or_status: Any, *, quiet: bool) -> None:
    """The ticket or status as JSON, or (quiet) its rollout id alone on one line."""
    if quiet:
        print(ticket_or_status.id)
    else:
        print_json(ticket_or_status.model_dump(mode="json", by_alias=True))


def exit_status(status: str) -> int:
    """0 for a rollout that is running or succeeded, 1 when it failed, was cancelled or expired."""
    return 1 if status in ("failed", "cancelled", "expired") else 0


def wants_table(args: argparse.Namespace) -> bool:
    return args.format == "table" if args.format else sys.stdout.isatty()


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Left-aligned columns, two spaces apart, the header first ("(none)" when there are no rows)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")
