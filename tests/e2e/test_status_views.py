"""Every view of a run reads the run's own config.json in BASE_DIR: a run launched with `--set outer.rounds=4` and
looked at with the bare config file (rounds 10) says 4/4, as `python -m train.status RUN_DIR` does, not 4/10. The SSH
backend's view is the per-host helper (`python -m train.launch.remote status`, what the launcher runs on each host
over SSH, started here as a real process), the Slurm backend's is slurm_ops.run_state."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO, tiny_config
from train.config import load_config
from train.core.store import atomic_write_json
from train.exchange.store import DiLoCoPaths
from train.launch.remote import MARK


def _run_with_4_rounds(tmp_path):
    """A config file saying rounds 10, and its run folder as a launch with `--set outer.rounds=4` leaves it after
    round 4: the coordinator's config.json (RunConfig.to_dict of the overridden config) and the rounds' markers."""
    cfg_file = tmp_path / "evolution.json"
    cfg_file.write_text(json.dumps(tiny_config(tmp_path / "base", outer={"rounds": 10},
                                               edt={"max_generations": 7})))
    launched = load_config(str(cfg_file), ["outer.rounds=4", "edt.max_generations=3"])
    paths = DiLoCoPaths(launched.run_dir)
    paths.root.mkdir(parents=True)
    atomic_write_json(paths.config_json, launched.to_dict())
    for r in range(1, 5):
        paths.round_dir(r).mkdir(parents=True)
        paths.committed(r).write_text("{}")
    return cfg_file, paths


def test_ssh_hosts_status_reads_the_runs_own_config(tmp_path):
    cfg_file, paths = _run_with_4_rounds(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "train.launch.remote", "status", "--config", str(cfg_file),
                        "--machine", "m0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    run = json.loads(next(line for line in p.stdout.splitlines() if line.startswith(MARK))[len(MARK):])["run"]
    assert (run["committed"], run["rounds"], run["generations"]) == (4, 4, 3)
    assert run["run_dir"] == str(paths.root)

    # before the coordinator wrote config.json: the config this command was given
    paths.config_json.unlink()
    p = subprocess.run([sys.executable, "-m", "train.launch.remote", "status", "--config", str(cfg_file),
                        "--machine", "m0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    run = json.loads(next(line for line in p.stdout.splitlines() if line.startswith(MARK))[len(MARK):])["run"]
    assert (run["committed"], run["rounds"], run["generations"]) == (4, 10, 7)


def test_slurm_status_reads_the_runs_own_config(tmp_path):
    from train.launch.slurm import SlurmLauncher, SlurmOptions
    from train.launch.slurm_ops import run_state

    cfg_file, paths = _run_with_4_rounds(tmp_path)
    ln = SlurmLauncher(str(cfg_file), [], SlurmOptions(), out=lambda *a: None)
    assert ln.paths.root == paths.root
    run = run_state(ln)
    assert (run["committed"], run["rounds"], run["generations"]) == (4, 4, 3)
