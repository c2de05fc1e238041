"""Client subcommands of `sigmaflight`: submit, status, list, cancel, pull, inspect, plot, models.

Each talks to a running server through `sigmaflight.client.Client` (`--url`, default
http://127.0.0.1:8000 or SIGMAFLIGHT_URL; `--token` or SIGMAFLIGHT_TOKEN), or reads an
`.arrow` file. JSON goes to stdout (`list` and `models` print a table instead when stdout is a
terminal), progress and errors to stderr; the exit status is 0 on success, 1 when the server or
the data said no, 2 for bad usage.
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


def check_url(url: str) -> str:
    """`url` if it can be the REST URL (http:// or https://); UsageError naming what it is instead:
    a URL without a scheme, or the Flight location (grpc+tcp://, the other port)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise UsageError(f"--url {url}: no scheme; the REST URL is http://HOST:PORT (e.g. http://{url})")
    if scheme.lower().startswith("grpc"):
        raise UsageError(f"--url {url}: that is the Flight location; --url takes the REST URL, http://HOST:PORT "
                         "(`sigmaflight serve --port`, default 8000; Flight listens on --flight-port)")
    if scheme.lower() not in ("http", "https"):
        raise UsageError(f"--url {url}: {scheme}:// is not a REST URL; use http://HOST:PORT or https://HOST:PORT")
    return url


def _client(args: argparse.Namespace) -> Any:
    from sigmaflight.client import Client

    return Client(check_url(args.url), token=args.token)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _output_arguments(p: argparse.ArgumentParser) -> None:
    """--json / --table: the format of a listing (default: a table on a terminal, else JSON)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", dest="format", action="store_const", const="json",
                   help="print JSON [default when stdout is not a terminal]")
    g.add_argument("--table", dest="format", action="store_const", const="table",
                   help="print a table [default on a terminal]")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _wants_table(args: argparse.Namespace) -> bool:
    return args.format == "table" if args.format else sys.stdout.isatty()


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Left-aligned columns, two spaces apart, the header first ("(none)" when there are no rows)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")


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
            _print_rollout(ticket, quiet=args.quiet)
            return 0
        st = client.wait(ticket, timeout=args.timeout, raise_on_failure=False)
    _print_rollout(st, quiet=args.quiet)
    return _exit_status(st.status)


def _print_rollout(ticket_or_status: Any, *, quiet: bool) -> None:
    """The ticket or status as JSON, or (quiet) its rollout id alone on one line."""
    if quiet:
        print(ticket_or_status.id)
    else:
        _print_json(ticket_or_status.model_dump(mode="json", by_alias=True))


def _exit_status(status: str) -> int:
    """0 for a rollout that is running or succeeded, 1 when it failed, was cancelled or expired."""
    return 1 if status in ("failed", "cancelled", "expired") else 0


# ---- status ---------------------------------------------------------------------------------


def rollout_ref(text: str) -> str:
    """A rollout as `status`, `cancel` and `pull` take it: a rollout id, a Flight ticket, or the
    file that `sigmaflight submit > FILE` (or `status`) wrote, whose "id" is used."""
    path = Path(text)
    if not path.is_file():
        return text
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{text}: a file, but not the JSON ticket `sigmaflight submit` prints ({exc})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        raise UsageError(f"{text}: a file, but it holds no rollout \"id\" (expected the JSON ticket "
                         "`sigmaflight submit` prints)")
    return str(obj["id"])


def run_status(args: argparse.Namespace) -> int:
    rollout = rollout_ref(args.id)
    with _client(args) as client:
        st = client.wait(rollout, timeout=args.timeout, raise_on_failure=False) if args.wait else client.status(rollout)
    _print_json(st.model_dump(mode="json", by_alias=True))
    return _exit_status(st.status)


# ---- list / cancel --------------------------------------------------------------------------


def run_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        listed = client.rollouts(status=args.status, limit=args.limit)
    if not _wants_table(args):
        _print_json({"rollouts": [st.model_dump(mode="json", by_alias=True) for st in listed]})
        return 0
    rows = [[st.id, st.status, st.model, f"{st.progress.steps_done}/{st.progress.steps_total}", st.created_at,
             _clip(f"{st.error.type}: {st.error.message}", 60) if st.error else ""] for st in listed]
    _print_table(["ID", "STATUS", "MODEL", "STEPS", "CREATED", "ERROR"], rows)
    return 0


def run_models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models = client.models()
    if not _wants_table(args):
        _print_json({"models": models})
        return 0
    rows = []
    for m in models:
        defaults = m.get("defaults") or {}
        size = f"{defaults.get('height')}x{defaults.get('width')}" if defaults.get("height") else ""
        lora = m.get("lora")
        rows.append([m["id"] + (" *" if m.get("default") else ""), str(m.get("family", "")), str(m.get("dtype", "")),
                     str(m.get("device", "")), size, str(defaults.get("num_inference_steps", "")),
                     str(m.get("weights_version", "")), str(m.get("digest", ""))[:12],
                     f"r={lora.get('r')}" if isinstance(lora, dict) else ""])
    _print_table(["ID (* default)", "FAMILY", "DTYPE", "DEVICE", "SIZE", "STEPS", "VERSION", "DIGEST", "LORA RANK"],
                 rows)
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    """Cancel a queued or running rollout. A finished one is refused (exit 1) unless --release,
    which frees its stored result (DELETE releases a finished rollout; it then reads "expired")."""
    rollout = rollout_ref(args.id)
    with _client(args) as client:
        before = client.status(rollout)
        if before.status in TERMINAL and not args.release:
            print(f"sigmaflight cancel: rollout {before.id} already {before.status}: nothing to cancel "
                  "(--release frees a finished rollout's stored result)", file=sys.stderr)
            return 1
        after = client.cancel(rollout)
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

    ref = rollout_ref(args.ticket)
    with _client(args) as client:
        location, ticket = client.locate(ref)
        try:
            reader = client.flight(location).reader(ticket)
            meta = schema_metadata(reader.schema)
            rollout_id = (meta.get(KEY_ROLLOUT) or {}).get("id")
            if args.output is None:  # named after the rollout, in the current folder
                out = Path(f"{rollout_id}.arrow" if rollout_id and os.sep not in rollout_id else "trajectory.arrow")
                print(f"sigmaflight pull: no -o given; writing {out}", file=sys.stderr)
            else:
                out = Path(args.output)
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
            raise client.flight_error(ref, exc) from None
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
    done: set[int] = set()
    nbytes = 0
    with tqdm(total=len(steps), desc=desc, unit="step", file=sys.stderr, mininterval=0.2) as bar:
        # Created right before the try that aborts it: a Ctrl-C while the bar starts leaves no .partial.
        writer = TrajectoryFileWriter(out, reader.schema)  # writes <out>.partial, replacing an old one
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
    if path.suffix == ".json" and path.is_file():  # the ticket file `submit > FILE` wrote
        src = rollout_ref(src)
    elif path.is_file() or path.suffix in FILE_SUFFIXES or os.sep in src:
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
    try:
        from sigmaflight.plot import render_png
    except ModuleNotFoundError as exc:  # a client-only install: name the extra, no traceback
        if (exc.name or "").split(".")[0] != "matplotlib":
            raise
        raise UsageError("matplotlib is not installed; pip install 'sigmaflight[plot]'") from None
    from sigmaflight.report import build_report, read_arrow_file

    schema, batches = read_arrow_file(args.file)
    rep = build_report(args.file, schema, batches)
    w, h = render_png(args.file, rep, args.output, decode=args.decode, model_dir=args.model_dir)
    print(f"wrote {args.output}: {w}x{h} PNG", file=sys.stderr)
    return 0


# ---- parser ---------------------------------------------------------------------------------


def _add_parser(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """One subcommand's parser; like every sigmaflight parser, it takes no abbreviated flags."""
    return sub.add_parser(name, formatter_class=argparse.HelpFormatter, allow_abbrev=False, **kwargs)  # type: ignore[no-any-return]


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name` of `parser` (`parser` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


def add_client_commands(sub: Any) -> None:
    """Add submit, status, list, cancel, pull, inspect, plot and models to `sigmaflight`'s subparsers."""
    p = _add_parser(sub, "submit", help="Submit a rollout; print its ticket (JSON).",
                    description="Submit a rollout request built from --json FILE and/or flags (flags win) "
                    "and print the 202 ticket as JSON (-q: the rollout id alone).")
    _client_arguments(p)
    p.add_argument("--json", metavar="FILE", help="a RolloutRequest JSON file (the base the flags override)")
    for path, field in request_fields():  # one flag per wire field, derived from sigmaflight.wire.RolloutRequest
        _add_request_flag(p, path, field)
    p.add_argument("--idempotency-key", help="Idempotency-Key header")
    p.add_argument("--wait", action="store_true",
                   help="wait until the rollout has finished, print its final status and exit like `status --wait`")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits [default %(default)s]")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only the rollout id (e.g. `id=$(sigmaflight submit -q -p ...)`)")
    p.set_defaults(run=run_submit)

    p = _add_parser(sub, "status", help="Print a rollout's status (JSON).",
                    description="Print GET /v1/rollouts/ID as JSON; exit 1 if it failed, was cancelled or expired.")
    _client_arguments(p)
    p.add_argument("id", metavar="ID", help="rollout id, Flight ticket, or the ticket file `submit > FILE` wrote")
    p.add_argument("--wait", action="store_true", help="wait until the rollout has finished")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits [default %(default)s]")
    p.set_defaults(run=run_status)

    p = _add_parser(sub, "list", help="List rollouts, newest first (a table, or JSON).",
                    description="Print GET /v1/rollouts, newest first: a table on a terminal, JSON "
                    "({\"rollouts\": [...]}) when stdout is a pipe or a file, or as --json / --table say.")
    _client_arguments(p)
    _output_arguments(p)
    p.add_argument("--status", choices=STATES, help="only rollouts with this status")
    p.add_argument("--limit", type=int, default=100, help="at most this many [default %(default)s]")
    p.set_defaults(run=run_list)

    p = _add_parser(sub, "cancel", help="Cancel a queued or running rollout (--release: free a finished one).",
                    description="Cancel a queued or running rollout and print its status. A rollout that has "
                    "already finished is refused with exit 1, unless --release: then its stored result is "
                    "freed (its status becomes expired).")
    _client_arguments(p)
    p.add_argument("id", metavar="ID", help="rollout id, Flight ticket, or the ticket file `submit > FILE` wrote")
    p.add_argument("--release", action="store_true",
                   help="also release a finished rollout's result (trajectory and streams are deleted)")
    p.set_defaults(run=run_cancel)

    p = _add_parser(sub, "pull", help="Pull a trajectory over Flight into an .arrow file.",
                    description="Stream a rollout over Arrow Flight into an Arrow IPC file, with a progress "
                    "bar (steps, bytes) on stderr. Resumable by re-running: a complete, valid file for the "
                    "same rollout is kept; an interrupted pull's OUT.partial is replaced.")
    _client_arguments(p)
    p.add_argument("ticket", metavar="TICKET_OR_ID",
                   help="rollout id, Flight ticket, or the ticket file `sigmaflight submit > FILE` wrote")
    p.add_argument("-o", "--output", metavar="OUT.arrow",
                   help="file to write [default: ROLLOUT_ID.arrow in the current folder, named on stderr]")
    p.set_defaults(run=run_pull)

    p = _add_parser(sub, "inspect", help="Show a trajectory's schema, schedule, statistics and inconsistencies.",
                    description="Inspect an .arrow file or a ticket / rollout id on --url: schema, the "
                    "sigmas/timesteps table by absolute index, per-step latent mean/std/min/max, log-prob "
                    "summaries per step, and flags (float32(t/1000) != sigma, sigma not decreasing, "
                    "terminal sigma != 0, steps not ascending, columns disagreeing with the metadata).")
    _client_arguments(p)
    p.add_argument("source", metavar="FILE_OR_TICKET",
                   help=".arrow file, rollout id, Flight ticket, or the ticket file (.json) `submit > FILE` wrote")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any flag")
    p.set_defaults(run=run_inspect)

    p = _add_parser(sub, "plot", help="Draw a trajectory as a PNG (matplotlib; the plot extra).",
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

    p = _add_parser(sub, "models", help="List the server's models (a table, or JSON).",
                    description="Print GET /v1/models: each model's id (* the default), family, dtype, device, "
                    "default size and steps, weights version and digest, LoRA adapter. A table on a terminal, "
                    "JSON ({\"models\": [...]}) when stdout is a pipe or a file, or as --json / --table say.")
    _client_arguments(p)
    _output_arguments(p)
    p.set_defaults(run=run_models)


def run(args: argparse.Namespace) -> int:
    """Run a client subcommand; API and data errors become one line on stderr and exit 1, bad
    usage exit 2, Ctrl-C exit 130 (an interrupted pull leaves no .partial file behind). A refused
    token (401) says how to give one: --token or SIGMAFLIGHT_TOKEN."""
    from sigmaflight.errors import ApiError, Unauthorized

    try:
        return int(args.run(args))
    except BrokenPipeError:  # stdout's reader went away: sigmaflight/cli.py ends quietly
        raise
    except Unauthorized as exc:
        how = ("the token given with --token or SIGMAFLIGHT_TOKEN was refused" if getattr(args, "token", None)
               else "the server wants a token: give it with --token or SIGMAFLIGHT_TOKEN")
        print(f"sigmaflight {args.command}: {exc} ({how})", file=sys.stderr)
        return 1
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
