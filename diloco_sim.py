"""DiLoCo on one machine: N worker processes plus the coordinator on one BASE_DIR (the cluster's code path).

    python diloco_sim.py                         # the embedded default: tiny Llama on Shakespeare, 2 workers
    python diloco_sim.py --workers 4 --rounds 20 --set outer.lr=1.0 --set outer.momentum=0
    python diloco_sim.py --fake-data --rounds 2  # smoke test

Ctrl-C stops every child. Running the same command again resumes from the last committed round.
"""
from __future__ import annotations

import argparse
import logging
import os


def main() -> int:
    from train.cli import add_config_args, load_from_args, preflight
    from train.coordinator import Coordinator, config_summary
    from train.model import quiet_transformers
    from train.procs import LocalWorkers
    from train.store import RunPaths, prepare_run_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker (default: cores / workers)")
    args = ap.parse_args()
    cfg, overrides = load_from_args(args)
    quiet_transformers()
    log = logging.getLogger("diloco_sim")
    preflight(cfg)
    log.info("%s", config_summary(cfg))
    n = cfg.outer.num_workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // (n * cfg.inner.nproc_per_node))
    paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
    workers = LocalWorkers("train.worker", cfg.source if cfg.source != "<defaults>" else args.config, overrides, n,
                           [paths.worker_log(i) for i in range(n)], threads=threads, nproc=cfg.inner.nproc_per_node)
    workers.start()
    log.info("started %d worker processes (logs: %s)", n, paths.logs)
    try:
        rec = Coordinator(cfg, monitor=workers.check).run()
        if not workers.wait(60):
            log.warning("workers did not exit within 60s of the last round; stopping them")
        workers.check()
    finally:
        workers.stop()
    log.info("done: eval loss %s after %s rounds; final model: %s; plot: %s", rec.get("eval_loss"),
             rec.get("round"), paths.final, paths.plot)
    return 0


if __name__ == "__main__":
    from train.errors import run_main
    run_main(main, "diloco_sim")
