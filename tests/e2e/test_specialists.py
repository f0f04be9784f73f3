"""The demo's parents: a base and per-task specialists from one init, resumable, with an accuracy table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import pin_threads
from train.evomerge.specialists import make_specialists
from train.core.store import verify_manifest
from train.core.tensorio import load_tensors

REPO = Path(__file__).resolve().parents[2]
MICRO = REPO / "configs" / "micro-llama.json"


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_tensors(d / "model.safetensors")


def test_make_specialists_resumes_and_reports(tmp_path):
    pin_threads()
    kw = dict(base_steps=3, steps=4, batch_size=4, train_items=50, eval_items=4, model_config=MICRO, progress=False)
    paths = make_specialists(tmp_path / "m", ("addition", "sort"), **kw)
    assert set(paths) == {"base", "addition", "sort"}
    for name, d in paths.items():
        verify_manifest(d)
        assert (d / "tokenizer_config.json").is_file() and json.loads((d / "train.json").read_text())["steps"]
    base, add, srt = (_weights(paths[n]) for n in ("base", "addition", "sort"))
    assert base.keys() == add.keys() == srt.keys()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(base[name], add[name]) and not torch.equal(add[name], srt[name])
    acc = json.loads((tmp_path / "m" / "accuracy.json").read_text())
    assert set(acc["accuracy"]) == {"base", "addition", "sort"} and acc["tasks"] == ["addition", "sort"]
    assert all(0.0 <= v <= 1.0 for row in acc["accuracy"].values() for v in row.values())
    assert "| sort |" in (tmp_path / "m" / "accuracy.md").read_text()

    # rerun: finished models are kept as they are; a missing one is rebuilt from the same base, identically
    stamp = (paths["base"] / "model.safetensors").stat().st_mtime_ns
    import shutil
    shutil.rmtree(paths["sort"])
    again = make_specialists(tmp_path / "m", ("addition", "sort"), **kw)
    assert (again["base"] / "model.safetensors").stat().st_mtime_ns == stamp
    assert torch.equal(_weights(again["sort"])[name], srt[name])


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
# the long tier (CI runs it): training the specialists and their report are
# test_make_specialists_resumes_and_reports' (default tier); here the script with --jobs 2 in spawned processes
@pytest.mark.long
def test_cli_fast_parallel_jobs(tmp_path):
    """scripts/make_specialists.py end to end: two specialists trained at once in spawned worker processes."""
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_specialists.py"), "--out", str(out), "--fast",
                        "--tasks", "reverse", "sort", "--jobs", "2", "--model-config", str(MICRO), "--eval-items", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| reverse |" in r.stdout and "| sort |" in r.stdout  # two specialists trained in parallel processes
    assert all((out / m / "MANIFEST.json").is_file() for m in ("base", "reverse", "sort"))
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "make_specialists.py"), "--out", str(out),
                          "--model-config", str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error:" in bad.stderr
