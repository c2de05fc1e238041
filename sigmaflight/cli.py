"""`sigmaflight` command line: the client commands, and `serve`.

The client commands (submit, status, list, cancel, pull, inspect, plot, models;
sigmaflight/commands/) load no server code; `serve` imports control/serve.py only when it runs
(`sigmaflight serve --help` explains every flag). No parser takes abbreviations: `--step` is an
unknown flag, never `--steps`; an unknown flag prints the usage of the subcommand it was given to.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Sequence

EARLY_SIGHUPS: list[int] = []
"""SIGHUPs `sigmaflight serve` got before control/serve.py took over (it reads them once ready)."""
if sys.argv[1:2] == ["serve"] and hasattr(signal, "SIGHUP"):
    # Before the imports below (pydantic: a few hundred ms): a SIGHUP's default action ends the
    # process, and a closing terminal or an early `kill -HUP` must not end a server that is starting.
    signal.signal(signal.SIGHUP, lambda signum, frame: EARLY_SIGHUPS.append(signum))

from sigmaflight.commands import parser as commands  # noqa: E402

SERVE_HELP = "Start the REST and Flight servers (see `sigmaflight serve --help`)."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sigmaflight",
        description="Rollout service for diffusion RL: REST control plane + Arrow Flight data plane.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sub.add_parser("serve", help=SERVE_HELP, add_help=False)  # its flags live in control/serve.py
    commands.add_client_commands(sub)
    return parser


def missing_for(extra: str) -> list[str]:
    """The distributions that `sigmaflight[extra]` lists and this environment lacks, read from the
    installed package's own metadata (pyproject.toml's extras); [] when it is not installed."""
    from importlib import metadata

    try:
        requires = metadata.requires("sigmaflight") or []
    except metadata.PackageNotFoundError:
        return []
    missing: list[str] = []
    for req in requires:
        spec, _, marker = req.partition(";")
        if not re.search(rf"extra\s*==\s*[\"']{re.escape(extra)}[\"']", marker):
            continue
        name = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        nested = re.search(r"\[([^\]]+)\]", spec)
        if name is None:
            continue
        if name.group(1) == "sigmaflight" and nested:  # sigmaflight[replay] inside the server extra
            missing += [m for e in nested.group(1).split(",") for m in missing_for(e.strip())]
            continue
        try:
            metadata.version(name.group(1))
        except metadata.PackageNotFoundError:
            missing.append(name.group(1))
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    """`sigmaflight ...`; when stdout's reader goes away (`sigmaflight list | head`) it ends
    quietly with 141, the status of a program that SIGPIPE ended, as `cat` in a pipe does."""
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit finds somewhere to write
        os.close(devnull)
        return 141
    return rc


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        missing = missing_for("server")
        if missing:  # a client-only install: say so before anything loads
            print(f"sigmaflight serve: the server extra is not installed (missing: {', '.join(sorted(missing))}); "
                  "pip install 'sigmaflight[server]'", file=sys.stderr)
            return 2
        from sigmaflight.control.serve import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's own parser: its usage, not the top level's
        subcommand = commands.subparser(parser, args.command)
        subcommand.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "run"):
        return commands.run(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
