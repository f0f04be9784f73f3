"""DiLoCo: the outer step as pure functions (for notebooks) and the coordinator CLI (for runs).

Notebook:
    import diloco
    new_params, momentum = diloco.diloco_round(params, [delta_w0, delta_w1], weights=None, momentum=None,
                                               lr=0.7, mu=0.9)
    metrics = diloco.load_metrics("runs/diloco-shakespeare")

Your own training loop (README "DiLoCoOptimizer"; workers synchronise through BASE_DIR, no extra process):
    opt = diloco.DiLoCoOptimizer(model, base_dir=..., run_id=..., worker=0, num_workers=2, num_inner_steps=50,
                                 inner_optimizer=partial(torch.optim.AdamW, lr=4e-4),
                                 outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))

Cluster (the launcher runs this for you next to the workers; see docs/multi-machine.md):
    python diloco.py --config evolution.json           # coordinator: reduce + commit every round
    python -m train.diloco.worker --config evolution.json --worker 0
"""
from __future__ import annotations

try:  # first: `train` is this project's package even beside a user's train.py (_edt_bootstrap.py)
    import _edt_bootstrap  # noqa: F401
except ModuleNotFoundError:  # an editable install older than it (pip install -e . again): no guard
    pass

from pathlib import Path

from train.diloco.optimizer import DiLoCoOptimizer, load_global  # noqa: F401  (public API)
from train.exchange.outer import average_deltas, diloco_round, outer_step, outer_step_tensor  # noqa: F401  (public API)
from train.core.store import RunPaths, base_path, read_jsonl


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics.jsonl records of a run folder (BASE_DIR/<project>), one per committed round."""
    return read_jsonl(RunPaths(base_path(run_dir)).metrics)  # a folder, or s3://bucket/prefix/<project>


def main() -> int:
    from train.launch.cli import coordinator_main
    return coordinator_main("diloco", "DiLoCo coordinator: waits for the workers' deltas on BASE_DIR, applies the "
                                      "outer step and commits each round.")


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "coordinator", fast_exit=True)
