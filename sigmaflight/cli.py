"""`sigmaflight` command line: the client commands, and `serve`.

The client commands (submit, status, pull, inspect, plot; sigmaflight/commands.py) load no
server code; `serve` imports control/serve.py only when it runs (`sigmaflight serve --help`
explains every flag).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from sigmaflight import commands

SERVE_HELP = "Start the REST and Flight servers (see `sigmaflight serve --help`)."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sigmaflight",
        description="Rollout service for diffusion RL: REST control plane + Arrow Flight data plane.",
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        missing = missing_for("server")
        if missing:  # a client-only install: say so before anything loads
            print(f"sigmaflight serve: the server extra is not installed (missing: {', '.join(sorted(missing))}); "
                  "pip install 'sigmaflight[server]'", file=sys.stderr)
            return 2
        from sigmaflight.control.serve import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    if hasattr(args, "run"):
        return commands.run(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
