"""Client subcommands of `sigmaflight`: submit, status, list, cancel, pull, inspect, plot.

Each talks to a running server through `sigmaflight.client.Client` (`--url`, default
http://127.0.0.1:8000 or SIGMAFLIGHT_URL; `--token` or SIGMAFLIGHT_TOKEN), or reads an
`.arrow` file. JSON goes to stdout, progress and errors to stderr; the exit status is 0 on
success, 1 when the server or the data said no, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from sigmaflight.wire import STATES, TERMINAL

DEFAULT_URL = "http://127.0.0.1:8000"
FILE_SUFFIXES = frozenset({".arrow", ".arrows", ".ipc", ".feather"})
"""An argument with one of these suffixes is a file, never looked up on the server."""


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("SIGMAFLIGHT_URL", DEFAULT_URL),
                   help="REST URL of the server [env SIGMAFLIGHT_URL; default %(default)s]")
    p.add_argument("--token", default=os.environ.get("SIGMAFLIGHT_TOKEN"),
                   help="bearer token [env SIGMAFLIGHT_TOKEN; default none]")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _client(args: argparse.Namespace) -> Any:
    from sigmaflight.client import Client

    return Client(args.url, token=args.token)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


# ---- submit ---------------------------------------------------------------------------------


class UsageError(Exception):
    """Bad usage found after parsing (an unreadable --json file): one line on stderr, exit 2."""


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
    help_ = f"{field.description} [{where}]" if field.description else f"RolloutRequest field {where}"
    kind = _optional(field.annotation)
    kw: dict[str, Any] = {"dest": DEST + where, "default": None, "help": help_}
    if typing.get_origin(kind) is typing.Literal:
        kw["choices"] = list(typing.get_args(kind))
    elif kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is list and typing.get_args(kind) == (int,):
        kw.update(type=_ints, metavar="I,J,...")
    elif typing.get_origin(kind) is list:  # list[str]: the flag repeats
        kw.update(action="append", metavar=path[-1].upper().rstrip("S"))
    else:
        kw.update(type=kind, metavar=METAVARS.get(path, path[-1].upper()))
    p.add_argument(*names, **kw)


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
    return req


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
    with _client(args) as client:
        ticket = client.submit(idempotency_key=args.idempotency_key, **req)
        if not args.wait:
            _print_json(ticket.model_dump(mode="json", by_alias=True))
            return 0
        st = client.wait(ticket, timeout=args.timeout, raise_on_failure=False)
    _print_json(st.model_dump(mode="json", by_alias=True))
    return _exit_status(st.status)


def _exit_status(status: str) -> int:
    """0 for a rollout that is running or succeeded, 1 when it failed, was cancelled or expired."""
    return 1 if status in ("failed", "cancelled", "expired") else 0


# ---- status ---------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        st = client.wait(args.id, timeout=args.timeout, raise_on_failure=False) if args.wait else client.status(args.id)
    _print_json(st.model_dump(mode="json", by_alias=True))
    return _exit_status(st.status)


# ---- list / cancel --------------------------------------------------------------------------


def run_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        listed = client.rollouts(status=args.status, limit=args.limit)
    _print_json({"rollouts": [st.model_dump(mode="json", by_alias=True) for st in listed]})
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    """Cancel a queued or running rollout. A finished one is refused (exit 1) unless --release,
    which frees its stored result (DELETE releases a finished rollout; it then reads "expired")."""
    with _client(args) as client:
        before = client.status(args.id)
        if before.status in TERMINAL and not args.release:
            print(f"sigmaflight cancel: rollout {before.id} already {before.status}: nothing to cancel "
                  "(--release frees a finished rollout's stored result)", file=sys.stderr)
            return 1
        after = client.cancel(args.id)
    _print_json(after.model_dump(mode="json", by_alias=True))
    if before.status in TERMINAL or after.status == "expired":  # --release, or it finished meanwhile
        print(f"sigmaflight cancel: rollout {after.id} had finished; released (its stored result is freed)",
              file=sys.stderr)
    return 0


# ---- pull -----------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def run_pull(args: argparse.Namespace) -> int:
    from pyarrow import flight

    from sigmaflight.dataplane.files import CorruptTrajectoryFile, read_trajectory
    from sigmaflight.dataplane.schema import KEY_ROLLOUT, schema_metadata

    out = Path(args.output)
    with _client(args) as client:
        location, ticket = client.locate(args.ticket)
        try:
            reader = client.flight(location).reader(ticket)
            meta = schema_metadata(reader.schema)
            rollout_id = (meta.get(KEY_ROLLOUT) or {}).get("id")
            if out.exists():
                try:
                    schema, _, _ = read_trajectory(out)
                except CorruptTrajectoryFile as exc:
                    print(f"{out}: incomplete or corrupt ({exc}); pulling again", file=sys.stderr)
                else:
                    have = (schema_metadata(schema).get(KEY_ROLLOUT) or {}).get("id")
                    if have != rollout_id:
                        print(f"{out} holds rollout {have}, not {rollout_id}; remove it or choose another -o",
                              file=sys.stderr)
                        return 1
                    print(f"{out}: complete and valid (rollout {have}); kept", file=sys.stderr)
                    return 0
            steps = _stream_to_file(reader, out, meta, f"pull {rollout_id}")
        except flight.FlightError as exc:
            raise client.flight_error(args.ticket, exc) from None
    read_trajectory(out)  # what was written reads back as a complete trajectory
    size = out.stat().st_size
    print(f"wrote {out}: rollout {rollout_id}, {steps} steps, {size} bytes", file=sys.stderr)
    return 0


def _stream_to_file(reader: Any, out: Path, meta: dict[str, Any], desc: str) -> int:
    """Write the stream to `out` (through `out.partial`) with a tqdm bar of steps; the steps written."""
    from tqdm import tqdm

    from sigmaflight.dataplane.files import TrajectoryFileWriter
    from sigmaflight.dataplane.schema import KEY_STEPS

    steps = list(meta.get(KEY_STEPS) or [])
    writer = TrajectoryFileWriter(out, reader.schema)  # writes <out>.partial, replacing an old one
    done: set[int] = set()
    nbytes = 0
    with tqdm(total=len(steps), desc=desc, unit="step", file=sys.stderr, mininterval=0.2) as bar:
        try:
            while True:
                try:
                    batch = reader.read_chunk().data
                except StopIteration:
                    break
                writer.write(batch)
                nbytes += batch.nbytes
                if batch.num_rows:
                    step = int(batch.column("step")[0].as_py())
                    if step not in done:
                        done.add(step)
                        bar.update(1)
                bar.set_postfix_str(_human(nbytes), refresh=False)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
    return len(done)


# ---- inspect / plot -------------------------------------------------------------------------


def _load(args: argparse.Namespace) -> tuple[str, Any, list[Any]]:
    """(label, schema, batches) of a file or a ticket / rollout id on --url."""
    from pyarrow import flight

    from sigmaflight.errors import NotFound
    from sigmaflight.report import read_arrow_file

    src = args.source
    path = Path(src)
    if path.is_file() or path.suffix in FILE_SUFFIXES or os.sep in src:
        schema, batches = read_arrow_file(src)  # a missing path: "no such file", not a server lookup
        return src, schema, batches
    with _client(args) as client:
        try:
            location, ticket = client.locate(src)
            try:
                table = client.flight(location).reader(ticket).read_all()
            except flight.FlightError as exc:
                raise client.flight_error(src, exc) from None
        except NotFound:
            raise NotFound(404, "not_found", f"{src}: no such file, and {args.url} knows no rollout or ticket "
                           "by that name") from None
    return f"{location} {ticket}", table.schema, table.to_batches()


def run_inspect(args: argparse.Namespace) -> int:
    from sigmaflight.report import build_report, render_text

    label, schema, batches = _load(args)
    rep = build_report(label, schema, batches)
    if args.json:
        _print_json(rep.to_json())
    else:
        sys.stdout.write(render_text(rep))
    return 1 if (rep.flags and args.strict) else 0


def run_plot(args: argparse.Namespace) -> int:
    from sigmaflight.plot import render_png
    from sigmaflight.report import build_report, read_arrow_file

    schema, batches = read_arrow_file(args.file)
    rep = build_report(args.file, schema, batches)
    w, h = render_png(args.file, rep, args.output, decode=args.decode, model_dir=args.model_dir)
    print(f"wrote {args.output}: {w}x{h} PNG", file=sys.stderr)
    return 0


# ---- parser ---------------------------------------------------------------------------------


def add_client_commands(sub: Any) -> None:
    """Add submit, status, pull, inspect and plot to `sigmaflight`'s subparsers."""
    fmt = argparse.HelpFormatter
    p = sub.add_parser("submit", help="Submit a rollout; print its ticket (JSON).", formatter_class=fmt,
                       description="Submit a rollout request built from --json FILE and/or flags (flags win) "
                       "and print the 202 ticket as JSON.")
    _client_arguments(p)
    p.add_argument("--json", metavar="FILE", help="a RolloutRequest JSON file (the base the flags override)")
    for path, field in request_fields():  # one flag per wire field, derived from sigmaflight.wire.RolloutRequest
        _add_request_flag(p, path, field)
    p.add_argument("--idempotency-key", help="Idempotency-Key header")
    p.add_argument("--wait", action="store_true",
                   help="wait until the rollout has finished, print its final status and exit like `status --wait`")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits [default %(default)s]")
    p.set_defaults(run=run_submit)

    p = sub.add_parser("status", help="Print a rollout's status (JSON).", formatter_class=fmt,
                       description="Print GET /v1/rollouts/ID as JSON; exit 1 if it failed, was cancelled or expired.")
    _client_arguments(p)
    p.add_argument("id", metavar="ID", help="rollout id")
    p.add_argument("--wait", action="store_true", help="wait until the rollout has finished")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits [default %(default)s]")
    p.set_defaults(run=run_status)

    p = sub.add_parser("list", help="List rollouts, newest first (JSON).", formatter_class=fmt,
                       description="Print GET /v1/rollouts as JSON, newest first.")
    _client_arguments(p)
    p.add_argument("--status", choices=STATES, help="only rollouts with this status")
    p.add_argument("--limit", type=int, default=100, help="at most this many [default %(default)s]")
    p.set_defaults(run=run_list)

    p = sub.add_parser("cancel", help="Cancel a queued or running rollout (--release: free a finished one).",
                       formatter_class=fmt,
                       description="Cancel a queued or running rollout and print its status. A rollout that has "
                       "already finished is refused with exit 1, unless --release: then its stored result is "
                       "freed (its status becomes expired).")
    _client_arguments(p)
    p.add_argument("id", metavar="ID", help="rollout id")
    p.add_argument("--release", action="store_true",
                   help="also release a finished rollout's result (trajectory and streams are deleted)")
    p.set_defaults(run=run_cancel)

    p = sub.add_parser("pull", help="Pull a trajectory over Flight into an .arrow file.", formatter_class=fmt,
                       description="Stream a rollout over Arrow Flight into an Arrow IPC file, with a progress "
                       "bar (steps, bytes) on stderr. Resumable by re-running: a complete, valid file for the "
                       "same rollout is kept; an interrupted pull's OUT.partial is replaced.")
    _client_arguments(p)
    p.add_argument("ticket", metavar="TICKET_OR_ID", help="Flight ticket or rollout id")
    p.add_argument("-o", "--output", required=True, metavar="OUT.arrow", help="file to write")
    p.set_defaults(run=run_pull)

    p = sub.add_parser("inspect", help="Show a trajectory's schema, schedule, statistics and inconsistencies.",
                       formatter_class=fmt,
                       description="Inspect an .arrow file or a ticket / rollout id on --url: schema, the "
                       "sigmas/timesteps table by absolute index, per-step latent mean/std/min/max, log-prob "
                       "summaries per step, and flags (float32(t/1000) != sigma, sigma not decreasing, "
                       "terminal sigma != 0, steps not ascending, columns disagreeing with the metadata).")
    _client_arguments(p)
    p.add_argument("source", metavar="FILE_OR_TICKET", help=".arrow file, Flight ticket or rollout id")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any flag")
    p.set_defaults(run=run_inspect)

    p = sub.add_parser("plot", help="Draw a trajectory as a PNG (matplotlib).", formatter_class=fmt,
                       description="Write a 1400x900 PNG: the sigma schedule with stochastic steps marked, "
                       "log-prob per step per sample (or prompt), and x_T decoded by the model's own VAE with "
                       "each sample's prompt under it (video: frames); the panel says why when it cannot decode.")
    p.add_argument("file", metavar="FILE.arrow", help="a trajectory file (see `sigmaflight pull`)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.png", help="PNG to write")
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                   help="decode x_T through the model's VAE [default: on]")
    p.add_argument("--model-dir", metavar="DIR", help="the local diffusers pipeline the server loaded "
                   "(`serve --model-dir`), to decode with its VAE [default: the built-in named in the file]")
    p.set_defaults(run=run_plot)


def run(args: argparse.Namespace) -> int:
    """Run a client subcommand; API and data errors become one line on stderr and exit 1, bad
    usage exit 2, Ctrl-C exit 130 (an interrupted pull leaves no .partial file behind)."""
    from sigmaflight.errors import ApiError

    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"sigmaflight {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sigmaflight {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ApiError, TimeoutError, OSError, ValueError, KeyError) as exc:
        print(f"sigmaflight {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # pyarrow.flight errors
        if type(exc).__module__.startswith("pyarrow"):
            print(f"sigmaflight {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        raise
