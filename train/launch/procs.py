"""Local processes for the simulators, and the supervisor that restarts a dead process (here and on every host of
the SSH launcher): start, watch, restart, stop (no orphans).

Each worker is a real OS process (`python -m <module> --config ... --worker i`) in its own session / process group,
with stdout and stderr appended to logs/worker-XXX.log in the run folder: the same program the SSH launcher starts
on a cluster. With `nproc` > 1 a worker is a torchrun group instead (`python -m torch.distributed.run --standalone
--nproc_per_node N -m <module> ...`; see train/core/dist.py), still one process group. The simulators run the
coordinator the same way (`python -m diloco` / `python -m edt`, its output on the simulator's terminal). `stop()`
signals each whole process group (SIGTERM, then SIGKILL after a grace period).

Restarts (like torchrun's --max-restarts): with max_restarts > 0 the process group's leader is a supervisor,
`python -m train.launch.supervise --max-restarts N --name "worker 3" -- <argv>` (plain python: no torch, no
listener), which runs the process as its child in the same process group and starts it again with the same command
when it dies (a signal, or an exit status other than 0 and 2) after 1 s, 2 s, 4 s, ... (at most 30 s), logging
`worker 1 exited with signal 9; restart 1/3 in 1.0 s`. Exit 0 (the run is complete, or the worker left on SIGTERM)
and exit 2 (a user error: it would fail the same way again) are final. When the restarts are used up the supervisor
exits with an exit STATUS that says how its child last ended (its status, or 128 + N for a death by signal N), never
by a signal: so whoever started it can tell its child's death (a status) from the supervisor's own (a signal: it was
killed). SIGTERM to the supervisor (or its group) stops it: no more restarts, the child is told to leave (and a
supervisor whose child died of that signal dies of it too). The simulators and train/launch/remote.py both start
processes this way: one implementation.

A supervisor may die too (SIGKILL, the OOM killer). Its child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and
exits at once; the simulator (`LocalProcess`) notices, waits for the group to empty (SIGKILL after 10 s), says what
happened — `the supervisor of worker 1 (pid 4242) was killed by signal 9; its worker stopped with it; restarting
both, 1/3` — and starts both again under the same Restarts policy; the worker resumes from its own state, the
coordinator from its last commit. On a cluster `launch_to_machines.py status` shows a dead supervisor and `launch`
(idempotent) restarts it.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from train.config import REPO_ROOT
from train.core.heartbeat import parent_died
from train.core.errors import (EXIT_NOTE_ENV, EXIT_USER_ERROR, EnvironmentProblem,  # noqa: F401  (raised here)
                               WorkerDied)

log = logging.getLogger("supervise")
sim_log = logging.getLogger("simulator")  # the simulators' own lines about their children

BACKOFF_S, BACKOFF_CAP_S = 1.0, 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a death by these was asked for: never restarted


def describe_exit(rc: int) -> str:
    """`exited with signal 9` / `exited with status 1` for a Popen return code."""
    return f"exited with signal {-rc}" if rc < 0 else f"exited with status {rc}"


def how_ended(rc: int) -> str:
    """`was killed by signal 9` / `exited with status 1` for a Popen return code."""
    return f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"


def exit_status(rc: int) -> int:
    """A supervisor's exit status for its child's Popen return code: the child's status, or 128 + N for a death by
    signal N (the shell's convention): a status, never a signal (`child_rc` reads it back)."""
    return 128 - rc if rc < 0 else rc


def child_rc(status: int) -> int:
    """The child's Popen return code from a supervisor's exit status (`exit_status`): -N for 128 + N."""
    return -(status - 128) if 128 < status < 128 + 65 else status


class Restarts:
    """The restart policy of one supervised process: which exits are restarted, and after how long."""

    def __init__(self, max_restarts: int, base: float = BACKOFF_S, cap: float = BACKOFF_CAP_S):
        self.max, self.base, self.cap, self.used = max_restarts, base, cap, 0

    @staticmethod
    def final(rc: int, retryable: bool = False) -> bool:
        """Exit 0 (done, or left), exit 2 (a user error) and a death by SIGTERM / SIGINT are not restarted; an exit 2
        the process marked `retryable` (the shared disk kept failing: train/core/errors.py) is, like a crash."""
        return rc == 0 or (rc == EXIT_USER_ERROR and not retryable) or (rc < 0 and -rc in STOP_SIGNALS)

    def next_delay(self, rc: int, retryable: bool = False) -> float | None:
        """Seconds to wait before restarting after exit `rc`, counting the restart; None: do not restart."""
        if self.final(rc, retryable) or self.used >= self.max:
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


def supervise(argv: list[str], max_restarts: int, name: str = "worker") -> tuple[int, int | None]:
    """Run `argv` as a child in our process group and restart it by the policy of `Restarts`; returns (its last
    return code, the stop signal that ended the supervision or None) when it exits for good or a stop signal
    (SIGTERM, SIGINT, SIGHUP) arrives (passed on to the child as SIGTERM, which makes a worker leave).
    train/launch/supervise.py turns this into its exit: `exit_status(rc)`, or death by the stop signal. A command
    that cannot be started at all is an EnvironmentProblem (one line, exit 2: final, like the child's own user
    error)."""
    policy = Restarts(max_restarts)
    stop = threading.Event()
    stopped_by: list[int] = []
    child: list[subprocess.Popen] = []
    ppid = os.getppid()

    def wake_child() -> None:
        """SIGCONT: a child held stopped (diloco_sim.py --slow, train/launch/throttle.py) would keep a SIGTERM
        pending, and live on stopped, past everyone who could continue it."""
        if child and child[0].poll() is None:
            try:
                child[0].send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGTERM and parent_died(ppid):
            wake_child()
            os._exit(143)  # the simulator died: so do we, at once (no unwinding that could hang: heartbeat.py's
            # install_leave_handler says why); the child gets its own death signal
        stopped_by.append(signum)
        stop.set()
        wake_child()
        if child and child[0].poll() is None:
            try:
                child[0].send_signal(signal.SIGTERM)  # it may have it already (a signal to the whole group)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # the child writes "retryable" here when its exit 2 is not the user's to fix (the shared disk kept failing)
    fd, note = tempfile.mkstemp(prefix="edt-exit-note-")
    os.close(fd)
    env = {**os.environ, EXIT_NOTE_ENV: note}
    try:
        while True:
            Path(note).write_text("")
            try:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(), env=env)
            except OSError as e:  # a wrong interpreter or command: the user's to fix, not a crash to retry
                raise EnvironmentProblem(f"{name}: cannot run {argv[0]!r} ({e.strerror or e}): check the command "
                                         f"(the `python` of machines.json, the simulator's interpreter)") from None
            child[:] = [p]
            rc = p.wait()
            if stop.is_set():
                return rc, stopped_by[0]
            retryable = rc == EXIT_USER_ERROR and Path(note).read_text().strip() == "retryable"
            delay = policy.next_delay(rc, retryable)
            if delay is None:
                if not policy.final(rc, retryable):
                    log.error("%s %s; no restarts left (%d used)", name, describe_exit(rc), policy.used)
                return rc, None
            why = " (the shared disk kept failing)" if retryable else ""
            log.warning("%s%s (it was pid %d)", policy.line(name, rc, delay), why, p.pid)
            if stop.wait(delay):
                return rc, stopped_by[0]
    finally:
        Path(note).unlink(missing_ok=True)


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for Popen (call it in the parent: it notes the parent's pid): in the child before exec, get
    SIGTERM when the parent dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG). A parent that dies between the
    fork and the prctl sends no signal: the child would run on as an orphan (a coordinator holding the run's lock
    after its simulator was killed at start-up), so a child that finds its parent gone after the prctl exits at
    once instead of starting."""
    parent = os.getpid()
    try:  # loaded here, not in the child: a dlopen after a fork of a threaded process may deadlock
        import ctypes
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None  # not Linux: the worker's own lock still prevents a second copy

    def in_child() -> None:
        if prctl is None:
            return
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)  # as if the signal had come

    return in_child


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


def group_alive(pgid: int) -> bool:
    """Does process group `pgid` still have a live (not zombie) process? (/proc on Linux; else os.killpg(pgid, 0))."""
    try:
        names = os.listdir("/proc")
    except OSError:
        names = None
    if names is None:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def child_env(threads: int = 0) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


class LocalProcess:
    """One process group of a simulator — a worker, or the coordinator — led by its supervisor when max_restarts > 0.

    `poll()` says how it ended for good: the child's own return code (a supervisor's exit status decoded: negative =
    killed by that signal), None while it runs. A supervisor that was itself killed (by a signal other than SIGTERM
    / SIGINT: nobody asked it to stop) is restarted with the same Restarts policy, once its process group is empty
    (its child gets SIGTERM from the kernel and exits at once; SIGKILL after `grace`), with one line in the
    simulator's log and in the process's own log that says what happened."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, env: dict, max_restarts: int,
                 grace: float = 10.0):
        self.name, self.argv, self.log_path, self.env, self.grace = name, argv, log_path, env, grace
        self.supervised = max_restarts > 0
        self.cmd = supervised_argv(sys.executable, argv, max_restarts, name)
        self.policy = Restarts(max_restarts)  # for the supervisor itself (it keeps its own for its child)
        self.proc: subprocess.Popen | None = None
        self.rc: int | None = None            # how it ended for good (the child's return code)
        self.supervisor_died: int | None = None  # the signal that killed the last supervisor, when that is the end
        self._dead: tuple | None = None       # a killed supervisor: (rc, pid, since, delay), its group draining
        self._how = ""                         # what became of its child

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         stdin=subprocess.DEVNULL, cwd=REPO_ROOT, start_new_session=True, env=self.env,
                                         preexec_fn=die_with_parent())
        finally:
            if out is not None:
                out.close()

    def say(self, text: str) -> None:
        """A line in the simulator's log and in the process's own log (what happened to it, in its story)."""
        sim_log.warning("%s", text)
        if self.log_path is not None:
            try:
                with open(self.log_path, "a") as f:
                    f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} simulator WARNING {text}\n")
            except OSError:
                pass

    def poll(self) -> int | None:
        if self.rc is not None:
            return self.rc
        if self.proc is None:
            return None
        if self._dead is None:
            rc = self.proc.poll()
            if rc is None:
                return None
            if not self.supervised:
                self.rc = rc
                return rc
            if rc >= 0:  # the supervisor ended by itself: its status says how its child last ended
                self.rc = child_rc(rc)
                return self.rc
            delay = self.policy.next_delay(rc)
            if delay is None:  # asked to stop (SIGTERM / SIGINT), or no restarts left
                if not Restarts.final(rc):
                    self.say(f"the supervisor of {self.name} (pid {self.proc.pid}) {how_ended(rc)}; no restarts left "
                             f"({self.policy.used} used)")
                self.rc, self.supervisor_died = rc, -rc
                return rc
            self._dead = (rc, self.proc.pid, time.monotonic(), delay)
            child = "its worker" if self.name.startswith("worker") else self.name
            self._how = f"{child} stopped with it"
        rc, pid, since, delay = self._dead
        waited = time.monotonic() - since
        alive = group_alive(pid)
        if alive and waited < self.grace:
            return None  # its child is on its way out (the parent-death signal)
        if alive:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 5
            while group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._how = self._how.replace("stopped with it", f"did not stop within {self.grace:g} s: killed (SIGKILL)")
        if waited < delay:
            return None
        self.say(f"the supervisor of {self.name} (pid {pid}) {how_ended(rc)}; {self._how}; restarting both, "
                 f"{self.policy.used}/{self.policy.max}")
        self._dead = None
        self.start()
        return None

    def ending(self) -> str:
        """How it ended, for an error message: `was killed by signal 9 after 3 restarts (supervisor pid 42)`."""
        rc = self.rc if self.rc is not None else 0
        if self.supervisor_died is not None:
            return f"stopped: its supervisor (pid {self.pid}) {how_ended(-self.supervisor_died)}"
        if not self.supervised:
            return f"(pid {self.pid}) {how_ended(rc)}"
        tries = f" after {self.policy.max} restarts" if not Restarts.final(rc) else ""
        return f"{how_ended(rc)}{tries} (supervisor pid {self.pid})"

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_all(procs: list[LocalProcess], grace: float = 5.0) -> None:
    """SIGTERM to every process group still running, SIGKILL after `grace` seconds (no orphans)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.proc is not None and group_alive(p.proc.pid)]
        if not alive:
            return
        for p in alive:
            p.signal_group(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(group_alive(p.proc.pid) for p in alive):
            for p in alive:
                p.proc.poll()  # reap the leaders
            time.sleep(0.05)


class LocalWorkers:
    """The simulators' workers: each one process group (its supervisor when max_restarts > 0, see above)."""

    def __init__(self, module: str, config_path: str, overrides: list[str], num: int, log_paths: list[Path],
                 threads: int = 0, extra_args: list[str] | None = None, nproc: int = 1, max_restarts: int = 0):
        self.module, self.config_path, self.overrides = module, config_path, overrides
        self.num, self.log_paths, self.threads, self.nproc = num, log_paths, threads, nproc
        self.extra_args = extra_args or []
        self.max_restarts = max_restarts
        env = child_env(threads)
        self.workers = [LocalProcess(f"worker {i}", self.command(i), log_paths[i], env, max_restarts)
                        for i in range(num)]

    def command(self, i: int) -> list[str]:
        """Worker i's command line (its supervisor's, LocalProcess, goes around it)."""
        cmd = [*worker_argv(sys.executable, self.module, self.nproc), "--config", self.config_path,
               "--worker", str(i), *[a for ov in self.overrides for a in ("--set", ov)], *self.extra_args]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        return cmd

    def start(self) -> None:
        for w in self.workers:
            w.log_path.parent.mkdir(parents=True, exist_ok=True)
            w.start()

    def check(self) -> None:
        """Restart killed supervisors; raise WorkerDied (with the log's tail) if a worker failed for good."""
        for i, w in enumerate(self.workers):
            rc = w.poll()
            if rc not in (None, 0):
                raise WorkerDied(f"worker {i} {w.ending()}; last lines of {self.log_paths[i]}:\n"
                                 f"{tail(self.log_paths[i])}\nFix the cause and run the same command again: the run "
                                 f"resumes from its last committed state.")

    def all_exited(self) -> bool:
        return bool(self.workers) and all(w.poll() is not None for w in self.workers)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.all_exited():
                return True
            time.sleep(0.1)
        return self.all_exited()

    def stop(self, grace: float = 5.0) -> None:
        stop_all(self.workers, grace)
