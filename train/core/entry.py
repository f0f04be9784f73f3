"""The body every worker module shares: `python -m <worker module> --config ... --worker i [--set K=V] [--threads N]`.

train/diloco/worker.py and train/edt/worker.py call it with their worker class; train/config/strategies.py names the
modules. Coordinators' bodies are train/launch/cli.py's coordinator_main (they are started from the top-level
scripts).
"""
from __future__ import annotations

import argparse

from train.core import logship, sharedfs
from train.config import DEFAULT_CONFIG, config_path, load_config


def worker_main(strategy: str, worker_cls: type, doc: str, argv: list[str] | None = None) -> int:
    """The body of a worker module (`python -m <worker module> --config ... --worker i`): the same flags for every
    strategy. The worker's heartbeat is its lease (train/core/heartbeat.py: from its first beat, after it holds its
    lock, until it exits, with a final record "exited" or "left"); SIGTERM = leave: the worker exits 0 at its next
    safe point (between inner steps, or in a wait) and the run resumes from its saved state."""
    from train.core.heartbeat import install_leave_handler
    from train.core.model import quiet_transformers
    from train.config.strategies import STRATEGIES

    ap = argparse.ArgumentParser(prog=f"python -m {STRATEGIES[strategy].worker_module}", description=doc)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="evolution.json of the run (default: %(default)s here, "
                                                             "else the repo's)")
    ap.add_argument("--worker", type=int, required=True, help="this worker's id, 0..num_workers-1")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: config / torch default)")
    args = ap.parse_args(argv)
    box: list = []  # the worker's Heartbeat once it exists; before it, SIGTERM exits at once
    install_leave_handler(lambda: box[0] if box else None)
    quiet_transformers()
    cfg = load_config(config_path(args.config), args.set, strategy=strategy)
    sharedfs.configure_from(cfg.outer)
    if args.threads:
        cfg.inner.threads = args.threads
    worker = worker_cls(cfg, args.worker)
    logship.start()  # on an s3:// BASE_DIR: this process's log goes to the bucket too (the worker attached it)
    hb = worker.hb.start_lease(at_first_beat=True)
    box.append(hb)
    waiting = getattr(worker, "monitor", None)
    if callable(waiting):  # the worker's wait loops call it every poll: a safe point to leave
        worker.monitor = lambda: (hb.leave_point(), waiting())[1]
    try:
        worker.run()
    except BaseException as e:
        if not isinstance(e, SystemExit):
            hb.stop("exited", error=f"{type(e).__name__}: {e}"[:500])
        raise
    hb.stop("exited")
    return 0
