"""The body every worker module shares: `python -m <worker module> --config ... --worker i [--set K=V] [--threads N]`.

train/diloco/worker.py and train/edt/worker.py call it with their worker class; train/core/strategies.py names the
modules. Coordinators' bodies are train/launch/cli.py's coordinator_main (they are started from the top-level
scripts).
"""
from __future__ import annotations

import argparse

from train.core.config import load_config


def worker_main(strategy: str, worker_cls: type, doc: str, argv: list[str] | None = None) -> int:
    """The body of a worker module (`python -m <worker module> --config ... --worker i`): the same flags for every
    strategy; SIGTERM exits 143 (the run resumes from the worker's saved state)."""
    import signal
    import sys

    from train.core.model import quiet_transformers
    from train.core.strategies import STRATEGIES

    ap = argparse.ArgumentParser(prog=f"python -m {STRATEGIES[strategy].worker_module}", description=doc)
    ap.add_argument("--config", default="evolution.json", help="evolution.json of the run")
    ap.add_argument("--worker", type=int, required=True, help="this worker's id, 0..num_workers-1")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: config / torch default)")
    args = ap.parse_args(argv)
    quiet_transformers()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = load_config(args.config, args.set, strategy=strategy)
    if args.threads:
        cfg.inner.threads = args.threads
    worker_cls(cfg, args.worker).run()
    return 0
