"""Streaming DiLoCo end to end (docs/streaming.md): P = 4 fragments of the 4-block Llama, real worker processes,
real files; a worker SIGKILLed mid-run, the simulator SIGKILLed at random moments, and the resumed runs give the
uninterrupted run's model bit for bit."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from tests.helpers import REPO, tiny_config
from tests.helpers.proc import (in_round_with_state, kill_and_await_restart, kill_sim_at_random_moments, run_script,
                                script_cmd, wait_until)
from train.core.store import read_json, read_jsonl
from train.core.tensorio import load_tensors
from train.exchange.store import DiLoCoPaths

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# every round waits for every worker (no straggler deadline, a dead worker waited for): who is in a round must not
# depend on timing, so a run with a kill and one without must give the same bits
FIXED = {"num_workers": 2, "fragments": 4, "local_steps": 8, "rounds": 8, "fragment_delay": 1, "fragment_mix": 0.5,
         "lr": 0.7, "momentum": 0.9, "straggler_factor": 0.0, "dead_after_s": 600.0, "round_timeout_s": 3600.0}


def _write(tmp_path, name, **outer):
    cfg = tiny_config(tmp_path / "runs", outer={**FIXED, **outer}, project_name=name)
    cfg["model"]["name"] = str(REPO / "configs" / "scaling-llama.json")  # 4 blocks: one per fragment
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path, DiLoCoPaths(tmp_path / "runs" / name)


def _same_model(a: DiLoCoPaths, b: DiLoCoPaths) -> bool:
    x, y = load_tensors(a.final / "model.safetensors"), load_tensors(b.final / "model.safetensors")
    return set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_four_fragments_with_a_killed_worker_resume_bit_identically(tmp_path):
    """P = 4, τ = 1, α = 0.5: each round commits one fragment (its own update file and metrics row, with `fragment`
    and `bytes_deltas`, a quarter of the model's bytes); worker 1 is SIGKILLed in round 3 and restarted by the
    simulator: it restores its own model and moments from its snapshot, replays what the snapshot missed, and the
    run ends on the uninterrupted run's model, bit for bit."""
    ref_cfg, ref = _write(tmp_path, "ref")
    out = run_script("diloco_sim.py", "--config", str(ref_cfg), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    recs = {r["round"]: r for r in read_jsonl(ref.metrics)}
    assert [recs[r]["fragment"] for r in range(1, 9)] == [0, 1, 2, 3, 0, 1, 2, 3]
    full = sum(t.numel() * 4 for t in load_tensors(ref.global_dir(0) / "model.safetensors").values())
    for r in range(1, 9):
        assert recs[r]["bytes_deltas"] <= 2 * 1.1 * full / 4, recs[r]  # two workers' fp32 deltas of one fragment
        assert recs[r]["bytes_deltas"] >= 2 * 0.9 * full / 4, recs[r]
        assert ref.update_file(r).stat().st_size <= 1.1 * full / 4  # the commit moves one fragment too

    cfg, paths = _write(tmp_path, "killed")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", str(cfg)), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        wait_until(lambda: in_round_with_state(paths, 1, 3), 300, "worker 1 in round 3", sim)
        kill_and_await_restart(paths, 1, lambda: os.kill(read_json(paths.progress(1))["pid"], signal.SIGKILL), sim)
        out, _ = sim.communicate(timeout=300)
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 0, out
    assert _same_model(ref, paths)
    log1 = paths.worker_log(1).read_text()
    assert "restart 1/" in log1 and "resumed worker state" in log1, out
    assert "our own model restored from the state snapshot" in log1, log1
    assert "differs from the published one" not in log1
    ra = {r["round"]: r for r in read_jsonl(ref.metrics)}
    rb = {r["round"]: r for r in read_jsonl(paths.metrics)}
    assert ra[8]["eval_loss"] == rb[8]["eval_loss"] and ra[8]["tokens"] == rb[8]["tokens"]


@pytest.mark.long
@pytest.mark.timeout(600)
def test_four_int4_fragments_resume_bit_identically_after_random_kills(tmp_path):
    """The simulator (coordinator and workers together) SIGKILLed at random moments, int4 both ways: the coordinator
    rebuilds the master θ, momentum and residual from the last checkpoint and the fragment updates since, each
    worker its own model from its snapshot; the final model is the uninterrupted run's."""
    fixed = {"compression": "int4", "block_size": 32, "checkpoint_every": 3}
    ref_cfg, ref = _write(tmp_path, "ref", **fixed)
    out = run_script("diloco_sim.py", "--config", str(ref_cfg), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    cfg, paths = _write(tmp_path, "killed", **fixed)
    kills = kill_sim_at_random_moments(script_cmd("diloco_sim.py", "--config", str(cfg)), paths, 8, seed=5,
                                       tries=2, max_pause=0.5)
    assert kills >= 1
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _same_model(ref, paths)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_worker_joins_mid_cycle_and_a_resume_with_fewer_workers_reads_no_window_twice(tmp_path):
    """P = 2 on the 2-block micro Llama: a third worker started by hand mid-run asks to join and is admitted at a round
    boundary (whatever fragment that round syncs), starting from the whole global model; the run then resumes with
    one worker (the others gone): every used delta's data slice is disjoint from every other, the fragment of every
    commit is its round's, and the run ends with a loadable model."""
    from tests.helpers.proc import coordinator_pid, held, kill_all, progress_of, start_script

    R = 8
    cfg = tiny_config(tmp_path / "runs", outer={"fragments": 2, "local_steps": 40, "rounds": R,
                                                "straggler_factor": 0.0})
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", str(path)), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    joiner = None
    try:
        wait_until(lambda: paths.committed(1).is_file(), 300, "round 1 committed", sim)
        with held(coordinator_pid(paths)):
            joiner = start_script(["-m", "train.diloco.worker", "--config", str(path), "--worker", "2"],
                                  tmp_path / "joiner.log")
            wait_until(lambda: progress_of(paths, 2).get("status") == "joining", 120, "the joiner asking", joiner)
        out, _ = sim.communicate(timeout=500)
        assert joiner.wait(timeout=120) == 0, (tmp_path / "joiner.log").read_text()[-3000:]
    finally:
        kill_all([p for p in (sim, joiner) if p is not None])
    assert sim.returncode == 0, out[-3000:]
    seg = read_json(paths.data / "layout.json")["segments"][-1]
    assert seg["slots"] == 3 and seg["from_round"] < R
    out = run_script("diloco_sim.py", "--config", str(path), "--workers", "1", "--rounds", str(R + 4), timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    recs = [r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0]
    assert [r["round"] for r in recs] == list(range(1, R + 5))
    assert [r["fragment"] for r in recs] == [(r["round"] - 1) % 2 for r in recs]
    assert all(r["workers_used"] == [0, 1, 2] for r in recs if seg["from_round"] <= r["round"] - 1 < R)
    got = [w for r in recs for off, n in r.get("data", {}).values() for w in range(off, off + n)]
    assert len(got) == len(set(got)), "a window was trained twice"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(str(paths.final))
