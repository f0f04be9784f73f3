"""Elastic workers with real processes: the supervisor's restarts, a SIGKILLed worker the simulator restarts, a
SIGTERMed worker that leaves, an EDT slot refilled by selection, and (with the DiLoCo coordinator's Membership
integration) a round that closes without a frozen worker within dead_after_s."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tests.helpers.proc import (coordinator_pid, ctrl_c_default, held, kill_all, kill_and_await_restart, progress_of,
                                script_cmd, start_script, wait_until)
from train.config import build_config
from train.core.store import read_json, read_jsonl, verify_manifest
from train.exchange.store import DiLoCoPaths
from train.launch.procs import Restarts


# -- the supervisor (no torch: fast) ---------------------------------------------------------------------------------
def test_restart_policy():
    r = Restarts(3)
    assert [r.next_delay(-9), r.next_delay(1), r.next_delay(-11), r.next_delay(1)] == [1.0, 2.0, 4.0, None]
    assert r.line("worker 1", -9, 4.0) == "worker 1 exited with signal 9; restart 3/3 in 4.0 s"
    for final in (0, 2, -signal.SIGTERM, -signal.SIGINT):  # done or left, a user error, a stop asked for
        assert Restarts(3).next_delay(final) is None
    capped = Restarts(10, cap=5.0)
    assert [capped.next_delay(1) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def _supervise(*args: str, child: str) -> list[str]:
    return [sys.executable, "-m", "train.launch.supervise", *args, "--", sys.executable, "-c", child]


def test_supervisor_restarts_with_backoff_then_exits_saying_how_its_worker_ended(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run(_supervise("--max-restarts", "2", "--name", "worker 9", child="import sys; sys.exit(3)"),
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 3 and time.monotonic() - t0 >= 3.0  # 1 s + 2 s of backoff
    assert "worker 9 exited with status 3; restart 1/2 in 1.0 s" in out.stderr
    assert "worker 9 exited with status 3; restart 2/2 in 2.0 s" in out.stderr
    assert "no restarts left (2 used)" in out.stderr
    # a user error (exit 2) is final: it would fail the same way again
    out = subprocess.run(_supervise("--max-restarts", "3", child="import sys; sys.exit(2)"), capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "restart" not in out.stderr
    # a worker killed by a signal: restarted
    marker = tmp_path / "runs"
    child = (f"import os, pathlib, signal; p = pathlib.Path({str(marker)!r}); p.mkdir(exist_ok=True); "
             f"n = len(list(p.iterdir())); (p / str(n)).touch(); "
             f"n < 1 and os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run(_supervise("--max-restarts", "1", child=child), capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 0 and len(list(marker.iterdir())) == 2, out.stderr
    assert "exited with signal 9; restart 1/1 in 1.0 s" in out.stderr
    # its child killed by a signal, restarts used up: an exit status that says so (128 + 9), not a signal of its own
    out = subprocess.run(_supervise("--max-restarts", "0", child="import os, signal; os.kill(os.getpid(), 9)"),
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 128 + 9


def test_sigterm_to_the_supervisor_group_stops_both_and_nothing_restarts(tmp_path):
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    p = subprocess.Popen(_supervise("--max-restarts", "3", child=child), stderr=subprocess.PIPE, text=True,
                         cwd=REPO, start_new_session=True)
    try:
        wait_until(lambda: pidfile.is_file() and pidfile.read_text(), 30, "the child started", p)
        os.killpg(p.pid, signal.SIGTERM)  # what `launch_to_machines.py stop` and the simulators do
        p.wait(20)
        err = p.stderr.read()
    finally:
        kill_all([p])
    assert p.returncode == -signal.SIGTERM and "restart" not in err, err
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)


def test_a_killed_simulator_takes_its_supervised_worker_with_it_at_once(tmp_path):
    """The simulator dies by SIGKILL: its supervisor gets the parent-death signal and exits, and so does the worker
    (at once, not at its next safe point: a rerun must find the worker's lock free)."""
    child = tmp_path / "child.py"
    child.write_text(f"import sys, time\nsys.path.insert(0, {str(REPO)!r})\n"
                     f"from train.core.heartbeat import Heartbeat, install_leave_handler\n"
                     f"hb = Heartbeat({str(tmp_path / 'progress.json')!r}, 0).start_lease(at_first_beat=True)\n"
                     f"install_leave_handler(lambda: hb)\nhb.beat(force=True, status='training')\n"
                     f"while True:\n    time.sleep(0.05)  # no safe point: a leave would wait forever\n")
    parent = (f"import subprocess, sys, time\nsys.path.insert(0, {str(REPO)!r})\n"
              f"from train.launch.procs import die_with_parent, supervised_argv\n"
              f"p = subprocess.Popen(supervised_argv(sys.executable, [sys.executable, {str(child)!r}], 3, 'worker 0'),"
              f" preexec_fn=die_with_parent(), cwd={str(REPO)!r})\nprint(p.pid, flush=True)\ntime.sleep(120)\n")
    sim = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, start_new_session=True)
    sup = worker = None
    try:
        sup = int(sim.stdout.readline())
        wait_until(lambda: (tmp_path / "progress.json").is_file(), 30, "the worker's first beat", sim)
        worker = read_json(tmp_path / "progress.json")["pid"]
        sim.send_signal(signal.SIGKILL)
        sim.wait(10)
        wait_until(lambda: not any(_running(p) for p in (sup, worker)), 10, "supervisor and worker gone")
    finally:
        kill_all([sim])
        for pid in (sup, worker):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_whose_parent_died_before_its_death_signal_was_set_does_not_start(tmp_path):
    """The parent (a simulator) is SIGKILLed between the fork of a child (a supervisor, a coordinator) and the
    child's prctl: no parent-death signal will ever come, so the child must not go on to run as an orphan (it would
    hold the run's coordinator lock against the rerun). The child's preexec waits for the event, then takes the real
    one."""
    pidfile, ran, script = tmp_path / "child.pid", tmp_path / "ran", tmp_path / "parent.py"
    script.write_text(f"""import os, subprocess, sys, time
sys.path.insert(0, {str(REPO)!r})
from train.launch.procs import die_with_parent
pre, me = die_with_parent(), os.getpid()

def late():
    open({str(pidfile)!r}, "w").write(str(os.getpid()))
    while os.getppid() == me:
        time.sleep(0.01)  # until the parent is gone
    pre()

subprocess.Popen([sys.executable, "-c", "import time; open({str(ran)!r}, 'w'); time.sleep(120)"], preexec_fn=late)
time.sleep(120)
""")
    _kill_parent_and_wait_for_the_child(script, pidfile, 30, "the child forked", "the orphaned child gone")
    assert not ran.exists()  # it exited in its preexec: the command never started


def _kill_parent_and_wait_for_the_child(script, pidfile, timeout: float, started: str, gone: str) -> None:
    """Run `script` (a simulator) in its own session; once its child wrote its pid to `pidfile`, SIGKILL the script
    and wait for that child to be gone (whatever is left is killed after)."""
    sim = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    child = None
    try:
        wait_until(lambda: pidfile.is_file() and pidfile.read_text(), timeout, started, sim)
        child = int(pidfile.read_text())
        sim.send_signal(signal.SIGKILL)
        sim.wait(10)
        wait_until(lambda: not _running(child), timeout, gone)
    finally:
        kill_all([sim])
        if _running(child):
            os.kill(child, signal.SIGKILL)


CHILD = """
import os, sys, threading
sys.path.insert(0, {repo!r})
from train.core.heartbeat import install_leave_handler
install_leave_handler(lambda: None)
stuck = threading.Thread(target=threading.Event().wait, daemon=True)  # a writer's job that never ends
stuck.start()
try:
    open({pidfile!r}, "w").write(str(os.getpid()))
    threading.Event().wait()  # training
finally:
    stuck.join()  # the unwinding's cleanup waits for it, as StreamingWriter's drain() waits for its writer thread
"""

PARENT = """
import subprocess, sys, time
sys.path.insert(0, {repo!r})
from train.launch.procs import die_with_parent
subprocess.Popen([sys.executable, "-c", {child!r}], preexec_fn=die_with_parent())
time.sleep(120)
"""


def test_a_worker_whose_simulator_dies_exits_even_while_a_thread_holds_its_exit(tmp_path):
    """The parent-death SIGTERM ends a worker at once, whatever its main thread is doing. Here the code it lands in
    has a cleanup that waits for a thread that never ends (as a delta writer's drain() waits for its writer thread,
    stuck on a queue whose lock the interrupted code held): unwinding with SystemExit hangs there for good, an
    orphan holding the worker's lock against the rerun (found by tests/e2e/test_streaming.py's random kills in
    CI: "worker 1 is already running")."""
    pidfile, script = tmp_path / "child.pid", tmp_path / "parent.py"
    child_code = CHILD.format(repo=str(REPO), pidfile=str(pidfile))
    script.write_text(PARENT.format(repo=str(REPO), child=child_code))
    _kill_parent_and_wait_for_the_child(script, pidfile, 60, "the worker started", "the orphaned worker gone")


def _parent(pid: int) -> int:
    """The parent of a process on this host (a worker's: its supervisor)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _running(pid: int | None) -> bool:
    from train.exchange.membership import local_pid_alive
    return isinstance(pid, int) and pid > 0 and local_pid_alive(pid)


# -- DiLoCo: a SIGKILLed worker is restarted by the simulator -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_sigkill_worker_mid_round_the_simulator_restarts_it_and_the_run_finishes(tmp_path, write_config):
    """3 workers; SIGKILL worker 1 while it trains round 1: its supervisor restarts it, it resumes from its own state
    and the same run finishes (no rerun); the final model loads; every delta counted once."""
    from transformers import AutoModelForCausalLM

    H, R = 100, 3
    cfg = write_config(outer={"num_workers": 3, "rounds": R, "local_steps": H})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        wait_until(lambda: progress_of(paths, 1).get("round", -1) >= 1 and progress_of(paths, 1).get("status") ==
                   "training" and progress_of(paths, 1).get("step", 0) >= 3, 300, "worker 1 training in round 1", sim)
        victim = progress_of(paths, 1)["pid"]
        kill_and_await_restart(paths, 1, lambda: os.kill(victim, signal.SIGKILL), sim)  # the survivors cannot finish
        out, _ = sim.communicate(timeout=400)
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 0, out[-3000:]
    log1 = paths.worker_log(1).read_text()
    assert "worker 1 exited with signal 9; restart 1/3 in 1.0 s" in log1
    assert "resumed worker state: last round done 0" in log1
    assert progress_of(paths, 1)["pid"] != victim and progress_of(paths, 1)["status"] == "exited"
    assert paths.latest_committed() == R
    for r in paths.committed_rounds():
        verify_manifest(paths.global_dir(r))
    AutoModelForCausalLM.from_pretrained(str(paths.final))
    recs = [r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0]
    assert [r["round"] for r in recs] == list(range(1, R + 1))  # each round committed once
    used = sum(len(r["workers_used"]) + len(r.get("late") or {}) for r in recs)  # a late delta folded in counts
    assert recs[-1]["tokens"] == used * H * 8 * 32


# -- SIGTERM = leave -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_a_sigtermed_worker_leaves_and_is_reported_as_left(tmp_path, write_config):
    from train.exchange.membership import Membership

    cfg = write_config(outer={"rounds": 40, "local_steps": 200})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO, preexec_fn=ctrl_c_default)
    try:
        wait_until(lambda: progress_of(paths, 1).get("status") == "training" and progress_of(paths, 1).get("step", 0)
                   >= 3, 300, "worker 1 training", sim)
        m = Membership(paths, 2, build_config(json.loads(open(cfg).read())).outer)
        rec = progress_of(paths, 1)
        sup = _parent(rec["pid"])
        os.kill(rec["pid"], signal.SIGTERM)
        t0 = time.monotonic()
        wait_until(lambda: progress_of(paths, 1).get("status") == "left", 30, "worker 1's final heartbeat", sim)
        took = time.monotonic() - t0
        d = m.poll({0})
        assert d.gone == {1: "exited (status left)"} and d.close
        state = read_json(paths.worker_state(1)) if paths.worker_state(1).is_file() else {"round_done": -1}
        final = progress_of(paths, 1)
        # nothing restarted: its supervisor exits (a restart would come from it) and the final record stays
        wait_until(lambda: not _running(sup), 30, "worker 1's supervisor exits", sim)
        assert progress_of(paths, 1) == final
    finally:
        sim.send_signal(signal.SIGINT)
        try:
            sim.communicate(timeout=60)
        finally:
            if sim.poll() is None:
                sim.kill()
    log1 = paths.worker_log(1).read_text()
    assert "leaving the run (SIGTERM)" in log1 and "restart" not in log1, log1[-2000:]
    assert took < 10  # at the next inner step, not after a timeout
    assert state["round_done"] < rec["round"]  # it abandoned the round it was training: nothing half-published
    assert not paths.delta_meta(rec["round"], 1).exists()


# -- EDT: a slot whose job keeps failing is refilled by selection ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
# the long tier (python -m pytest -m long; CI runs it): EDT under a kill: test_edt_e2e's coordinator-and-worker kill is
# the default tier's
@pytest.mark.long
def test_edt_slot_refilled_by_selection_when_its_job_is_abandoned(tmp_path, write_config):
    """Population 2 on 2 workers, edt.max_attempts = 1: SIGKILL the worker that holds m001 in generation 0. The
    coordinator sees its process gone, the job is abandoned once, and slot m001 becomes a copy of m000 (the only
    finished member) instead of stopping the run; generation 1 breeds from it as from any member."""
    from transformers import AutoModelForCausalLM

    from train.edt.store import EDTPaths

    S = 150
    cfg = write_config(outer={"num_workers": 2},
                  edt={"max_generations": 2, "mutation_steps": S, "job_lease_s": 60, "max_attempts": 1})
    paths = EDTPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("edt_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)

    def holder() -> int | None:
        try:
            c = read_json(paths.claim(0, 1))
        except (OSError, ValueError):
            return None
        return c.get("pid") if c.get("worker", -1) >= 0 else None

    try:
        wait_until(lambda: holder() is not None, 300, "a worker holds job g0/m001", sim)
        os.kill(holder(), signal.SIGKILL)
        out, _ = sim.communicate(timeout=400)
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 0, out[-3000:]
    genome = read_json(paths.genome(0, 1))
    assert genome["refilled"] is True and genome["copy_of"] == "g000000/m000"
    assert "job abandoned 1 times (edt.max_attempts = 1)" in genome["refill_reason"]
    recs = read_jsonl(paths.metrics)
    assert [r["generation"] for r in recs] == [0, 1]
    assert set(recs[0]["refilled"]) == {"m001"} and recs[1]["refilled"] == {}
    assert recs[0]["tokens_generation"] == S * 8 * 32  # the copy trained nothing
    assert recs[0]["eval_loss"]["m001"] == recs[0]["eval_loss"]["m000"]
    for f in ("pre-model.safetensors", "optimizer.safetensors"):  # (generation 0 has no outer momentum yet)
        assert (paths.member_dir(0, 1) / f).is_file()  # what a crossover and the next mutation read of a parent
    res = read_json(paths.result(0, 1))
    assert res["position"] == read_json(paths.job_json(0, 1))["position"]  # the slot's data position is kept
    assert "re-queued" in out and "refilled by selection" in out
    AutoModelForCausalLM.from_pretrained(str(paths.final))


# -- with the DiLoCo coordinator's Membership integration ------------------------------------------------------------
def _coordinator_uses_membership() -> bool:
    return "Membership(" in (REPO / "train" / "diloco" / "coordinator.py").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
@pytest.mark.skipif(not _coordinator_uses_membership(),
                    reason="needs the DiLoCo coordinator to consult train/exchange/membership.py (exchange rewrite)")
def test_round_closes_without_a_frozen_worker_within_dead_after_s(tmp_path, write_config):
    """INTEGRATION (runs once train/diloco/coordinator.py uses Membership): coordinator + 3 worker processes; SIGSTOP
    worker 2 mid-round (a frozen machine: its pid lives, its lease stops). The round closes with workers 0 and 1
    within dead_after_s + 1.5 x a normal round (+ slack for 2 shared cores), the record names worker 2 as missing,
    and the run finishes without it."""
    dead_after, H, R = 4.0, 60, 4
    cfg = write_config(outer={"num_workers": 3, "rounds": R, "local_steps": H, "dead_after_s": dead_after,
                                   "straggler_factor": 0, "round_timeout_s": 600})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    logs = tmp_path / "logs"
    logs.mkdir()
    coord = start_script([str(REPO / "diloco.py"), "--config", cfg], logs / "coord.log")
    workers = [start_script(["-m", "train.diloco.worker", "--config", cfg, "--worker", str(w)], logs / f"w{w}.log")
               for w in range(3)]
    procs = [coord, *workers]
    try:
        # the metrics of a round are logged after its commit (the evaluation runs in the background)
        wait_until(lambda: any(r.get("round", 0) >= 2 for r in read_jsonl(paths.metrics)), 300,
                   "two rounds committed and logged", coord)
        times = {r["round"]: r["time"] for r in read_jsonl(paths.metrics) if "round" in r}
        normal = [times[r] - times[r - 1] for r in times if r >= 2 and r - 1 in times]
        wait_until(lambda: progress_of(paths, 2).get("round", -1) >= 2 and progress_of(paths, 2).get("status") ==
                   "training", 120, "worker 2 training in round 2", coord)
        stopped_at = paths.latest_committed()
        workers[2].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_until(lambda: (paths.latest_committed() or 0) > stopped_at, 120, "the round without worker 2", coord)
        took = time.monotonic() - t0
        assert coord.wait(300) == 0, (logs / "coord.log").read_text()[-3000:]
    finally:
        for p in workers:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        kill_all(procs)
    assert took <= dead_after + 1.5 * max(normal) + 10, (took, normal)
    rec = next(r for r in read_jsonl(paths.metrics) if r.get("round") == stopped_at + 1)
    assert 2 in rec["missing"] and sorted(rec["workers_used"]) == [0, 1]
    assert paths.latest_committed() == R


# -- join and leave: the data layout ---------------------------------------------------------------------------------
def _stream_windows(paths: DiLoCoPaths) -> list[int]:
    """Every stream window a committed delta was trained on (metrics: the slice each used delta read)."""
    out = []
    for rec in read_jsonl(paths.metrics):
        for off, n in rec.get("data", {}).values():
            out += range(off, off + n)
    return out


@pytest.mark.slow
@pytest.mark.long  # a variant: tests/unit/test_layout.py's property and test_streaming's long-tier resume cover it
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_resume_with_more_then_fewer_workers_reads_no_window_twice(tmp_path, write_config):
    """2 workers for 2 rounds, then the same run resumed with 3 workers, then with 1: the data layout re-splits the
    stream at the first round nobody started, every used delta's slice is disjoint from every other and the tokens
    add up. The third worker's first delta (fresh AdamW moments, larger than the others') passes the screen."""
    cfg = write_config(outer={"rounds": 2})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    for n, rounds in ((2, 2), (3, 4), (1, 6)):
        out = subprocess.run(script_cmd("diloco_sim.py", "--config", cfg, "--workers", str(n), "--rounds",
                                        str(rounds)), capture_output=True, text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    lay = read_json(paths.data / "layout.json")
    assert [s["slots"] for s in lay["segments"]] == [2, 3, 1] and lay["config_workers"] == 1
    assert "outer.num_workers 2 -> 3" in lay["segments"][1]["why"]
    recs = [r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0]
    assert [r["round"] for r in recs] == list(range(1, 7))
    s1, s2 = (s["from_round"] for s in lay["segments"][1:])
    for r in recs:  # a round uses the workers of its segment; a shrink's last old rounds await only the kept ones
        r0 = r["round"] - 1
        assert r["workers_used"] == ([0, 1] if r0 < s1 else [0, 1, 2] if r0 < 4 else [0]), (r0, lay)
        assert r0 < s2 or set(r["missing"]) == set() or r["missing"] == [1, 2]
    got = _stream_windows(paths)
    assert len(got) == len(set(got)), "a window was trained twice"
    assert recs[-1]["tokens"] == len(got) * 32
    assert len(got) == sum(len(r["workers_used"]) for r in recs) * 5 * 8


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_a_worker_started_mid_run_joins_at_the_next_round_boundary(tmp_path, write_config):
    """A 2-worker run; a third worker process started by hand after round 1 asks to join (lease status "joining"),
    the coordinator gives it a slot at the next round boundary, and from then on every round uses its delta.
    The coordinator is held (SIGSTOP) while the joiner starts: its start-up (torch, the data) must not race the
    rest of the run, which the two workers could otherwise finish first on a busy box."""
    R = 8  # admitted by round asked_at + 3 <= 5 (asked while round 1 or 2 is committed): rounds with it remain
    cfg = write_config(outer={"rounds": R, "local_steps": 40})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    joiner = None
    try:
        wait_until(lambda: paths.committed(1).is_file(), 300, "round 1 committed", sim)
        with held(coordinator_pid(paths)):
            joiner = start_script(["-m", "train.diloco.worker", "--config", cfg, "--worker", "2"],
                                  tmp_path / "joiner.log")
            wait_until(lambda: progress_of(paths, 2).get("status") == "joining", 120, "the joiner asking", joiner)
            asked_at = paths.latest_committed()
        out, _ = sim.communicate(timeout=600)
        assert joiner.wait(timeout=120) == 0, (tmp_path / "joiner.log").read_text()[-3000:]
    finally:
        kill_all([p for p in (sim, joiner) if p is not None])
    assert sim.returncode == 0, out[-3000:]
    lay = read_json(paths.data / "layout.json")
    seg = lay["segments"][-1]
    assert seg["slots"] == 3 and "join: worker(s) [2]" in seg["why"]
    assert seg["from_round"] <= asked_at + 3  # admitted at a round boundary soon after it asked
    recs = {r["round"] - 1: r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0}
    assert all(recs[r]["workers_used"] == [0, 1] for r in recs if r < seg["from_round"])
    assert all(recs[r]["workers_used"] == [0, 1, 2] for r in recs if r >= seg["from_round"])
    assert seg["from_round"] < R, "the join came too late to train a round"
    got = _stream_windows(paths)
    assert len(got) == len(set(got))
    log2 = (tmp_path / "joiner.log").read_text()
    assert "asks to join a run of 2 workers" in log2 and f"joined the run at round {seg['from_round']}" in log2
    # it trains at the run's learning rate from its first round (the schedule is the run's, not its own step count:
    # from step 0, warmup included, it published deltas larger than the others' for the rest of the run)
    deltas = {(d["round"], d["worker"]): d for t in read_jsonl(paths.root / "timeline.jsonl") for d in t["deltas"]}
    assert deltas[(seg["from_round"], 2)]["lr"] == deltas[(seg["from_round"], 0)]["lr"]


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_a_late_delta_is_folded_into_the_next_round_with_its_staleness_weight(tmp_path, write_config):
    """outer.late_weight = 0.5 with int8: worker 1 is frozen (SIGSTOP) in round 1 until the round closes without it
    (dead_after_s), then thawed: it publishes its round-1 delta late and round 2 folds it in at half weight; the
    record says so, its tokens count and its slice is still read once."""
    H = 400  # a few seconds of steps: worker 1 is frozen while it trains round 1, before it can publish it
    cfg = write_config(outer={"rounds": 3, "local_steps": H, "late_weight": 0.5, "dead_after_s": 3,
                                   "compression": "int8", "straggler_factor": 0})
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    sim = subprocess.Popen(script_cmd("diloco_sim.py", "--config", cfg), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        def training_round_1() -> bool:
            p = progress_of(paths, 1)
            return p.get("round") == 1 and p.get("status") == "training"
        wait_until(training_round_1, 300, "worker 1 training round 1", sim)
        pid = progress_of(paths, 1)["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:  # frozen mid-round: what it trains must not be published yet (else the test aimed too late)
            assert not paths.delta_meta(1, 1).exists(), "worker 1 was frozen after it published round 1"
            wait_until(lambda: paths.committed(2).is_file(), 120, "round 1 closed without worker 1", sim)
        finally:
            os.kill(pid, signal.SIGCONT)
        out, _ = sim.communicate(timeout=400)
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 0, out[-3000:]
    recs = {r["round"]: r for r in read_jsonl(paths.metrics) if r.get("round", 0) > 0}
    assert recs[2]["workers_used"] == [0] and "dead" in recs[2]["missing_why"]["w001"]
    assert recs[3]["late"] == {"w001": {"round": 1, "weight": 0.5, "tokens": H * 8 * 32}}
    assert recs[3]["tokens"] - recs[2]["tokens"] == 3 * H * 8 * 32  # two deltas of round 2 + the late one
    assert read_json(paths.committed(3))["late"]["w001"]["round"] == 1
    got = _stream_windows(paths)
    assert len(got) == len(set(got))
    assert "publishing our delta late" in paths.worker_log(1).read_text()
