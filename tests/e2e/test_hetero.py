"""Mixed machines with real processes: the inner schedule follows the run (a worker back after missed rounds trains
at the run's learning rate), H taken from the data layout (a resume with another local_steps trains on), rounds by
time with given speeds resume bit for bit, and the data windows stay exactly-once under a speed change and a death."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.helpers import REPO
from tests.helpers.proc import (coordinator_pid, held, kill_all, progress_of, script_cmd, wait_until,
                                wait_until_workers_gone)
from train.core.store import read_json, read_jsonl
from train.exchange.store import DiLoCoPaths


def _deltas(paths: DiLoCoPaths) -> dict[tuple[int, int], dict]:
    """(round, worker) -> the sidecar fields timeline.jsonl keeps of every delta a commit read."""
    return {(d["round"], d["worker"]): d for t in read_jsonl(paths.root / "timeline.jsonl") for d in t["deltas"]}


def _slices(paths: DiLoCoPaths) -> list[tuple[int, int]]:
    return sorted((off, off + n) for rec in read_jsonl(paths.metrics) for off, n in (rec.get("data") or {}).values())


def _disjoint(spans: list[tuple[int, int]]) -> bool:
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.slow
@pytest.mark.long  # (the default tier's joiner test, test_elastic.py, checks the same schedule at a join)
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_a_worker_back_after_missed_rounds_trains_at_the_runs_learning_rate(tmp_path, write_config):
    """3 workers; worker 2 is SIGKILLed after round 2 while its supervisor is held, so the run goes on without it for
    rounds; when the supervisor is let go it restarts the worker, which resumes its stale state (round 1 or 2 done)
    and rejoins at the latest round. Its first delta there was trained at the run's learning rate (the same as worker
    0's in that round, to the bit: the schedule is the run's, not the worker's step count) and passes the screen."""
    R, H = 12, 5
    cfg = write_config(outer={"num_workers": 3, "rounds": R, "local_steps": H, "lr": 1.0, "momentum": 0.0,
                              "dead_after_s": 3.0}, inner={"warmup_steps": 5})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    sup = None
    try:
        wait_until(lambda: (paths.latest_committed() or 0) >= 2 and progress_of(paths, 2).get("round", -1) >= 2,
                   240, "round 2 committed, worker 2 on round 2", sim)
        victim = progress_of(paths, 2)["pid"]
        sup = os.getpgid(victim)  # its supervisor leads the group: held, it cannot restart the worker yet
        os.kill(sup, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        killed_at = paths.latest_committed()
        wait_until(lambda: (paths.latest_committed() or 0) >= killed_at + 3, 240, "3 rounds without worker 2", sim)
        # the coordinator held until the restarted worker is up (its start-up on a busy box may take longer than
        # the rest of the run): its return is the event, not the survivors' speed
        log = paths.worker_log(2)
        before = log.read_text().count("training windows of")
        with held(coordinator_pid(paths)):
            os.kill(sup, signal.SIGCONT)
            sup = None
            wait_until(lambda: log.read_text().count("training windows of") > before, 180, "worker 2 back", sim)
        out, _ = sim.communicate(timeout=300)
    finally:
        if sup is not None:
            os.kill(sup, signal.SIGCONT)
        kill_all([sim])
    assert sim.returncode == 0, out[-3000:]
    log2 = paths.worker_log(2).read_text()
    assert "resumed worker state: last round done" in log2
    recs = {r["round"] - 1: r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0}
    back = min((r for r in recs if r > killed_at + 2 and 2 in recs[r]["workers_used"]), default=None)
    assert back is not None, "worker 2 never delivered after its return"
    deltas = _deltas(paths)
    assert deltas[(back, 2)]["lr"] == deltas[(back, 0)]["lr"], "the returned worker trains at its own schedule"
    assert not recs[back]["rejected"] and sorted(recs[back]["workers_used"]) == [0, 1, 2]
    assert _disjoint(_slices(paths))


@pytest.mark.slow
@pytest.mark.long  # a variant of test_elastic's resume with more then fewer workers
@pytest.mark.timeout(300)
def test_a_resume_with_another_local_steps_trains_on_with_the_layouts_h(tmp_path, write_config):
    """A run made with H = 5, resumed with --rounds 6 --set outer.local_steps=10: the workers take each round's H from
    the data layout (rounds a worker may have started keep H = 5, the new H from the first free round), so the run
    finishes instead of stopping with "would read 80 windows ... gives each worker 40"."""
    cfg = write_config(outer={"rounds": 3, "local_steps": 5})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    first = subprocess.run(script_cmd("diloco_sim.py", "--config", cfg), capture_output=True, text=True, cwd=REPO,
                           timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    wait_until_workers_gone(paths, 2)
    second = subprocess.run(script_cmd("diloco_sim.py", "--config", cfg, "--rounds", "6", "--set",
                                       "outer.local_steps=10"), capture_output=True, text=True, cwd=REPO, timeout=240)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    lay = read_json(paths.data / "layout.json")
    assert lay["segments"][-1]["windows"] == 10 * 8
    recs = [r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0]
    assert [r["round"] for r in recs] == list(range(1, 7))
    assert _disjoint(_slices(paths))
    steps = [v[1] // 8 for r in recs for v in r["data"].values()]
    assert set(steps) == {5, 10}


def _run_sim(cfg, *extra, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(script_cmd("diloco_sim.py", "--config", cfg, *extra), capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(400)
def test_rounds_by_time_with_given_speeds_resume_bit_identical(tmp_path, write_config):
    """Rounds by time with the speeds given (outer.step_rates: H = 10 and 5, no deadline): a run killed with every
    process after round 2 and run again with the same command ends with the same final model, bit for bit, as one
    that was never interrupted."""
    outer = {"rounds": 5, "local_steps": 10, "round_time_s": 0.5, "step_rates": {"0": 20, "1": 10}}
    a = write_config("a.json", project_name="a", outer=outer)
    b = write_config("b.json", project_name="b", outer=outer)
    ra = _run_sim(a)
    assert ra.returncode == 0, ra.stdout[-2000:] + ra.stderr[-2000:]
    pb = DiLoCoPaths(tmp_path / "runs" / "b")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", b), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
    try:
        wait_until(lambda: (pb.latest_committed() or 0) >= 2, 240, "round 2 committed", sim)
    finally:
        os.killpg(sim.pid, signal.SIGKILL)
        sim.wait(30)
    wait_until_workers_gone(pb, 2)
    rb = _run_sim(b)
    assert rb.returncode == 0, rb.stdout[-2000:] + rb.stderr[-2000:]
    pa = DiLoCoPaths(tmp_path / "runs" / "a")
    assert (pa.final / "model.safetensors").read_bytes() == (pb.final / "model.safetensors").read_bytes()
    lay = read_json(pb.data / "layout.json")
    assert [s["windows"] for s in lay["segments"]] == [[80, 40]]  # the plan from the given speeds, never changed
    assert {tuple(sorted(json.loads(json.dumps(r.get("planned_steps", {}))).values())) for r in
            read_jsonl(pb.metrics) if r.get("round", 0) > 0} == {(5, 10)}


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(500)
def test_rounds_by_time_follow_a_speed_change_and_a_death_with_every_window_once(tmp_path, write_config):
    """3 workers by time; worker 1 at a third of its speed until round 4, then at full speed; worker 2 SIGKILLed mid-
    run (its supervisor restarts it). Worker 1's H follows its speed within two rounds; every committed slice is
    disjoint from every other; the windows a worker did not read by its round's end are read first in its next round
    (the record's `carried`), and only what is still carried when the run ends is `skipped`."""
    R = 9
    # a cap no worker reaches in 1.5 s, so that every H is its speed's (a capped H would hide the slowdown)
    cfg = write_config(outer={"num_workers": 3, "rounds": R, "local_steps": 100_000, "round_time_s": 1.5,
                              "dead_after_s": 3.0})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg, "--slow", "1=0.34,1=1@4"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        wait_until(lambda: (paths.latest_committed() or 0) >= 5 and progress_of(paths, 2).get("status") == "training",
                   300, "round 5 committed, worker 2 training", sim)
        os.kill(progress_of(paths, 2)["pid"], signal.SIGKILL)
        out, _ = sim.communicate(timeout=400)
    finally:
        kill_all([sim])
    assert sim.returncode == 0, out[-3000:]
    recs = [r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0]
    assert len(recs) == R
    h1 = {r["round"] - 1: r["planned_steps"]["w001"] for r in recs}
    h0 = {r["round"] - 1: r["planned_steps"]["w000"] for r in recs}
    # a plan follows the speed it measured the round before (the throttle may take hold only after round 0's
    # calibration): rounds 2-3 run at the slow speed's plan (a third), rounds 6-8 at the full speed's. Each ratio is
    # of two measured speeds on a shared 2-core box (worker 2's kill and restart at round 5 among them), so the
    # phases are judged by their means (CI saw single rounds at 0.66 of full speed and 0.53 in the slow phase)
    slow = sum(h1[r] / h0[r] for r in (2, 3)) / 2
    fast = sum(h1[r] / h0[r] for r in (6, 7, 8)) / 3
    assert slow < 0.6 and fast > 0.7 and fast > 1.5 * slow, (slow, fast, h0, h1)
    assert _disjoint(_slices(paths))
    # what a worker did not read by the round's end goes on to its next round, read there first; nothing is skipped
    # before the run's last round
    reads = [{} for _ in recs]
    for k, r in enumerate(recs):
        for key, (off, n) in r["data"].items():
            if "@" not in key:
                own, kind = key[:4], ("in" if "+" in key else "own")
                reads[k].setdefault(own, {"in": 0, "own": 0})[kind] += n
        for w, got in reads[k].items():
            assert got["in"] + got["own"] <= r["planned_steps"][w] * 8
    for k in range(len(recs) - 1):
        for w in ("w000", "w001"):  # never killed (a round that went on without one is not compared)
            if w not in reads[k] or w not in reads[k + 1]:
                continue
            passed_on = (recs[k].get("carried") or {}).get(w, 0)
            # read first, within its next round's H (what its early end leaves of that is carried again)
            assert 0 < reads[k + 1][w]["in"] <= min(passed_on, recs[k + 1]["planned_steps"][w] * 8) or not passed_on
    assert all(not r.get("skipped") for r in recs[:-1])
    assert recs[-1]["skipped_windows"] == sum((recs[-1].get("skipped") or {}).values())


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_killed_simulator_leaves_no_throttled_worker_stopped(tmp_path, write_config):
    """--slow stops a worker for part of every 0.2 s: the simulator SIGKILLed meanwhile (it continues nobody) must
    not leave the worker stopped with its death signal pending: its supervisor continues it as it dies."""
    cfg = write_config(outer={"rounds": 50, "local_steps": 20})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg, "--slow", "1=0.2"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_until(lambda: (paths.latest_committed() or 0) >= 2, 240, "round 2 committed", sim)
        sim.kill()
        sim.wait(30)
        wait_until_workers_gone(paths, 2)  # their locks free: no worker left, stopped or running
    finally:
        kill_all([sim])
