"""Helpers for tests that run the real scripts as subprocesses."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO, TEST_THREADS

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


def ctrl_c_default() -> None:
    """A Popen `preexec_fn`: SIGINT back to its default in the child, so that a process a test stops with SIGINT
    (Ctrl-C) takes it even when the suite runs in the background (`pytest &`: a non-interactive shell starts
    background jobs with SIGINT ignored, and a Python started so leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


def kill_sim_at_random_moments(cmd: list[str], paths, rounds: int, seed: int, tries: int, max_pause: float,
                               workers: int = 2) -> int:
    """Start `cmd` (a simulator) and SIGKILL it at a random moment of its run; up to `tries` times or until round
    `rounds` is committed. The moment is an event plus a fraction of the run's own pace, never a fixed time (a fast
    run would finish before it): a random round k to be committed (not the last), then a random pause of up to
    max_pause and up to the last round's measured length. Waits until the killed runs' workers are gone; returns
    the number of kills."""
    import random

    rng = random.Random(seed)
    kills = 0
    for _ in range(tries):
        start = paths.latest_committed() or 0
        if start >= rounds - 1:
            break
        k = rng.randint(start + 1, max(start + 1, rounds - 2))
        sim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
        seen: dict[int, float] = {}  # commit -> when it was first seen
        try:
            def reached() -> bool:
                seen.setdefault(paths.latest_committed() or 0, time.monotonic())
                return max(seen) >= k
            wait_until(reached, 240, f"round {k} committed", sim)
            times = sorted(seen.items())
            round_s = times[-1][1] - times[-2][1] if len(times) > 1 else max_pause
            time.sleep(rng.uniform(0.0, min(max_pause, round_s)))
        except AssertionError:
            pass
        if sim.poll() is None:
            sim.send_signal(signal.SIGKILL)
            kills += 1
        sim.wait(30)
        if paths.latest_committed() == rounds:
            break
    wait_until_workers_gone(paths, workers)
    return kills


def wait_until_workers_gone(paths, workers: int, timeout: float = 60.0) -> None:
    """The workers die with the simulator, a moment after it (their supervisor is told by the kernel): a rerun
    before that would find their locks held."""
    import fcntl

    def free(w):
        f = paths.worker_dir(w) / "lock"
        if not f.exists():
            return True
        with open(f, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(fh, fcntl.LOCK_UN)
            return True
    wait_until(lambda: all(free(w) for w in range(workers)), timeout, "the killed run's workers exit")


def progress_of(paths, w: int) -> dict:
    """Worker w's progress.json, {} while it is not there or half-written."""
    from train.core.store import read_json
    try:
        return read_json(paths.progress(w))
    except (OSError, ValueError):
        return {}



@contextlib.contextmanager
def held(*pids: int):
    """SIGSTOP the processes `pids` for the block (those that would otherwise race ahead of the event a test waits
    for), SIGCONT them when it ends, also when it raises. A held process keeps its pid: the run sees it alive."""
    stopped = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def coordinator_pid(paths) -> int:
    """The pid in the run's coordinator lease (the coordinator process itself, under the simulator's supervisor)."""
    from train.core.coordinator_lease import coordinator_lease_path
    from train.core.store import read_json
    return int(read_json(coordinator_lease_path(paths.root))["pid"])


def in_round_with_state(paths, w: int, r: int) -> bool:
    """Worker w is working on round r or later (its lease; not done or gone) and its state.json records round r - 1
    done, so a kill now resumes ("resumed worker state"). With overlap a worker trains round r while its snapshot of
    r - 1 is still written in the background: a kill before state.json exists restarts it from nothing (a loaded CI
    box did exactly that)."""
    from train.core.store import read_json
    try:
        p = read_json(paths.progress(w))
        done = read_json(paths.worker_state(w))["round_done"] if paths.worker_state(w).is_file() else -1
    except (OSError, ValueError, KeyError):
        return False
    return p.get("round", -1) >= r and p.get("status") not in ("done", "exited", "left") and done >= r - 1


def kill_and_await_restart(paths, w: int, kill, sim: subprocess.Popen, timeout: float = 120):
    """kill() (it SIGKILLs worker w, or its supervisor) while the coordinator is held (SIGSTOP), and hold it until
    the restarted worker w is up again (its log's start line, written after it loaded its state); returns what kill()
    returned. Without the hold, the surviving workers can finish the run before the restart is up (the coordinator
    rightly goes on without a dead worker): the restart is the event, not the survivors' speed."""
    log = paths.worker_log(w)
    started = "training windows of"  # the worker's start line, after restore_state (train/diloco/worker.py)
    before = log.read_text().count(started) if log.is_file() else 0
    with held(coordinator_pid(paths)):
        victim = kill()
        wait_until(lambda: log.read_text().count(started) > before, timeout,
                   f"worker {w} restarted and resumed", sim)
    return victim
