"""EDT on one machine: N worker processes plus the EDT coordinator on one BASE_DIR (the cluster's code path).

    python edt_sim.py                                   # the embedded default: tiny Llama on Shakespeare
    python edt_sim.py --workers 2 --population 4 --generations 5      # more members than workers: jobs queue
    python edt_sim.py --fake-data --generations 2 --set edt.mutation_steps=5   # smoke test

Any process that dies (a worker, the coordinator, a supervisor) is restarted (--max-restarts). Ctrl-C stops every
child. Running the same command again resumes from the last committed generation.
"""
from __future__ import annotations

try:  # first: `train` is this project's package even beside a user's train.py (_edt_bootstrap.py)
    import _edt_bootstrap  # noqa: F401
except ModuleNotFoundError:  # an editable install older than it (pip install -e . again): no guard
    pass


def main() -> int:
    from train.launch.sim import sim_main
    return sim_main("edt", __doc__)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "edt_sim", fast_exit=True)
