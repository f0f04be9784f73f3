"""outer.local_steps_schedule: H changes over the rounds; the data layout gives each round its H x batch windows
before any worker can start it, with and without the overlapped outer step."""
from __future__ import annotations

import pytest

from tests.helpers.proc import kill_sim_at_random_moments, run_script, script_cmd
from train.core.store import read_json, read_jsonl
from train.exchange.store import DiLoCoPaths

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real processes: runs, kills, reruns on 2 busy cores


# delayed in the long tier (CI runs it), beside the killed run with the delayed step below
@pytest.mark.parametrize("overlap", ["none", pytest.param("delayed", marks=pytest.mark.long)])
def test_h_schedule_trains_each_round_its_h_and_reads_no_window_twice(write_config, tmp_path, overlap):
    sched, rounds, batch, seq = [[0, 2], [2, 5], [3, 3]], 5, 8, 32
    H = [2, 2, 5, 3, 3]
    cfg = write_config(outer={"rounds": rounds, "local_steps": 9, "local_steps_schedule": sched, "overlap": overlap,
                              "keep_rounds": 1})
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    recs = {r["round"]: r for r in read_jsonl(paths.metrics)}
    assert sorted(recs) == list(range(rounds + 1))
    windows = []
    for r in range(rounds):
        rec = recs[r + 1]
        assert sorted(rec["workers_used"]) == [0, 1]
        for w, (offset, read) in rec["data"].items():
            assert read == H[r] * batch, (r, w, read)  # each worker trained round r for its H steps
            windows += range(offset, offset + read)
    assert len(windows) == len(set(windows)) == sum(H) * 2 * batch  # no window read twice, none skipped
    assert recs[rounds]["tokens"] == sum(H) * 2 * batch * seq
    assert recs[rounds]["inner_steps"] == sum(H)
    layout = read_json(paths.data / "layout.json")
    assert [(s["from_round"], s["windows"]) for s in layout["segments"]] == [(0, 2 * batch), (2, 5 * batch),
                                                                             (3, 3 * batch)]
    assert "H schedule: H = 5 from round 2" in layout["segments"][1]["why"]
    if overlap != "none":
        assert "of 5 steps" in paths.worker_log(0).read_text()  # the fold speaks of round 2's H


@pytest.mark.timeout(600)  # up to 3 killed runs and the rerun
# the long tier (python -m pytest -m long; CI runs it): the schedule: the test above; random kills: test_kill.py's
# simulator kills
@pytest.mark.long
def test_h_schedule_run_killed_at_random_moments_resumes_and_reads_no_window_twice(write_config, tmp_path):
    """SIGKILL the simulator (coordinator + workers) at random moments of a run whose H changes, with the delayed
    outer step; the same command finishes it, every round trained for its H, no window read twice."""
    H, batch = [3, 3, 6, 6, 6, 2], 8
    cfg = write_config(outer={"rounds": len(H), "local_steps_schedule": [[0, 3], [2, 6], [5, 2]],
                              "overlap": "delayed", "keep_rounds": 1})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    kills = kill_sim_at_random_moments(script_cmd("diloco_sim.py", "--config", str(cfg)), paths, len(H), seed=1,
                                       tries=3, max_pause=1.5)
    assert kills >= 1
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    logged = read_jsonl(paths.metrics)
    assert [r["round"] for r in logged] == list(range(len(H) + 1))  # every round logged once, across the kills
    recs = {r["round"]: r for r in logged}
    windows = []
    for r, h in enumerate(H):
        for offset, read in recs[r + 1]["data"].values():
            assert read == h * batch
            windows += range(offset, offset + read)
    why = {r: (rec.get("missing_why"), rec.get("late")) for r, rec in recs.items() if rec.get("missing_why")}
    assert len(windows) == len(set(windows)) == sum(H) * 2 * batch, why  # a round closed without a worker: why


def test_a_resume_with_live_workers_gives_the_next_rounds_their_scheduled_h(write_config, tmp_path):
    """The coordinator restarts with θ_3 committed, worker 1's delta of round 3 published, worker 0 alive (training
    round 4, delayed overlap): rounds up to 4 may be under way and keep their slices; round 5 is free and gets the
    schedule's H = 2 before the commit of θ_4 lets anyone start it. (A resume that took round 6 as the first free
    one kept round 5 at H = 6: CI's random kills found it; in process here, the moment placed exactly.)"""
    from train.config import load_config
    from train.core.heartbeat import Heartbeat
    from train.core.store import atomic_write_json
    from train.diloco.coordinator import Coordinator
    from train.exchange.layout import Layout
    from train.exchange.protocol import commit

    batch = 8
    cfg = load_config(str(write_config(outer={"rounds": 6, "local_steps_schedule": [[0, 3], [2, 6], [5, 2]],
                                              "overlap": "delayed"})), [], strategy="diloco")
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    lay = Layout.single(2, 3 * batch)
    lay.resize(2, 2, 6 * batch, "H schedule: H = 6 from round 2")  # what the killed coordinator had written
    lay.save(paths)
    for r in range(4):
        commit(paths, r, {"record": {"round": r}})
    atomic_write_json(paths.worker_state(0), {"round_done": 2})
    atomic_write_json(paths.worker_state(1), {"round_done": 3})
    hb = Heartbeat(paths.progress(0), 0)
    hb.beat(force=True, status="training", round=4)
    hb.start_lease(0.2)  # a live worker (its lease beating): this process
    co = Coordinator(cfg, progress=False)
    try:
        co.layout = co.plan_layout()
    finally:
        hb.stop()
    assert co._free_round == 5  # rounds 0..4 may be under way (3 + rounds_ahead 1)
    co.follow_schedule(3 + co.overlap.rounds_ahead, lo=co._free_round)  # what setup() does next
    co.follow_schedule(3 + 1 + co.overlap.rounds_ahead)  # run_round(3), before the commit of θ_4
    on_disk = Layout.load(paths)
    assert [on_disk.windows_of(r, 0) // batch for r in range(6)] == [3, 3, 6, 6, 6, 2]
