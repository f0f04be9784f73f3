"""DiLoCo on one machine: N worker processes plus the coordinator on one BASE_DIR (the cluster's code path).

    python diloco_sim.py                         # the embedded default: tiny Llama on Shakespeare, 2 workers
    python diloco_sim.py --workers 4 --rounds 20 --set outer.lr=1.0 --set outer.momentum=0
    python diloco_sim.py --fake-data --rounds 2  # smoke test

Any process that dies (a worker, the coordinator, a supervisor) is restarted (--max-restarts). Ctrl-C stops every
child. Running the same command again resumes from the last committed round.
"""
from __future__ import annotations

try:  # first: `train` is this project's package even beside a user's train.py (_edt_bootstrap.py)
    import _edt_bootstrap  # noqa: F401
except ModuleNotFoundError:  # an editable install older than it (pip install -e . again): no guard
    pass


def main() -> int:
    from train.launch.sim import sim_main
    return sim_main("diloco", __doc__)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "diloco_sim", fast_exit=True)
