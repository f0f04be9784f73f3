"""Polling that tightens where an awaited event is due (bench/peers.py: the exchange's latency against torchft).

A shared disk pushes nothing: an NFS client sees a file another client created only when it asks (a listing), so
the time to notice an event is the poll interval (outer.poll_interval_s, 0.2 s: on average 0.1 s per wait, twice a
round: the coordinator noticing the round's last delta, each worker noticing the commit). Polling faster all the
time would multiply the metadata load on the NFS server for the whole round; the events, though, come at about the
same time each round. `Expect` keeps the median of the last rounds' times of one event and polls every FAST_S only
within WINDOW_S of it (at most 2 x WINDOW_S / FAST_S = 200 extra listings of one small folder a round, about 10 ms
of CPU), at the normal interval the rest of the round. A round whose event comes outside the window costs nothing
more than before. The first wait is not counted: it holds the start-up (processes importing torch, the first θ).

Where many processes wait for the same event (every worker for the commit: `sharers` = outer.num_workers), their
fast polls together are what the NFS server sees: they share FAST_HZ listings a second (each polls every
max(FAST_S, sharers / FAST_HZ) s), so up to 8 workers poll every 10 ms, 16 every 20 ms, and from 160 workers on
the fast window is off (its interval would not beat outer.poll_interval_s). Without that bound, 256 workers polled
25,600 listings a second around every commit (bench/scale.py).
"""
from __future__ import annotations

import statistics
import time
from collections import deque

FAST_S = 0.01     # the poll interval where the event is due
WINDOW_S = 1.0    # ... from WINDOW_S before the usual time to WINDOW_S after it
KEEP = 5          # rounds the usual time is the median of
FAST_HZ = 800.0   # the fast polls a second of all the processes that wait for one event, together


class Expect:
    """When one event usually comes, measured from the start of each wait; `interval(elapsed)` is how long to sleep
    before looking again. `sharers`: how many processes wait for the same event this way."""

    def __init__(self, poll: float, sharers: int = 1):
        self.poll = poll
        self.fast = max(FAST_S, max(1, int(sharers)) / FAST_HZ)
        self.times: deque[float] = deque(maxlen=KEEP)
        self.waits = 0

    def interval(self, elapsed: float) -> float:
        if not self.times or self.poll <= self.fast:
            return self.poll
        usual = statistics.median(self.times)
        return self.fast if usual - WINDOW_S <= elapsed <= usual + WINDOW_S else self.poll

    def seen(self, elapsed: float) -> None:
        """The event came `elapsed` seconds after the wait began."""
        self.waits += 1
        if self.waits > 1:
            self.times.append(max(0.0, elapsed))


class Closing:
    """The coordinator's other sign that a round's last deltas are due: all but a few are in (at most max(1,
    N / 32) missing). Where the rounds are irregular (wide runs: 256 workers whose arrivals spread differently every
    round), `Expect`'s window around the usual time misses the last arrival, which then waits up to a whole
    poll_interval_s to be noticed (bench/scale.py). While due, the deltas folder is listed every FAST_S, for at
    most BUDGET_S a round (then at the normal interval: a straggler that stays away does not cost 100 listings a
    second), so a round costs at most BUDGET_S / FAST_S extra listings, as Expect's window does."""

    BUDGET_S = 2 * WINDOW_S

    def __init__(self, expected: int, poll: float):
        self.few = max(1, int(expected) // 32)
        self.fast = min(FAST_S, poll)
        self.left = self.BUDGET_S

    def due(self, missing: int) -> bool:
        return 0 < missing <= self.few and self.left > 0

    def spent(self, seconds: float) -> None:
        self.left -= max(0.0, seconds)


def wait_commit(paths, r: int, hint: int | None, expect: Expect, stop) -> int | None:
    """A worker's wait for round r's commit (train/diloco/worker.py; bench/scale.py's fake workers run the same):
    `paths.latest_committed(hint)` (the rounds after `hint`, a round known committed: a listing or two, not one per
    round folder) polled at `expect`'s intervals until it is past r or `stop()` (the coordinator's watch) is
    truthy. Returns the latest committed round seen (the next hint)."""
    t0, latest = time.monotonic(), None
    while not stop():
        latest = paths.latest_committed(hint)
        if (latest or 0) > r:
            break
        hint = latest if latest is not None else hint
        time.sleep(expect.interval(time.monotonic() - t0))
    expect.seen(time.monotonic() - t0)
    return latest
