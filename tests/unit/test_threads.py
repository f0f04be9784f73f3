"""train/core/threads.py: ordered_map's order, errors and the lanes' torch threads."""
from __future__ import annotations

import threading

import pytest
import torch

from train.core.threads import intra_op_threads, ordered_map


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_ordered_map_yields_in_the_items_order_whatever_finishes_first(lanes):
    release = {i: threading.Event() for i in range(10)}

    def fn(i):
        if lanes > 1 and i % 2 == 0 and i + 1 < 10:
            release[i + 1].wait(5)  # the even item waits for the next one to finish first
        release[i].set()
        return i * i
    assert list(ordered_map(fn, range(10), lanes, ahead=4)) == [i * i for i in range(10)]


def test_ordered_map_raises_the_first_error_and_leaves_no_item_running():
    started, finished = [], []
    gate = threading.Event()

    def fn(i):
        started.append(i)
        if i == 2:
            gate.wait(5)
            raise ValueError("item 2")
        if i == 3:
            gate.set()
        finished.append(i)
        return i
    got = []
    with pytest.raises(ValueError, match="item 2"):
        for x in ordered_map(fn, range(50), lanes=2, ahead=4):
            got.append(x)
    assert got == [0, 1]
    # what started has finished (none is left half done); what was queued behind it never started
    assert sorted(set(started) - {2}) == sorted(finished) and len(started) < 50


def test_lanes_run_torch_with_the_threads_set_around_them():
    with intra_op_threads(1):
        seen = list(ordered_map(lambda _: torch.get_num_threads(), range(4), lanes=2))
    assert seen == [1, 1, 1, 1]
