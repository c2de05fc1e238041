"""`sigmaflight status`, `list`, `cancel` and `models`: the server's REST answers, printed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sigmaflight.commands.common import (
    UsageError,
    add_client_arguments,
    add_output_arguments,
    add_parser,
    clip,
    connect,
    exit_status,
    int_in,
    print_json,
    print_table,
    rollout_ref,
    seconds,
    wants_table,
)
from sigmaflight.wire import STATES, TERMINAL

_ID_HELP = "rollout id, Flight ticket, or the ticket file `submit > FILE` wrote"

MAX_LIMIT = 1000
"""The most rollouts one page lists (`GET /v1/rollouts?limit=`, the server's bound)."""


def run_status(args: argparse.Namespace) -> int:
    rollout = rollout_ref(args.id)
    with connect(args) as client:
        st = client._status_by_id_or_ticket(rollout)  # a Flight ticket names its rollout, as pull takes it
        if args.wait:
            st = client.wait(st.id, timeout=args.timeout, raise_on_failure=False)
    print_json(st.model_dump(mode="json", by_alias=True))
    return exit_status(st.status)


def run_list(args: argparse.Namespace) -> int:
    from sigmaflight import rest  # here: `sigmaflight --help` loads no httpx

    if args.after is not None and not rest.is_rollout_id(args.after):
        raise UsageError(f"--after {rest.shown(args.after)}: not a rollout id; give the last ID of the page "
                         "before (its JSON's \"next\")")
    with connect(args) as client:
        page = client.rollout_page(status=args.status, limit=args.limit, after=args.after)
    if not wants_table(args):
        print_json(page.model_dump(mode="json", by_alias=True))
        return 0
    listed = page.rollouts
    rows = [[st.id, st.status, st.model, f"{st.progress.steps_done}/{st.progress.steps_total}", st.created_at,
             clip(f"{st.error.type}: {st.error.message}", 60) if st.error else ""] for st in listed]
    print_table(["ID", "STATUS", "MODEL", "STEPS", "CREATED", "ERROR"], rows)
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    """Cancel a queued or running rollout. A finished one is refused (exit 1) unless --release,
    which frees its stored result (DELETE releases a finished rollout; it then reads "expired")."""
    rollout = rollout_ref(args.id)
    with connect(args) as client:
        before = client._status_by_id_or_ticket(rollout)  # a Flight ticket names its rollout, as pull takes it
        if before.status in TERMINAL and not args.release:
            print(f"sigmaflight cancel: rollout {before.id} already {before.status}: nothing to cancel "
                  "(--release frees a finished rollout's stored result)", file=sys.stderr)
            return 1
        after = client.cancel(before.id)
    print_json(after.model_dump(mode="json", by_alias=True))
    if before.status in TERMINAL or after.status == "expired":  # --release, or it finished meanwhile
        print(f"sigmaflight cancel: rollout {after.id} had finished; released (its stored result is freed)",
              file=sys.stderr)
    return 0


def run_models(args: argparse.Namespace) -> int:
    with connect(args) as client:
        models = client.models()
    if not wants_table(args):
        print_json({"models": models})
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
    print_table(["ID (* default)", "FAMILY", "DTYPE", "DEVICE", "SIZE", "STEPS", "VERSION", "DIGEST", "LORA RANK"],
                rows)
    return 0


def add_status(sub: Any) -> None:
    p = add_parser(sub, "status", help="Print a rollout's status (JSON).",
                   description="Print GET /v1/rollouts/ID as JSON; exit 1 if it failed, was cancelled or expired.")
    add_client_arguments(p)
    p.add_argument("id", metavar="ID", help=_ID_HELP)
    p.add_argument("--wait", action="store_true", help="wait until the rollout has finished")
    p.add_argument("--timeout", type=seconds, default=600.0,
                   help="seconds --wait waits, >= 0 (inf: no limit) [default %(default)s]")
    p.set_defaults(run=run_status)


def add_list(sub: Any) -> None:
    p = add_parser(sub, "list", help="List rollouts, newest first (a table, or JSON).",
                   description="Print GET /v1/rollouts, newest first: a table on a terminal, JSON "
                   "({\"rollouts\": [...]}) when stdout is a pipe or a file, or as --json / --table say.")
    add_client_arguments(p)
    add_output_arguments(p)
    p.add_argument("--status", choices=[str(s) for s in STATES], help="only rollouts with this status")
    p.add_argument("--limit", type=int_in(1, MAX_LIMIT), default=100,
                   help=f"at most this many, 1..{MAX_LIMIT} [default %(default)s]")
    p.add_argument("--after", metavar="ID", help="the next page: the rollouts listed after this one (the last ID "
                   "of the page before)")
    p.set_defaults(run=run_list)


def add_cancel(sub: Any) -> None:
    p = add_parser(sub, "cancel", help="Cancel a queued or running rollout (--release: free a finished one).",
                   description="Cancel a queued or running rollout and print its status. A rollout that has "
                   "already finished is refused with exit 1, unless --release: then its stored result is "
                   "freed (a succeeded one becomes expired, a failed or cancelled one keeps its status).")
    add_client_arguments(p)
    p.add_argument("id", metavar="ID", help=_ID_HELP)
    p.add_argument("--release", action="store_true",
                   help="also release a finished rollout's result (trajectory and streams are deleted)")
    p.set_defaults(run=run_cancel)


def add_models(sub: Any) -> None:
    p = add_parser(sub, "models", help="List the server's models (a table, or JSON).",
                   description="Print GET /v1/models: each model's id (* the default), family, dtype, device, "
                   "default size and steps, weights version and digest, LoRA adapter. A table on a terminal, "
                   "JSON ({\"models\": [...]}) when stdout is a pipe or a file, or as --json / --table say.")
    add_client_arguments(p)
    add_output_arguments(p)
    p.set_defaults(run=run_models)
