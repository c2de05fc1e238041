"""Run one page's code blocks in order, as a reader would: `python run_page.py BLOCKS.json`.

Python blocks run in this process, in one namespace shared by the page's blocks (a later block
may use what an earlier one made); bash blocks run with `bash -euo pipefail` in the same folder.
Code is compiled with the page's name and its own line numbers, so a traceback points into the
Markdown. Prints `ran PAGE:LINE` per block; exits 1 at the first failing block.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback


def main(path: str) -> int:
    namespace: dict[str, object] = {"__name__": "__main__"}
    for b in json.loads(open(path).read()):
        t0 = time.perf_counter()
        try:
            if b["lang"] == "python":
                code = "\n" * b["line"] + b["code"]  # the block's first line keeps its line number
                exec(compile(code, b["page"], "exec"), namespace)
            else:
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]], capture_output=True, text=True,
                                      timeout=120)
                if proc.returncode:
                    print(f"FAILED {b['page']}:{b['line']} (bash exit {proc.returncode})\n--- stdout\n{proc.stdout}"
                          f"\n--- stderr\n{proc.stderr}", flush=True)
                    return 1
        except Exception:
            print(f"FAILED {b['page']}:{b['line']}", flush=True)
            traceback.print_exc(file=sys.stdout)
            return 1
        print(f"ran {b['page']}:{b['line']} ({b['lang']}, {time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
