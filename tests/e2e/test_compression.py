"""Compressed exchange end to end (docs/compression.md): real worker processes, real files.

One θ (every copy bit-identical, checked by checksum every round), the fp32 checkpoints, exact resume after SIGKILLs
of the whole simulator at random moments, host-local worker state, and what the reducer refuses.
"""
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
from train.config import build_config
from train.core.store import atomic_write_json, read_json, read_jsonl, verify_manifest
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import load_tensors
from train.diloco.coordinator import Coordinator
from train.core.errors import ProtocolError
from train.exchange.codec import SCALE, get_codec
from train.exchange.master import exchange_codecs
from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
from train.exchange.theta import GlobalTheta, theta_checksum

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: runs, kills, restarts on 2 busy cores

OUTER = {"compression": "int8", "rounds": 5, "checkpoint_every": 2, "local_steps": 4, "block_size": 32}


def _write(tmp_path, name, **outer):
    cfg = tiny_config(tmp_path / "runs", outer={**OUTER, **outer}, project_name=name)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path, DiLoCoPaths(tmp_path / "runs" / name)


def _kill_worker_in_round(sim: subprocess.Popen, paths: DiLoCoPaths, w: int, r: int) -> str:
    """SIGKILL worker w once it is in round r (training or waiting for a fold: its heartbeat lease is written once a
    second and a short segment takes about that long, so a "training" snapshot may never be seen), with the
    coordinator held until the restarted worker has resumed (kill_and_await_restart: the surviving worker cannot
    finish the run first), once its state records round r - 1 (in_round_with_state); the simulator's output."""
    try:
        wait_until(lambda: in_round_with_state(paths, w, r), 300, f"worker {w} in round {r}", sim)
        kill_and_await_restart(paths, w, lambda: os.kill(read_json(paths.progress(w))["pid"], signal.SIGKILL), sim)
        out, _ = sim.communicate(timeout=400)
    finally:
        if sim.poll() is None:
            sim.kill()
    return out


def test_int8_run_keeps_one_theta_checkpoints_load_and_host_local_state(tmp_path):
    local = tmp_path / "local-state"
    cfg, paths = _write(tmp_path, "int8", rounds=4, state_dir=str(local), keep_rounds=3)
    out = run_script("diloco_sim.py", "--config", str(cfg), "--rounds", "2", timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    opt = list(local.rglob("opt-r*.safetensors"))
    assert len(opt) == 2 and not list(paths.root.rglob("opt-r*.safetensors"))  # off the shared disk
    for f in opt:
        f.unlink()  # as if the workers restarted on other hosts
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    log = paths.worker_log(0).read_text()
    assert "not on this host" in log and "fresh AdamW moments" in log

    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(str(paths.final))
    # checkpoints: round 0, every 2 rounds and the last one; in between only the encoded update
    assert paths.is_checkpoint(2) and paths.is_checkpoint(4) and not paths.global_dir(3).exists()
    for r in (2, 4):
        verify_manifest(paths.global_dir(r))
    # θ_4 rebuilt from checkpoint 2 + updates 3, 4 is the final checkpoint, bit for bit, and matches the record
    th = GlobalTheta(paths, get_codec("int8", 32))
    th.load_checkpoint(2)
    th.apply(3)
    th.apply(4)
    final = load_tensors(paths.global_dir(4) / "model.safetensors")
    assert all(torch.equal(final[n], th.tensors[n]) for n in th.names)
    assert theta_checksum(final, th.names) == read_json(paths.committed(4))["theta_sha256"]
    # the workers checked their copy every round (a mismatch stops them); the sidecars say what they sent
    meta = read_json(paths.delta_meta(3, 0))
    assert meta["codec"] == "int8" and meta["io"]["read"] > 0
    recs = [r for r in read_jsonl(paths.metrics) if r["round"] > 0]
    assert all(r["codec"] == "int8" and r["bytes_total"] > 0 for r in recs)
    assert recs[-1]["round"] == 4 and recs[-1]["tokens"] == 4 * 2 * 4 * 8 * 32  # every round's tokens once
    # the deltas of a round: 1 + 4/32 bytes per value (+ the safetensors headers, sizeable on a 38k-parameter model)
    values = sum(t.numel() for t in final.values())
    r3 = next(r for r in recs if r["round"] == 3)
    assert 2 * values * 1.125 < r3["bytes_deltas"] < 2 * values * 1.125 * 1.15


# eager covers the synchronous replay too (the same coordinator and worker replays, plus the overlap's threads);
# the plain protocol's random kills are tests/e2e/test_kill.py's (default tier), streaming DiLoCo's worker kill
# tests/e2e/test_streaming.py's; these variants run in the long tier (CI runs both)
@pytest.mark.timeout(600)  # a reference run, up to 2 killed runs and the rerun
@pytest.mark.parametrize("overlap", [pytest.param("eager", marks=pytest.mark.long),
                                     pytest.param("topk-eager", marks=pytest.mark.long)])
def test_sigkill_at_random_moments_resumes_bit_identically(tmp_path, overlap):
    """Coordinator replay (momentum, residual from the deltas since the checkpoint) and worker replay (rounds whose
    state snapshot was lost) give the uninterrupted run's model, bit for bit; with overlap too, where the delta, the
    state and the snapshot are written by the publisher thread while the next segment trains and θ is read ahead
    by the prefetch thread (train/core/background.py), and a segment starts from θ_{r−1} + γ × the saved progress
    (eager) and folds θ_r in after overlap_steps = 3 of its 8 steps, before and after a restart (the delayed
    start is the eager one with γ = 1)."""
    # rounds wait for every worker (no straggler deadline): who is in a round must not depend on timing here
    sparse = overlap.startswith("topk-")  # topk: a restarted coordinator rebuilds θ from the sparse deltas, and a
    overlap = overlap.removeprefix("topk-")  # replayed sparse delta must have the published sha256
    fixed = {"momentum": 0.9, "lr": 0.7, "straggler_factor": 0.0, "dead_after_s": 600.0, "round_timeout_s": 3600.0,
             "rounds": 4,
             "overlap": overlap, "local_steps": 8, "overlap_steps": 3,
             **({"compression": "topk", "density": 0.05, "chunk_size": 256, "lr": 2.0} if sparse else {})}
    ref_cfg, ref = _write(tmp_path, "ref", **fixed)
    out = run_script("diloco_sim.py", "--config", str(ref_cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    cfg, paths = _write(tmp_path, "killed", **fixed)
    kills = kill_sim_at_random_moments(script_cmd("diloco_sim.py", "--config", str(cfg)), paths, 4, seed=3,
                                       tries=2, max_pause=1.0)
    assert kills >= 1
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    a = load_tensors(ref.final / "model.safetensors")
    b = load_tensors(paths.final / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = {r["round"]: r for r in read_jsonl(ref.metrics)}
    rb = {r["round"]: r for r in read_jsonl(paths.metrics)}
    assert ra[4]["eval_loss"] == rb[4]["eval_loss"] and ra[4]["tokens"] == rb[4]["tokens"]
    for w in range(2):
        assert "differs from the published one" not in paths.worker_log(w).read_text()
    # every segment after the first folded the new θ in after 3 of its 8 steps
    assert "round 3: folded θ_3 in after 3 of 8 steps" in ref.worker_log(0).read_text()


# -- what the reducer refuses ------------------------------------------------------------------------------------------
def _coordinator(tmp_path, **outer):
    outer = {"num_workers": 3, "min_workers": 2, "compression": "int8", "block_size": 32, **outer}
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000}, outer=outer))
    co = Coordinator(cfg, progress=False)
    co.setup()
    return co


def _publish(co, w, seed, corrupt=None, r=0):
    paths = co.paths
    theta = co.master.theta.tensors
    g = torch.Generator().manual_seed(seed)
    params = {k: v - torch.randn(v.shape, generator=g) * 1e-3 for k, v in theta.items()}
    codec = get_codec("int8", 32)
    f = paths.delta_file(r, w)
    file = write_delta(f, co.names, theta, params, codec, r, w)
    side = delta_sidecar(r, w, file, inner_steps=5, tokens=1000, loss=3.0)
    off, n = co.layout.slice(r, w)  # the slice of the data layout this delta says it was trained on
    side["data"] = {"segment": r, "offset": off, "windows": n, "read": n}
    if corrupt == "nan_scale":
        from safetensors.torch import load_file, save_file
        t = load_file(str(f))
        k = next(k for k in t if k.endswith(SCALE))
        t[k][0] = float("nan")
        save_file(t, str(f), metadata={"codec": "int8", "block": "32"})
    elif corrupt == "wrong_block":
        file = write_delta(f, co.names, theta, params, get_codec("int8", 64), 0, w)
    elif corrupt == "undeclared":
        file = write_delta(f, co.names, theta, params, get_codec("int4", 32), 0, w)
    elif corrupt == "truncated":
        f.write_bytes(f.read_bytes()[:-10])
    if corrupt in ("nan_scale", "wrong_block", "undeclared"):
        import hashlib
        side.update(sha256=hashlib.sha256(f.read_bytes()).hexdigest(), bytes=f.stat().st_size)
    publish_sidecar(paths, side)


@pytest.mark.parametrize("case,reason", [("nan_scale", "scales are not finite"),
                                         ("wrong_block", "block size 64"),
                                         ("undeclared", "declares codec 'int4'"),
                                         ("truncated", "bytes, sidecar says")])
def test_bad_compressed_delta_is_rejected_and_theta_untouched(tmp_path, case, reason):
    co = _coordinator(tmp_path)
    _publish(co, 0, 0)
    _publish(co, 1, 1)
    _publish(co, 2, 2, corrupt=case)
    rec = co.run_round(0)
    assert rec["workers_used"] == [0, 1] and reason in rec["rejected"]["w002"], rec["rejected"]
    # θ_1 equals a round computed from the two good deltas alone
    co2 = _coordinator(tmp_path / "clean")
    _publish(co2, 0, 0)
    _publish(co2, 1, 1)
    atomic_write_json(co2.paths.root / "note.json", {})
    co2.cfg.outer.round_timeout_s = 0.2
    co2.run_round(0)
    a, b = co.master.theta.tensors, co2.master.theta.tensors
    assert all(torch.equal(a[k], b[k]) for k in a)


# the long tier (CI runs it), as its topk twin below: a killed worker's restart is test_elastic.py's (default tier),
# int8 test_int8_run_keeps_one_theta..., the delayed step test_kill.py's overlap restart
@pytest.mark.long
def test_int8_delayed_overlap_with_a_worker_killed_and_restarted_completes(tmp_path):
    """The composed run (docs/overlap.md, docs/elastic.md): int8 both ways + the one-round-delayed outer step; a
    worker is SIGKILLed mid-run, the simulator restarts it, it resumes from its own state and the run finishes
    without a rerun; every copy of θ stayed identical (workers check the checksum every round)."""

    cfg, paths = _write(tmp_path, "composed", rounds=6, local_steps=40, overlap="delayed", dead_after_s=600.0)
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", str(cfg)), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    out = _kill_worker_in_round(sim, paths, 1, 2)
    assert sim.returncode == 0, out
    assert "restart 1/" in paths.worker_log(1).read_text(), out  # the supervisor's line, in the worker's log
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(str(paths.final))
    recs = {r["round"]: r for r in read_jsonl(paths.metrics)}
    assert max(recs) == 6 and all(recs[r]["codec"] == "int8" for r in range(1, 7))
    # no token twice: the tokens counted are those of the deltas used, at most every worker's every segment
    used = sum(len(recs[r]["workers_used"]) for r in range(1, 7))
    assert recs[6]["tokens"] == used * 40 * 8 * 32
    log1 = paths.worker_log(1).read_text()
    assert "resumed worker state" in log1
    # the default fold is adaptive: every segment after the first folds the new θ in as soon as it is read
    assert "round 5: folded θ_5 in after" in paths.worker_log(0).read_text()


def test_pruning_keeps_every_kept_round_buildable_from_a_checkpoint(tmp_path):
    """keep_rounds = 2 after round 4 keeps θ_3, which is checkpoint 2 + update 3: checkpoint 2 must stay. (It was
    pruned once, and a worker restarted after its round-3 snapshot was lost could not replay round 3: CI, stop 22.)
    A copy of θ at round 0 whose next updates are pruned starts again from the checkpoint."""
    co = _coordinator(tmp_path, num_workers=2, checkpoint_every=2, keep_rounds=2, rounds=5, late_weight=0.0)
    thetas = {}
    for r in range(4):
        for w in range(2):
            _publish(co, w, 10 * r + w, r=r)
        co.run_round(r)
        thetas[r + 1] = {k: v.clone() for k, v in co.master.theta.tensors.items()}
    paths = co.paths
    assert [r for r in range(5) if paths.round_dir(r).exists()] == [0, 2, 3, 4]
    copy = GlobalTheta(paths, get_codec("int8", 32))
    copy.load_checkpoint(0)  # where a worker's copy stands before it reads the round it resumes at
    assert copy.buildable(3)
    copy.advance_to(3)
    assert all(torch.equal(copy.tensors[n], thetas[3][n]) for n in copy.names)
    copy.advance_to(4)
    assert all(torch.equal(copy.tensors[n], thetas[4][n]) for n in copy.names)
    # with checkpoint 2 gone, θ_3 cannot be built: replay is skipped (buildable) and advance_to says why
    import shutil
    shutil.rmtree(paths.round_dir(2))
    fresh = GlobalTheta(paths, get_codec("int8", 32))
    assert not fresh.buildable(3) and fresh.buildable(4)
    with pytest.raises(ProtocolError, match="round 3 cannot be rebuilt"):
        fresh.advance_to(3)


# the long tier (python -m pytest -m long; CI runs it): the int8 delayed-overlap kill test is the default tier's
@pytest.mark.long
def test_topk_delayed_overlap_with_a_worker_killed_and_restarted_completes(tmp_path):
    """The sparse exchange composed (docs/compression.md#sparse-exchange-topk): top-k deltas that every copy of θ
    sums itself + the one-round-delayed outer step; a worker is SIGKILLed mid-run, the simulator restarts it, it
    resumes (replaying what its snapshot missed, with the same sha256) and the run finishes; every copy of θ stayed
    identical (each worker checks theta_sha256 every round, the coordinator's checkpoint is rebuilt from files)."""

    cfg, paths = _write(tmp_path, "topk", compression="topk", density=0.05, chunk_size=256, rounds=4,
                        local_steps=8, checkpoint_every=2, overlap="delayed", dead_after_s=600.0, keep_rounds=2)
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", str(cfg)), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    out = _kill_worker_in_round(sim, paths, 1, 1)
    assert sim.returncode == 0, out
    log1 = paths.worker_log(1).read_text()
    assert "restart 1/" in log1 and "resumed worker state" in log1, out
    assert "differs from the published one" not in log1  # a replayed sparse delta has the published sha256
    recs = {r["round"]: r for r in read_jsonl(paths.metrics)}
    assert max(recs) == 4 and all(recs[r]["codec"] == "topk" for r in range(1, 5))
    used = sum(len(recs[r]["workers_used"]) for r in range(1, 5))
    assert recs[4]["tokens"] == used * 8 * 8 * 32  # no token twice
    # no update files: θ travels as the sparse deltas; the final checkpoint is θ_2 + the deltas of rounds 2 and 3
    assert not list(paths.root.rglob("update.safetensors"))
    th = GlobalTheta(paths, exchange_codecs(build_config(json.loads(cfg.read_text())).outer)[1])
    th.load_checkpoint(2)
    th.advance_to(4)  # checks theta_sha256 of rounds 3 and 4
    final = load_tensors(paths.global_dir(4) / "model.safetensors")
    assert all(torch.equal(final[n], th.tensors[n]) for n in th.names)
    # what a worker read for θ: the sparse deltas of every worker (its sidecar's io), a fraction of one fp32 model
    meta = read_json(paths.delta_meta(3, 0))
    assert meta["codec"] == "topk" and 0 < meta["io"]["read"] < 4 * sum(t.numel() for t in final.values())
