"""One box, any strategy: N worker processes plus the coordinator on one BASE_DIR, the cluster's code path.

Both simulators are this function with a strategy name. Every role is a real OS process, as on a cluster: the
workers (`python -m <worker module>`, see train/config/strategies.py; their output in logs/worker-NNN.log) and the
coordinator (`python -m diloco` / `python -m edt` with the same config and overrides; its progress bars and lines on
this terminal). This process only starts, watches and stops them, so any of them may die and be restarted alone:

* a worker that dies is restarted with the same command by its supervisor (`--max-restarts`, default
  outer.max_restarts = 3; backoff 1 s, 2 s, 4 s, ...; a line in its log, train/launch/procs.py) and resumes from its
  own state on BASE_DIR; one that still fails after its restarts stops the run with its log's tail (WorkerDied,
  exit 1), and so does the case where every worker has exited while the coordinator still waits for them;
* the coordinator runs under the same supervisor and policy: killed, it is restarted and resumes from its last
  commit, while the workers wait for it (they say so in their logs: train/core/coordinator_lease.py, CoordinatorWatch).
  Its user error (exit 2) ends the simulation with exit 2 and the coordinator's own one-line message; a failure
  after its restarts with exit 1;
* a supervisor that is killed takes its child with it (the kernel's parent-death signal); this process restarts
  both, with the same policy, and says so: `the supervisor of worker 1 (pid 4242) was killed by signal 9; its
  worker stopped with it; restarting both, 1/3`.
Ctrl-C or any error stops every child; the same command resumes.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from train.config import RunConfig
from train.core.errors import EXIT_USER_ERROR, WorkerDied
from train.core.coordinator_lease import STATUS_WAITING, coordinator_lease_path
from train.launch.procs import LocalProcess, LocalWorkers, child_env, stop_all
from train.core.store import RunPaths, prepare_run_dir, read_json, read_jsonl
from train.config.strategies import Strategy

log = logging.getLogger("local_run")

POLL_S = 0.25          # how often the simulator looks at its children
STALL_S = 3.0          # every worker gone while the coordinator still says "collecting" this long: the run is stuck


def default_threads(num_workers: int, procs_per_worker: int = 1) -> int:
    """torch threads per process: the cores shared evenly by every process of every worker (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers * procs_per_worker))


def coordinator_command(strat: Strategy, config_path: str, overrides: list[str]) -> list[str]:
    """The coordinator's CLI, as `launch_to_machines.py` starts it: `python -m diloco --config ... --set ...`."""
    return [sys.executable, "-m", strat.coordinator_module, "--config", config_path,
            *[a for ov in overrides for a in ("--set", ov)]]


def run_local(strat: Strategy, cfg: RunConfig, config_path: str | Path, overrides: list[str],
              threads: int = 0, max_restarts: int | None = None,
              slow: dict | None = None) -> tuple[dict, RunPaths]:
    """Run `strat` on this machine until the coordinator finishes; returns (its last metrics record, the run's
    paths). `max_restarts`: restarts per process after a failure (None: outer.max_restarts). `slow`: workers held
    to a fraction of full speed (train/launch/throttle.py)."""
    paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
    config_path = str(Path(config_path).resolve())  # the same file for every child, wherever they start
    n = cfg.outer.num_workers
    nproc = cfg.inner.nproc_per_node if strat.multi_process else 1
    restarts = cfg.outer.max_restarts if max_restarts is None else max_restarts
    workers = LocalWorkers(strat.worker_module, config_path, overrides, n,
                           [paths.worker_log(i) for i in range(n)], threads=threads or default_threads(n, nproc),
                           nproc=nproc, max_restarts=restarts)
    coordinator = LocalProcess("the coordinator", coordinator_command(strat, config_path, overrides), None,
                               child_env(), restarts)
    wait_lock_free(paths.root / "coordinator.lock")  # an earlier simulator's coordinator, killed, on its way out
    from train.exchange.store import DiLoCoPaths
    from train.launch.throttle import Throttle
    throttle = Throttle(slow or {}, workers.workers, DiLoCoPaths(paths.root))
    try:
        coordinator.start()
        workers.start()  # they import torch while the coordinator prepares the data and round / generation 0
        throttle.start()
        log.info("started the coordinator (pid %d) and %d worker processes (logs: %s; restarts per process: %d)",
                 coordinator.pid, n, paths.logs, restarts)
        stall = Stall(paths)
        while (rc := coordinator.poll()) is None:
            workers.check()  # restarts a killed supervisor; a worker that failed for good: its log's tail
            stall.check(workers)
            time.sleep(POLL_S)
        if rc == EXIT_USER_ERROR:  # its one-line message is above: say nothing more, exit as it did
            raise SystemExit(EXIT_USER_ERROR)
        if rc != 0:
            raise WorkerDied(f"the coordinator {coordinator.ending()}; its output is above. Fix the cause and run "
                             f"the same command again: the run resumes from its last committed state.")
        if not workers.wait(60):
            log.warning("workers did not exit within 60s of the last %s; stopping them", strat.title)
        workers.check()
    finally:
        throttle.stop()  # (a stopped process would hold its SIGTERM until continued)
        stop_all([coordinator, *workers.workers])
    recs = read_jsonl(paths.metrics)
    return (recs[-1] if recs else {}), paths


class Stall:
    """Every worker exited (0: done or left) while the coordinator's lease still says it waits for them, for
    STALL_S: nobody will deliver what it waits for (WorkerDied)."""

    def __init__(self, paths: RunPaths):
        self.paths, self.since = paths, None

    def check(self, workers: LocalWorkers) -> None:
        if not workers.all_exited() or self.coordinator_status() != STATUS_WAITING:
            self.since = None
            return
        if self.since is None:
            self.since = time.monotonic()
        elif time.monotonic() - self.since >= STALL_S:
            raise WorkerDied(f"every worker exited while the coordinator still waits for them; see {self.paths.logs}")

    def coordinator_status(self) -> str | None:
        try:
            return read_json(coordinator_lease_path(self.paths.root)).get("status")
        except (OSError, ValueError, AttributeError):
            return None


def wait_lock_free(path: Path, timeout: float = 15.0) -> None:
    """Wait (up to `timeout`) until nobody holds the flock on `path`: a killed simulator's coordinator dies a moment
    after it (the parent-death signal through its supervisor). A live coordinator still holds it after that: the
    new one then refuses to start with its own message ("the coordinator is already running")."""
    import fcntl

    if not path.is_file():
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)
        except OSError:
            return
