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
