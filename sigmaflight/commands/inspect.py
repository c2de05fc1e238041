"""`sigmaflight inspect` and `plot`: a trajectory's report (sigmaflight/report.py) as text,
JSON or a PNG; `inspect` reads a file or pulls a rollout from --url, `plot` reads a file."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from sigmaflight.commands.common import (
    UsageError,
    add_client_arguments,
    add_parser,
    connect,
    is_file,
    print_json,
    rollout_ref,
)

FILE_SUFFIXES = frozenset({".arrow", ".arrows", ".ipc", ".feather"})
"""An argument with one of these suffixes is a file, never looked up on the server."""


def _load(args: argparse.Namespace) -> tuple[str, Any, list[Any], list[int | None] | None]:
    """(label, schema, batches, the batches' checksums as written) of a file, or of a ticket /
    rollout id on --url (pulled: the server checked its copy, so no checksums)."""
    from pyarrow import flight

    from sigmaflight.errors import NotFound
    from sigmaflight.report import read_arrow_file, written_checksums

    src = args.source
    path = Path(src)
    if path.suffix == ".json" and is_file(src):  # the ticket file `submit > FILE` wrote
        src = rollout_ref(src)
    elif is_file(src) or path.suffix in FILE_SUFFIXES or os.sep in src:
        schema, batches = read_arrow_file(src)  # a missing path: "no such file", not a server lookup
        return src, schema, batches, written_checksums(src)
    with connect(args) as client:
        try:
            location, ticket = client.stream_ticket(src, "trajectory")  # any of the rollout's tickets
            try:
                table = client.flight(location).reader(ticket).read_all()
            except flight.FlightError as exc:
                raise client.flight_error(src, exc) from None
        except NotFound:
            raise NotFound(404, "not_found", f"{src}: no such file, and {args.url} knows no rollout or ticket "
                           "by that name") from None
    return f"{location} {ticket}", table.schema, table.to_batches(), None


def run_inspect(args: argparse.Namespace) -> int:
    from sigmaflight.report import build_report, render_text

    label, schema, batches, checksums = _load(args)
    rep = build_report(label, schema, batches, checksums=checksums)
    if args.json:
        print_json(rep.to_json())
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


def add_inspect(sub: Any) -> None:
    p = add_parser(sub, "inspect", help="Show a trajectory's schema, schedule, statistics and inconsistencies.",
                   description="Inspect an .arrow file or a ticket / rollout id on --url: schema, the "
                   "sigmas/timesteps table by absolute index, per-step latent mean/std/min/max, log-prob "
                   "summaries per step, and flags (float32(t/1000) != sigma, sigma not decreasing, "
                   "terminal sigma != 0, steps not ascending, columns disagreeing with the metadata).")
    add_client_arguments(p)
    p.add_argument("source", metavar="FILE_OR_TICKET",
                   help=".arrow file, rollout id, Flight ticket, or the ticket file (.json) `submit > FILE` wrote")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any flag")
    p.set_defaults(run=run_inspect)


def add_plot(sub: Any) -> None:
    p = add_parser(sub, "plot", help="Draw a trajectory as a PNG (matplotlib; the plot extra).",
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
