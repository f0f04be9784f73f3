"""The data layout: every (round, worker) slice of the stream is disjoint, across resizes, joins and replays; the
stream sampler reads a slice and nothing past it."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.core.data import StreamSampler, TokenData
from train.core.errors import DataError
from train.core.store import ProtocolError, RunPaths
from train.exchange.layout import Layout


def _windows(lay: Layout, rounds: int) -> list[int]:
    out = []
    for r in range(rounds):
        for w in range(lay.slots(r)):
            off, n = lay.slice(r, w)
            out += range(off, off + n)
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=5),
       st.integers(1, 4), st.integers(1, 5))
def test_slices_never_overlap_and_leave_no_gap_across_resizes(changes, n0, w0):
    lay = Layout.single(n0, w0)
    r = 0
    for gap, slots, windows in changes:
        r += gap
        lay.resize(r, slots, windows, "test")
    total = r + 3
    got = _windows(lay, total)
    assert len(got) == len(set(got))                     # no window handed out twice
    assert sorted(got) == list(range(len(got)))          # and none skipped: the stream is cut without gaps
    assert got == sorted(got)                            # in round order


def test_a_later_unreached_segment_is_replaced_and_slots_are_checked():
    lay = Layout.single(2, 10)
    lay.resize(3, 3, 10, "join")
    lay.resize(3, 4, 10, "join again before round 3 started")
    assert [s["slots"] for s in lay.segments] == [2, 4] and lay.slice(3, 3) == (90, 10)
    with pytest.raises(ValueError, match="would rewrite rounds"):
        lay.resize(2, 5, 10, "too late")
    with pytest.raises(ProtocolError, match="round 1 has 2 worker slots"):
        lay.slice(1, 2)


def test_layout_file_round_trip_and_a_damaged_file_is_named(tmp_path):
    paths = RunPaths(tmp_path)
    paths.data.mkdir(parents=True)
    lay = Layout.single(3, 7)
    lay.resize(5, 2, 7, "resume")
    lay.config_workers = 2
    lay.save(paths)
    back = Layout.load(paths)
    assert back.segments == lay.segments and back.config_workers == 2
    Layout.path(paths).write_text('{"segments": [{"from_round": 0}]}')
    with pytest.raises(ProtocolError, match="layout.json: not a data layout"):
        Layout.load(paths)


def test_stream_sampler_reads_its_slice_once_per_epoch_and_refuses_to_overrun(tmp_path):
    toks = np.arange(10 * 4 + 1 + 100, dtype=np.int32)
    data = TokenData(toks, seq_length=4, eval_fraction=100 / len(toks))
    n = data.n_train_windows
    s = StreamSampler(data, seed=3)
    s.begin(0, 2 * n)
    firsts = [int(s.next_batch(1)[0, 0]) // 4 for _ in range(2 * n)]
    assert sorted(firsts[:n]) == list(range(n)) and sorted(firsts[n:]) == list(range(n))  # each epoch: all once
    assert firsts[:n] != firsts[n:]                                                        # reshuffled per epoch
    with pytest.raises(DataError, match="slice exhausted"):
        s.next_batch(1)
    again = StreamSampler(data, seed=3)
    again.begin(n // 2, 3)  # a replay of a slice reads the same windows
    assert [int(again.next_batch(1)[0, 0]) // 4 for _ in range(3)] == firsts[n // 2: n // 2 + 3]
