"""Shared fixtures: tiny run configs in a temp BASE_DIR (micro Llama, the embedded corpus or fake data).

Torch CPU threads are pinned for the whole session, in this process and in every process a test starts:
EDT_TEST_THREADS (default 1) sets torch.set_num_threads here and OMP_NUM_THREADS for child processes (coordinators
take torch's default from it); worker processes get `--threads EDT_TEST_THREADS` from tests.helpers.proc.with_threads.
A test that compares two runs bit for bit thus compares the same computation, whatever the machine's core count.
Tests that assert on a trained outcome train to a margin (or assert with a tolerance) that float kernels cannot
cross, so they pass with any EDT_TEST_THREADS and PYTHONHASHSEED.
A proof run with other values: `EDT_TEST_THREADS=2 PYTHONHASHSEED=7 python -m pytest tests`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TEST_THREADS, tiny_config

# Never reach a hub from tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

os.environ["EDT_TEST_THREADS"] = str(TEST_THREADS)  # the session's value, for anything a test starts
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)   # torch's default in child processes (coordinators, workers)
# Tests run several processes of TEST_THREADS threads each on few cores: OpenMP threads that spin while they wait
# starve the others (with 2 threads on 2 cores a 400-step round took > 4 minutes instead of seconds). Timing only.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(TEST_THREADS)


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
