"""Crash safety: SIGKILL a worker mid-round, or the coordinator mid-commit; the same command finishes the run."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from tests.helpers.deltas import publish_round0_deltas
from tests.helpers import REPO, tiny_config
from tests.helpers.proc import (held, kill_sim_at_random_moments, progress_of, run_script, script_cmd, wait_until,
                                wait_until_workers_gone)
from train.config import build_config
from train.diloco.coordinator import Coordinator
from train.core.store import read_json, read_jsonl, verify_manifest
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import load_tensors, save_streaming

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: runs, kills, reruns on 2 busy cores


def _check_finished(paths: DiLoCoPaths, rounds: int, workers: int, H: int, batch: int, seq: int) -> None:
    from transformers import AutoModelForCausalLM
    assert paths.latest_committed() == rounds
    for r in paths.committed_rounds():
        verify_manifest(paths.global_dir(r))
    AutoModelForCausalLM.from_pretrained(str(paths.final))
    recs = {r["round"]: r for r in read_jsonl(paths.metrics)}
    # every delta counted once: no round trained twice into the model, no data replayed
    assert recs[rounds]["tokens"] == rounds * workers * H * batch * seq


# the long tier (python -m pytest -m long; CI runs it): kills mid-round: the simulator kills at random moments below are
# the default tier's
@pytest.mark.long
def test_sigkill_worker_mid_round_then_rerun_finishes(write_config, tmp_path):
    cfg = write_config(outer={"rounds": 3, "local_steps": 400})  # rounds of a few seconds: room to aim
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    cmd = script_cmd("diloco_sim.py", "--config", str(cfg), "--max-restarts", "0")  # no restart: a rerun resumes
    sim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        wait_until(lambda: progress_of(paths, 1).get("round", -1) >= 1 and progress_of(paths, 1).get("status") ==
                   "training" and progress_of(paths, 1).get("step", 0) >= 3, 240, "worker 1 training in round 1", sim)
        pid = progress_of(paths, 1)["pid"]
        with held(pid):  # frozen mid round 1, then killed: the kill lands before its round-1 delta is published
            assert read_json(paths.worker_state(1))["round_done"] == 0, "worker 1 was frozen after round 1's end"
            os.kill(pid, signal.SIGKILL)
        out, _ = sim.communicate(timeout=120)
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 1, out
    assert "worker 1" in out and "killed by signal 9" in out and "run the same command again" in out
    state = read_json(paths.worker_state(1))
    assert state["round_done"] == 0  # died mid round 1: its resume point is the end of round 0

    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed worker state: last round done 0" in paths.worker_log(1).read_text()
    _check_finished(paths, 3, 2, 400, 8, 32)


@pytest.mark.timeout(600)  # up to 3 killed runs and the rerun
def test_sigkill_simulator_at_random_moments_then_rerun_finishes(write_config, tmp_path):
    """The simulator hosts the coordinator: kill it (workers die with it) at random points, several times."""
    cfg = write_config(outer={"rounds": 6, "local_steps": 4, "keep_rounds": 1})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    kills = kill_sim_at_random_moments(script_cmd("diloco_sim.py", "--config", str(cfg)), paths, 6, seed=0,
                                       tries=3, max_pause=1.5)
    assert kills >= 1
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    _check_finished(paths, 6, 2, 4, 8, 32)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_coordinator_crash_mid_commit_leaves_nothing_trusted_and_recomputes_identically(tmp_path, monkeypatch, codec):
    """Deterministic version of a crash inside the commit: the reduce dies after writing some tensors (int8: after
    some segments' θ_{r+1}, momentum and residual were computed in place and their codes written)."""
    import train.exchange.master as master_mod

    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"compression": codec}))
    if codec == "int8":  # segments of 256 values: the micro model's tensors span several
        monkeypatch.setattr(master_mod, "CODED_SEGMENT", 256)
    co = Coordinator(cfg, progress=False)
    co.setup()
    paths = co.paths
    publish_round0_deltas(co, codec)
    from train.exchange import fused, outer

    # the step, piece by piece (train/exchange/master.py _step_full, _step_coded): torch's ops or the fused kernels
    real = {(outer, "outer_step_piece"): outer.outer_step_piece, (fused, "mean_step"): fused.mean_step,
            (fused, "coded_step"): fused.coded_step}
    calls = {"n": 0}

    def dying(fn):
        def step(*a, **k):
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt("simulated crash mid-commit")
            return fn(*a, **k)
        return step

    for (mod, name), fn in real.items():
        monkeypatch.setattr(mod, name, dying(fn))
    with pytest.raises(KeyboardInterrupt):
        co.run_round(0)
    assert paths.latest_committed() == 0 and not paths.committed(1).exists()
    assert not paths.global_dir(1).exists() and not paths.update_file(1).exists()
    for (mod, name), fn in real.items():
        monkeypatch.setattr(mod, name, fn)
    co.close()  # the crashed coordinator's process is gone, and its lock with it

    # A commit that wrote everything but the marker (killed just before it) is redone too.
    co2 = Coordinator(cfg, progress=False)
    co2.setup()
    co2.run_round(0)
    written = paths.global_dir(1) / "model.safetensors" if codec == "none" else paths.update_file(1)
    first, first_bytes = load_tensors(written), written.read_bytes()
    rec = read_json(paths.committed(1))
    paths.committed(1).unlink()
    co2.close()
    co3 = Coordinator(cfg, progress=False)
    co3.setup()
    co3.run_round(0)
    again = load_tensors(written)
    assert all(torch.equal(first[k], again[k]) for k in first) and written.read_bytes() == first_bytes
    rec2 = read_json(paths.committed(1))
    keys = ("update_sha256", "theta_sha256")
    assert [rec2.get(k) for k in keys] == [rec.get(k) for k in keys]
    if codec == "none":
        verify_manifest(paths.global_dir(1))
    assert not list(paths.rounds.rglob(".*tmp*"))


def test_coordinator_killed_between_commit_and_metrics_logs_the_round_on_resume(tmp_path, monkeypatch):
    """The coordinator commits round r before it evaluates θ_r (in the background, so workers never wait for an
    evaluation): a coordinator that dies in between has committed a round that metrics.jsonl lacks. The same
    command logs it on resume, from the record the COMMITTED marker carries, with the evaluation redone."""
    import train.diloco.coordinator as coord_mod
    from train.core.store import PROTOCOL_VERSION, atomic_write_json

    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    co.evals.join()
    paths = co.paths
    assert [r["round"] for r in read_jsonl(paths.metrics)] == [0]
    theta = load_tensors(paths.global_dir(0) / "model.safetensors")
    for w in (0, 1):
        sha = save_streaming(paths.delta_file(0, w), {k: torch.full_like(v, 0.01) for k, v in theta.items()})
        off, n = co.layout.slice(0, w)
        atomic_write_json(paths.delta_meta(0, w), {"protocol": PROTOCOL_VERSION, "round": 0, "worker": w,
                                                   "inner_steps": 5, "tokens": 100, "loss": 1.0, "sha256": sha,
                                                   "bytes": paths.delta_file(0, w).stat().st_size,
                                                   "data": {"segment": 0, "offset": off, "windows": n, "read": n}})
    real = coord_mod.evaluate

    def dying(*a, **k):
        raise KeyboardInterrupt("simulated kill during the evaluation")

    monkeypatch.setattr(coord_mod, "evaluate", dying)
    co.run_round(0)  # returns once committed: the evaluation runs in the background
    with pytest.raises(KeyboardInterrupt):
        co.evals.join()
    assert paths.latest_committed() == 1
    assert [r["round"] for r in read_jsonl(paths.metrics)] == [0]  # committed, not logged
    co.close()
    monkeypatch.setattr(coord_mod, "evaluate", real)

    co2 = Coordinator(cfg, progress=False)
    co2.setup()
    co2.evals.join()
    recs = read_jsonl(paths.metrics)
    assert [r["round"] for r in recs] == [0, 1]
    assert recs[1]["tokens"] == 200 and recs[1]["workers_used"] == [0, 1]
    assert isinstance(recs[1]["eval_loss"], float) and recs[1]["eval_loss"] == recs[1]["eval_loss"]  # not NaN
    co2.close()
    co3 = Coordinator(cfg, progress=False)  # logged once: a later resume adds nothing
    co3.setup()
    co3.evals.join()
    assert [r["round"] for r in read_jsonl(paths.metrics)] == [0, 1]
    co3.close()


@pytest.mark.parametrize("moved", [False, pytest.param(True, marks=pytest.mark.long)],
                         ids=["before-the-move", "before-the-sidecar"])
def test_restart_between_resume_point_and_publication_publishes_first_with_overlap(write_config, tmp_path, moved):
    """A worker killed after writing its resume point (state.json: round r done) but before its Δ_r was published
    (still in its pending file, or moved into the round but without the sidecar that marks it complete): the
    restart publishes it before training on. With the delayed outer step the next segment folds in θ_{r+1}, which
    waits for that very delta: the round closed only at round_timeout_s, without the worker (CI, stop 22; a
    random-kill stress run for the moved case)."""
    cfg = write_config(outer={"rounds": 3, "local_steps": 40, "overlap": "delayed", "round_timeout_s": 120.0,
                              "straggler_factor": 0.0, "dead_after_s": 600.0})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", str(cfg)), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
    try:  # hold the coordinator once θ_1 is committed: round 1's deltas arrive, round 2 cannot be committed
        wait_until(lambda: paths.committed(1).is_file(), 240, "round 1 committed", sim)
        sim.send_signal(signal.SIGSTOP)
        assert not paths.committed(2).is_file(), "the coordinator was held too late; raise local_steps"
        wait_until(lambda: paths.delta_meta(1, 1).is_file() and read_json(paths.worker_state(1))["round_done"] == 1,
                   240, "worker 1 published round 1")
    finally:
        os.killpg(sim.pid, signal.SIGKILL)
        sim.wait(30)
    wait_until_workers_gone(paths, 2)
    # undo the publication (a kill in step 5): no sidecar, and the delta back in the worker's pending file
    paths.delta_meta(1, 1).unlink()
    if not moved:
        os.replace(paths.delta_file(1, 1), paths.worker_pending_delta(1, 1))
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    recs = {r["round"]: r for r in read_jsonl(paths.metrics)}
    assert sorted(recs[2]["workers_used"]) == [0, 1] and not recs[2].get("missing_why"), recs[2]
    log = paths.worker_log(1).read_text()
    assert "round 1: published delta" in log.split("worker 1 on ")[-1]  # after the restart's set-up
