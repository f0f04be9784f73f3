"""Leases: a worker's heartbeat (workers/wXXX/progress.json; the coordinator's, coordinator/progress.json, is the same
record: train/core/coordinator_lease.py), and SIGTERM as "leave".

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
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable

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

    def _write(self, tick: bool = False) -> None:
        """`tick`: a periodic rewrite of the lease by its thread, which changes only `beat` and `time` (and the
        fields a step set): written without fsyncs (store.atomic_write_bytes, durable=False). A server crash that
        loses one only makes the lease look a beat older, and the next tick replaces it; at 256 workers the fsyncs
        were 2 x 256 synchronous commits a second on the NFS server (bench/scale.py). Every other record (the
        first, the status changes, the final one) is durable."""
        with self._lock:
            self.count += 1
            rec = self.record()
            if tick:  # (the lease's first record was written by start_lease, durably)
                try:
                    atomic_write_json(self.path, rec, durable=False)
                    return
                except FileNotFoundError:  # the folder went away (a wiped run folder): make it again, durably
                    pass
            atomic_write_json(self.path, rec)

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
                self._write(tick=True)
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
    A SIGTERM that is the parent-death signal (its simulator was killed) exits 143 at once: os._exit, not SystemExit,
    whose unwinding from wherever the signal landed can hang for good (a queue's lock the interrupted code held, a
    lane thread the interpreter's exit joins: a worker orphaned so held its lock against the rerun). Every file a
    worker writes appears atomically, so this leaves what a SIGKILL leaves, which a rerun resumes from."""
    ppid = os.getppid()

    def on_sigterm(signum, frame) -> None:
        if parent_died(ppid):
            os._exit(143)
        hb = get_heartbeat()
        if hb is None:
            raise SystemExit(0)
        hb.request_leave()

    signal.signal(signal.SIGTERM, on_sigterm)


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
