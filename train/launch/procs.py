"""Local worker processes for the simulators, and the supervisor that restarts a dead worker (here and on every
host of the SSH launcher): start, watch, restart, stop (no orphans).

Each worker is a real OS process (`python -m <module> --config ... --worker i`) in its own session / process group,
with stdout and stderr appended to logs/worker-XXX.log in the run folder: the same program the SSH launcher starts
on a cluster. With `nproc` > 1 a worker is a torchrun group instead (`python -m torch.distributed.run --standalone
--nproc_per_node N -m <module> ...`; see train/core/dist.py), still one process group. `stop()` signals each whole
process group (SIGTERM, then SIGKILL after a grace period).

Restarts (like torchrun's --max-restarts): with max_restarts > 0 the process group's leader is a supervisor,
`python -m train.launch.supervise --max-restarts N --name "worker 3" -- <worker argv>` (plain python: no torch, no
listener), which runs the worker as its child in the same process group and starts it again with the same command
when it dies (a signal, or an exit status other than 0 and 2) after 1 s, 2 s, 4 s, ... (at most 30 s), logging
`worker 1 exited with signal 9; restart 1/3 in 1.0 s`. Exit 0 (the run is complete, or the worker left on SIGTERM)
and exit 2 (a user error: it would fail the same way again) are final. When the restarts are used up the supervisor
exits as its worker did, so the caller sees the worker's own death. SIGTERM to the supervisor (or its group) stops
it: no more restarts, the worker is told to leave. The simulators and train/launch/remote.py both start workers
this way: one implementation.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from train.core.config import REPO_ROOT
from train.core.heartbeat import parent_died
from train.core.errors import EXIT_USER_ERROR, WorkerDied  # noqa: F401  (raised here)

log = logging.getLogger("supervise")

BACKOFF_S, BACKOFF_CAP_S = 1.0, 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a death by these was asked for: never restarted


def describe_exit(rc: int) -> str:
    """`exited with signal 9` / `exited with status 1` for a Popen return code."""
    return f"exited with signal {-rc}" if rc < 0 else f"exited with status {rc}"


class Restarts:
    """The restart policy of one supervised process: which exits are restarted, and after how long."""

    def __init__(self, max_restarts: int, base: float = BACKOFF_S, cap: float = BACKOFF_CAP_S):
        self.max, self.base, self.cap, self.used = max_restarts, base, cap, 0

    @staticmethod
    def final(rc: int) -> bool:
        """Exit 0 (done, or left), exit 2 (a user error) and a death by SIGTERM / SIGINT are not restarted."""
        return rc in (0, EXIT_USER_ERROR) or (rc < 0 and -rc in STOP_SIGNALS)

    def next_delay(self, rc: int) -> float | None:
        """Seconds to wait before restarting after exit `rc`, counting the restart; None: do not restart."""
        if self.final(rc) or self.used >= self.max:
            return None
        delay = min(self.cap, self.base * 2 ** self.used)
        self.used += 1
        return delay

    def line(self, name: str, rc: int, delay: float) -> str:
        return f"{name} {describe_exit(rc)}; restart {self.used}/{self.max} in {delay:.1f} s"


def supervised_argv(python: str, argv: list[str], max_restarts: int, name: str) -> list[str]:
    """`argv` under the supervisor (restarted up to max_restarts times); `argv` itself when max_restarts is 0."""
    if max_restarts <= 0:
        return list(argv)
    return [python, "-m", "train.launch.supervise", "--max-restarts", str(max_restarts), "--name", name, "--",
            *argv]


def supervise(argv: list[str], max_restarts: int, name: str = "worker") -> int:
    """Run `argv` as a child in our process group and restart it by the policy of `Restarts`; returns when it
    exits for good or a stop signal (SIGTERM, SIGINT, SIGHUP) arrives (passed on to the child as SIGTERM, which
    makes a worker leave). The caller exits with the returned code (a negative one: die by that signal)."""
    policy = Restarts(max_restarts)
    stop = threading.Event()
    child: list[subprocess.Popen] = []
    ppid = os.getppid()

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGTERM and parent_died(ppid):
            raise SystemExit(143)  # the simulator died: so do we, at once; the worker gets its own death signal
        stop.set()
        if child and child[0].poll() is None:
            try:
                child[0].send_signal(signal.SIGTERM)  # it may have it already (a signal to the whole group)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    while True:
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        except OSError as e:
            log.error("%s: cannot run %r: %s", name, argv[0], e)
            return 127
        child[:] = [p]
        rc = p.wait()
        if stop.is_set():
            return rc
        delay = policy.next_delay(rc)
        if delay is None:
            if not policy.final(rc):
                log.error("%s %s; no restarts left (%d used)", name, describe_exit(rc), policy.used)
            return rc
        log.warning("%s", policy.line(name, rc, delay))
        if stop.wait(delay):
            return rc


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the simulator dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the worker's own lock still prevents a second copy


def worker_argv(python: str, module: str, nproc: int = 1) -> list[str]:
    """The command prefix that starts one worker: `python -m module`, or a standalone torchrun group of `nproc`
    processes on this host (its own rendezvous on a free local port, so several groups share a host)."""
    if nproc <= 1:
        return [python, "-m", module]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", module]


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in lines[-n:])


class LocalWorkers:
    """The simulators' workers: each one process group (its supervisor when max_restarts > 0, see above)."""

    def __init__(self, module: str, config_path: str, overrides: list[str], num: int, log_paths: list[Path],
                 threads: int = 0, extra_args: list[str] | None = None, nproc: int = 1, max_restarts: int = 0):
        self.module, self.config_path, self.overrides = module, config_path, overrides
        self.num, self.log_paths, self.threads, self.nproc = num, log_paths, threads, nproc
        self.extra_args = extra_args or []
        self.max_restarts = max_restarts
        self.procs: list[subprocess.Popen] = []

    def command(self, i: int) -> list[str]:
        cmd = [*worker_argv(sys.executable, self.module, self.nproc), "--config", self.config_path,
               "--worker", str(i), *[a for ov in self.overrides for a in ("--set", ov)], *self.extra_args]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        return supervised_argv(sys.executable, cmd, self.max_restarts, f"worker {i}")

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        if self.threads:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        for i in range(self.num):
            self.log_paths[i].parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_paths[i], "ab") as logf:
                self.procs.append(subprocess.Popen(self.command(i), stdout=logf, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                                   start_new_session=True, env=env,
                                                   preexec_fn=die_with_parent))

    def check(self) -> None:
        """Raise WorkerDied (with the log's tail) if a worker exited with an error (after its restarts)."""
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc not in (None, 0):
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
                tries = f" after {self.max_restarts} restarts" if self.max_restarts and not Restarts.final(rc) \
                    else ""
                raise WorkerDied(f"worker {i} (pid {p.pid}) {how}{tries}; last lines of {self.log_paths[i]}:\n"
                                 f"{tail(self.log_paths[i])}\nFix the cause and run the same command again: the run "
                                 f"resumes from its last committed state.")

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            left = max(0.0, deadline - time.monotonic())
            try:
                p.wait(left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, grace: float = 5.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                return
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in alive):
                time.sleep(0.05)
