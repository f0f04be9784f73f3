"""Polling that tightens where an awaited event is due (bench/peers.py: the exchange's latency against torchft).

A shared disk pushes nothing: an NFS client sees a file another client created only when it asks (a listing), so
the time to notice an event is the poll interval (outer.poll_interval_s, 0.2 s: on average 0.1 s per wait, twice a
round: the coordinator noticing the round's last delta, each worker noticing the commit). Polling faster all the
time would multiply the metadata load on the NFS server for the whole round; the events, though, come at about the
same time each round. `Expect` keeps the median of the last rounds' times of one event and polls every FAST_S only
within WINDOW_S of it (at most 2 x WINDOW_S / FAST_S = 200 extra listings of one small folder a round, about 10 ms
of CPU), at the normal interval the rest of the round. A round whose event comes outside the window costs nothing
more than before. The first wait is not counted: it holds the start-up (processes importing torch, the first θ).
"""
from __future__ import annotations

import statistics
from collections import deque

FAST_S = 0.01     # the poll interval where the event is due
WINDOW_S = 1.0    # ... from WINDOW_S before the usual time to WINDOW_S after it
KEEP = 5          # rounds the usual time is the median of


class Expect:
    """When one event usually comes, measured from the start of each wait; `interval(elapsed)` is how long to sleep
    before looking again."""

    def __init__(self, poll: float):
        self.poll = poll
        self.times: deque[float] = deque(maxlen=KEEP)
        self.waits = 0

    def interval(self, elapsed: float) -> float:
        if not self.times or self.poll <= FAST_S:
            return self.poll
        usual = statistics.median(self.times)
        return FAST_S if usual - WINDOW_S <= elapsed <= usual + WINDOW_S else self.poll

    def seen(self, elapsed: float) -> None:
        """The event came `elapsed` seconds after the wait began."""
        self.waits += 1
        if self.waits > 1:
            self.times.append(max(0.0, elapsed))
