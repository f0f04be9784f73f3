"""The end of a round is noticed sooner than a poll interval (train/exchange/reduce.py TAIL_FAST_S, tail_poll_s):
the coordinator lists the deltas folder every tail_poll_s once all but one delta are in, and a worker whose delta was
the round's last looks for the commit as often, each for a bounded time (bench/peers.py measured the two half poll
intervals as most of the exchange's cost against torchft: docs/benchmarks.md)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

import train.diloco.coordinator as coordinator_mod
from tests.e2e.test_rejections import _good_delta, _publish
from tests.helpers import tiny_config
from train.config import build_config
from train.core.tensorio import load_tensors
from train.diloco.coordinator import Coordinator
from train.diloco.worker import Worker
from train.exchange.layout import Layout
from train.exchange.reduce import TAIL_FAST_S, tail_poll_s


def test_the_coordinator_polls_fast_only_while_one_delta_is_missing(tmp_path, monkeypatch):
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"num_workers": 3, "min_workers": 3, "poll_interval_s": 0.2}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    theta = load_tensors(co.paths.global_dir(0) / "model.safetensors")
    _publish(co.paths, 0, 0, _good_delta(theta, 0))
    naps: list[float] = []

    def sleep(s: float) -> None:  # the coordinator's naps; the other deltas arrive during the 2nd and the 5th
        naps.append(s)
        if len(naps) == 2:
            _publish(co.paths, 0, 2, _good_delta(theta, 2))
        if len(naps) == 5:
            _publish(co.paths, 0, 1, _good_delta(theta, 1))

    monkeypatch.setattr(coordinator_mod, "time", SimpleNamespace(sleep=sleep, monotonic=time.monotonic,
                                                                 perf_counter=time.perf_counter, time=time.time))
    rec = co.run_round(0)
    assert rec["workers_used"] == [0, 1, 2]
    assert tail_poll_s(0.2) == 0.025 and TAIL_FAST_S <= 10 * 0.2
    assert naps == [0.2, 0.2, 0.025, 0.025, 0.025]  # two of three in at the third listing: fast from there


def test_a_worker_looks_for_the_commit_fast_only_when_its_delta_was_the_last(tmp_path):
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"num_workers": 2, "poll_interval_s": 0.2}))
    co = Coordinator(cfg, progress=False)
    co.setup()
    theta = load_tensors(co.paths.global_dir(0) / "model.safetensors")
    me = SimpleNamespace(paths=co.paths, poll=0.2, layout=lambda: Layout.load(co.paths))
    _publish(co.paths, 0, 0, _good_delta(theta, 0))
    assert Worker.commit_poll(me, 0) == 0.2  # the other worker's delta is not in: the commit is not near
    _publish(co.paths, 0, 1, {k: torch.zeros_like(v) for k, v in theta.items()})
    poll = Worker.commit_poll(me, 0)
    assert callable(poll) and poll() == tail_poll_s(0.2)  # ours completed the round: its outer step is under way
