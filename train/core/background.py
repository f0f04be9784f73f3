"""One background job at a time, whose error reaches the thread that owns it.

The worker's I/O off the training thread (train/diloco/worker.py): the state snapshot, and with delayed overlap the
whole publication of a round (delta encode + write + fsync, state.json, the sidecar) and the prefetch of the next
global model. A bounded queue of one: `submit` first waits for the previous job (back-pressure: training never runs
more than one round ahead of its own disk writes) and re-raises its error, so a failed write stops the worker at its
next round instead of being lost in a thread. Every file a job writes appears atomically, so a crash (or a kill)
mid-job leaves only complete files, as on the training thread.
"""
from __future__ import annotations

import threading
from typing import Callable


class OneSlot:
    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stop = threading.Event()  # set by `cancel`: a job that waits should look at it

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn in the background once the previous job is done (its error, if any, is raised here)."""
        self.join()
        self.stop.clear()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised by the next join
                self._error = e

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        """Wait for the job in flight; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def cancel(self) -> None:
        """Ask a waiting job to give up (`stop` is set) and wait for it; its error is dropped."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._error = None
