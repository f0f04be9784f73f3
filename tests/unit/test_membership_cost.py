"""What one poll of Membership (train/exchange/membership.py) costs on the shared disk, counted: a lease once read is
read directly (one open, no listing of its folder), the joiner scan is one listing of workers/, and asking for
joiners reads no running worker's lease (the coordinator asks at every commit, in the round's tail). The costs that
bench/scale.py measured growing with N (docs/benchmarks.md, "Wide").
"""
from __future__ import annotations

import pytest

import train.exchange.membership as membership_mod
from train.config import build_config
from train.core import sharedfs
from train.core.heartbeat import Heartbeat
from train.core.store import RunPaths, read_json
from train.exchange.membership import Membership

N = 64


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def calls(monkeypatch):
    """Every listing (sharedfs.listdir) and every JSON read Membership makes, by path."""
    seen = {"list": [], "read": []}
    listdir = sharedfs.listdir

    def counted_listdir(folder):
        seen["list"].append(str(folder))
        return listdir(folder)

    def counted_read(path):
        seen["read"].append(str(path))
        return read_json(path)

    monkeypatch.setattr(sharedfs, "listdir", counted_listdir)
    monkeypatch.setattr(membership_mod, "read_json", counted_read)
    return seen


def test_a_poll_reads_each_lease_not_yet_in_once_and_lists_one_folder(tmp_path, calls):
    paths = RunPaths(tmp_path / "run")
    beats = [Heartbeat(paths.progress(w), w) for w in range(N)]
    for b in beats:
        b.beat(force=True, status="training")
    clock = Clock()
    m = Membership(paths, N, build_config({"outer": {"num_workers": N}}).outer, clock)
    assert len(calls["read"]) == N  # the baseline: every lease, each found by a listing first
    m.poll(set())  # the first joiner scan finds workers/ (by listings from the root, once)
    for i in range(3):
        calls["list"].clear(), calls["read"].clear()
        clock.t += 0.5
        for b in beats:
            b.beat(force=True, status="training")
        d = m.poll(set(range(N // 2)))
        assert not d.close and len(d.waiting) == N // 2 and all(v.startswith("alive") for v in d.missing.values())
        # one read per lease; a worker whose delta is in is read once more (its delta proven its), then no longer
        read = range(N) if i == 0 else range(N // 2, N)
        assert sorted(calls["read"]) == sorted(str(paths.progress(w)) for w in read)
        assert calls["list"] == [str(paths.worker_dir(0).parent)]  # one listing: workers/, for joiners
    m.record_round()  # the next round reads every lease again
    calls["read"].clear()
    m.poll(set())
    assert sorted(calls["read"]) == sorted(str(paths.progress(w)) for w in range(N))


def test_a_lease_not_seen_yet_is_asked_of_a_listing_then_read(tmp_path, calls):
    paths = RunPaths(tmp_path / "run")
    b0 = Heartbeat(paths.progress(0), 0)
    b0.beat(force=True, status="training")
    clock = Clock()
    m = Membership(paths, 2, build_config({"outer": {"num_workers": 2}}).outer, clock)
    calls["read"].clear()
    m.poll(set())
    assert str(paths.progress(1)) not in calls["read"]  # no lease yet: never looked up by name (NFS lookup cache)
    b1 = Heartbeat(paths.progress(1), 1)
    b1.beat(force=True, status="training")
    calls["list"].clear()
    clock.t += 1
    d = m.poll(set())
    assert d.missing[1].startswith("alive") and str(paths.worker_dir(1)) in calls["list"]


def test_asking_for_joiners_reads_no_running_workers_lease(tmp_path, calls):
    paths = RunPaths(tmp_path / "run")
    beats = [Heartbeat(paths.progress(w), w) for w in range(N)]
    for b in beats:
        b.beat(force=True, status="training")
    clock = Clock()
    m = Membership(paths, N, build_config({"outer": {"num_workers": N}}).outer, clock)
    joiner = Heartbeat(paths.progress(N), N)
    joiner.beat(force=True, status="joining")
    m.poll(set())
    calls["read"].clear(), calls["list"].clear()
    clock.t += 1
    joiner.beat(force=True, status="joining")
    assert m.joiners() == [N]
    assert calls["read"] == [str(paths.progress(N))]
    assert calls["list"] == [str(paths.worker_dir(0).parent)]


def test_the_coordinator_reads_leases_at_a_bounded_rate_but_often_enough_to_notice_a_death():
    """0.5 s up to 16 workers; then N / 32 s (at most 32 lease reads a second: the metadata load stays flat in N,
    bench/scale.py), never longer than dead_after_s / 5."""
    from train.diloco.coordinator import leases_every_s

    assert leases_every_s(2, 10.0) == leases_every_s(16, 10.0) == 0.5
    assert leases_every_s(64, 10.0) == 2.0 and leases_every_s(256, 10.0) == 2.0  # dead_after_s / 5
    assert leases_every_s(256, 60.0) == 8.0 and leases_every_s(64, 60.0) == 2.0
    assert leases_every_s(256, 1.0) == 0.5  # never below the half second
