"""python -m train.status RUN_DIR [--watch [SECONDS]] [--json]: a run's status from its folder on BASE_DIR, from any
machine that mounts it (read-only). docs/status.md."""
from __future__ import annotations

import argparse
import json
import sys
import time

from train.core.errors import run_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.status", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="the run folder: BASE_DIR/<project_name>")
    ap.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="refresh in place every SECONDS (default 2) until Ctrl-C")
    ap.add_argument("--json", action="store_true", help="print the view as JSON (one object; with --watch, a line "
                                                        "per refresh)")
    a = ap.parse_args(argv)
    from train.status.view import Liveness, gather, render

    if a.watch is None:
        v = gather(a.run_dir)
        print(json.dumps(v, sort_keys=True) if a.json else render(v))
        return 0
    live = Liveness()
    try:
        while True:
            v = gather(a.run_dir, live=live)
            if a.json:
                print(json.dumps(v, sort_keys=True), flush=True)
            else:
                sys.stdout.write("\x1b[H\x1b[2J" + render(v) + "\n")  # home + clear: refresh in place
                sys.stdout.flush()
            time.sleep(max(0.2, a.watch))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    run_main(main, "status", cli=True)
