"""How long `sigmaflight --help` takes, against importing the client stack before parsing.

Each command runs in a fresh interpreter, interleaved, --repeats times; medians of wall time:
- floor:   `python -c pass` (the interpreter alone);
- help:    `sigmaflight --help` (the console script of this environment);
- stack:   importing the users' client, the data plane's torch client and the replay module (torch +
           diffusers), then printing help: what the CLI's lazy imports keep off `--help`.

    .venv/bin/python ops/bench_cli.py              # 7 runs each
    .venv/bin/python ops/bench_cli.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent

COMMANDS = {
    "floor": [sys.executable, "-c", "pass"],
    "help": [str(BIN / "sigmaflight"), "--help"],
    "stack": [sys.executable, "-c", "import sigmaflight.client, sigmaflight.dataplane.client, "
              "sigmaflight.pipeline.replay\nfrom sigmaflight.cli import build_parser\nbuild_parser().format_help()"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:6} median {med[name]:.3f} s  (min {min(ts):.3f}, max {max(ts):.3f}, {len(ts)} runs)")
    print(f"ratio help / stack = {med['help'] / med['stack']:.3f}x   help - floor = {med['help'] - med['floor']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
