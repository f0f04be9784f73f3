"""Every process may die, the coordinator and the supervisors included (issue #24): the coordinator beats a lease,
the workers say in one line when it goes silent and when it is back, and the simulator restarts a killed coordinator
or a killed supervisor; the run finishes without a rerun."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess

import pytest

from tests.helpers import REPO, tiny_config
from tests.helpers.proc import kill_and_await_restart, script_cmd, wait_until
from train.core.coordinator_lease import CoordinatorLease, CoordinatorWatch, coordinator_lease_path
from train.core.heartbeat import pid_alive
from train.core.store import atomic_write_json, read_json, read_jsonl, verify_manifest
from train.exchange.store import DiLoCoPaths


def _read(path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return {}


# -- the workers' watch on the coordinator's lease (a fake clock) ----------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _beat(path, lease: str, beat: int, pid: int = 4242, host: str = "elsewhere", **fields) -> None:
    atomic_write_json(path, {"role": "coordinator", "pid": pid, "host": host, "lease": lease, "beat": beat,
                             "status": "collecting", "round": 2, **fields})


def _lines(caplog) -> list[str]:
    out = [r.getMessage() for r in caplog.records if r.name == "watch-test"]
    caplog.clear()
    return out


def test_coordinator_watch_says_silence_once_and_the_return(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="watch-test")
    path = coordinator_lease_path(tmp_path)
    clock, alive = Clock(), {4242: True, 4343: True}
    watch = CoordinatorWatch(path, dead_after_s=10, startup_grace_s=20, hint="python diloco.py --config c.json",
                             clock=clock, pid_alive=lambda pid, start: alive.get(pid, False),
                             logger=logging.getLogger("watch-test"))
    # no lease yet: waited for dead_after_s + startup_grace_s, then ONE line
    for _ in range(29):
        clock.t += 1
        assert watch.check() == "starting"
    clock.t += 1.5
    assert watch.check() == "missing"
    lines = _lines(caplog)
    assert len(lines) == 1 and "no coordinator has beaten" in lines[0] and "python diloco.py --config c.json" in \
        lines[0], lines
    for _ in range(60):
        clock.t += 1
        watch.check()
    assert _lines(caplog) == []
    # it starts: one line, alive while it beats
    for b in range(1, 6):
        _beat(path, "A", b, command="python /repo/diloco.py --config /abs/c.json")
        clock.t += 1
        assert watch.check() == "alive"
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("the coordinator is here: pid 4242 on host elsewhere"), lines
    # silent: dead after dead_after_s without a change, in ONE line (who, since when, what it did, how to restart)
    for _ in range(9):
        clock.t += 1
        assert watch.check() == "alive"
    clock.t += 1
    assert watch.check() == "dead"
    for _ in range(120):  # it keeps waiting, and says nothing more
        clock.t += 1
        assert watch.check() == "dead"
    lines = _lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("the coordinator (pid 4242 on host elsewhere) has not beaten since ") and \
        "(10 s; dead_after_s = 10); it was collecting round 2: waiting for it to come back" in lines[0] and \
        "resumes from its last commit (python /repo/diloco.py --config /abs/c.json)" in lines[0], lines[0]
    # restarted: a new lease, one line
    _beat(path, "B", 6, pid=4343, status="preparing")
    clock.t += 1
    assert watch.check() == "alive"
    assert _lines(caplog) == ["the coordinator is back: pid 4343 on host elsewhere (preparing round 2)"]
    # same host, its pid gone: dead at once
    _beat(path, "B", 7, pid=4343, host=socket.gethostname())
    clock.t += 1
    assert watch.check() == "alive"
    alive[4343] = False
    clock.t += 1
    assert watch.check() == "dead"
    lines = _lines(caplog)
    assert len(lines) == 1 and "(pid 4343 on host" in lines[0] and "is gone: its process no longer runs" in lines[0]
    # a final record with an error: dead at once; a final record of a finished run: nothing to say
    _beat(path, "C", 8, pid=4444, status="exited", last_status="reducing", error="RuntimeError: boom")
    clock.t += 1
    assert watch.check() == "dead"
    lines = _lines(caplog)
    assert lines[0].startswith("the coordinator is back: pid 4444") and "exited at" in lines[1] and \
        "with an error (RuntimeError: boom); it was reducing round 2" in lines[1], lines
    _beat(path, "D", 9, pid=4545, status="exited", last_status="done")
    clock.t += 1
    assert watch.check() == "done"
    clock.t += 60
    assert watch.check() == "done"
    assert len(_lines(caplog)) == 1  # "back", then nothing: the run is complete


def test_coordinator_lease_records_and_ends(tmp_path):
    lease = CoordinatorLease(tmp_path).start("preparing", round=0)
    try:
        rec = read_json(coordinator_lease_path(tmp_path))
        assert rec["role"] == "coordinator" and rec["status"] == "preparing" and rec["pid"] == os.getpid()
        assert "worker" not in rec
        lease.set("collecting", round=3)
        first = read_json(coordinator_lease_path(tmp_path))
        assert (first["status"], first["round"]) == ("collecting", 3)
        wait_until(lambda: read_json(coordinator_lease_path(tmp_path))["beat"] > first["beat"], 5, "a lease beat")
        lease.set("done", round=3)
    finally:
        lease.end()
    rec = read_json(coordinator_lease_path(tmp_path))
    assert (rec["status"], rec["last_status"]) == ("exited", "done") and "error" not in rec
    again = CoordinatorLease(tmp_path).start("preparing")  # a restart: a new lease id, the beat counter goes on
    again.end(RuntimeError("boom"))
    rec2 = read_json(coordinator_lease_path(tmp_path))
    assert rec2["lease"] != rec["lease"] and rec2["beat"] > rec["beat"]
    assert (rec2["status"], rec2["last_status"], rec2["error"]) == ("exited", "preparing", "RuntimeError: boom")


# -- a killed supervisor, without torch: what the simulator's LocalProcess does ---------------------------------------
def test_the_simulator_restarts_a_killed_supervisor_and_says_what_became_of_its_child(tmp_path):
    import sys
    from train.launch.procs import LocalProcess, child_env, stop_all

    pids = tmp_path / "pids"
    child = tmp_path / "child.py"
    child.write_text(f"import os, signal, sys, time\n"
                     f"if len(sys.argv) > 1: signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf\n"
                     f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(120)\n")
    log = tmp_path / "w.log"
    p = LocalProcess("worker 7", [sys.executable, str(child)], log, child_env(), max_restarts=1, grace=1.0)
    deaf = LocalProcess("worker 8", [sys.executable, str(child), "deaf"], log, child_env(), max_restarts=1, grace=1.0)

    def started(n: int) -> bool:
        return pids.is_file() and len(pids.read_text().split()) >= n

    try:
        p.start()
        wait_until(lambda: started(1), 30, "the child started")
        sup = p.pid
        os.kill(sup, signal.SIGKILL)
        wait_until(lambda: p.poll() is None and started(2), 30, "supervisor and child restarted")
        assert (f"simulator WARNING the supervisor of worker 7 (pid {sup}) was killed by signal 9; its worker stopped "
                f"with it; restarting both, 1/1") in log.read_text()
        assert not _running(int(pids.read_text().split()[0]))
        os.kill(p.pid, signal.SIGKILL)  # once more: no restarts left, the end of this process (WorkerDied's text)
        wait_until(lambda: p.poll() is not None, 30, "the last supervisor's end")
        assert p.poll() == -9 and p.ending() == f"stopped: its supervisor (pid {p.pid}) was killed by signal 9"
        assert "no restarts left (1 used)" in log.read_text()

        deaf.start()
        wait_until(lambda: started(3), 30, "the deaf child started")
        os.kill(deaf.pid, signal.SIGKILL)
        wait_until(lambda: deaf.poll() is None and started(4), 30, "the deaf child killed and both restarted")
        assert "its worker did not stop within 1 s: killed (SIGKILL); restarting both, 1/1" in log.read_text()
        assert not _running(int(pids.read_text().split()[2]))
    finally:
        stop_all([p, deaf])


# -- real processes: the simulator restarts a killed coordinator, a killed supervisor ----------------------------------
def _config(tmp_path, **outer) -> str:
    path = tmp_path / "evolution.json"
    path.write_text(json.dumps(tiny_config(tmp_path / "runs", outer={"dead_after_s": 4, **outer}), indent=1))
    return str(path)


def _check_finished(paths: DiLoCoPaths, rounds: int, H: int) -> list[dict]:
    """Committed, the final model verified, every round's record once, tokens = the deltas used (none twice)."""
    assert paths.latest_committed() == rounds
    for r in paths.committed_rounds():
        verify_manifest(paths.global_dir(r))
    verify_manifest(paths.final)
    recs = read_jsonl(paths.metrics)
    assert [r["round"] for r in recs] == list(range(rounds + 1)), [r["round"] for r in recs]
    used = sum(len(r["workers_used"]) + len(r.get("late") or {}) for r in recs[1:])
    assert recs[-1]["tokens"] == used * H * 8 * 32
    return recs


def _run_sim(cfg: str, ready, kill) -> tuple[subprocess.Popen, str, object]:
    """Start diloco_sim.py, wait for ready(), call kill(sim); the simulator, its output and what kill returned."""
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        wait_until(ready, 240, "the moment to kill", sim)
        victim = kill(sim)
        out, _ = sim.communicate(timeout=240)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait(30)
    return sim, out, victim


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_sigkill_the_coordinator_the_workers_say_so_and_the_run_finishes(tmp_path):
    """SIGKILL the coordinator while it collects round 1: the workers say in one line that it is gone (and that it
    is back), its supervisor restarts it, it resumes from its last commit and the same run finishes: no rerun,
    every round committed and logged once."""
    H, R = 150, 3
    cfg = _config(tmp_path, rounds=R, local_steps=H)
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    lease = coordinator_lease_path(paths.root)

    def ready() -> bool:
        rec = _read(lease)
        return rec.get("status") == "collecting" and rec.get("round", 0) >= 1

    def kill(sim) -> int:
        pid = _read(lease)["pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    sim, out, victim = _run_sim(cfg, ready, kill)
    assert sim.returncode == 0, out[-3000:]
    assert f"the coordinator exited with signal 9; restart 1/3 in 1.0 s (it was pid {victim})" in out, out[-3000:]
    assert "resuming at round" in out
    for w in range(2):
        log = paths.worker_log(w).read_text()
        said = [ln for ln in log.splitlines() if f"the coordinator (pid {victim} on host" in ln]
        assert len(said) == 1 and "waiting for it to come back" in said[0] and "it resumes from its last commit" in \
            said[0], log[-3000:]
        assert "the coordinator is back: pid" in log
    final = _read(lease)
    assert final["pid"] != victim and (final["status"], final["last_status"]) == ("exited", "done")
    _check_finished(paths, R, H)


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
# the long tier (CI runs it): the simulator's restart of a killed supervisor and what it says are
# test_the_simulator_restarts_a_killed_supervisor_and_says_what_became_of_its_child's (default tier); here in a run
@pytest.mark.long
def test_sigkill_a_supervisor_the_simulator_restarts_it_and_the_run_finishes(tmp_path):
    """SIGKILL the supervisor of worker 1 while worker 1 trains round 1: the worker stops with it (parent-death
    signal), the simulator says exactly that, restarts both, the worker resumes from its own state and the run
    finishes without a rerun."""
    H, R = 150, 3
    cfg = _config(tmp_path, rounds=R, local_steps=H)
    paths = DiLoCoPaths(tmp_path / "runs" / "t")

    def ready() -> bool:
        rec = _read(paths.progress(1))
        return rec.get("round", -1) >= 1 and rec.get("status") == "training" and rec.get("step", 0) >= 3

    def kill_supervisor() -> tuple[int, int]:
        worker = _read(paths.progress(1))["pid"]
        with open(f"/proc/{worker}/stat") as f:
            sup = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent: the supervisor
        os.kill(sup, signal.SIGKILL)
        return sup, worker

    # the coordinator held until worker 1 is back: worker 0 alone cannot finish the run before the restart
    sim, out, (sup, worker) = _run_sim(cfg, ready,
                                       lambda sim: kill_and_await_restart(paths, 1, kill_supervisor, sim))
    assert sim.returncode == 0, out[-3000:]
    said = (f"the supervisor of worker 1 (pid {sup}) was killed by signal 9; its worker stopped with it; restarting "
            f"both, 1/3")
    assert said in out, out[-3000:]
    log1 = paths.worker_log(1).read_text()
    assert said in log1 and "resumed worker state" in log1, log1[-3000:]
    assert _read(paths.progress(1))["pid"] != worker and _read(paths.progress(1))["status"] == "exited"
    _check_finished(paths, R, H)


# -- the launcher's side: `status` shows the supervisor, its restarts, the coordinator's lease; a killed supervisor ---
def _remote(cfg: str, *args: str) -> dict:
    import sys
    out = subprocess.run([sys.executable, "-m", "train.launch.remote", *args[:1], "--config", cfg, "--machine", "m1",
                          *args[1:]], capture_output=True, text=True, cwd=REPO, timeout=60)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("EDT-JSON ")]
    assert line, out.stdout + out.stderr
    return json.loads(line[-1][len("EDT-JSON "):])


def test_remote_status_shows_the_supervisor_its_restarts_and_the_coordinator_lease(tmp_path):
    """The launcher's agent (what `launch_to_machines.py status` shows per host), with a stand-in coordinator that
    only beats its lease: killed, its supervisor restarts it (1 restart); the supervisor killed, the role is shown
    as died (no final record) and `start` starts it again."""
    import sys
    cfg = _config(tmp_path)
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    lease = coordinator_lease_path(paths.root)
    child = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
             f"from train.core.coordinator_lease import CoordinatorLease\n"
             f"CoordinatorLease({str(paths.root)!r}).start('collecting', round=1)\ntime.sleep(120)\n")
    try:
        ans = _remote(cfg, "start", "--role", "coordinator", "--check", "0.5", "--", sys.executable, "-c", child)
        assert ans["state"] == "running" and ans["max_restarts"] == 3 and ans["command"][:2] == [sys.executable, "-c"]
        wait_until(lambda: _read(lease).get("status") == "collecting", 30, "the stand-in's lease")
        first = _read(lease)["pid"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: _read(lease).get("pid") not in (None, first), 30, "the restarted stand-in's lease")
        st = _remote(cfg, "status")
        p = {x["role"]: x for x in st["processes"]}["coordinator"]
        assert p["state"] == "running" and p["supervisor"] == "alive" and p["restarts"] == 1, p
        assert p["summary"] == "running, 1 restart" and p["progress"]["status"] == "collecting", p
        assert p["progress"]["round"] == 1 and 0 <= p["progress"]["beat_age_s"] < 5, p

        os.kill(p["pid"], signal.SIGKILL)  # the supervisor: its child gets the parent-death signal
        wait_until(lambda: not _running(_read(lease).get("pid")), 30, "the stand-in dies with its supervisor")
        st = _remote(cfg, "status")
        p = {x["role"]: x for x in st["processes"]}["coordinator"]
        assert p["state"] == "stopped" and p["summary"].startswith("stopped: died (no final record"), p
        again = _remote(cfg, "start", "--role", "coordinator", "--check", "0.5", "--", sys.executable, "-c", child)
        assert again["state"] == "running" and not again["reused"], again
    finally:
        _remote(cfg, "stop", "--grace", "5")


def _running(pid) -> bool:
    return isinstance(pid, int) and pid_alive(pid)
