"""Leases: a worker's heartbeat (workers/wXXX/progress.json), the coordinator's (coordinator/progress.json, read by
the workers' CoordinatorWatch), and SIGTERM as "leave".

The file is the worker's lease: a background thread rewrites it about every second for as long as the process
lives, whatever the worker does (waits, trains, saves), each time with a higher `beat` counter. Readers judge
liveness from these contents, never from mtimes (NFS caches attributes): train/exchange/membership.py watches the
`beat` change on its own clock. Every record carries

    worker, pid, host, boot_id, proc_start   who writes it (a reader on the same host can check the pid)
    lease                        a random id per process: a restarted worker is a new lease
    beat                         +1 per write; continues from the previous process's last value
    status, round / generation, step, steps, loss   what the worker is doing (progress bars, `status`)
    time                         the writer's wall clock (display only: never compared with another host's)

The last record of a process says why it ended: status "exited" (it returned, or failed: then `error` too) or
"left" (SIGTERM). A SIGKILL writes nothing: the reader's dead_after_s, or its pid check on the same host, tells.

The coordinator beats the same lease (`CoordinatorLease`, `role: coordinator`, its status and round / generation)
from the moment it holds its lock until it exits. Each worker watches it from its wait loops (`CoordinatorWatch`,
its `monitor()`): a coordinator that goes silent for dead_after_s, exits with an error, or whose pid is gone on this
host is said in ONE line (who, since when, what it was doing, how to restart it), its return in one more; the
worker keeps waiting, since a restarted coordinator resumes from its last commit (docs/elastic.md).

SIGTERM = leave (`install_leave_handler`): the worker finishes what it is writing and exits 0 at its next safe
point, after a final beat with status "left". Safe points are the worker's own beats (between inner steps, before
a wait: nothing half-written) and `leave_point()` calls in its wait loops. Before the lease started (the process is
still importing, or never holds the worker's lock) SIGTERM exits 0 at once: nothing of its own is on disk yet.
More SIGTERMs change nothing (a supervisor passes its own on); SIGKILL is the way to stop a worker at once, and
the run still resumes after it (every file is written atomically). A SIGTERM that is the parent-death signal (the
simulator that started the worker, or its supervisor, was killed) exits 143 at once: there is nobody to leave to,
and a rerun must find the worker's lock free.
"""
from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from train.core import sharedfs
from train.core.store import atomic_write_json, read_json

log = logging.getLogger("heartbeat")

LEASE_EVERY_S = 1.0          # how often the lease thread rewrites the file
GONE_STATUSES = ("exited", "left")  # a final record: the process that wrote it has ended


def boot_id() -> str:
    """This machine's boot id (Linux): with the hostname, tells whether a pid in a record is one of ours."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_start_ticks(pid: int | None = None) -> int | None:
    """A process's start time in clock ticks since boot (Linux /proc): with the pid, names one process for good."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            raw = f.read()
        return int(raw[raw.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Heartbeat:
    """workers/wXXX/progress.json: progress for bars and `status`, and the worker's lease.

    `beat(**fields)` sets what the worker is doing. Without a lease (start_lease not called) beats are written at
    most every `every` seconds by a short background thread, as before. With the lease running, a beat only
    records the fields and the lease thread writes them on its next tick (a training step never waits for an
    fsync); forced beats (status changes) are written at once, in order, by the caller.
    """

    def __init__(self, path, worker: int, every: float = 1.0):
        self.path, self.worker, self.every = path, worker, every
        self.lease_id = uuid.uuid4().hex[:12]
        self._proc_start = proc_start_ticks()
        self.count = 0                       # the `beat` of the last record written
        self.leaving = False                 # SIGTERM seen: leave at the next safe point
        self._last = 0.0
        self._fields: dict = {}
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()        # one write at a time, each with the latest fields
        self._lease: threading.Thread | None = None
        self._lease_armed = False
        self._lease_every = LEASE_EVERY_S
        self._stop = threading.Event()
        self._busy = 0
        self._final = False

    # -- beats ----------------------------------------------------------------------------------------------------
    def beat(self, force: bool = False, **fields) -> None:
        if self._final:
            return
        self._fields = fields
        started = self._lease_armed and self._lease is None
        if started:
            self.start_lease(self._lease_every)  # writes this beat
        if self.leaving and not self._busy:
            self.leave()  # a beat is a safe point: between steps, or before a wait
        if self._lease is not None:
            if force and not started:
                self._write()
            return
        now = time.time()
        if not force and now - self._last < self.every:
            return
        busy = self._writer is not None and self._writer.is_alive()
        if busy and not force:
            return
        self._last = now
        if force:
            if busy:
                self._writer.join()
            self._write()
            return
        self._writer = threading.Thread(target=self._write, daemon=True)
        self._writer.start()

    def record(self) -> dict:
        fields = dict(self._fields)
        if fields.get("loss") is not None and not isinstance(fields["loss"], (int, float)):
            fields["loss"] = float(fields["loss"])  # a 0-d tensor: synced here, by the writer, once per write
        return {"worker": self.worker, "pid": os.getpid(), "host": socket.gethostname(), "boot_id": _BOOT_ID,
                "proc_start": self._proc_start, "lease": self.lease_id, "beat": self.count, "time": time.time(),
                **fields}

    def _write(self) -> None:
        with self._lock:
            self.count += 1
            atomic_write_json(self.path, self.record())

    # -- the lease ------------------------------------------------------------------------------------------------
    def start_lease(self, every: float = LEASE_EVERY_S, *, at_first_beat: bool = False) -> "Heartbeat":
        """Keep the file fresh from a background thread until stop(). `at_first_beat`: start it with the worker's
        first beat instead (workers take their lock first, so a second copy of a worker never overwrites the live
        one's lease; the other ranks of a torchrun group never beat, so they hold no lease)."""
        self._lease_every = every
        if at_first_beat:
            self._lease_armed = True
            return self
        if self._lease is not None:
            return self
        try:  # continue the counter of the previous process of this worker: `beat` only grows
            prev = read_json(self.path)
            self.count = max(self.count, int(prev.get("beat", 0)))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
        self._write()  # the lease exists when this returns
        self._lease = threading.Thread(target=self._lease_loop, args=(every,), name="heartbeat-lease", daemon=True)
        self._lease.start()
        return self

    def _lease_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self._write()
            except OSError as e:  # a full or vanished disk: the reader will call us dead, which is the truth
                log.warning("heartbeat: cannot write %s: %s", self.path, e)

    @property
    def running(self) -> bool:
        return self._lease is not None and not self._final

    def stop(self, status: str = "exited", **extra) -> None:
        """The final record (status exited or left), after which the file is never written again by us."""
        if self._final:
            return
        self._stop.set()
        if self._lease is not None and self._lease is not threading.current_thread():
            self._lease.join(5)
        if self._writer is not None and self._writer.is_alive():
            self._writer.join(5)
        if self._lease is not None or self.count:  # only a process that beat has a record to close
            last = self._fields.get("status")
            self._fields = {**self._fields, "status": status, **({"last_status": last} if last else {}), **extra}
            try:
                self._write()
            except OSError as e:
                log.warning("heartbeat: cannot write the final record to %s: %s", self.path, e)
        self._final = True

    # -- leaving (SIGTERM) ----------------------------------------------------------------------------------------
    def request_leave(self) -> None:
        """SIGTERM's handler: leave at the next safe point; at once when nothing of ours is on disk yet."""
        if self.leaving:
            return  # a second SIGTERM (the supervisor passes its own on): the same request
        self.leaving = True
        if self._lease is None and not self.count:
            raise SystemExit(0)
        log.warning("SIGTERM: leaving the run at the next safe point (after the current step or write)")

    def leave_point(self) -> None:
        """Call where the worker holds nothing half-written (its wait loops): leave now if SIGTERM asked to."""
        if self.leaving and not self._busy and not self._final:
            self.leave()

    def leave(self) -> None:
        log.warning("leaving the run (SIGTERM): final heartbeat 'left', exit 0")
        self.stop("left")
        raise SystemExit(0)

    @contextmanager
    def busy(self):
        """A stretch that must not be cut by a leave (a claim being written, a member being published): a SIGTERM
        that arrives inside it takes effect at the next safe point after it."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1


_BOOT_ID = boot_id()


def parent_died(ppid_at_start: int) -> bool:
    """Is this SIGTERM the parent-death signal (the simulator or supervisor that started us with PR_SET_PDEATHSIG
    died), not a request to leave? Then there is nobody to leave to: the caller exits at once, as before."""
    if os.getppid() == ppid_at_start:
        return False
    try:
        import ctypes
        sig = ctypes.c_int(0)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
        return sig.value == signal.SIGTERM
    except (OSError, AttributeError):
        return False


def install_leave_handler(get_heartbeat: Callable[[], "Heartbeat | None"]) -> None:
    """SIGTERM = leave: `get_heartbeat()` is the process's Heartbeat once there is one (None before: exit 0 now).
    A SIGTERM that is the parent-death signal (its simulator was killed) exits 143 at once, as it always did."""
    ppid = os.getppid()

    def on_sigterm(signum, frame) -> None:
        if parent_died(ppid):
            raise SystemExit(143)
        hb = get_heartbeat()
        if hb is None:
            raise SystemExit(0)
        hb.request_leave()

    signal.signal(signal.SIGTERM, on_sigterm)


# -- the coordinator's lease, and the workers' watch on it -----------------------------------------------------------
def coordinator_lease_path(root) -> Path:
    """BASE_DIR/<project>/coordinator/progress.json: the coordinator's lease (RunPaths.root / ...)."""
    return Path(root) / "coordinator" / "progress.json"


STATUS_WAITING = "collecting"  # the coordinator waits for the workers (DiLoCo: deltas; EDT: members' results)


class CoordinatorLease(Heartbeat):
    """The coordinator's heartbeat: the same lease as a worker's (a thread rewrites it about every second with a
    higher `beat`, judged by readers from its contents), with `role: coordinator` for a worker id, and

        status        preparing, collecting (waiting for the workers), reducing, committing, evaluating, breeding,
                      finalizing, done
        round / generation   what it works on: a restarted coordinator resumes from its last commit
        command       the command line that started it (a worker's message says how to restart it)

    Started once the coordinator holds its lock (a second coordinator never overwrites the live one's lease); the
    last record says how it ended: status "exited" with last_status "done", or with `error`. A SIGKILL writes
    nothing: readers tell from the silence (dead_after_s), or at once from its pid on the same host."""

    def __init__(self, root):
        super().__init__(coordinator_lease_path(root), worker=-1)
        cmd = list(sys.argv)
        self.command = shlex.join(["python", *cmd]) if cmd and Path(cmd[0]).name in ("diloco.py", "edt.py") \
            else None

    def record(self) -> dict:
        rec = super().record()
        del rec["worker"]
        rec["role"] = "coordinator"
        if self.command:
            rec["command"] = self.command
        return rec

    def start(self, status: str, **fields) -> "CoordinatorLease":
        self._fields = {"status": status, **fields}
        return self.start_lease()

    def set(self, status: str, **fields) -> None:
        """What the coordinator does now, on disk when this returns (the simulator reads `collecting` as "waiting
        for the workers": it must not still say so after the round's deltas are in)."""
        self.beat(force=True, status=status, **fields)

    def end(self, error: BaseException | None = None) -> None:
        """The final record: exited (after `done`, or what it was doing when `error` stopped it)."""
        if self._final:
            return
        if error is None:
            self.stop("exited")
        else:
            self.stop("exited", error=f"{type(error).__name__}: {error}"[:500])


class NoLease:
    """A coordinator's lease before setup() starts it (a null object: a test that calls a step of the coordinator
    without setup, or a failure before the lock, writes nothing)."""

    def set(self, status: str, **fields) -> None:
        pass

    def end(self, error: BaseException | None = None) -> None:
        pass


NO_LEASE = NoLease()


class CoordinatorWatch:
    """A worker's eye on the coordinator's lease, called from its wait loops (`monitor()`): it says in ONE line when
    the coordinator goes silent, exits with an error or never shows up, and in one line when it is back — and keeps
    waiting (a restarted coordinator resumes from its last commit; the simulators and the launcher's supervisor
    restart it). It never raises and returns None, so `monitor() or ready()` still polls.

    Judged like a worker's lease (train/exchange/membership.py), on this process's monotonic clock, never mtimes:
      gone at once   its final record ("exited" with an error, or while not done), or it names this host and a pid
                     that no longer runs;
      silent         no change of (lease, beat) for outer.dead_after_s;
      missing        no change since this watch started (no file, or a stale one of an earlier process) for
                     dead_after_s + outer.startup_grace_s (the coordinator imports torch and prepares the data first).
    A record that says the run is done is not a death. `clock`, `wall` and `pid_alive` are injectable for tests."""

    def __init__(self, path, dead_after_s: float = 10.0, startup_grace_s: float = 120.0, hint: str = "",
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 pid_alive: Callable[[int, int | None], bool] | None = None, every: float = LEASE_EVERY_S,
                 logger: logging.Logger | None = None):
        self.path, self.dead_after_s, self.startup_grace_s = Path(path), float(dead_after_s), float(startup_grace_s)
        self.hint, self.clock, self.wall, self.every = hint, clock, wall, every
        self.pid_alive = pid_alive
        self.log = logger or log
        self.host, self.boot = socket.gethostname(), _BOOT_ID
        self.t0 = clock()
        self.record: dict | None = None
        self.record = self._read()
        self.key = _lease_key(self.record)  # the baseline: what an earlier process left says nothing about now
        self.changed = self.t0
        self.current = False   # (lease, beat) changed since we started: a coordinator of the present
        self.seen: str | None = None  # the lease id of the last current coordinator
        self.said: str | None = None  # what we last said: "dead" (for self.seen) or "missing"; None: nothing
        self.state = "starting"
        self._next = -math.inf

    @classmethod
    def of(cls, cfg, strategy: str) -> "CoordinatorWatch":
        """The watch of a run's worker: its config's timings, and `python <strategy>.py --config ...` as the hint."""
        hint = f"python {strategy}.py" + (f" --config {cfg.source}" if not cfg.source.startswith("<") else "")
        return cls(coordinator_lease_path(cfg.run_dir), cfg.outer.dead_after_s, cfg.outer.startup_grace_s, hint)

    def __call__(self) -> None:
        self.check()

    def _read(self) -> dict | None:
        try:
            if self.record is None and not sharedfs.exists(self.path):
                return None  # a name not seen yet is asked of its folder's listing (NFS lookup cache), not looked up
            rec = read_json(self.path)
        except (OSError, ValueError):  # missing, unreadable, torn by a disk error: no beat
            return None
        return rec if isinstance(rec, dict) else None

    def check(self, now: float | None = None) -> str:
        """Read the lease (at most every `every` seconds) and log what changed; returns the state: starting,
        alive, done, dead or missing."""
        now = self.clock() if now is None else now
        if now < self._next:
            return self.state
        self._next = now + self.every
        rec = self._read()
        key = _lease_key(rec)
        if rec is not None:
            self.record = rec
        if key is not None and key != self.key:
            self.key, self.changed, self.current = key, now, True
            if key[0] != self.seen:
                self._new_lease(rec, key[0])
            elif self.said == "dead":  # the same process beats again (a frozen machine or disk came back)
                self.log.info("the coordinator beats again: %s (%s)", _who(rec), _doing(rec) or "running")
                self.said = None
        self.state = self._judge(now)
        return self.state

    def _new_lease(self, rec: dict, lease: str) -> None:
        who = _who(rec)
        if self.said:
            self.log.info("the coordinator is %s: %s (%s)", "back" if self.said == "dead" else "here", who,
                          _doing(rec) or rec.get("status", "running"))
        elif self.seen is not None:
            self.log.info("the coordinator restarted: %s (%s)", who, _doing(rec) or rec.get("status", "running"))
        self.seen, self.said = lease, None

    def _judge(self, now: float) -> str:
        rec = self.record or {}
        if not self.current:
            waited, limit = now - self.t0, self.dead_after_s + self.startup_grace_s
            if waited < limit:
                return "starting"
            if self.said is None:
                self.said = "missing"
                if self.record is None:
                    what = f"no coordinator has beaten in {self.path}"
                else:
                    what = (f"the coordinator's lease {self.path} ({_who(rec)}, written before this worker started) "
                            f"has not changed")
                self.log.warning("%s in the %.0f s since this worker started (dead_after_s + startup_grace_s = "
                                 "%g): waiting for a coordinator; start it with %s (the simulators and "
                                 "launch_to_machines.py start it for you)", what, waited, limit, self._hint(rec))
            return "missing"
        status = rec.get("status")
        if status in GONE_STATUSES and rec.get("last_status") == "done" and not rec.get("error"):
            return "done"  # it finished the run: nothing to wait for, nothing to say
        why = None
        if status in GONE_STATUSES:
            err = rec.get("error")
            why = f"exited at {self._at(now)}" + (f" with an error ({err})" if err else "")
        else:
            pid = rec.get("pid")
            if isinstance(pid, int) and rec.get("host") == self.host and \
                    (not rec.get("boot_id") or rec.get("boot_id") == self.boot) and \
                    not self._pid_alive(pid, rec.get("proc_start")):
                why = f"is gone: its process no longer runs on this host (last beat at {self._at(now)})"
            elif now - self.changed >= self.dead_after_s:
                why = (f"has not beaten since {self._at(now)} ({now - self.changed:.0f} s; dead_after_s = "
                       f"{self.dead_after_s:g})")
        if why is None:
            return "alive"
        if self.said != "dead":
            self.said = "dead"
            doing = _doing(rec)
            self.log.warning("the coordinator (%s) %s%s: waiting for it to come back; restarted, it resumes from "
                             "its last commit (%s)", _who(rec), why, f"; it was {doing}" if doing else "",
                             self._hint(rec))
        return "dead"

    def _at(self, now: float) -> str:
        """Our wall-clock time of the last change we saw (HH:MM:SS)."""
        return time.strftime("%H:%M:%S", time.localtime(self.wall() - (now - self.changed)))

    def _hint(self, rec: dict) -> str:
        return rec.get("command") or self.hint or "python diloco.py --config <the run's config>"

    def _pid_alive(self, pid: int, proc_start: int | None) -> bool:
        return (self.pid_alive or pid_alive)(pid, proc_start)


def pid_alive(pid: int, proc_start: int | None = None) -> bool:
    """Is `pid` a running (not zombie) process of this host, and the same process when its start time is known?
    (Workers' leases in train/exchange/membership.py and the coordinator's watch both judge with it.)"""
    if pid <= 0:
        return False  # 0 and negative pids name process groups for os.kill
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return True  # no /proc (not Linux): os.kill said it exists
    fields = raw[raw.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return False
    return proc_start is None or int(fields[19]) == proc_start


def _lease_key(rec: dict | None) -> tuple | None:
    if not rec or "beat" not in rec:
        return None
    return rec.get("lease"), rec.get("beat")


def _who(rec: dict) -> str:
    return f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')}"


def _doing(rec: dict) -> str:
    """`collecting round 3` / `breeding generation 2` / `preparing`, from a coordinator's record."""
    status = rec.get("last_status") if rec.get("status") in GONE_STATUSES else rec.get("status")
    where = next((f"{k} {rec[k]}" for k in ("round", "generation") if rec.get(k) is not None), "")
    return " ".join(x for x in (status, where) if x)
