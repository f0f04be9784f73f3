"""The supervisor of one process: run it, restart it when it dies (train/launch/procs.py: `supervise`).

    python -m train.launch.supervise --max-restarts 3 --name "worker 1" -- python -m train.diloco.worker ...

Plain python (no torch, no listener). The simulators and the SSH launcher's remote side start every worker and the
coordinator under it; `stop` signals its process group, which holds its child too. It exits with a status that says
how its child last ended — the child's own status, or 128 + N when a signal N killed it — never by a signal of its
own, so that a supervisor that was killed (a signal) is told apart from a child that died after its restarts (a
status). Stopped by SIGTERM / SIGINT / SIGHUP, it passes SIGTERM on and, if its child dies of it, dies of it too.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from train.core.errors import EXIT_USER_ERROR
    from train.launch.procs import exit_status, supervise

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="python -m train.launch.supervise", description=__doc__.split("\n")[0])
    ap.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (default: %(default)s)")
    ap.add_argument("--name", default="worker", help="what the log lines call the process")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        ap.error("the command to run goes after --")
    rc, stopped_by = supervise(cmd, a.max_restarts, a.name)
    if stopped_by is not None and rc not in (0, EXIT_USER_ERROR):  # stopped on request; the child did not finish
        sig = stopped_by if stopped_by in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM  # (SIGHUP: a stop too)
        signal.signal(sig, signal.SIG_DFL)  # die of the stop signal: whoever started us sees it was asked for
        os.kill(os.getpid(), sig)
        time.sleep(5)
    return exit_status(rc)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "supervise")
