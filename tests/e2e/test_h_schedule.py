"""outer.local_steps_schedule: H changes over the rounds; the data layout gives each round its H x batch windows
before any worker can start it, with and without the overlapped outer step."""
from __future__ import annotations

import pytest

from helpers_proc import run_script
from train.core.store import RunPaths, read_json, read_jsonl

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_h_schedule_trains_each_round_its_h_and_reads_no_window_twice(write_config, tmp_path, overlap):
    sched, rounds, batch, seq = [[0, 2], [2, 5], [3, 3]], 5, 8, 32
    H = [2, 2, 5, 3, 3]
    cfg = write_config(outer={"rounds": rounds, "local_steps": 9, "local_steps_schedule": sched, "overlap": overlap,
                              "keep_rounds": 1})
    out = run_script("diloco_sim.py", "--config", str(cfg), timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    paths = RunPaths(tmp_path / "runs" / "t")
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
