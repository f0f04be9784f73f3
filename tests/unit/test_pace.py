"""Rounds by time without processes: the per-slot data layout, the plan from speeds, the run's schedule position,
the weighting of unequal deltas, and the simulator's --slow spec."""
from __future__ import annotations

import pytest

from train.config import ConfigError, build_config
from train.diloco.pace import HYSTERESIS, Pace, calibration_steps, data_record, schedule_for, split_carry
from train.exchange.accumulate import delta_weight
from train.exchange.layout import Layout, per_slot
from train.launch.throttle import fraction_at, parse_slow

B = 8  # windows per inner step


def cfg_with(**outer):
    return build_config({}, overrides=[f"outer.{k}={v}" for k, v in outer.items()] +
                        ["inner.total_batch_size=8", "inner.per_device_batch_size=8"])


def covered(lay: Layout, rounds: int) -> list[tuple[int, int]]:
    return sorted((off, off + n) for r in range(rounds) for w in range(lay.slots(r))
                  for off, n in [lay.slice(r, w)])


def test_per_slot_windows_give_disjoint_gapless_slices_across_plans_and_joins():
    lay = Layout.single(3, [5 * B, 5 * B, 5 * B])
    assert lay.segments[0]["windows"] == 5 * B  # all equal: stored as one count
    lay.resize(2, 3, [20 * B, 10 * B, 5 * B], "rounds by time")
    lay.resize(4, 4, [20 * B, 10 * B, 5 * B, 5 * B], "join")
    spans = covered(lay, 7)
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no overlap, no gap
    assert lay.slice(3, 1) == (lay.slice(3, 0)[0] + 20 * B, 10 * B)


def test_layout_with_lists_round_trips_through_its_file(tmp_path):
    from train.core.store import RunPaths
    paths = RunPaths(tmp_path)
    (tmp_path / "data").mkdir()
    lay = Layout.single(2, [4 * B, 2 * B])
    lay.resize(3, 2, [6 * B, 3 * B], "x")
    lay.save(paths)
    back = Layout.load(paths)
    assert back.segments == lay.segments and per_slot(back.segment(5)) == [6 * B, 3 * B]


def test_schedule_position_is_the_sum_of_the_rounds_mean_windows():
    fixed = Layout.single(4, 10 * B)
    assert [fixed.schedule_position(r) / B for r in range(4)] == [0, 10, 20, 30]
    lay = Layout.single(2, [20 * B, 10 * B])  # mean H 15
    lay.resize(2, 3, [20 * B, 10 * B, 6 * B], "join")  # mean H 12
    assert lay.schedule_position(2) / B == 30 and lay.schedule_position(4) / B == 30 + 2 * 12


def test_schedule_for_a_fixed_h_is_each_workers_own_step_count():
    cfg = cfg_with(num_workers=2, rounds=5, local_steps=10)
    lay = Layout.single(2, 10 * B)
    for r in range(5):
        start, per_step, total = schedule_for(lay, r, 1, cfg)
        assert (start, per_step, total) == (10 * r, 1, None) and isinstance(start, int)


def test_schedule_for_rounds_by_time_walks_every_worker_over_the_same_stretch():
    cfg = cfg_with(num_workers=2, rounds=10, local_steps=40, round_time_s=2)
    lay = Layout.single(2, [30 * B, 10 * B])  # mean H 20
    fast, slow = schedule_for(lay, 3, 0, cfg), schedule_for(lay, 3, 1, cfg)
    assert fast[0] == slow[0] == 60
    assert fast[1] * 30 == pytest.approx(20) and slow[1] * 10 == pytest.approx(20)  # both end the round at 80
    assert fast[2] == slow[2] == 200  # the projection: 10 rounds of mean H 20
    cfg2 = build_config({}, overrides=["outer.round_time_s=2", "inner.total_steps=500"])
    assert schedule_for(Layout.single(2, [3, 3]), 0, 0, cfg2)[2] is None  # inner.total_steps fixes the length


def test_pace_calibrates_then_plans_from_measured_speed_capped_and_with_hysteresis():
    oc = cfg_with(num_workers=3, local_steps=40, round_time_s=2).outer
    pace = Pace(oc, B)
    assert pace.windows(3) == [calibration_steps(40) * B] * 3
    pace.observe({0: {"inner_steps": 10, "train_seconds": 0.5}, 1: {"inner_steps": 10, "train_seconds": 1.0},
                  2: {"inner_steps": 10, "train_seconds": 0.1}})
    assert pace.windows(3) == [40 * B, 20 * B, 40 * B]  # 20 and 10 steps/s for 2 s; 100 steps/s capped at 40
    cur = pace.windows(3)
    assert pace.replan(cur) is None
    pace.observe({1: {"inner_steps": 10, "train_seconds": 1.0 / (1 + HYSTERESIS / 2)}})  # within the band: kept
    assert pace.replan(cur) is None
    pace.observe({1: {"inner_steps": 10, "train_seconds": 0.5}})  # twice as fast: a new plan
    assert pace.replan(cur) == [40 * B, 40 * B, 40 * B]


def test_rates_are_the_median_of_the_last_three_and_a_change_of_speed_is_followed_at_once():
    pace = Pace(cfg_with(num_workers=1, local_steps=1000, round_time_s=1).outer, B)
    for rate in (20, 24, 18):  # noise: the median
        pace.observe({0: {"inner_steps": rate, "train_seconds": 1.0}})
    assert pace.steps_for(0) == 20
    pace.observe({0: {"inner_steps": 10, "train_seconds": 1.0}})  # half speed: followed from this round
    assert pace.steps_for(0) == 10
    pace.observe({0: {"inner_steps": 11, "train_seconds": 1.0}})
    assert pace.steps_for(0) == 10  # median of 10 and 11, floored


def test_a_round_time_below_one_step_is_one_line_naming_the_key():
    pace = Pace(cfg_with(round_time_s=0.01).outer, B)
    pace.observe({0: {"inner_steps": 2, "train_seconds": 1.0}})
    with pytest.raises(ConfigError, match=r"outer\.round_time_s = 0\.01 is below the time of one inner step"):
        pace.replan([B])


def test_given_rates_make_a_fixed_plan_without_calibration():
    oc = cfg_with(num_workers=2, local_steps=40, round_time_s=1, step_rates='{"0": 30, "1": 12.5}').outer
    pace = Pace(oc, B)
    assert pace.windows(2) == [30 * B, 12 * B]
    pace.observe({0: {"inner_steps": 1, "train_seconds": 10.0}})  # measurements do not move a given plan
    assert pace.replan(pace.windows(2)) is None


@pytest.mark.parametrize("overrides, match", [
    (["outer.round_time_s=-1"], r"outer\.round_time_s"),
    (["outer.round_time_s=2", "outer.fragments=2", "outer.local_steps=10"], r"outer\.round_time_s.*fragments"),
    (["outer.round_time_s=2", "outer.local_steps_schedule=[[0, 5], [3, 10]]"], r"local_steps_schedule"),
    (["outer.step_rates={\"0\": 5}"], r"outer\.step_rates.*round_time_s"),
    (["outer.round_time_s=2", "outer.num_workers=2", "outer.step_rates={\"0\": 5}"], r"no rate for worker\(s\) \[1\]"),
    (["outer.round_time_s=2", "outer.step_rates={\"0\": 0, \"1\": 3}"], r"outer\.step_rates"),
    (["outer.weighting=per_step", "outer.token_weighted=false"], r"outer\.weighting"),
    (["outer.weighting=median"], r"outer\.weighting"),
])
def test_bad_rounds_by_time_settings_are_one_line_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config({}, overrides=overrides)


def test_delta_weights_tokens_equal_and_per_step():
    assert delta_weight(300, "tokens") == delta_weight(300, True) == 300.0
    assert delta_weight(300, "equal") == delta_weight(300, False) == 1.0
    # per_step: Σ a_w Δ_w / Σ a_w with a_w = 1/tokens is each delta scaled to the round's harmonic mean H
    toks = [100.0, 200.0]
    a = [delta_weight(t, "per_step") for t in toks]
    hmean = len(toks) / sum(1 / t for t in toks)
    assert [x / sum(a) for x in a] == pytest.approx([hmean / t / len(toks) for t in toks])


def test_slow_spec_parses_fractions_by_round_and_names_bad_parts():
    plan = parse_slow("1=0.5, 3=0.5@20, 1=1@10", 4)
    assert plan == {1: [(0, 0.5), (10, 1.0)], 3: [(20, 0.5)]}
    assert [fraction_at(plan[3], r) for r in (0, 19, 20, 99)] == [1.0, 1.0, 0.5, 0.5]
    for spec, match in [("4=0.5", "worker 4 does not exist"), ("1=0", r"must be in \(0, 1\]"),
                        ("1=1.5", r"must be in \(0, 1\]"), ("one=half", "is not WORKER=FRACTION"),
                        ("1=0.5@-2", "round -2")]:
        with pytest.raises(ConfigError, match=match):
            parse_slow(spec, 4)


def test_carried_windows_are_split_by_the_rounds_budget_oldest_first():
    assert split_carry([], 40) == ([], [])
    assert split_carry([[100, 16], [300, 8]], 40) == ([[100, 16], [300, 8]], [])
    assert split_carry([[100, 16], [300, 8]], 20) == ([[100, 16], [300, 4]], [[304, 4]])
    assert split_carry([[100, 16]], 8) == ([[100, 8]], [[108, 8]])


def test_the_record_keeps_each_range_read_and_what_is_passed_on_or_skipped():
    side = {"data": {"offset": 500, "windows": 80, "read": 56, "carried_in": [[100, 16]], "carry_out": [[556, 24]]}}
    old = {"data": {"offset": 600, "windows": 80, "read": 72}}  # a worker without carry-over (older, or torchrun)
    data, carried, skipped = data_record({0: side, 1: old}, {}, 5, last=False)
    assert data == {"w000": [500, 56], "w000+0": [100, 16], "w001": [600, 72]}
    assert carried == {"w000": 24} and skipped == {"w001": 8}
    data, carried, skipped = data_record({0: side}, {2: old}, 5, last=True)
    assert "w002@4" in data and carried == {} and skipped == {"w000": 24}


def test_a_sampler_reads_carried_ranges_first_and_says_what_it_left():
    import numpy as np
    from train.core.data import StreamSampler

    class Data:
        n_train_windows, seq_length = 1000, 2

        def window(self, start):
            return np.array([start, start + 1, start + 2])

    s = StreamSampler(Data(), seed=0)
    s.begin(500, 8, before=[[100, 4], [300, 4]])
    first = s.next_batch(6)  # crosses from the first carried range into the second
    assert first.shape == (6, 3)
    assert s.reads() == [(100, 4), (300, 2), (500, 0)]
    s.next_batch(4)
    assert s.reads() == [(100, 4), (300, 4), (500, 2)] and s.unread() == [(502, 6)]
    s.next_batch(6)
    assert s.unread() == []
    with pytest.raises(Exception, match="slice exhausted"):
        s.next_batch(1)


def test_a_segment_names_its_calibrating_slots_until_they_are_measured():
    pace = Pace(cfg_with(num_workers=3, local_steps=40, round_time_s=2).outer, B)
    seg = pace.mark({"slots": 3})
    assert seg["calibrate"] == [0, 1, 2]
    pace.observe({0: {"inner_steps": 10, "train_seconds": 1.0}, 1: {"inner_steps": 10, "train_seconds": 1.0}})
    assert pace.mark({"slots": 3})["calibrate"] == [2]
    pace.observe({2: {"inner_steps": 10, "train_seconds": 1.0}})
    assert "calibrate" not in pace.mark({"slots": 3, "calibrate": [2]})
