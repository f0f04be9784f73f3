"""Helpers for tests that run the real scripts as subprocesses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, TEST_THREADS

# The programs that train (or start workers that do) and take `--threads N`: the simulators pass it on to their
# workers (without it they pick cores / workers, which differs between machines).
THREADED = {"diloco_sim.py", "edt_sim.py", "train.diloco.worker", "train.edt.worker", "diloco_opt_worker.py"}


def with_threads(argv: list[str]) -> list[str]:
    """argv (a script path or `-m module` first, then its arguments) plus `--threads EDT_TEST_THREADS` when the
    program is one of THREADED and argv does not set --threads itself: every worker a test starts trains with the
    session's thread count (see conftest.py)."""
    prog = argv[1] if argv[:1] == ["-m"] else Path(argv[0]).name
    if prog in THREADED and "--threads" not in argv:
        return [*argv, "--threads", str(TEST_THREADS)]
    return list(argv)


def script_cmd(script: str, *args: str) -> list[str]:
    """The command line that runs a repo script (or `-m`, module) with args, threads pinned (with_threads)."""
    argv = [script, *args] if script == "-m" else [str(REPO / script), *args]
    return [sys.executable, *with_threads(argv)]


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(script_cmd(script, *args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def start_script(script_or_module: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "ab")
    return subprocess.Popen([sys.executable, *with_threads(script_or_module)], stdout=f, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)


def wait_until(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited (rc {proc.returncode}) before: {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process groups (start_script starts each in its own session) of those still running."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
