"""EDT end to end: the job queue protocol, the simulator, and crash safety with real processes on a temp BASE_DIR."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.helpers import REPO, pin_threads, tiny_config
from tests.helpers.proc import kill_all, run_script, start_script, wait_until
from train.edt.store import EDTPaths
from train.edt.protocol import (holds_claim, publish_once, renew_lease, requeue, stale_count,
                                tmp_member_dir, try_claim)
from train.core.store import read_json, read_jsonl, verify_manifest

EDT = {"max_generations": 2, "mutation_steps": 4, "job_lease_s": 30}


def edt_config(tmp_path, workers: int, plot: bool = False, **edt) -> str:
    cfg = tiny_config(tmp_path / "runs", outer={"num_workers": workers}, edt={**EDT, **edt}, logging={"plot": plot})
    path = tmp_path / "evolution.json"
    path.write_text(json.dumps(cfg, indent=1))
    return str(path)


# -- the job queue (in process, fast) --------------------------------------------------------------------------------
def test_exactly_one_of_many_racing_workers_claims_a_job(tmp_path):
    paths = EDTPaths(tmp_path)
    paths.jobs_dir(0).mkdir(parents=True)
    wins, barrier = [], threading.Barrier(8)

    def claim(w):
        barrier.wait()
        wins.append(try_claim(paths, 0, 0, w))

    threads = [threading.Thread(target=claim, args=(w,)) for w in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len([a for a in wins if a]) == 1


def test_an_expired_claim_is_requeued_and_its_holder_loses_the_lease(tmp_path):
    paths = EDTPaths(tmp_path)
    paths.jobs_dir(3).mkdir(parents=True)
    first = try_claim(paths, 3, 1, worker=0)
    assert first and try_claim(paths, 3, 1, worker=1) is None and renew_lease(paths, 3, 1, first)
    assert requeue(paths, 3, 1, "lease expired") == 1 and stale_count(paths, 3, 1) == 1
    assert read_json(paths.jobs_dir(3) / "m001.stale-1")["requeued"] == "lease expired"
    second = try_claim(paths, 3, 1, worker=1)
    assert second and holds_claim(paths, 3, 1, second)
    assert not renew_lease(paths, 3, 1, first)  # the presumed-dead worker notices and drops the job


def test_a_member_is_published_once_even_when_two_attempts_finish(tmp_path):
    paths = EDTPaths(tmp_path)
    dirs = [tmp_member_dir(paths, 1, 0, f"a{i}") for i in range(2)]
    for i, d in enumerate(dirs):
        (d / "result.json").write_text(json.dumps({"attempt": i}))
        (d / "MANIFEST.json").write_text("{}")
    assert publish_once(dirs[0], paths.member_dir(1, 0)) is True
    assert publish_once(dirs[1], paths.member_dir(1, 0)) is False
    assert read_json(paths.result(1, 0))["attempt"] == 0 and paths.has_result(1, 0)
    assert try_claim(paths, 1, 0, worker=0) is None  # a published member is never claimed again


def test_import_edt_has_no_side_effects_and_scripts_have_help(tmp_path):
    code = "import edt, os; edt.select_pairs([1.0, 2.0], 2); print(sorted(os.listdir('.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    out = subprocess.run([sys.executable, str(REPO / "edt_sim.py"), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and "--generations" in out.stdout and "--population" in out.stdout, out.stderr


def test_bad_gene_is_one_clear_line(tmp_path):
    cfg = tmp_path / "evolution.json"
    cfg.write_text('{"edt": {"genes": {"inner_lr": [2, 1]}}}')
    out = run_script("edt_sim.py", "--config", str(cfg), timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "edt.genes.inner_lr = [2, 1]: needs" in out.stderr


# -- real processes --------------------------------------------------------------------------------------------------
def check_lineage(paths: EDTPaths, generations: int, population: int) -> list[dict]:
    """Every member of every generation is in lineage.jsonl once; every parent path exists or was recorded."""
    lineage = read_jsonl(paths.lineage)
    ids = [r["id"] for r in lineage]
    assert len(ids) == len(set(ids)) == generations * population
    recorded = set(ids)
    genomes = lineage + [read_json(p) for p in paths.generations.glob("g*/members/m*/genome.json")]
    for rec in genomes:
        assert rec["generation"] == 0 or len(rec["parents"]) == 2
        for p in rec["parents"]:
            assert (paths.root / p["path"]).is_dir() or p["id"] in recorded, p
            assert rec["generation"] - 2 <= int(p["id"][1:7]) < rec["generation"]
        if rec.get("elite"):
            assert rec["parents"][0]["id"] == rec["parents"][1]["id"]
    return lineage


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_three_workers_two_generations_complete(tmp_path):
    from transformers import AutoModelForCausalLM

    from transformers import AutoConfig

    # generation 0 from a local HF model directory and the config JSON, filled by random choice to 3 members
    hf_dir = tmp_path / "hf-model"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "micro-llama.json")) \
        .save_pretrained(hf_dir)
    specs = [str(hf_dir), str(REPO / "configs" / "micro-llama.json")]
    cfg = edt_config(tmp_path, workers=3, initial_population=specs, plot=True)
    out = run_script("edt_sim.py", "--config", cfg, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    paths = EDTPaths(tmp_path / "runs" / "t")
    recs = read_jsonl(paths.metrics)
    assert [r["generation"] for r in recs] == [0, 1]
    for r in recs:
        assert set(r["eval_loss"]) == {"m000", "m001", "m002"}
        assert r["top_fitness"] >= r["avg_fitness"] - 1e-12  # max >= mean (sum / n may round 1 ulp above)
        assert r["tokens_generation"] == 3 * 4 * 8 * 32  # members x steps x batch x seq_length
        assert r["bytes_workers"] > 0
    assert recs[1]["bytes_coordinator"] > 0 and len(recs[1]["parents"]["m000"]) == 2
    # it learns: 7.54 < 7.60 here, fp32, where kernel differences move a loss by ~1e-6
    assert recs[1]["best_eval_loss"] < recs[0]["avg_eval_loss"] - 0.01, (recs[1]["best_eval_loss"],
                                                                        recs[0]["avg_eval_loss"])
    lineage = check_lineage(paths, 2, 3)
    origins = [r["origin"] for r in lineage if r["generation"] == 0]
    assert set(origins) == set(specs) and origins[:2] == specs
    for png in (paths.lineage_png, paths.fitness_png):
        assert png.stat().st_size > 10_000
    AutoModelForCausalLM.from_pretrained(str(paths.final))
    assert read_json(paths.done)["generations"] == 2
    for w in range(3):
        assert "the run is complete" in paths.worker_log(w).read_text()
    # A coordinator that died while writing generation 1 rebuilds exactly the same jobs when rerun. Bit for bit: this
    # process and edt_sim.py's coordinator run the merges with the same thread count (conftest.py pins both).
    from train.config import load_config
    from train.edt.coordinator import EDTCoordinator

    pin_threads()

    before = {m: (read_json(paths.job_json(1, m)), read_json(paths.job_dir(1, m) / "MANIFEST.json"))
              for m in range(3)}
    coord = EDTCoordinator(load_config(cfg), progress=False)
    coord.make_generation(1, [coord.load_member(0, m) for m in range(3)])
    for m in range(3):
        assert read_json(paths.job_json(1, m)) == before[m][0]
        assert read_json(paths.job_dir(1, m) / "MANIFEST.json")["files"]["model.safetensors"] == \
            before[m][1]["files"]["model.safetensors"]


def _training(paths: EDTPaths, w: int, gen_at_least: int) -> bool:
    """Worker w holds a job of generation >= gen_at_least (its claim file: the protocol's own record, written at
    the claim and removed after the publish; heartbeats are rate-limited and can miss a short job)."""
    g = paths.latest_generation()
    if g is None or g < gen_at_least:
        return False
    for claim in paths.jobs_dir(g).glob("m*.claim"):
        try:
            if read_json(claim).get("worker") == w:
                return True
        except (OSError, ValueError):
            continue
    return False


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_sigkill_coordinator_and_a_worker_mid_generation_then_the_run_finishes(tmp_path):
    """Cluster layout: 2 worker processes, population 3 (jobs queue), the coordinator a separate process.
    SIGKILL the coordinator mid-generation (workers keep going), restart it; then SIGKILL a worker holding a job:
    its lease expires, the job is re-queued and the other worker finishes the run."""
    G, P, S = 3, 3, 120
    cfg = edt_config(tmp_path, workers=2, population_size=P, max_generations=G, mutation_steps=S, job_lease_s=3,
                     keep_generations=2)
    raw = json.loads(open(cfg).read())
    raw["data"].update(fake_data=True, fake_tokens=100_000)  # no tokenizing: this test is about processes
    open(cfg, "w").write(json.dumps(raw))
    paths = EDTPaths(tmp_path / "runs" / "t")
    logs = tmp_path / "logs"
    logs.mkdir()
    coord = start_script([str(REPO / "edt.py"), "--config", cfg], logs / "coord-1.log")
    workers = [start_script(["-m", "train.edt.worker", "--config", cfg, "--worker", str(w)], logs / f"w{w}.log")
               for w in range(2)]
    procs = [coord, *workers]
    try:
        wait_until(lambda: paths.gen_committed(1).is_file() and _training(paths, 0, 1), 180,
                   "generation 1 committed and being trained", coord)
        coord.send_signal(signal.SIGKILL)
        coord.wait(30)
        wait_until(lambda: sum(paths.has_result(1, m) for m in range(P)) >= 1, 120, "a member published while the "
                   "coordinator is down")
        coord = start_script([str(REPO / "edt.py"), "--config", cfg], logs / "coord-2.log")
        procs.append(coord)
        wait_until(lambda: _training(paths, 1, 2), 180, "worker 1 training in generation 2 or later", coord)
        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait(30)
        assert coord.wait(240) == 0, (logs / "coord-2.log").read_text()[-3000:]
        assert workers[0].wait(60) == 0
    finally:
        kill_all(procs)
    recs = read_jsonl(paths.metrics)
    assert [r["generation"] for r in recs] == list(range(G))  # each generation logged once
    assert sum(r["requeued"] for r in recs) >= 1
    assert "re-queued" in (logs / "coord-2.log").read_text()
    for r in recs:
        assert r["tokens_generation"] == P * S * 8 * 32  # every member trained once per generation
    check_lineage(paths, G, P)
    # data positions: a slot continues exactly where its previous mutation stopped (no replay, no skip)
    for g in (G - 2, G - 1):
        for m in range(P):
            job = read_json(paths.job_json(g, m))
            res = read_json(paths.result(g, m))
            assert sum(res["position"].values()) == sum(job["position"].values()) + S * 8
            if g > G - 2:
                assert job["position"] == read_json(paths.result(g - 1, m))["position"]
    # cleanup: old generations keep only their best member; the last two are whole
    for g in range(G - 2):
        kept = [d.name for d in paths.members_dir(g).iterdir() if not d.name.startswith(".")]
        assert kept == [f"m{read_json(paths.gen_dir(g) / 'EVALUATED.json')['best']:03d}"]
        assert not paths.jobs_dir(g).exists()
        verify_manifest(paths.member_dir(g, int(kept[0][1:])))
    assert all((paths.jobs_dir(g)).is_dir() for g in (G - 2, G - 1))
    verify_manifest(paths.final)


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_a_worker_started_mid_run_takes_jobs_of_the_next_generation(tmp_path):
    """EDT joining: workers pull jobs from the queue, so one more worker process (any new id) started mid-run takes
    jobs from the next generation on, and the run finishes with it.

    The coordinator (the simulator's main process) is held with SIGSTOP while the joiner starts: on a slow box the
    joiner's start-up (torch, transformers, the data) can outlast the rest of this small run, and a worker that
    arrives after the last job has nothing to take. Worker 0 keeps training meanwhile; the next generation is posted
    once the joiner is set up, and both workers poll for its jobs."""
    cfg = edt_config(tmp_path, workers=1, population_size=4, max_generations=3, mutation_steps=30)
    paths = EDTPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen([sys.executable, str(REPO / "edt_sim.py"), "--config", cfg, "--threads", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    joiner, log = None, tmp_path / "joiner.log"
    try:
        wait_until(lambda: paths.metrics.is_file() and len(read_jsonl(paths.metrics)) >= 1, 300,
                   "generation 0 evaluated", sim)
        os.kill(sim.pid, signal.SIGSTOP)
        try:
            joiner = start_script(["-m", "train.edt.worker", "--config", cfg, "--worker", "1", "--threads", "1"], log)
            wait_until(lambda: "EDT worker 1 (" in log.read_text(), 300, "the joiner set up", joiner)
        finally:
            os.kill(sim.pid, signal.SIGCONT)
        out, _ = sim.communicate(timeout=600)
        assert joiner.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        kill_all([p for p in (sim, joiner) if p is not None])
    assert sim.returncode == 0, out[-3000:]
    last = [read_json(paths.result(g, m)) for g in (1, 2) for m in range(4) if paths.result(g, m).is_file()]
    assert len(last) == 8 and {r["worker"] for r in last} == {0, 1}, [r["worker"] for r in last]
