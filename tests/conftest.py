"""Shared fixtures: tiny run configs in a temp BASE_DIR (micro Llama, the embedded corpus or fake data).

Torch CPU threads are pinned for the whole session, in this process and in every process a test starts:
EDT_TEST_THREADS (default 1) sets torch.set_num_threads here and OMP_NUM_THREADS for child processes (coordinators
take torch's default from it); worker processes get `--threads EDT_TEST_THREADS` from helpers_proc.with_threads.
A test that compares two runs bit for bit thus compares the same computation, whatever the machine's core count.
Tests that assert on a trained outcome train to a margin (or assert with a tolerance) that float kernels cannot
cross, so they pass with any EDT_TEST_THREADS and PYTHONHASHSEED.
A proof run with other values: `EDT_TEST_THREADS=2 PYTHONHASHSEED=7 python -m pytest tests`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Never reach a hub from tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEST_THREADS = int(os.environ.get("EDT_TEST_THREADS") or 1)
if TEST_THREADS < 1:
    raise pytest.UsageError(f"EDT_TEST_THREADS = {TEST_THREADS}: must be >= 1")
os.environ["EDT_TEST_THREADS"] = str(TEST_THREADS)  # the session's value, for anything a test starts
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)   # torch's default in child processes (coordinators, workers)
# Tests run several processes of TEST_THREADS threads each on few cores: OpenMP threads that spin while they wait
# starve the others (with 2 threads on 2 cores a 400-step round took > 4 minutes instead of seconds). Timing only.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(TEST_THREADS)


def pin_threads() -> None:
    """Back to the session's thread count (a test that trained in process calls this first: another test, or a
    library call, may have changed it)."""
    torch.set_num_threads(TEST_THREADS)


def tiny_config(base_dir: Path, **sections) -> dict:
    """A run config for tests: micro Llama (~38k params), short windows, 1 thread, fast polling, no plots
    (matplotlib costs each finished run ~1.5 s of CPU)."""
    cfg = {
        "project_name": "t",
        "base_dir": str(base_dir),
        "seed": 0,
        "model": {"name": str(REPO / "configs" / "micro-llama.json"), "tokenizer": str(REPO / "data" / "tokenizer")},
        "data": {"dataset": str(REPO / "data" / "corpus"), "seq_length": 32, "eval_fraction": 0.02,
                 "max_tokens": 200_000},
        "inner": {"lr": 3e-3, "warmup_steps": 2, "per_device_batch_size": 8, "total_batch_size": 8,
                  "threads": 1, "device": "cpu"},
        "outer": {"num_workers": 2, "rounds": 3, "local_steps": 5, "lr": 0.7, "momentum": 0.9,
                  "poll_interval_s": 0.05, "round_timeout_s": 120},
        "eval": {"batch_size": 8, "batches": 2},
        "logging": {"progress": False, "plot": False},  # the tests that check plots turn them on
    }
    for sec, vals in sections.items():
        if isinstance(vals, dict) and isinstance(cfg.get(sec), dict):
            cfg[sec].update(vals)
        else:
            cfg[sec] = vals
    return cfg


@pytest.fixture
def write_config(tmp_path):
    """write_config(**sections) -> path of an evolution.json in tmp_path (BASE_DIR = tmp_path/runs)."""
    def _write(name: str = "evolution.json", **sections) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(tiny_config(tmp_path / "runs", **sections), indent=1))
        return path
    return _write


@pytest.fixture(scope="module")
def tok():
    """The embedded tokenizer (data/tokenizer)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer"))
