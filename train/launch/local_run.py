"""One box, any strategy: N worker processes plus the coordinator on one BASE_DIR, the cluster's code path.

Both simulators are this function with a strategy name. The workers are real OS processes (`python -m <worker
module>`, see train/core/strategies.py) that import torch while the coordinator prepares the data; the coordinator
runs in this process and checks its children while it waits. A worker that dies is restarted with the same command
by its supervisor (`--max-restarts`, default outer.max_restarts = 3; backoff 1 s, 2 s, 4 s, ...; a line in its log,
train/launch/procs.py) and resumes from its own state on BASE_DIR; one that still fails after its restarts stops
the run with its log's tail (WorkerDied, exit 1), and so does the case where every worker has exited while the
coordinator still waits. Ctrl-C or any error stops every child; the same command resumes.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from train.core.config import RunConfig
from train.core.errors import WorkerDied
from train.launch.procs import LocalWorkers
from train.core.store import RunPaths, prepare_run_dir
from train.core.strategies import Strategy

log = logging.getLogger("local_run")


def default_threads(num_workers: int, procs_per_worker: int = 1) -> int:
    """torch threads per process: the cores shared evenly by every process of every worker (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers * procs_per_worker))


def run_local(strat: Strategy, cfg: RunConfig, config_path: str | Path, overrides: list[str],
              threads: int = 0, max_restarts: int | None = None) -> tuple[dict, RunPaths]:
    """Run `strat` on this machine until the coordinator finishes; returns (its last record, the run's paths).
    `max_restarts`: restarts per worker after a failure (None: outer.max_restarts)."""
    paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
    n = cfg.outer.num_workers
    nproc = cfg.inner.nproc_per_node if strat.multi_process else 1
    restarts = cfg.outer.max_restarts if max_restarts is None else max_restarts
    workers = LocalWorkers(strat.worker_module, str(config_path), overrides, n,
                           [paths.worker_log(i) for i in range(n)], threads=threads or default_threads(n, nproc),
                           nproc=nproc, max_restarts=restarts)

    def monitor() -> None:
        workers.check()  # a worker that failed: its log's tail
        if workers.procs and all(p.poll() is not None for p in workers.procs):
            raise WorkerDied(f"every worker exited while the coordinator still waits for them; see {paths.logs}")

    workers.start()  # they import torch while the coordinator prepares the data and round / generation 0
    log.info("started %d worker processes (logs: %s; restarts per worker: %d)", n, paths.logs, restarts)
    try:
        rec = strat.coordinator(cfg, monitor=monitor).run()
        if not workers.wait(60):
            log.warning("workers did not exit within 60s of the last %s; stopping them", strat.title)
        workers.check()
    finally:
        workers.stop()
    return rec, paths
