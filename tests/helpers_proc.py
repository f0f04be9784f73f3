"""Helpers for tests that run the real scripts as subprocesses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def start_script(script_or_module: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "ab")
    return subprocess.Popen([sys.executable, *script_or_module], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


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
