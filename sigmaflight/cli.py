"""`sigmaflight` command line: the client commands, and `serve`.

The client commands (submit, status, pull, inspect, plot; sigmaflight/commands.py) load no
server code; `serve` imports control/serve.py only when it runs (`sigmaflight serve --help`
explains every flag).
"""

from __future__ import annotations

import argparse
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from sigmaflight.control.serve import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    if hasattr(args, "run"):
        return commands.run(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
