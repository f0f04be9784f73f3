"""train/exchange/expect.py: fast polling only around the time an event usually comes."""
from train.exchange.expect import FAST_S, WINDOW_S, Expect


def test_no_history_polls_at_the_normal_interval():
    e = Expect(0.2)
    assert all(e.interval(t) == 0.2 for t in (0.0, 1.0, 100.0))


def test_fast_only_within_the_window_around_the_median():
    e = Expect(0.2)
    # the first wait (the start-up) is not counted; one outlier does not move the median
    for t in (60.0, 5.0, 5.2, 4.8, 30.0, 5.1):
        e.seen(t)
    assert e.interval(5.0 - WINDOW_S - 0.1) == 0.2
    assert e.interval(5.0) == FAST_S and e.interval(5.0 + WINDOW_S - 0.05) == FAST_S
    assert e.interval(5.1 + WINDOW_S + 0.1) == 0.2 and e.interval(30.0) == 0.2


def test_a_poll_already_faster_than_fast_is_kept():
    e = Expect(FAST_S / 2)
    e.seen(1.0)
    e.seen(1.0)
    assert e.interval(1.0) == FAST_S / 2


def test_processes_waiting_for_one_event_share_the_fast_polls():
    """N workers waiting for the commit poll fast at FAST_HZ / N each (the NFS server sees at most FAST_HZ fast
    listings a second); where that is no faster than the normal poll, there is no fast window at all."""
    from train.exchange.expect import FAST_HZ

    def warm(e):
        for t in (60.0, 5.0, 5.0):
            e.seen(t)
        return e

    assert warm(Expect(0.2, 8)).interval(5.0) == FAST_S
    assert warm(Expect(0.2, 16)).interval(5.0) == 16 / FAST_HZ
    assert warm(Expect(0.2, 256)).interval(5.0) == 0.2


def test_wait_commit_starts_from_the_last_round_seen(tmp_path):
    """A worker's wait (train/exchange/expect.py's wait_commit) asks for the rounds after the one it knows: two
    round folders looked at per poll, however many rounds the run keeps."""
    from train.core.store import atomic_write_json
    from train.exchange.expect import wait_commit
    from train.exchange.store import DiLoCoPaths

    paths = DiLoCoPaths(tmp_path / "run")
    for r in range(6):
        atomic_write_json(paths.committed(r), {"round": r})
    asked = []
    latest = paths.latest_committed

    def counted(hint=None):
        asked.append(hint)
        return latest(hint)

    paths.latest_committed = counted
    assert wait_commit(paths, 4, 4, Expect(0.01), lambda: False) == 5 and asked == [4]
    assert wait_commit(paths, 2, None, Expect(0.01), lambda: True) is None  # the watch says stop: no listing
    assert asked == [4]


def test_closing_polls_fast_for_the_last_few_deltas_within_a_budget():
    from train.exchange.expect import Closing

    c = Closing(256, 0.2)
    assert c.few == 8 and c.fast == FAST_S
    assert not c.due(9) and c.due(8) and c.due(1) and not c.due(0)
    c.spent(Closing.BUDGET_S - 0.1)
    assert c.due(1)
    c.spent(0.2)
    assert not c.due(1)  # the round's budget of fast listings is spent
    assert Closing(4, 0.2).few == 1 and Closing(4, 0.005).fast == 0.005
