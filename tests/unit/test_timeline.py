"""The data behind timeline.png and the status view, from a run folder written with the protocol's own writers (store
helpers, the recorder): lanes, segments per worker and round, a killed worker's death and restart, a straggler, the
coordinator's phases; the status rows; the picture exists and loads; `python -m train.status` on a non-run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from train.core.store import append_jsonl, atomic_write_json
from train.exchange.store import DiLoCoPaths
from train.status.recorder import TimelineRecorder
from train.status.timeline import JOURNAL, build_timeline, supervisor_events
from train.status.view import gather, render

T0 = 1_800_000_000.0
STRAGGLER = "straggler: past the deadline of 6.0 s = 3 x median recent round (2.0 s)"


def _sidecar(paths, r, w, start, secs, pub, lease):
    atomic_write_json(paths.delta_meta(r, w), {
        "protocol": 1, "round": r, "worker": w, "lease": lease, "host": "elsewhere", "train_seconds": secs,
        "trained_at": start + secs, "time": start + secs + pub, "load_seconds": 0.1, "tokens": 1000,
        "bytes": 5000, "inner_steps": 10, "loss": 5.0, "sha256": "x", "io": {"read": 100, "written": 5000}})


def _record(paths, k, t, **extra):
    append_jsonl(paths.metrics, {"round": k, "time": t, "tokens": 3000 * k, "bytes_total": 20000 * k,
                                 "wait_s": 1.5, "reduce_s": 0.1, "commit_s": 0.05, "eval_s": 0.2,
                                 "workers_used": [0, 1, 2], "missing": [], "missing_why": {}, "rejected": {}, **extra})
    atomic_write_json(paths.committed(k), {"round": k, "time": t})


@pytest.fixture
def run(tmp_path):
    """A 3-worker DiLoCo run of 3 rounds (2 s each): worker 1 is SIGKILLed in round 1 and restarted (a new lease,
    its supervisor's lines in its log), worker 2 is a straggler left behind in round 2; the recorder journals each
    round as the coordinator does, and the sidecars are then pruned."""
    paths = DiLoCoPaths(tmp_path / "t")
    atomic_write_json(paths.run_json, {"protocol": 1, "identity": {}, "created": T0})
    atomic_write_json(paths.config_json, {"project_name": "t", "outer": {"num_workers": 3, "rounds": 3,
                                                                         "dead_after_s": 10, "min_workers": 1}})
    atomic_write_json(paths.data / "layout.json", {"segments": [{"from_round": 0, "slots": 3, "windows": 80,
                                                                 "offset": 0}], "config_workers": 3})
    rec = TimelineRecorder(paths.root, draw=False)
    _record(paths, 0, T0)
    # round 0: everyone computes 1.5 s and publishes in 0.2 s; the round closes at T0 + 2
    for w in range(3):
        _sidecar(paths, 0, w, T0 + 0.1, 1.5, 0.2, f"L{w}")
    _record(paths, 1, T0 + 2.0)
    rec.round_closed(0)
    # round 1: worker 1 dies at T0 + 3 and its restarted process (lease L1b) trains round 1 again from T0 + 5
    for w in (0, 2):
        _sidecar(paths, 1, w, T0 + 2.2, 1.5, 0.2, f"L{w}")
    _sidecar(paths, 1, 1, T0 + 5.0, 1.5, 0.2, "L1b")
    _record(paths, 2, T0 + 7.0)
    rec.round_closed(1)
    # round 2: worker 2 straggles; the round closes without it
    for w in (0, 1):
        _sidecar(paths, 2, w, T0 + 7.2, 1.5, 0.2, "L0" if w == 0 else "L1b")
    _record(paths, 3, T0 + 9.0, workers_used=[0, 1], missing=[2], missing_why={"w002": STRAGGLER})
    rec.round_closed(2)
    for r in range(3):  # pruned, as outer.keep_rounds does: the journal keeps what the timeline needs
        for w in range(3):
            paths.delta_meta(r, w).unlink(missing_ok=True)
    died = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + 3))
    paths.logs.mkdir(parents=True, exist_ok=True)
    paths.worker_log(1).write_text(f"{died} simulator WARNING worker 1 exited with signal 9; restart 1/3 in 1.0 s "
                                   f"(it was pid 4242)\n")
    for w in range(3):
        atomic_write_json(paths.progress(w), {"worker": w, "pid": 999_999, "host": "elsewhere", "lease": "x",
                                               "beat": 9, "time": T0 + 9.5, "status": "exited", "round": 3})
    return paths


def test_lanes_segments_per_worker_and_round(run):
    tl = build_timeline(run.root, now=T0 + 10)
    assert tl.strategy == "diloco"
    assert [ln.name for ln in tl.lanes] == ["w000", "w001", "w002", "coordinator"]
    w0 = tl.lane("w000")
    compute = [(s.round, round(s.start - T0, 2), round(s.end - T0, 2)) for s in w0.segments if s.state == "compute"]
    assert compute == [(0, 0.1, 1.6), (1, 2.2, 3.7), (2, 7.2, 8.7)]
    pub = [(s.round, round(s.end - s.start, 2)) for s in w0.segments if s.state == "publishing"]
    assert pub == [(0, 0.2), (1, 0.2), (2, 0.2)]
    waits = [(s.round, round(s.start - T0, 2), round(s.end - T0, 2)) for s in w0.segments if s.state == "waiting"]
    assert waits[:2] == [(0, 1.8, 2.0), (1, 3.9, 7.0)]  # published, then waiting for the round's commit
    assert [s.round for s in tl.lane("w002").segments if s.state == "compute"] == [0, 1]
    assert tl.boundaries == [(0, T0), (1, T0 + 2.0), (2, T0 + 7.0), (3, T0 + 9.0)]
    assert tl.bytes == [(1, 20000), (2, 40000), (3, 60000)]
    assert 0 < tl.utilisation["w000"] < 1
    phases = [(s.state, s.round) for s in tl.lane("coordinator").segments if not s.sub]
    assert phases[:3] == [("collecting", 0), ("reducing", 0), ("committing", 0)]


def test_a_killed_worker_has_a_death_and_a_restart_mark_and_a_straggler_a_late_one(run):
    tl = build_timeline(run.root, now=T0 + 10)
    w1 = tl.lane("w001")
    deaths = [m for m in w1.marks if m.kind == "death"]
    assert len(deaths) == 1 and deaths[0].t == T0 + 3 and "signal 9" in deaths[0].text
    assert [m.t for m in w1.marks if m.kind == "restart"] == [T0 + 4]
    gap = [s for s in w1.segments if s.state == "restarting"]  # between its two processes' segments
    assert len(gap) == 1 and gap[0].end == T0 + 5.0
    late = [m for m in tl.lane("w002").marks if m.kind == "late"]
    assert len(late) == 1 and late[0].round == 2 and late[0].t == T0 + 9.0 and "straggler" in late[0].text
    assert not tl.lane("w000").marks


def test_status_rows(run):
    v = gather(run.root, now=T0 + 10)
    assert (v["strategy"], v["committed"], v["total"], v["unit"]) == ("diloco", 3, 3, "round")
    rows = {w["worker"]: w for w in v["workers"]}
    assert [rows[w]["state"] for w in ("w000", "w001", "w002")] == ["exited"] * 3
    assert rows["w001"]["restarts"] == 1 and rows["w000"]["restarts"] == 0
    assert rows["w000"]["beat_age_s"] == 0.5 and rows["w000"]["host"] == "elsewhere"
    assert v["problems"] == [{"round": 2, "worker": "w002", "kind": "missing", "why": STRAGGLER}]
    recent = {r["round"]: r for r in v["recent"]}
    assert recent[3]["deltas"] == 2 and recent[3]["bytes"] == 60000 and recent[3]["seconds"] == 2.0
    assert recent[1]["ttq_s"] == pytest.approx(1.75, abs=0.01)  # quorum 2 of 3: the 2nd delta, 1.8 s - the commit
    text = render(v)
    assert "w001    exited" in text and "straggler: past the deadline" in text and "round 3/3 committed" in text


def test_a_live_worker_on_this_host_whose_process_is_gone_is_dead(run):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket
    atomic_write_json(run.progress(0), {"worker": 0, "pid": int(dead.stdout), "host": socket.gethostname(),
                                        "lease": "y", "beat": 3, "time": time.time(), "status": "training",
                                        "round": 3, "step": 2, "steps": 10})
    atomic_write_json(run.progress(2), {"worker": 2, "pid": os.getpid(), "host": socket.gethostname(), "lease": "z",
                                        "beat": 3, "time": time.time(), "status": "training", "round": 3, "step": 10,
                                        "steps": 10})
    rows = {w["worker"]: w for w in gather(run.root)["workers"]}
    assert rows["w000"]["state"] == "dead" and "gone on this host" in rows["w000"]["why"]
    assert rows["w002"]["state"] == "publishing"  # its steps are done, its delta of round 3 not in yet


def test_the_journal_survives_pruning_and_is_not_written_twice(run):
    lines = [json.loads(x) for x in (run.root / JOURNAL).read_text().splitlines()]
    assert [len(x["deltas"]) for x in lines] == [3, 3, 2]
    TimelineRecorder(run.root, draw=False).round_closed(2)  # a resumed coordinator: nothing new on disk
    assert len((run.root / JOURNAL).read_text().splitlines()) == 3


def test_the_picture_exists_and_loads(run, tmp_path):
    from matplotlib.image import imread
    from train.status.draw import draw_timeline

    out = tmp_path / "timeline.png"
    draw_timeline(build_timeline(run.root, now=T0 + 10), out, title="t")
    assert imread(out).shape[0] > 100


def test_supervisor_lines():
    got = supervisor_events("2026-01-02 03:04:05 simulator WARNING worker 2 exited with status 1; restart 2/3 in "
                            "2.0 s (it was pid 7)\nsomething else\n")
    assert [m.kind for m in got] == ["death", "restart"] and got[1].t - got[0].t == 2.0


def test_not_a_run_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "train.status", str(tmp_path)], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "not a run folder (no run.json)" in out.stderr
    assert not any(tmp_path.iterdir())  # read-only


def test_a_long_run_is_drawn_with_a_collection_per_lane_and_state_not_per_segment(tmp_path, monkeypatch):
    """The 1000-round soak (bench/soak.py) found the picture quadratic in its segments: a broken_barh call per
    segment, each re-scaling the axes over all the earlier ones (26k segments: over 10 minutes of the coordinator's
    CPU, in its background thread, every few minutes). A lane's segments of one state go in one collection."""
    import train.status.draw as draw_mod
    from train.status.timeline import Lane, Mark, Segment, Timeline

    rounds, lanes = 400, []
    for w in range(4):
        segs, t = [], 0.0
        for r in range(rounds):
            segs += [Segment(t, t + 0.6, "compute", r), Segment(t + 0.6, t + 0.7, "publishing", r),
                     Segment(t + 0.7, t + 1.0, "waiting", r)]
            t += 1.0
        lanes.append(Lane(f"w{w:03d}", segs, [Mark(5.0 * k, "late") for k in range(50)]))
    tl = Timeline("diloco", lanes, [(r, float(r)) for r in range(rounds)], [(r, 10**6) for r in range(rounds)],
                  {ln.name: 0.6 for ln in lanes}, 0.0, float(rounds))
    figs = []
    monkeypatch.setattr(draw_mod, "save_figure", lambda fig, out: figs.append(fig))
    draw_mod.draw_timeline(tl, tmp_path / "t.png")
    ax = figs[0].axes[0]
    assert sum(len(line.get_xdata()) for line in ax.lines) == 4 * 50  # the marks: one line per kind
    assert len(ax.collections) <= 4 * 3 + 1, len(ax.collections)  # lanes x states + the boundaries, not 4 x 1200
