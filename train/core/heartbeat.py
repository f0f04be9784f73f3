"""A worker's heartbeat: its progress file, rewritten in the background so a beat never stalls a training step.

The coordinators read it for progress bars and leases, `launch_to_machines.py status` for the last line per host.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import torch

from train.core.store import atomic_write_json


class Heartbeat:
    """workers/wXXX/progress.json, rewritten at most every `every` seconds (progress bars, `status`).

    Beats during training are written by a background thread: the fsyncs of an atomic write would otherwise stall
    the step (and, in a torchrun group, every rank waiting for rank 0 in the next all-reduce). A beat due while the
    previous one is still being written is skipped; forced beats (status changes) wait for it and are written here.
    """

    def __init__(self, path, worker: int, every: float = 1.0):
        self.path, self.worker, self.every = path, worker, every
        self._last = 0.0
        self._writer: threading.Thread | None = None

    def beat(self, force: bool = False, **fields) -> None:
        now = time.time()
        if not force and now - self._last < self.every:
            return
        busy = self._writer is not None and self._writer.is_alive()
        if busy and not force:
            return
        self._last = now
        loss = fields.get("loss")
        if isinstance(loss, torch.Tensor):
            fields["loss"] = float(loss)
        record = {"worker": self.worker, "pid": os.getpid(), "host": socket.gethostname(), "time": now, **fields}
        if force:
            if busy:
                self._writer.join()
            atomic_write_json(self.path, record)
            return
        self._writer = threading.Thread(target=atomic_write_json, args=(self.path, record), daemon=True)
        self._writer.start()
