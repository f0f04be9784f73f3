"""Who is still in the run: worker liveness from their leases, and when a round may close without someone.

Contract (the DiLoCo coordinator's wait loop; the EDT coordinator uses `gone()` for its job claims):

    m = Membership(paths, num_workers, cfg.outer)      # when the coordinator starts waiting (its clock starts here)
    while True:
        d = m.poll(set(arrived))                       # arrived: workers whose delta of this round is in
        if d.close:                                    # d.missing = {worker: reason} for every worker not arrived
            break                                      # d.why says why the round closes (or why it waits)
        time.sleep(poll_interval_s)
    ... reduce with the arrived workers, commit ...
    m.record_round()                                   # the round is over: its time-to-quorum joins the history

A worker's lease is workers/wXXX/progress.json (train/core/heartbeat.py): rewritten about every second with a
growing `beat`, by a thread that lives as long as the process. Liveness is judged from its contents on this
process's monotonic clock, never from mtimes (NFS caches attributes) nor from another host's clock:

  gone     at once when the lease's status is "exited" / "left" (a final record), or when the record names this
           host (hostname and boot id) and its pid is not running (or is a zombie, or another process now);
           after `outer.dead_after_s` without a change of (lease, beat) otherwise (a SIGKILL on another host, a
           frozen machine, a partitioned disk).
  starting a worker whose lease has not changed since this object was made (a run that starts or resumes: stale
           files of earlier processes say nothing about the new ones) is awaited for dead_after_s +
           `outer.startup_grace_s` from then (workers import torch, read the data, load θ), then gone.
  alive    otherwise. Nothing is sticky: a worker that comes back (restarted: a new lease) is alive again.

A round closes (`Decision.close`), first rule that holds:
  1. every live worker (alive or starting) has arrived and at least `outer.min_workers` deltas are in;
  2. straggler deadline (`outer.straggler_factor` > 0, and a recorded round): a quorum of max(min_workers,
     ceil(num_workers / 2)) deltas is in and the round has waited max(straggler_factor x median time-to-quorum of
     the last 10 rounds, dead_after_s) — never giving up on a live worker sooner than on a silent one: a worker
     still starting, or whose process (re)started less than dead_after_s + startup_grace_s ago and has not
     delivered a delta yet, holds the round open (it imports torch, reads the data and loads θ before it trains);
  3. `outer.round_timeout_s` passed and at least min_workers deltas are in (the absolute cap, as before).
With fewer than min_workers deltas it keeps waiting (for restarts) and says so in `why`.

The round's clock starts at its first poll (after construction or record_round). Time-to-quorum, not the whole
round, is what the history keeps: rounds that waited for a straggler or a death do not stretch later deadlines.
"""
from __future__ import annotations

import math
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from train.core import sharedfs
from train.core.heartbeat import GONE_STATUSES, boot_id, pid_alive
from train.core.store import RunPaths, read_json

HISTORY = 10  # rounds whose time-to-quorum makes the straggler deadline
MAX_JOIN = 8  # worker ids past the current ones whose leases are watched for "joining"


@dataclass
class Decision:
    """One poll's verdict. `missing` covers every worker not in `arrived`, with the reason it is not (or is still)
    awaited; `gone` and `late` are the parts of it the round goes on without; `waiting` the workers still
    awaited when the round does not close."""
    close: bool
    why: str
    missing: dict[int, str] = field(default_factory=dict)
    gone: dict[int, str] = field(default_factory=dict)
    late: dict[int, str] = field(default_factory=dict)
    waiting: list[int] = field(default_factory=list)
    arrived: int = 0
    quorum: int = 1
    elapsed_s: float = 0.0
    deadline_s: float | None = None

    def summary(self) -> str:
        """One line for the log: the verdict and every missing worker's reason."""
        parts = [self.why] + [f"w{w}: {why}" for w, why in sorted(self.missing.items())]
        return "; ".join(parts)


@dataclass
class _Lease:
    key: tuple | None = None       # (lease id, beat) last seen
    changed: float = 0.0           # our clock when key last changed (or when we started)
    current: bool = False          # changed since we started: written by a process of this run's present
    record: dict | None = None
    born: float = -math.inf        # our clock when its present lease id (process) was first seen changing; -inf
    #                                for the process already beating when we started
    proven: bool = False           # that process has delivered a delta (its start-up is behind it)
    out_before: str | None = None  # missing from the last round committed before we started (why): no start-up
    #                                allowance until it beats again


class Membership:
    """Liveness of workers 0..num_workers-1 and the close-the-round rule (module docstring).

    `clock` (monotonic seconds) and `pid_alive` (pid -> bool, this host) are injectable for tests; `dead_after_s`,
    `startup_grace_s` override the config's values (workers_alive uses a short watch)."""

    def __init__(self, paths: RunPaths, num_workers: int, outer, clock: Callable[[], float] = time.monotonic,
                 pid_alive: Callable[[int, int | None], bool] | None = None, *, dead_after_s: float | None = None,
                 startup_grace_s: float | None = None):
        self.paths, self.n, self.outer, self.clock = paths, num_workers, outer, clock
        self.dead_after_s = float(outer.dead_after_s if dead_after_s is None else dead_after_s)
        self.startup_grace_s = float(outer.startup_grace_s if startup_grace_s is None else startup_grace_s)
        self.pid_alive = pid_alive or local_pid_alive
        self.host, self.boot = socket.gethostname(), boot_id()
        self.t0 = clock()
        self.history: list[float] = []
        self._round_t0: float | None = None
        self._read_since_arrival: set[int] = set()  # this round: arrived workers whose lease was read since
        self._quorum_s: float | None = None
        self._elapsed = 0.0
        self._seen: set[int] = set()  # workers whose lease file this object has read (see _read)
        self.leases = {w: _Lease(changed=self.t0) for w in range(num_workers)}
        for w in range(num_workers):  # the baseline: what earlier processes left behind
            rec = self._read(w)
            self.leases[w].record, self.leases[w].key = rec, _key(rec)
        self.join_from = num_workers  # the first id a joiner would get (the coordinator moves it on)
        self._joining: dict[int, _Lease] = {}

    # -- leases -----------------------------------------------------------------------------------------------------
    def _read(self, w: int, listed: set[str] | None = None) -> dict | None:
        """Worker w's lease record (None: none yet, or unreadable). A lease not seen yet is asked of a listing
        first (a joiner's lease appears late to a lookup: NFS lookup cache): `listed`, the names in workers/ when
        the caller listed it, else a listing of the worker's folder. A lease once read is read directly from then
        on (its file is only ever replaced atomically, never removed): one open per read, not a listing each."""
        f = self.paths.progress(w)
        try:
            if w not in self._seen:
                if listed is not None and self.paths.worker_dir(w).name not in listed:
                    return None
                if not sharedfs.exists(f):
                    return None
            rec = read_json(f)
        except (OSError, ValueError):
            return None
        if isinstance(rec, dict):
            self._seen.add(w)
            return rec
        return None

    def observe(self, now: float | None = None, skip: set[int] | frozenset = frozenset()) -> float:
        """Read every lease once (but those of `skip`); a changed (lease, beat) is a sign of life at `now`."""
        now = self.clock() if now is None else now
        for w, ls in self.leases.items():
            if w in skip:
                continue
            rec = self._read(w)
            key = _key(rec)
            if rec is not None:
                ls.record = rec
            if key is not None and key != ls.key:
                if ls.key is None or key[0] != ls.key[0]:
                    ls.born, ls.proven = now, False  # a new process of this worker (started, restarted)
                ls.key, ls.changed, ls.current = key, now, True
        self._observe_joiners(now)
        return now

    def _observe_joiners(self, now: float) -> None:
        """The leases of ids join_from .. join_from + MAX_JOIN - 1 (workers asking to join): one listing of
        workers/ for all of them (their folders usually do not exist), not one per id."""
        listed = set(sharedfs.names(self.paths.worker_dir(self.join_from).parent))
        for w in range(self.join_from, self.join_from + MAX_JOIN):
            rec = self._read(w, listed)
            if rec is None or rec.get("status") != "joining":
                self._joining.pop(w, None)
                continue
            ls = self._joining.setdefault(w, _Lease(key=_key(rec), changed=now, born=now))
            if _key(rec) != ls.key:
                ls.key, ls.changed, ls.current = _key(rec), now, True
            ls.record = rec

    def joiners(self) -> list[int]:
        """Workers asking to join (lease status "joining", beating within dead_after_s), as the ids from
        `join_from` on that are all present (a gap stops the list: ids are handed out in order). Reads only the
        joiners' leases (the coordinator asks at each commit: no read per running worker in a round's tail)."""
        now = self.clock()
        self._observe_joiners(now)
        out = []
        for w in range(self.join_from, self.join_from + MAX_JOIN):
            ls = self._joining.get(w)
            if ls is None or not ls.current or now - ls.changed >= self.dead_after_s:
                break
            out.append(w)
        return out

    def set_workers(self, n: int) -> None:
        """Follow workers 0..n-1 from now on (the run grew or shrank). A worker added is judged from its lease as
        of now: alive at once if it was beating as a joiner, else given the start-up allowance from now."""
        now = self.clock()
        for w in range(self.n, n):
            joined = self._joining.pop(w, None)
            rec = self._read(w)
            self.leases[w] = joined or _Lease(key=_key(rec), changed=now, record=rec, born=now)
        for w in range(n, self.n):
            self.leases.pop(w, None)
        self.n = n

    def out_before(self, missing: dict[int, str], committed_at: float) -> None:
        """A resumed coordinator: the workers missing from the last committed round (with the reason it gave) whose
        lease is absent, or was last written before that round was committed (`committed_at`, wall clock) and is
        final (left, exited) or silent for dead_after_s, were out before this process started;
        while their lease stays as it was they are gone at once, not waited for dead_after_s + startup_grace_s
        (that allowance is for processes starting with the run: after a whole run is stopped and started again,
        its workers were in the last round). A worker that beats again is judged as any other from then on."""
        for w, why in missing.items():
            ls = self.leases.get(w)
            rec = (ls.record or {}) if ls is not None else {}
            t = float(rec.get("time") or 0)  # (wall clock: the lease's own)
            stale = time.time() - t >= self.dead_after_s
            if ls is not None and (not rec or (t < committed_at and (rec.get("status") in GONE_STATUSES or stale))):
                ls.out_before = why

    def state(self, w: int, now: float) -> tuple[str, str]:
        """("alive" | "starting" | "gone", reason) of worker w as of the last observe()."""
        ls = self.leases[w]
        if not ls.current and ls.out_before is not None:
            prefix = "out since before the coordinator started"
            return "gone", ls.out_before if ls.out_before.startswith(prefix) else f"{prefix} ({ls.out_before})"
        if not ls.current:
            limit = self.dead_after_s + self.startup_grace_s
            age = now - ls.changed  # since we started watching it
            if age < limit:
                return "starting", f"starting: no heartbeat yet ({age:.1f} s of {limit:g} s = dead_after_s + " \
                                   f"startup_grace_s)"
            what = "no heartbeat" if ls.record is None else "no heartbeat change"
            return "gone", f"never started: {what} in {age:.1f} s of waiting for it (dead_after_s + " \
                           f"startup_grace_s = {limit:g})"
        rec = ls.record or {}
        status = rec.get("status")
        if status in GONE_STATUSES:
            err = f": {rec['error']}" if rec.get("error") else ""
            return "gone", f"exited (status {status}{err})"
        pid = rec.get("pid")
        if isinstance(pid, int) and rec.get("host") == self.host and (not rec.get("boot_id") or
                                                                     rec.get("boot_id") == self.boot):
            if not self.pid_alive(pid, rec.get("proc_start")):
                return "gone", f"process {pid} gone on this host"
        silent = now - ls.changed
        if silent >= self.dead_after_s:
            return "gone", f"dead: no heartbeat change for {silent:.1f} s (dead_after_s = {self.dead_after_s:g})"
        return "alive", f"alive: {status or 'running'} (beat {rec.get('beat')}, {silent:.1f} s ago)"

    def states(self, now: float | None = None) -> dict[int, tuple[str, str]]:
        now = self.observe(now)
        return {w: self.state(w, now) for w in self.leases}

    def gone(self) -> dict[int, str]:
        """Workers judged gone now, with the reason."""
        return {w: why for w, (st, why) in self.states().items() if st == "gone"}

    def alive(self) -> set[int]:
        """Workers alive or starting now."""
        return {w for w, (st, _) in self.states().items() if st != "gone"}

    # -- rounds -----------------------------------------------------------------------------------------------------
    @property
    def quorum(self) -> int:
        return max(int(self.outer.min_workers), math.ceil(self.n / 2))

    def deadline_s(self) -> float | None:
        """The straggler deadline of a round (from its start), None when off or without history."""
        factor = float(self.outer.straggler_factor)
        if factor <= 0 or not self.history:
            return None
        return max(factor * statistics.median(self.history[-HISTORY:]), self.dead_after_s)

    def poll(self, arrived: set[int], leases: dict[int, str | None] | None = None) -> Decision:
        """`leases`: the lease id each arrived delta's sidecar names (the process that wrote it), so that a delta
        left by a killed process does not count as its restarted successor's first delivery."""
        # a worker whose delta is in is not read again this round once its lease was read since, or at once when
        # its sidecar names the live lease already known (that process delivered: nothing to learn from its file):
        # a round's polls read fewer leases as it fills, and a poll in the burst of a wide round's last arrivals
        # reads the few missing, not N (256 reads were up to 0.2 s of the tail at N = 256, bench/scale.py)
        by = leases or {}
        known = {w for w in arrived if w in self.leases and self.leases[w].current and self.leases[w].key is not None
                 and by.get(w) is not None and by[w] == self.leases[w].key[0]}
        now = self.observe(skip=(self._read_since_arrival & set(arrived)) | known)
        self._read_since_arrival |= {w for w in arrived if w in self.leases}
        if self._round_t0 is None:
            self._round_t0 = now
        elapsed = self._elapsed = now - self._round_t0
        arrived = {w for w in arrived if w in self.leases}
        for w in arrived:
            ls, by = self.leases[w], (leases or {}).get(w)
            if ls.current and (by is None or (ls.key is not None and by == ls.key[0])):
                ls.proven = True
        n_in, oc = len(arrived), self.outer
        if self._quorum_s is None and n_in >= self.quorum:
            self._quorum_s = elapsed
        missing, gone, live = {}, {}, []
        for w in sorted(set(self.leases) - arrived):
            st, why = self.state(w, now)
            missing[w] = why
            if st == "gone":
                gone[w] = why
            else:
                live.append(w)
        deadline = self.deadline_s()
        d = Decision(False, "", missing, gone, {}, live, n_in, self.quorum, elapsed, deadline)
        enough = n_in >= oc.min_workers
        past = deadline is not None and n_in >= self.quorum and elapsed >= deadline  # the straggler deadline
        young = self._young(live, now) if past else []
        if not live and enough:
            d.close, d.waiting = True, []
            d.why = f"every live worker arrived ({n_in} of {self.n})"
        elif past and not young:
            med = statistics.median(self.history[-HISTORY:])
            d.late = {w: f"straggler: past the deadline of {deadline:.1f} s = {float(oc.straggler_factor):g} x "
                         f"median recent round ({med:.1f} s)" + (" (floor: dead_after_s)" if deadline ==
                                                                  self.dead_after_s else "") for w in live}
            d.missing.update(d.late)
            d.close, d.waiting = True, []
            d.why = f"straggler deadline {deadline:.1f} s passed with {n_in} of {self.n} (quorum {self.quorum})"
        elif elapsed >= oc.round_timeout_s and enough:
            d.late = {w: f"timeout: round_timeout_s = {oc.round_timeout_s:g} passed" for w in live}
            d.missing.update(d.late)
            d.close, d.waiting = True, []
            d.why = f"round_timeout_s = {oc.round_timeout_s:g} passed with {n_in} of {self.n}"
        elif past:
            ages = ", ".join(f"w{w} " + (f"(re)started {now - self.leases[w].born:.1f} s ago"
                                         if self.leases[w].current else "still starting") for w in sorted(young))
            d.why = f"straggler deadline {deadline:.1f} s passed with {n_in} of {self.n}, but {ages}: waiting up " \
                    f"to dead_after_s + startup_grace_s = {self.dead_after_s + self.startup_grace_s:g} s from a " \
                    f"process's start before leaving it behind"
        elif not live:
            d.why = f"only {n_in} of {self.n} in and no other live worker (min_workers = {oc.min_workers}): " \
                    f"waiting for workers to come back"
        else:
            d.why = f"waiting for {len(live)} live worker(s) {live} ({n_in} of {self.n} in)"
        return d

    def _young(self, live: list[int], now: float) -> list[int]:
        """Live workers the straggler rule may not leave behind yet: still starting, or their process (re)started
        less than dead_after_s + startup_grace_s ago and has not delivered a delta since (it imports torch, reads
        the data, loads θ first) — never sooner than a worker that has not beaten at all."""
        limit = self.dead_after_s + self.startup_grace_s
        return [w for w in live if not self.leases[w].current or
                (not self.leases[w].proven and now - self.leases[w].born < limit)]

    def record_round(self, seconds: float | None = None) -> None:
        """The round is over. Its time-to-quorum (as poll measured it; the whole wait when the quorum never came)
        joins the history, or `seconds` when given (e.g. earlier rounds' times on resume). The next poll starts
        the next round's clock."""
        value = seconds if seconds is not None else (self._quorum_s if self._quorum_s is not None else
                                                     self._elapsed if self._round_t0 is not None else None)
        if value is not None and math.isfinite(value) and value >= 0:
            self.history = (self.history + [float(value)])[-HISTORY:]
        self._round_t0, self._quorum_s, self._elapsed = None, None, 0.0
        self._read_since_arrival = set()


def _key(rec: dict | None) -> tuple | None:
    if not rec or "beat" not in rec:
        return None
    return rec.get("lease"), rec.get("beat")


local_pid_alive = pid_alive  # one pid check (train/core/heartbeat.py), the name membership's callers use


def workers_alive(paths: RunPaths, num_workers: int, outer, watch_s: float = 2.5,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                  ) -> dict[int, str]:
    """Watch the leases for `watch_s` seconds (> the 1 s lease period); {worker: reason} of those alive (a beat
    changed, or its process runs on this host). For tools (status, benchmarks), not for the round loop."""
    m = Membership(paths, num_workers, outer, clock, dead_after_s=watch_s, startup_grace_s=0.0)
    out: dict[int, str] = {}
    while True:
        now = m.observe()
        for w, ls in m.leases.items():
            if ls.current:
                st, why = m.state(w, now)
                if st == "alive":
                    out[w] = why
        if now - m.t0 >= watch_s or len(out) == num_workers:
            return out
        sleep(min(0.25, watch_s))
