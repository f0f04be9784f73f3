"""`diloco_sim.py --slow`: hold chosen workers to a fraction of full speed, as a slower machine would be.

    --slow 1=0.5             worker 1 at half speed for the whole run
    --slow 1=0.5,3=0.5@20    ... and worker 3 at half speed from round 20 on
    --slow 2=0.25,2=1@10     worker 2 at a quarter of its speed until round 10, then at full speed

A worker at fraction f has its process stopped (SIGSTOP) for (1 − f) of every PERIOD_S and running for f of it, from
the outside, as a shared or hot machine would be: the worker does not know, and measures its own speed as any worker
does (rounds by time, train/diloco/pace.py). The round is the latest committed one and the worker's pid its lease's,
both read from BASE_DIR about once a second. Only the worker is stopped, never its supervisor: a stopped process
keeps a SIGTERM pending, so the supervisor continues its child before it stops it or dies with the simulator
(train/launch/procs.py), and the simulator continues every throttled worker when it ends.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

from train.core.errors import ConfigError
from train.core.store import read_json

log = logging.getLogger("throttle")

PERIOD_S = 0.2  # one stop/continue cycle (short against a round, long against a scheduler's tick)
ROUND_EVERY_S = 1.0  # how often the current round is read


def parse_slow(spec: str, num_workers: int) -> dict[int, list[tuple[int, float]]]:
    """`W=F[@R],...` -> {worker: [(from_round, fraction), ...] by round}; ConfigError naming --slow otherwise."""
    out: dict[int, list[tuple[int, float]]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            who, rest = item.split("=", 1)
            frac, _, at = rest.partition("@")
            w, f, r = int(who), float(frac), int(at) if at else 0
        except ValueError:
            raise ConfigError(f"--slow {spec!r}: {item!r} is not WORKER=FRACTION[@ROUND] (e.g. 1=0.5 or 3=0.5@20)") \
                from None
        if not 0 <= w < num_workers:
            raise ConfigError(f"--slow {spec!r}: worker {w} does not exist (the run has workers 0..{num_workers - 1}, "
                              f"outer.num_workers = {num_workers})")
        if not 0 < f <= 1:
            raise ConfigError(f"--slow {spec!r}: fraction {f:g} of worker {w} must be in (0, 1] (1 = full speed, "
                              f"0.5 = half)")
        if r < 0:
            raise ConfigError(f"--slow {spec!r}: round {r} of worker {w} must be >= 0")
        out.setdefault(w, []).append((r, f))
    for w in out:
        out[w].sort()
    return out


def fraction_at(plan: list[tuple[int, float]], r: int) -> float:
    """The fraction of full speed in round r (1 before the first entry)."""
    f = 1.0
    for start, frac in plan:
        if start <= r:
            f = frac
    return f


class Throttle:
    """One thread holding the `slow` workers to their fractions; `stop()` continues them all."""

    def __init__(self, slow: dict[int, list[tuple[int, float]]], workers, paths):
        self.slow, self.workers, self.paths = slow, workers, paths  # workers: LocalProcess list
        self._pids: dict[int, int] = {}  # each throttled worker's own pid (its lease's)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)
        self._round, self._t_round = 0, 0.0
        self._said: dict[int, float] = {}

    def start(self) -> "Throttle":
        if self.slow:
            self._thread.start()
        return self

    def _current_round(self) -> int:
        if time.monotonic() - self._t_round >= ROUND_EVERY_S:
            self._t_round = time.monotonic()
            try:
                self._round = self.paths.latest_committed(self._round or None) or 0
            except OSError:
                pass
            for w in self.slow:
                self._pids[w] = self._worker_pid(w)
        return self._round

    def _worker_pid(self, w: int) -> int | None:
        """The worker process itself: its lease's pid while that process is a child of w's process group (not a
        stale lease of an earlier process); the group's leader when it runs without a supervisor."""
        lead = self.workers[w].pid
        if lead is None:
            return None
        if not self.workers[w].supervised:
            return lead
        try:
            pid = int(read_json(self.paths.progress(w)).get("pid", 0))
            return pid if pid and os.getpgid(pid) == lead else None
        except (OSError, ValueError, TypeError):
            return None

    def _signal(self, w: int, sig: int) -> None:
        pid = self._pids.get(w)
        if pid is None:
            return
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                r = self._current_round()
                fracs = {w: fraction_at(plan, r) for w, plan in self.slow.items()}
                for w, f in fracs.items():
                    if self._said.get(w) != f:
                        log.info("worker %d at %g of full speed from round %d (--slow)", w, f, r)
                        self._said[w] = f
                # one cycle: every slowed worker stopped for its (1 − f) of the period, in turn of their ends
                held = sorted((PERIOD_S * (1 - f), w) for w, f in fracs.items() if f < 1)
                for _, w in held:
                    self._signal(w, signal.SIGSTOP)
                t0 = time.monotonic()
                for until, w in held:
                    self._stop.wait(max(0.0, until - (time.monotonic() - t0)))
                    self._signal(w, signal.SIGCONT)
                self._stop.wait(max(0.0, PERIOD_S - (time.monotonic() - t0)))
        finally:
            for w in self.slow:
                self._signal(w, signal.SIGCONT)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for w in self.slow:  # (also when the thread never ran)
            self._signal(w, signal.SIGCONT)
