"""EDT (evolutionary distributed training): selection and crossover as pure functions (for notebooks), run
loaders, and the coordinator CLI (for runs).

Notebook:
    import edt
    pairs = edt.select_pairs(fitness=[0.21, 0.19, 0.2], n_children=3, elitism=1)      # [(0, 0), (2, 0), ...]
    child = edt.slerp(0.5, tensor_a, tensor_b)                                         # mergekit semantics
    child, mom = edt.outer_sgd_crossover(pre_a, pre_b, mut_a, mut_b, lr=0.7, momentum=0.9)
    lineage = edt.load_lineage("runs/edt-shakespeare")          # every genome: parents, DNA, fitness, ...
    members = edt.load_population("runs/edt-shakespeare")       # the last generation, with model_dir per member

Cluster (the launcher runs this next to the workers; see docs/edt.md):
    python edt.py --config evolution.json                       # coordinator: select, cross over, commit
    python -m train.edt.worker --config evolution.json --worker 0
"""
from __future__ import annotations

try:  # first: `train` is this project's package even beside a user's train.py (_edt_bootstrap.py)
    import _edt_bootstrap  # noqa: F401
except ModuleNotFoundError:  # an editable install older than it (pip install -e . again): no guard
    pass

from pathlib import Path

from train.edt.genes import (GENES, crossover_dna, decode, fitness_function, mutate_dna, rank_order,  # noqa: F401
                                 rank_weights, select_pairs, tournament)
from train.edt.lineage import load_lineage, load_population, plot_fitness, plot_lineage  # noqa: F401
from train.merge.crossover import (curve_value, interpolate, lerp, merge_files, outer_sgd_crossover,  # noqa: F401
                                   outer_sgd_tensor, slerp, t_for)
from train.core.store import RunPaths, base_path, read_jsonl
from train.launch.cli import add_edt_args  # noqa: F401  (public: the EDT flags, for scripts that wrap edt.py)


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics.jsonl records of an EDT run folder (BASE_DIR/<project>), one per evaluated generation."""
    return read_jsonl(RunPaths(base_path(run_dir)).metrics)  # a folder, or s3://bucket/prefix/<project>


def main() -> int:
    from train.launch.cli import coordinator_main
    return coordinator_main("edt", "EDT coordinator: waits for the members' results on BASE_DIR, selects, crosses "
                                   "over and commits each generation.", add_edt_args)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "edt-coordinator", fast_exit=True)
