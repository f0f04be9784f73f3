"""EDT on one machine: N worker processes plus the EDT coordinator on one BASE_DIR (the cluster's code path).

    python edt_sim.py                                   # the embedded default: tiny Llama on Shakespeare
    python edt_sim.py --workers 2 --population 4 --generations 5      # more members than workers: jobs queue
    python edt_sim.py --fake-data --generations 2 --set edt.mutation_steps=5   # smoke test

A worker that dies is restarted (--max-restarts). Ctrl-C stops every child. Running the same command again
resumes from the last committed generation.
"""
from __future__ import annotations

import argparse
import logging


def main() -> int:
    from edt import add_edt_args
    from train.launch.cli import load_from_args, preflight
    from train.launch.local_run import run_local
    from train.core.model import quiet_transformers
    from train.core.strategies import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_edt_args(ap)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / workers)")
    ap.add_argument("--max-restarts", type=int, default=None, metavar="N",
                    help="restart a worker that dies up to N times (backoff 1 s, 2 s, 4 s, ...; default: "
                         "outer.max_restarts, 3); 0: a death stops the run")
    args = ap.parse_args()
    strat = STRATEGIES["edt"]
    cfg, overrides = load_from_args(args, strategy=strat.name)
    quiet_transformers()
    preflight(cfg, strat.name)
    log = logging.getLogger("edt_sim")
    log.info("%s", strat.summary(cfg))
    rec, paths = run_local(strat, cfg, cfg.source if cfg.source != "<defaults>" else args.config, overrides,
                           args.threads, args.max_restarts)
    log.info("done: best eval loss %s in generation %s; final model: %s; plots: %s, %s",
             rec.get("best_eval_loss"), rec.get("generation"), paths.final, paths.root / "lineage.png",
             paths.root / "fitness.png")
    return 0


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "edt_sim")
