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
