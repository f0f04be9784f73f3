"""Where the time of a pipelined piece of work goes: busy seconds per named phase, summed over threads.

    ph = Phases()
    with ph("read"):
        ...
    ph.busy  ->  {"read": 0.12, ...}

A phase that runs on several threads at once (reading beside adding beside writing) adds up its busy time on each,
so the phases of a pipelined step can sum to more than its wall time: that difference is what the overlap saved.
`NO_PHASES` is the null object the code uses when nobody asks (a context manager that costs a function call).
bench/outer_step.py prints the breakdown of the coordinator's tail and of the worker's side of a round with it.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext


class Phases:
    def __init__(self):
        self.busy: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.busy[name] = self.busy.get(name, 0.0) + seconds

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)


class _NoPhases:
    busy: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        pass

    def __call__(self, name: str):
        return nullcontext()


NO_PHASES = _NoPhases()
