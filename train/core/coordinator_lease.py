"""The coordinator's lease (coordinator/progress.json: the same heartbeat as a worker's, train/core/heartbeat.py, with
`role: coordinator` and the step it is in) and the workers' watch on it: a worker says in one line when the
coordinator goes silent, is gone or never appeared, and again when it is back, while it keeps waiting
(docs/elastic.md "When each process dies")."""
from __future__ import annotations

import logging
import math
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from train.core import sharedfs
from train.core.heartbeat import _BOOT_ID, GONE_STATUSES, LEASE_EVERY_S, Heartbeat, pid_alive
from train.core.store import read_json

log = logging.getLogger("heartbeat")


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
