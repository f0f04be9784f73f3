"""The body of both simulators (`python diloco_sim.py`, `python edt_sim.py`): parse, check, run every process of
the strategy on this machine (train/launch/local_run.py), say where the results are."""
from __future__ import annotations

import argparse
import logging


def sim_main(strategy: str, doc: str) -> int:
    from train.config.strategies import STRATEGIES
    from train.launch.cli import ARGS, load_from_args, preflight
    from train.launch.local_run import run_local

    strat = STRATEGIES[strategy]
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ARGS[strategy](ap)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker process (default: cores / worker processes)")
    ap.add_argument("--max-restarts", type=int, default=None, metavar="N",
                    help="restart a process that dies (a worker, the coordinator, a supervisor) up to N times "
                         "(backoff 1 s, 2 s, 4 s, ...; default: outer.max_restarts, 3); 0: a death stops the run")
    if strategy == "diloco":
        ap.add_argument("--slow", default="", metavar="W=F[@R],...",
                        help="hold worker W to fraction F of full speed (from round R on): e.g. 1=0.5,3=0.5@20; its "
                             "processes are stopped for 1 - F of every 0.2 s, as a slower machine (docs/hetero.md)")
    args = ap.parse_args()
    cfg, overrides = load_from_args(args, strategy=strategy)
    slow = {}
    if getattr(args, "slow", ""):
        from train.launch.throttle import parse_slow
        slow = parse_slow(args.slow, cfg.outer.num_workers)
    preflight(cfg, strategy)
    log = logging.getLogger(f"{strategy}_sim")
    from train.core.objstore import where
    # the run's one-line summary is the coordinator's first line (printed here with its log): this process only
    # starts and watches the others, and imports neither torch nor transformers (a second or two of CPU per run)
    rec, paths = run_local(strat, cfg, cfg.source if cfg.source != "<defaults>" else args.config, overrides,
                           args.threads, args.max_restarts, slow=slow)
    if strategy == "edt":
        log.info("done: best eval loss %s in generation %s; final model: %s; plots: %s, %s, %s",
                 rec.get("best_eval_loss"), rec.get("generation"), where(paths.final), paths.root / "lineage.png",
                 paths.root / "fitness.png", paths.root / "timeline.png")
    else:
        log.info("done: eval loss %s after %s rounds; final model: %s; plots: %s, %s", rec.get("eval_loss"),
                 rec.get("round"), where(paths.final), paths.plot, paths.root / "timeline.png")
    return 0
