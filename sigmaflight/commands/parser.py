"""The client subcommands in one parser, and how their errors become exit statuses."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sigmaflight.commands.common import UsageError
from sigmaflight.commands.inspect import add_inspect, add_plot
from sigmaflight.commands.pull import add_pull
from sigmaflight.commands.rollouts import add_cancel, add_list, add_models, add_status
from sigmaflight.commands.submit import add_submit

ADDERS = (add_submit, add_status, add_list, add_cancel, add_pull, add_inspect, add_plot, add_models)
"""Each subcommand's parser, in the order `sigmaflight --help` lists them."""


def add_client_commands(sub: Any) -> None:
    """Add submit, status, list, cancel, pull, inspect, plot and models to `sigmaflight`'s subparsers."""
    for add in ADDERS:
        add(sub)


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name` of `parser` (`parser` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]  # type: ignore[no-any-return]
    return parser


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
