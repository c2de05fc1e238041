"""`sigmaflight pull`: a rollout's Flight stream into an .arrow file, with a progress bar.

The file is written through `OUT.partial` and renamed when complete; pulling again keeps a
complete, valid file of the same rollout and replaces an interrupted pull's `.partial`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from sigmaflight.commands.common import UsageError, add_client_arguments, add_parser, connect, rollout_ref


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
    if args.output is not None:
        check_output(args.output)
    with connect(args) as client:
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


def check_output(text: str) -> Path:
    """-o as a file to write, else UsageError before anything is pulled: a directory (never
    "incomplete or corrupt"), or a folder that does not exist (a typo makes no directories)."""
    out = Path(text)
    if not text:
        raise UsageError("-o '': give the file to write, e.g. -o out.arrow")
    if out.is_dir():
        raise UsageError(f"-o {text}: is a directory; give the file to write (e.g. -o {out / 'out.arrow'})")
    folder = out.parent
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise UsageError(f"-o {text}: the folder {folder} {what}; create it first (pull makes no directories)")
    return out


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


def add_pull(sub: Any) -> None:
    p = add_parser(sub, "pull", help="Pull a trajectory over Flight into an .arrow file.",
                   description="Stream a rollout over Arrow Flight into an Arrow IPC file, with a progress "
                   "bar (steps, bytes) on stderr. Resumable by re-running: a complete, valid file for the "
                   "same rollout is kept; an interrupted pull's OUT.partial is replaced.")
    add_client_arguments(p)
    p.add_argument("ticket", metavar="TICKET_OR_ID",
                   help="rollout id, Flight ticket, or the ticket file `sigmaflight submit > FILE` wrote")
    p.add_argument("-o", "--output", metavar="OUT.arrow",
                   help="file to write, in a folder that exists [default: ROLLOUT_ID.arrow in the current folder, "
                   "named on stderr]")
    p.set_defaults(run=run_pull)
