"""End to end with real worker processes: the simulator, the cluster layout, the outputs a user opens."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.helpers import REPO
from tests.helpers.proc import run_script, start_script
from train.core.store import read_jsonl, verify_manifest
from train.exchange.store import DiLoCoPaths

# one xdist worker: the module's shared run; its first test also pays for that run
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("finished_run"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from tests.helpers import tiny_config
    tmp = tmp_path_factory.mktemp("e2e")
    cfg = tmp / "evolution.json"
    cfg.write_text(json.dumps(tiny_config(tmp / "runs", outer={"rounds": 3, "local_steps": 8, "keep_rounds": 2},
                                      logging={"plot": True})))
    out = run_script("diloco_sim.py", "--config", str(cfg))
    assert out.returncode == 0, out.stdout + out.stderr
    return cfg, DiLoCoPaths(tmp / "runs" / "t"), out


def test_two_workers_three_rounds_learn(finished_run):
    _, paths, _ = finished_run
    recs = read_jsonl(paths.metrics)
    assert [r["round"] for r in recs] == [0, 1, 2, 3]
    for r in recs[1:]:
        for key in ("train_loss", "worker_loss", "eval_loss", "tokens", "bytes_read", "bytes_written", "wait_s",
                    "reduce_s", "eval_s", "commit_s", "workers_used"):
            assert key in r, key
        assert set(r["worker_loss"]) == {"w000", "w001"} and r["missing"] == [] and r["rejected"] == {}
    evals = [r["eval_loss"] for r in recs]
    # 7.62 -> 7.53 -> 7.17 -> 6.98 here (fp32: kernel differences move these by ~1e-6), so a margin of 0.01 holds
    assert evals[3] < evals[1] - 0.01 and evals[1] < evals[0] - 0.01, evals
    assert recs[3]["tokens"] == 3 * 2 * 8 * 8 * 32  # rounds x workers x H x batch x seq_length


def test_outputs_a_user_opens(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, paths, out = finished_run
    assert paths.plot.is_file() and paths.plot.stat().st_size > 10_000
    for w in (0, 1):
        assert "published delta" in paths.worker_log(w).read_text()
    model = AutoModelForCausalLM.from_pretrained(str(paths.final))
    tok = AutoTokenizer.from_pretrained(str(paths.final))
    ids = tok("To be", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] == ids.shape[1] + 8 and isinstance(tok.decode(gen[0]), str)
    verify_manifest(paths.final)


def test_global_model_written_once_per_round_and_old_rounds_pruned(finished_run):
    _, paths, _ = finished_run
    rounds = sorted(d.name for d in paths.rounds.iterdir() if not d.name.startswith("."))
    assert rounds == ["r000000", "r000002", "r000003"]  # θ_0 (template) + keep_rounds=2
    for r in (2, 3):
        assert len(list(paths.round_dir(r).glob("**/model.safetensors"))) == 1
        verify_manifest(paths.global_dir(r))
    assert not list(paths.root.glob("workers/*/*model*"))  # no per-worker model copies
    assert not list(paths.root.rglob(".*tmp*"))  # no temp leftovers


def test_rerunning_a_finished_run_is_a_no_op(finished_run):
    cfg, paths, _ = finished_run
    before = (paths.global_dir(3) / "model.safetensors").stat().st_mtime_ns
    out = run_script("diloco_sim.py", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert (paths.global_dir(3) / "model.safetensors").stat().st_mtime_ns == before
    assert len(read_jsonl(paths.metrics)) == 4


def test_cluster_layout_gives_the_same_model_as_the_simulator(finished_run, tmp_path):
    """diloco.py + two `python -m train.diloco.worker` processes (what the launcher starts) == diloco_sim.py, bit
    for bit: the workers of both runs train with the same thread count (tests.helpers.proc.with_threads passes
    --threads to both)."""
    cfg_path, sim_paths, _ = finished_run
    raw = json.loads(cfg_path.read_text())
    raw["base_dir"] = str(tmp_path / "runs")
    cfg2 = tmp_path / "evolution.json"
    cfg2.write_text(json.dumps(raw))
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    paths.logs.mkdir(parents=True)
    procs = [start_script([str(REPO / "diloco.py"), "--config", str(cfg2), "--no-progress"],
                          paths.logs / "coordinator.log")]
    procs += [start_script(["-m", "train.diloco.worker", "--config", str(cfg2), "--worker", str(w)],
                           paths.worker_log(w)) for w in (0, 1)]
    try:
        for p in procs:
            p.wait(timeout=300)
        assert [p.returncode for p in procs] == [0, 0, 0], (paths.logs / "coordinator.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    from safetensors.torch import load_file
    a = load_file(str(sim_paths.final / "model.safetensors"))
    b = load_file(str(paths.final / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_second_copy_of_a_worker_is_refused(finished_run, tmp_path):
    import fcntl
    cfg_path, paths, _ = finished_run
    lock = open(paths.worker_dir(0) / "lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # stands for a live worker 0
    try:
        import subprocess
        out = subprocess.run([sys.executable, "-m", "train.diloco.worker", "--config", str(cfg_path), "--worker", "0"],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 2 and "worker 0 is already running" in out.stderr
    finally:
        lock.close()


def test_a_second_coordinator_is_refused(finished_run):
    import fcntl
    import subprocess
    cfg_path, paths, _ = finished_run
    lock = open(paths.root / "coordinator.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # stands for a live coordinator (e.g. a forgotten diloco.py)
    try:
        out = subprocess.run([sys.executable, str(REPO / "diloco.py"), "--config", str(cfg_path)],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 2 and "the coordinator is already running" in out.stderr, out.stderr[-2000:]
    finally:
        lock.close()
