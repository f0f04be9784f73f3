"""A process's log on an s3:// BASE_DIR, in the bucket too.

On a disk every process's output goes to BASE_DIR/<project>/logs/<role>.log, which every machine reads. On a bucket
that file is in the mirror of the machine that writes it (each process appends to it all the time: no object store
takes that), so `python -m train.status` on another machine saw no log tail, and neither the restarts nor the
deaths its supervisor had logged there. So a process whose output goes to a log file inside a bucket's mirror also
puts the file's last SHIP_BYTES at that log's key, every SHIP_EVERY_S while the file grows and once as it exits
(`launch_to_machines.py logs` still reads the whole file on each host over SSH). Workers (train/core/entry.py) and
coordinators call `start()` once their run is attached. The lines of a supervisor
(train/launch/supervise.py) go up with its next child's first upload. Readers: train/status/timeline.py `log_tail`
takes the newer of this machine's copy and the bucket's.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path

from train.core import objstore

log = logging.getLogger("store")

SHIP_EVERY_S = 30.0
SHIP_BYTES = 256 << 10
LOG_ENV = "EDT_LOG_FILE"  # the launchers set it; else this process's stdout, when it is a file

_started: "LogShipper | None" = None
_start_lock = threading.Lock()


def own_log() -> Path | None:
    """The log file this process writes to, if it lies in a bucket's mirror (None otherwise)."""
    name = os.environ.get(LOG_ENV)
    if not name:
        try:
            name = os.readlink("/proc/self/fd/1")  # Linux: where stdout goes (a launcher's `>> logs/x.log`)
        except OSError:
            return None
    path = Path(name)
    if not path.is_absolute() or path.parent.name != "logs" or not path.is_file():
        return None
    return path if objstore.store_for(path) is not None else None


class LogShipper:
    """Puts the tail of `path` at its key every `every` seconds while it grows, and at stop()."""

    def __init__(self, path: Path, every: float = SHIP_EVERY_S, nbytes: int = SHIP_BYTES):
        self.path, self.every, self.nbytes = path, every, nbytes
        self._sent: tuple[int, int] | None = None  # (size, mtime_ns) of the last upload
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failed = False
        self._thread = threading.Thread(target=self._loop, name="log-ship", daemon=True)

    def start(self) -> "LogShipper":
        self._thread.start()
        return self

    def ship(self) -> bool:
        """One upload if the file changed since the last; False if it failed (said once; the next one retries)."""
        with self._lock:
            try:
                st = os.stat(self.path)
                if self._sent == (st.st_size, st.st_mtime_ns):
                    return True
                with open(self.path, "rb") as f:
                    f.seek(max(0, st.st_size - self.nbytes))
                    tail = f.read(self.nbytes)
                store = objstore.store_for(self.path)
                if store is None:
                    return False
                store.put_bytes(self.path, tail)  # one PUT, no retry loop: the next tick is the retry
                self._sent = (st.st_size, st.st_mtime_ns)
                if self._failed:
                    log.info("log %s: in the bucket again", objstore.where(self.path))
                self._failed = False
                return True
            except Exception as e:  # noqa: BLE001  (a log upload never stops the process)
                if not self._failed:
                    log.warning("log %s: cannot put it in the bucket (%s); retrying every %.0f s",
                                objstore.where(self.path), e, self.every)
                self._failed = True
                return False

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.ship()

    def stop(self) -> None:
        self._stop.set()
        self.ship()


def start() -> LogShipper | None:
    """Ship this process's log (once per process; nothing where its log is not in a bucket's mirror)."""
    global _started
    with _start_lock:
        if _started is not None:
            return _started
        path = own_log()
        if path is None:
            return None
        _started = LogShipper(path).start()
        atexit.register(_started.stop)
        return _started
