"""The loss screen (train/exchange/loss_screen.py): the decision on numbers, the held-out windows it draws, and the
model it evaluates (θ_r − Δ written piece by piece as the accumulator decodes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from train.exchange.loss_screen import RELATIVE, ScreenWindows, auto_decision, decide_loss, forward_flops

M = 0.03  # outer.screen_loss_margin's default


def _decide(gains, base=6.0, steps=None, fresh=frozenset(), margin=M):
    keys = list(range(len(gains)))
    return decide_loss(keys, [base - g for g in gains], base, margin, steps, fresh)


@pytest.mark.parametrize("gains", [
    [0.5, 0.46, 0.51], [0.19, 0.17, 0.21], [0.042, 0.045, 0.023],   # early and mid run (bench: 3 workers, H = 20)
    [0.0003, 0.0038, 0.0039], [0.0021, -0.0004, 0.0025], [-0.0008, -0.0031, -0.0022],  # late: gains ~ 0
    [0.2, 0.18], [0.004, -0.002], [0.3], [-0.005], [0.05, 0.06, 0.04, 0.055, 0.07, 0.03, 0.045, 0.05],
])
def test_healthy_rounds_reject_nothing(gains):
    rejected, info = _decide(gains)
    assert rejected == {}, info
    assert all(set(v) == {"loss", "loss_gain", "loss_bar"} for v in info.values())


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_delta_worse_than_theta_r_while_the_others_improve_is_rejected_with_its_figures(n):
    gains = [0.2, 0.18, 0.22, 0.19, 0.21][:n - 1] + [-0.3]  # a flipped delta: the loss goes up
    rejected, info = _decide(gains)
    assert set(rejected) == {n - 1}, info
    why = rejected[n - 1]
    assert why.startswith("screen: loss of θ_r − Δ") and "6.3000" in why and "6.0000" in why and "-0.3000" in why
    assert "outer.screen_loss_margin = 0.03" in why
    assert ("no other delta" in why) == (n == 1)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_noise_that_gains_nothing_while_the_others_gain_is_rejected(n):
    """Same-norm noise barely moves the loss (its effect is second order: measured -0.05..+0.01 while healthy deltas
    gained 0.04-0.5): under a quarter of the others' gain."""
    gains = [0.15, 0.14, 0.16][:n - 1] + [0.002]
    rejected, _ = _decide(gains)
    assert set(rejected) == {n - 1}


def test_a_lone_delta_within_the_margin_of_theta_r_is_kept_one_beyond_it_is_not():
    assert _decide([-0.029])[0] == {}
    assert set(_decide([-0.031])[0]) == {0}


def test_a_round_whose_deltas_all_lose_rejects_only_the_one_far_worse():
    """Late in a run of averaging θ_r beats each worker's model: bench/soak.py saw a healthy delta at -0.0169 where
    the others' median was -0.0029."""
    assert _decide([-0.0169, -0.0029, -0.0025, -0.0035])[0] == {}
    rejected, info = _decide([-0.02, -0.025, -0.022, -0.3])
    assert set(rejected) == {3}, info
    assert _decide([-0.02, -0.025, -0.022, -0.03])[0] == {}


def test_fewer_inner_steps_lower_the_bar():
    """Rounds by time: a delta of 10 steps among deltas of 40 gains less, and is held to its share of the steps."""
    gains, steps = [0.2, 0.21, 0.19, 0.2 * RELATIVE * 0.2], [40, 40, 40, 10]
    assert set(_decide(gains)[0]) == {3}            # as if it had trained as long as the others
    assert _decide(gains, steps=steps)[0] == {}     # its bar scaled by 10 / 40


def test_fresh_moments_are_held_to_the_first_rule_only():
    gains = [0.2, 0.21, 0.01]
    assert set(_decide(gains)[0]) == {2}
    assert _decide(gains, fresh={2})[0] == {}
    assert set(_decide([0.2, 0.21, -0.05], fresh={2})[0]) == {2}


def test_a_nan_loss_is_rejected():
    rejected, _ = decide_loss([0, 1], [5.9, math.nan], 6.0, M)
    assert set(rejected) == {1}


def test_auto_is_on_for_small_models_and_off_with_its_reason_for_large_ones():
    on, line = auto_decision("auto", forward_flops(40_000, 16, 32), "cpu", 0.01, "16 windows")
    assert on and "auto): on" in line
    on, line = auto_decision("auto", forward_flops(135_000_000, 16, 2048), "cpu", 9.0, "16 windows")
    assert not on and "off" in line and "outer.screen_loss = \"on\"" in line
    assert auto_decision("auto", forward_flops(135_000_000, 16, 2048), "cuda", 0.05, "x")[0]
    assert auto_decision("on", 1e20, "cpu", 9.0, "x")[0] and not auto_decision("off", 1.0, "cpu", 0.0, "x")[0]


class _Data:
    """TokenData's window arithmetic over a numbered token array (token i = i)."""

    def __init__(self, tokens: int, seq: int, frac: float):
        from train.core.data import TokenData

        self.d = TokenData(np.arange(tokens), seq, frac)

    def __getattr__(self, k):
        return getattr(self.d, k)


def test_windows_are_held_out_not_the_eval_ones_and_drawn_fresh_each_round():
    data = _Data(100_000, 32, 0.05)
    eval_w = data.eval_windows(16)
    sw = ScreenWindows(data, 16, 8, seed=0)
    assert not sw.shared
    held_start = len(data.tokens) - data.n_eval_tokens
    train_end = data.n_train_windows * 32 + 1  # the last token any training window reads
    seen = []
    for r in range(5):
        b = sw.of_round(r)
        assert b.shape == (8, 33)
        assert int(b.min()) >= held_start > train_end - 1  # no token of the training windows
        assert int(b.min()) >= int(eval_w.max())  # past the eval's windows (the first one shares its first token)
        assert torch.equal(b, ScreenWindows(data, 16, 8, seed=0).of_round(r))  # the same in every process
        seen.append(b)
    assert not torch.equal(seen[0], seen[1])
    assert not torch.equal(seen[0], ScreenWindows(data, 16, 8, seed=1).of_round(0))


def test_windows_are_the_eval_ones_where_the_held_out_split_has_no_others():
    data = _Data(10_000, 32, 0.02)  # 200 held-out tokens: 6 windows, all the eval's
    sw = ScreenWindows(data, 16, 8, seed=0)
    assert sw.shared and "reported eval" in sw.describe()
    assert sw.of_round(0).shape == (6, 33)
