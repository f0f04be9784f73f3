"""DiLoCo on one machine: N worker processes plus the coordinator on one BASE_DIR (the cluster's code path).

    python diloco_sim.py                         # the embedded default: tiny Llama on Shakespeare, 2 workers
    python diloco_sim.py --workers 4 --rounds 20 --set outer.lr=1.0 --set outer.momentum=0
    python diloco_sim.py --fake-data --rounds 2  # smoke test

A worker that dies is restarted (--max-restarts). Ctrl-C stops every child. Running the same command again
resumes from the last committed round.
"""
from __future__ import annotations

import argparse
import logging


def main() -> int:
    from train.launch.cli import add_config_args, load_from_args, preflight
    from train.launch.local_run import run_local
    from train.core.model import quiet_transformers
    from train.core.strategies import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_args(ap)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker process (default: cores / worker processes)")
    ap.add_argument("--max-restarts", type=int, default=None, metavar="N",
                    help="restart a worker that dies up to N times (backoff 1 s, 2 s, 4 s, ...; default: "
                         "outer.max_restarts, 3); 0: a death stops the run")
    args = ap.parse_args()
    strat = STRATEGIES["diloco"]
    cfg, overrides = load_from_args(args, strategy=strat.name)
    quiet_transformers()
    preflight(cfg, strat.name)
    log = logging.getLogger("diloco_sim")
    log.info("%s", strat.summary(cfg))
    rec, paths = run_local(strat, cfg, cfg.source if cfg.source != "<defaults>" else args.config, overrides,
                           args.threads, args.max_restarts)
    log.info("done: eval loss %s after %s rounds; final model: %s; plot: %s", rec.get("eval_loss"),
             rec.get("round"), paths.final, paths.plot)
    return 0


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "diloco_sim")
