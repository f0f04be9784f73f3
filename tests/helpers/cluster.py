"""A run's processes as a cluster starts them, for the storage tests (tests/e2e/test_seaweed.py, test_s3.py): the
config every process reads, and each process's command line (the coordinator's script, or a worker module)."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import REPO, TEST_THREADS, tiny_config

WORKERS, ROUNDS, H = 2, 4, 6


def cluster_config(path: Path, codec: str = "none", **outer) -> Path:
    """The micro run both strategies read (DiLoCo: ROUNDS x H with every worker in every round; EDT: 2 generations),
    written to `path` without a base_dir (each process gets its own with --set)."""
    cfg = tiny_config(path.parent / "unused", outer={"rounds": ROUNDS, "local_steps": H, "num_workers": WORKERS,
                                                      "min_workers": WORKERS, "compression": codec, **outer},
                      edt={"max_generations": 2, "mutation_steps": 4, "job_lease_s": 60})
    cfg.pop("base_dir", None)
    path.write_text(json.dumps(cfg))
    return path


def cluster_argv(strategy: str, cfg: Path, base: str | Path, project: str, worker: int | None) -> list[str]:
    """The arguments after `python` of the coordinator (`worker` None) or of worker `worker`."""
    sets = ["--set", f"base_dir={base}", "--set", f"project_name={project}"]
    if worker is None:
        return [str(REPO / f"{strategy}.py"), "--config", str(cfg), "--no-progress", *sets]
    return ["-m", f"train.{strategy}.worker", "--config", str(cfg), "--worker", str(worker),
            "--threads", str(TEST_THREADS), *sets]
