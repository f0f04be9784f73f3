"""EDT on one machine: N worker processes plus the EDT coordinator on one BASE_DIR (the cluster's code path).

    python edt_sim.py                                   # the embedded default: tiny Llama on Shakespeare
    python edt_sim.py --workers 2 --population 4 --generations 5      # more members than workers: jobs queue
    python edt_sim.py --fake-data --generations 2 --set edt.mutation_steps=5   # smoke test

Ctrl-C stops every child. Running the same command again resumes from the last committed generation.
"""
from __future__ import annotations

import argparse
import logging
import os


def main() -> int:
    from edt import add_edt_args
    from train.cli import load_from_args, preflight
    from train.edt_coordinator import EDTCoordinator, config_summary
    from train.model import quiet_transformers
    from train.procs import LocalWorkers, WorkerDied
    from train.store import RunPaths, prepare_run_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_edt_args(ap)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / workers)")
    args = ap.parse_args()
    cfg, overrides = load_from_args(args)
    quiet_transformers()
    log = logging.getLogger("edt_sim")
    preflight(cfg, "edt")
    log.info("%s", config_summary(cfg))
    n = cfg.outer.num_workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
    workers = LocalWorkers("train.edt_worker", cfg.source if cfg.source != "<defaults>" else args.config,
                           overrides, n, [paths.worker_log(i) for i in range(n)], threads=threads)

    def monitor() -> None:
        workers.check()  # a worker that failed: its log's tail
        if workers.procs and all(p.poll() is not None for p in workers.procs):
            raise WorkerDied("every worker exited while the coordinator still waits for results; see "
                             f"{paths.logs}")

    workers.start()  # they import torch while the coordinator prepares the data and generation 0
    log.info("started %d worker processes (logs: %s)", n, paths.logs)
    try:
        rec = EDTCoordinator(cfg, monitor=monitor).run()
        if not workers.wait(60):
            log.warning("workers did not exit within 60s of the last generation; stopping them")
        workers.check()
    finally:
        workers.stop()
    log.info("done: best eval loss %s in generation %s; final model: %s; plots: %s, %s",
             rec.get("best_eval_loss"), rec.get("generation"), paths.final, paths.root / "lineage.png",
             paths.root / "fitness.png")
    return 0


if __name__ == "__main__":
    from train.errors import run_main
    run_main(main, "edt_sim")
