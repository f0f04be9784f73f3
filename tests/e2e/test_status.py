"""timeline.png and `python -m train.status` on real runs: a 3-worker diloco_sim.py run with one worker SIGKILLed
(its supervisor restarts it) and one straggler (throttled with SIGSTOP / SIGCONT: alive, beating, slow) that a round
leaves behind; and an EDT run's generations and jobs on the same lanes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tests.helpers.proc import script_cmd, wait_until, progress_of
from train.core.store import read_json
from train.exchange.store import DiLoCoPaths
from train.status.timeline import build_timeline


def _throttle(pid: int, until, timeout: float) -> None:
    """Run `pid` at ~10% speed (stopped 0.45 s of every 0.5 s: its lease thread still beats) until `until()`."""
    deadline = time.monotonic() + timeout
    try:
        while not until() and time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.45)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
    except ProcessLookupError:
        pass  # it ended (the caller's checks say why)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _record(paths: DiLoCoPaths, r: int) -> dict:
    try:
        return read_json(paths.committed(r))
    except (OSError, ValueError):
        return {}


def _left_behind(paths: DiLoCoPaths, w: int, start: int, rounds: int) -> int | None:
    """The first round from `start` on that was committed without worker w (COMMITTED of r + 1 closes round r)."""
    for r in range(start, rounds):
        try:
            rec = read_json(paths.committed(r + 1))
        except (OSError, ValueError):
            continue
        if w in rec.get("missing", []):
            return r
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
# the long tier (python -m pytest -m long; CI runs it): the views: the test below; kills and stragglers:
# test_elastic.py's
@pytest.mark.long
def test_a_killed_worker_and_a_straggler_in_the_timeline_and_the_status_view(tmp_path, write_config):
    R = 8
    cfg = write_config(outer={"num_workers": 3, "rounds": R, "local_steps": 60, "dead_after_s": 2,
                                   "startup_grace_s": 6, "straggler_factor": 2},
                  logging={"progress": False, "plot": True}, eval={"every": 100, "batch_size": 8, "batches": 1})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        # the straggler: worker 2 slowed down in round 3 (the deadline needs a history of rounds after the start-up)
        wait_until(lambda: progress_of(paths, 2).get("round", -1) >= 3 and progress_of(paths, 2).get("status") ==
                   "training", 120, "worker 2 training round 3", sim)
        # throttled until a round closes without it (seen in the commit records; under load it may make the
        # deadline of the round it was in when the throttle began, never of the next one)
        start = progress_of(paths, 2)["round"]
        _throttle(progress_of(paths, 2)["pid"], lambda: _left_behind(paths, 2, start, R) is not None, 90)
        slow_round = _left_behind(paths, 2, start, R)
        assert slow_round is not None, ("worker 2 at ~10% speed was never left behind",
                                        [_record(paths, r + 1) for r in range(R)])
        # then worker 1 SIGKILLed while it trains a later round (its supervisor restarts it)
        wait_until(lambda: progress_of(paths, 1).get("round", -1) > slow_round and progress_of(paths, 1).get(
            "status") == "training", 60, "worker 1 training after the straggler's round", sim)
        killed_round = progress_of(paths, 1)["round"]
        os.kill(progress_of(paths, 1)["pid"], signal.SIGKILL)
        out, _ = sim.communicate(timeout=120)
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 0, out[-3000:]

    tl = build_timeline(paths.root)
    assert [ln.name for ln in tl.lanes] == ["w000", "w001", "w002", "coordinator"]
    assert [k for k, _ in tl.boundaries] == list(range(R + 1))
    w0 = {s.round for s in tl.lane("w000").segments if s.state == "compute"}
    assert w0 == set(range(R))  # every round's segment, though the sidecars of old rounds were pruned
    w1 = tl.lane("w001")
    death = [m for m in w1.marks if m.kind == "death"]
    assert len(death) == 1 and "signal 9" in death[0].text
    assert any(m.kind == "restart" for m in w1.marks)
    assert any(m.kind == "missed" and m.round == killed_round and "gone" in m.text for m in w1.marks)
    late = [m for m in tl.lane("w002").marks if m.kind == "late"]
    assert late and late[0].round == slow_round and "straggler" in late[0].text
    assert {"collecting", "committing"} <= {s.state for s in tl.lane("coordinator").segments}
    from matplotlib.image import imread
    assert imread(paths.root / "timeline.png").shape[0] > 100

    before = sorted(p.name for p in paths.root.iterdir())
    st = subprocess.run([sys.executable, "-m", "train.status", str(paths.root), "--json"], capture_output=True,
                        text=True, cwd=REPO)
    assert st.returncode == 0, st.stderr
    v = json.loads(st.stdout)
    rows = {w["worker"]: w for w in v["workers"]}
    assert rows["w001"]["restarts"] == 1 and rows["w000"]["restarts"] == 0
    assert all(w["state"] == "exited" and w["last_delta"] is not None for w in rows.values())
    assert any(p["worker"] == "w002" and p["round"] == slow_round and "straggler" in p["why"] for p in v["problems"])
    assert v["committed"] == R and v["finished"] and v["coordinator"]["doing"] == "done"
    # each worker's H and idle seconds per round (the windows its committed delta read, and the round's wall time
    # less its compute)
    for row in v["recent"]:
        assert set(row["H"]) <= {"w000", "w001", "w002"} and all(h == 60 for h in row["H"].values())
        assert all(x >= 0 for x in row["idle"].values())
    assert sorted(p.name for p in paths.root.iterdir()) == before  # read-only


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_an_edt_runs_generations_and_jobs_on_the_worker_lanes(tmp_path, write_config):
    cfg = write_config(outer={"num_workers": 2, "local_steps": 4},
                  edt={"population_size": 3, "max_generations": 2, "mutation_steps": 3},
                  logging={"progress": False, "plot": False})
    out = subprocess.run(script_cmd("edt_sim.py", "--config", cfg), capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    root = tmp_path / "runs" / "t"
    tl = build_timeline(root)
    assert tl.strategy == "edt" and [k for k, _ in tl.boundaries] == [0, 1]
    jobs = sorted(s.label for ln in tl.lanes if ln.name != "coordinator" for s in ln.segments
                  if s.state == "compute")
    assert jobs == [f"g{g}/m{m:03d}" for g in (0, 1) for m in range(3)]  # each job once, on its worker's lane
    assert [s.state for s in tl.lane("coordinator").segments] == ["collecting", "breeding", "collecting"]
    assert not (root / "timeline.png").exists()  # logging.plot off: the journal only
    v = json.loads(subprocess.run([sys.executable, "-m", "train.status", str(root), "--json"], capture_output=True,
                                  text=True, cwd=REPO).stdout)
    assert (v["strategy"], v["unit"], v["committed"], v["total"]) == ("edt", "generation", 1, 2)
