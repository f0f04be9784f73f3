"""The supervisor of one worker process: run it, restart it when it dies (train/launch/procs.py: `supervise`).

    python -m train.launch.supervise --max-restarts 3 --name "worker 1" -- python -m train.diloco.worker ...

Plain python (no torch, no listener). The simulators and the SSH launcher's remote side start every worker under
it; `stop` signals its process group, which holds the worker too. It exits as its worker last did.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from train.launch.procs import supervise

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="python -m train.launch.supervise", description=__doc__.split("\n")[0])
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (default: %(default)s)")
    ap.add_argument("--name", default="worker", help="what the log lines call the process")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        ap.error("the command to run goes after --")
    rc = supervise(cmd, a.max_restarts, a.name)
    if rc < 0:  # die the way the worker died, so that our parent sees the same
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL / SIGSTOP: always the default action
        os.kill(os.getpid(), -rc)
        return 128 - rc
    return rc


if __name__ == "__main__":
    from train.core.errors import setup_logging
    setup_logging("supervise")
    sys.exit(main())
