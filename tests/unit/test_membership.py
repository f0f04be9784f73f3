"""Membership (train/exchange/membership.py) on real lease files written by real Heartbeat objects, with a fake clock.

Every test writes workers/wXXX/progress.json through train/core/heartbeat.py and moves the coordinator's clock by
hand: liveness comes from the files' contents and that clock only (no mtimes, no sleeping).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tests.helpers.proc import wait_until
from train.config import ConfigError, build_config
from train.core.heartbeat import Heartbeat
from train.core.store import RunPaths, read_json
from train.exchange.membership import Membership, local_pid_alive, workers_alive


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def outer(**kw):
    return build_config({"outer": {"num_workers": 3, **kw}}).outer


@pytest.fixture
def paths(tmp_path):
    return RunPaths(tmp_path / "run")


def hb(paths, w: int) -> Heartbeat:
    return Heartbeat(paths.progress(w), w)


def test_config_fields_and_their_checks():
    oc = build_config({}).outer
    assert (oc.dead_after_s, oc.startup_grace_s, oc.straggler_factor, oc.max_restarts) == (10.0, 120.0, 3.0, 3)
    for key, bad in (("dead_after_s", 1.0), ("straggler_factor", -1), ("max_restarts", -1),
                     ("startup_grace_s", -5)):
        with pytest.raises(ConfigError, match=f"outer.{key}"):
            build_config({"outer": {key: bad}})


def test_a_lease_record_names_its_process_and_its_beat_only_grows(paths):
    a = hb(paths, 0)
    a.beat(force=True, status="waiting for round 0")
    a.beat(force=True, status="training", round=0, step=1, steps=5, loss=2.5)
    rec = read_json(paths.progress(0))
    assert rec["beat"] == 2 and rec["pid"] == os.getpid() and rec["status"] == "training" and rec["lease"]
    assert {"host", "boot_id", "proc_start", "time"} <= set(rec)
    a.stop("exited")
    assert read_json(paths.progress(0))["status"] == "exited" and read_json(paths.progress(0))["last_status"] == \
        "training"
    a.beat(force=True, status="training")  # nothing after the final record
    assert read_json(paths.progress(0))["status"] == "exited"
    b = hb(paths, 0).start_lease(every=0.02)  # the next process of worker 0: the counter continues
    try:
        deadline = time.monotonic() + 5
        while read_json(paths.progress(0))["beat"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        rec = read_json(paths.progress(0))
        assert rec["beat"] >= 6 and rec["lease"] == b.lease_id != a.lease_id
    finally:
        b.stop("left")
    assert read_json(paths.progress(0))["status"] == "left"


def test_the_lease_beats_while_the_worker_does_nothing(paths):
    a = hb(paths, 0).start_lease(every=0.02, at_first_beat=True)
    assert not paths.progress(0).exists()  # armed: nothing before the worker's first beat (it takes its lock first)
    a.beat(status="waiting for the outer step")
    try:
        seen = set()
        deadline = time.monotonic() + 5
        while len(seen) < 4 and time.monotonic() < deadline:
            rec = read_json(paths.progress(0))
            seen.add(rec["beat"])
            assert rec["status"] == "waiting for the outer step"
            time.sleep(0.01)
        assert len(seen) >= 4
    finally:
        a.stop()


def test_dead_after_dead_after_s_without_a_beat_change(paths):
    clock, beats = Clock(), [hb(paths, w) for w in range(3)]
    for b in beats:
        b.beat(force=True, status="training")
    m = Membership(paths, 3, outer(dead_after_s=10), clock)
    for b in beats:
        b.beat(force=True, status="training")  # a beat after the coordinator started: these leases are current
    d = m.poll(set())
    assert not d.close and d.waiting == [0, 1, 2] and all(r.startswith("alive") for r in d.missing.values())
    clock.t += 9.9
    beats[0].beat(force=True, status="training")
    beats[1].beat(force=True, status="training")
    assert m.poll({0, 1}).missing[2].startswith("alive")  # 9.9 s of silence: not yet
    clock.t += 2.1
    d = m.poll({0, 1})
    assert d.close and d.why == "every live worker arrived (2 of 3)"
    assert d.gone == {2: "dead: no heartbeat change for 12.0 s (dead_after_s = 10)"} == d.missing
    beats[2].beat(force=True, status="training")  # it comes back (a stall, not a death): alive again
    assert m.poll({0, 1}).missing[2].startswith("alive")


def test_left_and_exited_are_gone_at_once(paths):
    clock = Clock()
    beats = [hb(paths, w) for w in range(3)]
    m = Membership(paths, 3, outer(), clock)
    for b in beats:
        b.beat(force=True, status="training")
    beats[1].stop("left")
    beats[2].stop("exited", error="RuntimeError: boom")
    d = m.poll({0})
    assert d.close and d.gone == {1: "exited (status left)", 2: "exited (status exited: RuntimeError: boom)"}


def _child_beats(paths, w: int, then: str) -> subprocess.Popen:
    """A real process that writes worker w's lease once, then exits or sleeps."""
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
            f"from train.core.heartbeat import Heartbeat\n"
            f"Heartbeat({str(paths.progress(w))!r}, {w}).beat(force=True, status='training')\n"
            f"print('beat', flush=True)\n"
            f"{'time.sleep(60)' if then == 'sleep' else 'pass'}\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (Z: a zombie, dead but not reaped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_process_gone_on_this_host_is_gone_at_once_zombie_or_reaped(paths):
    clock = Clock()
    m = Membership(paths, 3, outer(), clock)
    exited = _child_beats(paths, 1, "exit")
    exited.wait(30)  # reaped: the pid no longer exists
    killed = _child_beats(paths, 2, "sleep")
    assert killed.stdout.readline() == "beat\n"
    killed.send_signal(signal.SIGKILL)
    wait_until(lambda: _proc_state(killed.pid) == "Z", 30, "the killed child a zombie")  # not reaped: counts as gone
    hb(paths, 0).beat(force=True, status="training")
    d = m.poll({0})
    killed.wait(10)
    assert d.close and d.gone == {1: f"process {exited.pid} gone on this host",
                                  2: f"process {killed.pid} gone on this host"}
    assert local_pid_alive(os.getpid()) and not local_pid_alive(exited.pid)


def test_a_record_from_another_host_is_judged_by_its_beat_only(paths):
    clock = Clock()
    m = Membership(paths, 1, outer(num_workers=1), clock, pid_alive=lambda pid, start: False)
    b = hb(paths, 0)
    b.beat(force=True, status="training")
    rec = read_json(paths.progress(0))
    paths.progress(0).write_text(json.dumps({**rec, "host": "elsewhere", "beat": rec["beat"] + 1}))
    assert m.poll(set()).missing[0].startswith("alive")  # pid_alive would say no: not asked for another host
    clock.t += 10
    assert m.poll(set()).gone[0].startswith("dead: no heartbeat change for 10.0 s")


def test_startup_grace_and_stale_files_of_earlier_processes(paths):
    clock = Clock()
    old = hb(paths, 1)
    old.beat(force=True, status="training")
    old.stop("left")  # what the previous session left behind: says nothing about the new process
    m = Membership(paths, 3, outer(dead_after_s=10, startup_grace_s=120), clock)
    hb(paths, 0).beat(force=True, status="waiting for round 0")
    clock.t += 129.9
    d = m.poll({0})
    assert not d.close and d.waiting == [1, 2]
    assert d.missing[1].startswith("starting: no heartbeat yet (129.9 s of 130 s")
    new = hb(paths, 1)
    new.beat(force=True, status="waiting for round 0")  # worker 1 started: alive from now on
    clock.t += 0.2
    d = m.poll({0})
    assert d.missing[1].startswith("alive") and d.gone == {2: "never started: no heartbeat in 130.1 s of waiting "
                                                              "for it (dead_after_s + startup_grace_s = 130)"}
    assert not d.close
    assert m.poll({0, 1}).close


def test_straggler_deadline_after_a_quorum_with_dead_after_s_as_floor(paths):
    clock = Clock()
    beats = [hb(paths, w) for w in range(3)]
    m = Membership(paths, 3, outer(dead_after_s=10, straggler_factor=3.0), clock)

    def tick(dt: float, arrived: set[int]):
        clock.t += dt
        for b in beats:
            b.beat(force=True, status="training")  # everyone alive, the straggler too
        return m.poll(arrived)

    assert tick(0, set()).deadline_s is None  # no history: no deadline
    assert not tick(60, {0, 1}).close  # the first round waits for every live worker
    assert tick(1, {0, 1, 2}).close
    m.record_round()  # time-to-quorum 60 s (when 2 of 3 were in), not the 61 s the round took
    assert m.history == [60.0]
    for secs in (5.0, 5.0, 5.0):
        m.record_round(secs)
    assert m.deadline_s() == 15.0  # 3 x median(60, 5, 5, 5) = 3 x 5
    tick(0, set())
    assert not tick(4, {0}).close  # 1 of 3: below the quorum of 2, whatever the time
    d = tick(10.9, {0, 1})
    assert not d.close and d.quorum == 2 and d.waiting == [2]
    d = tick(0.1, {0, 1})
    assert d.close and d.late == {2: "straggler: past the deadline of 15.0 s = 3 x median recent round (5.0 s)"}
    assert d.missing == d.late and d.why.startswith("straggler deadline 15.0 s passed with 2 of 3 (quorum 2)")
    m.record_round()
    m.history = [1.0]  # fast rounds: the deadline is never below dead_after_s
    assert m.deadline_s() == 10.0
    tick(0, set())
    assert not tick(9.9, {0, 1}).close and tick(0.1, {0, 1}).late[2].endswith("(floor: dead_after_s)")
    m.record_round()
    m.outer.straggler_factor = 0.0  # off: wait for every live worker (until round_timeout_s)
    assert m.deadline_s() is None and not tick(1000, {0, 1}).close


def two_running_workers(paths):
    """Two workers beating since before the coordinator started, fast rounds recorded: the straggler deadline is
    10 s (the dead_after_s floor), the start-up allowance dead_after_s + startup_grace_s = 130 s."""
    clock = Clock()
    beats = [hb(paths, w) for w in range(2)]
    for b in beats:
        b.beat(force=True, status="training")
    m = Membership(paths, 2, outer(num_workers=2, dead_after_s=10, startup_grace_s=120, straggler_factor=3.0),
                   clock)
    m.history = [1.0]
    return clock, beats, m


def test_the_straggler_deadline_never_leaves_a_restarted_worker_behind_before_its_startup_grace(paths):
    """A worker SIGKILLed and restarted mid-run (or a run resumed with a delta already in) imports torch, reads the
    data and loads θ before it can train: it gets dead_after_s + startup_grace_s from its new process's first beat,
    like a worker that has not beaten at all, before the straggler rule may close the round without it."""
    clock, beats, m = two_running_workers(paths)
    assert m.deadline_s() == 10.0
    assert not m.poll({0}).close
    beats[1] = hb(paths, 1)  # a new process of worker 1 (its lease id changes)
    clock.t += 5
    beats[1].beat(force=True, status="waiting for round 0")
    assert not m.poll({0}).close  # first seen at t0 + 5
    for dt in (5.0, 50.0, 74.9):
        clock.t += dt
        beats[0].beat(force=True, status="waiting for the outer step")
        beats[1].beat(force=True, status="training")
        d = m.poll({0})
        assert not d.close and d.waiting == [1], d.why
    assert "(re)started 129.9 s ago" in d.why and "dead_after_s + startup_grace_s = 130 s" in d.why
    clock.t += 0.1
    beats[1].beat(force=True, status="training")
    d = m.poll({0})
    assert d.close and d.late[1].startswith("straggler: past the deadline of 10.0 s")
    m.record_round()
    clock.t += 1
    assert m.poll({0, 1}).close  # it arrived: the next round is a normal one
    m.record_round()
    for straggler in (0, 1):  # worker 0: the process beating since before we started; worker 1: the restarted
        assert not m.poll({1 - straggler}).close  # one, which delivered a delta since: the deadline applies as before
        clock.t += 10
        beats[0].beat(force=True, status="training")
        beats[1].beat(force=True, status="training")
        late = m.poll({1 - straggler}).late
        assert list(late) == [straggler] and late[straggler].startswith("straggler: past the deadline of 10.0 s")
        m.record_round()


def test_a_delta_left_by_a_killed_process_does_not_prove_its_restarted_successor(paths):
    """Resume: worker 1's old process published round r's delta before it was killed; the new process beats while
    that delta is collected. Only a delta whose sidecar names the new lease ends the new process's start-up
    allowance."""
    clock, beats, m = two_running_workers(paths)
    old = beats[1].lease_id
    beats[1] = hb(paths, 1)
    beats[1].beat(force=True, status="waiting for round 0")
    assert m.poll({0, 1}, {0: beats[0].lease_id, 1: old}).close  # round r: both deltas were on disk
    m.record_round()
    assert not m.poll({0}).close
    clock.t += 20  # past the 10 s deadline, the new process has delivered nothing yet
    beats[0].beat(force=True, status="waiting for the outer step")
    beats[1].beat(force=True, status="training")
    d = m.poll({0}, {0: beats[0].lease_id})
    assert not d.close and "w1 (re)started 20.0 s ago" in d.why
    assert m.poll({0, 1}, {0: beats[0].lease_id, 1: beats[1].lease_id}).close  # its own delta: proven
    m.record_round()
    assert not m.poll({0}).close
    clock.t += 10
    beats[1].beat(force=True, status="training")
    beats[0].beat(force=True, status="training")
    assert list(m.poll({0}).late) == [1]


def test_a_poll_reads_no_lease_of_an_arrived_worker_whose_sidecar_names_its_known_lease(paths, monkeypatch):
    """Once a worker's delta is in and its sidecar names the live lease the coordinator knows, its lease file is
    not read again this round (a wide round's last polls read the missing few, not N); a sidecar naming another
    lease (a restarted process) is read once, as before."""
    clock, beats, m = two_running_workers(paths)
    reads: list[int] = []
    real = Membership._read

    def counted(self, w, listed=None):
        if listed is None:  # (not the joiners' ids, read from one listing)
            reads.append(w)
        return real(self, w, listed)
    monkeypatch.setattr(Membership, "_read", counted)
    m.poll(set())
    for b in beats:  # a beat since the coordinator started: their leases are live ("current")
        b.beat(force=True, status="training")
    m.poll(set())
    assert sorted(reads) == [0, 0, 1, 1]
    reads.clear()
    m.poll({0}, {0: beats[0].lease_id})
    assert reads == [1]
    reads.clear()
    m.poll({0, 1}, {0: beats[0].lease_id, 1: "another-process"})
    assert reads == [1]
    reads.clear()
    m.poll({0, 1}, {0: beats[0].lease_id, 1: "another-process"})
    assert reads == []


def test_round_timeout_is_the_cap_and_min_workers_the_floor(paths):
    clock = Clock()
    beats = [hb(paths, w) for w in range(3)]
    m = Membership(paths, 3, outer(min_workers=2, round_timeout_s=100, straggler_factor=0), clock)
    for b in beats:
        b.beat(force=True, status="training")
    assert not m.poll({0}).close
    clock.t += 100
    beats[1].beat(force=True, status="training")
    beats[2].beat(force=True, status="training")
    assert not m.poll({0}).close  # the timeout passed but only 1 delta (min_workers = 2)
    d = m.poll({0, 1})
    assert d.close and d.late == {2: "timeout: round_timeout_s = 100 passed"}
    m.record_round()
    beats[1].stop("left")
    beats[2].stop("left")
    d = m.poll({0})
    assert not d.close and d.why.startswith("only 1 of 3 in and no other live worker (min_workers = 2)")


def test_workers_alive_watches_the_leases(paths):
    a = hb(paths, 0).start_lease(every=0.05)
    b = hb(paths, 1)
    b.beat(force=True, status="training")  # one beat and silence: not alive within the watch
    try:
        alive = workers_alive(paths, 3, outer(), watch_s=0.5)
    finally:
        a.stop()
    assert set(alive) == {0} and alive[0].startswith("alive")


def test_a_resumed_coordinator_does_not_wait_the_startup_grace_for_a_worker_out_before_it(paths):
    """The soak (bench/soak.py) found: a worker that had left long before the coordinator restarted was waited for
    dead_after_s + startup_grace_s in the first round after every restart. A worker the last commit says was
    missing, whose lease is final or silent, is gone at once; one that was in the last round keeps the allowance
    (a whole run stopped and started again), and one that beats again is alive."""
    clock = Clock()
    left = hb(paths, 1)
    left.beat(force=True, status="training")
    left.stop("left")
    was_in = hb(paths, 2)
    was_in.beat(force=True, status="training")
    was_in.stop("left")  # Ctrl-C of the whole run: every worker left, and comes back with the run
    m = Membership(paths, 3, outer(dead_after_s=10, startup_grace_s=120), clock)
    m.out_before({1: "exited (status left)"}, time.time() + 1)  # the last commit (after both left): worker 1 missing
    m2 = Membership(paths, 3, outer(dead_after_s=10, startup_grace_s=120), clock)
    m2.out_before({1: "exited (status left)"}, time.time() - 60)  # it left after the commit (a whole run stopped
    hb(paths, 0).beat(force=True, status="training")                 # mid-round): still given the allowance
    assert m2.poll({0}).missing[1].startswith("starting")
    hb(paths, 0).beat(force=True, status="training")
    d = m.poll({0})
    assert d.gone == {1: "out since before the coordinator started (exited (status left))"}
    assert d.missing[2].startswith("starting") and not d.close
    back = hb(paths, 1)
    back.beat(force=True, status="waiting for round 0")  # worker 1 started again: judged as any other
    clock.t += 0.2
    assert m.poll({0}).missing[1].startswith("alive")
