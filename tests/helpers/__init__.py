"""Helpers the tests share (fixtures stay in tests/conftest.py):

    tests.helpers            REPO, TEST_THREADS, pin_threads(), tiny_config()
    tests.helpers.proc       run the real scripts as subprocesses: script_cmd, run_script, start_script, wait_until,
                             progress_of, kill helpers
    tests.helpers.sshd       a private OpenSSH server on a loopback port (marker `ssh`)
    tests.helpers.slurm      a private Slurm: munged, slurmctld, three slurmd on loopback (marker `slurm`)
    tests.helpers.fusefs     NFS-client emulation, one FUSE mount per process (also used by bench/nfs.py)
    tests.helpers.seaweed    a private SeaweedFS on loopback, one `weed mount` per process (also bench/soak.py)
    tests/helpers/diloco_opt_worker.py   a script: one DiLoCoOptimizer worker (tests/e2e/test_diloco_optimizer.py)

Torch CPU threads: EDT_TEST_THREADS (default 1) is the thread count of the test process and of every worker a test
starts (conftest.py sets it up for the session; see its docstring).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

TEST_THREADS = int(os.environ.get("EDT_TEST_THREADS") or 1)
# data.cache_dir of tiny_config: the shipped corpus is tokenized once per machine and copied into each test's run
# (about 2 s of CPU per coordinator start saved). EDT_TEST_TOKEN_CACHE= (empty) tokenizes in every run.
TOKEN_CACHE = os.environ.get("EDT_TEST_TOKEN_CACHE",
                             os.path.join(tempfile.gettempdir(), f"edt-test-token-cache-{os.getuid()}"))
if TEST_THREADS < 1:
    raise ValueError(f"EDT_TEST_THREADS = {TEST_THREADS}: must be >= 1")


def pin_threads() -> None:
    """Back to the session's thread count (a test that trained in process calls this first: another test, or a
    library call, may have changed it)."""
    import torch
    torch.set_num_threads(TEST_THREADS)


def tiny_config(base_dir: Path, **sections) -> dict:
    """A run config for tests: micro Llama (~38k params), short windows, 1 thread, fast polling, no plots
    (matplotlib costs each finished run ~1.5 s of CPU), the machine's shared token cache (TOKEN_CACHE)."""
    cfg = {
        "project_name": "t",
        "base_dir": str(base_dir),
        "seed": 0,
        "model": {"name": str(REPO / "configs" / "micro-llama.json"), "tokenizer": str(REPO / "data" / "tokenizer")},
        "data": {"dataset": str(REPO / "data" / "corpus"), "seq_length": 32, "eval_fraction": 0.02,
                 "max_tokens": 200_000, "cache_dir": TOKEN_CACHE},
        "inner": {"lr": 3e-3, "warmup_steps": 2, "per_device_batch_size": 8, "total_batch_size": 8,
                  "threads": 1, "device": "cpu"},
        # straggler_factor 0: a round waits for every live worker, so that which deltas a round uses never depends
        # on how fast a busy box runs each process (the tests of the straggler deadline set it themselves)
        "outer": {"num_workers": 2, "rounds": 3, "local_steps": 5, "lr": 0.7, "momentum": 0.9,
                  "poll_interval_s": 0.05, "round_timeout_s": 120, "straggler_factor": 0.0},
        "eval": {"batch_size": 8, "batches": 2},
        "logging": {"progress": False, "plot": False},  # the tests that check plots turn them on
    }
    for sec, vals in sections.items():
        if isinstance(vals, dict) and isinstance(cfg.get(sec), dict):
            cfg[sec].update(vals)
        else:
            cfg[sec] = vals
    return cfg
