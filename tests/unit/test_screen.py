"""The screen's decision (train/exchange/screen.py): on numbers, and on real deltas through the accumulators."""
from __future__ import annotations

import math
import random

import pytest
import torch

from train.exchange.screen import MIN_DELTAS, DeltaStats, decide, stride_for


def _round(deltas: list[torch.Tensor], weights=None, ratio=5.0, min_cos=-0.5, shapes=None, fresh=frozenset(),
           steps=None):
    """decide() on deltas given as flat tensors, through DeltaStats (as the accumulators feed it), with the noise
    floor of their sample size."""
    shapes = shapes or {"a": (deltas[0].numel(),)}
    st = DeltaStats(shapes)
    for i, d in enumerate(deltas):
        pos = 0
        for n, s in shapes.items():
            k = math.prod(s)
            st.observe(i, n, d[pos:pos + k].reshape(s))
            pos += k
    keys = list(range(len(deltas)))
    return decide(keys, [math.sqrt(st.norm2[k]) for k in keys], st.gram(keys), weights or [1.0] * len(keys),
                  ratio, min_cos, fresh, st.sample(0).numel(), steps)


def _healthy(n: int, size: int = 2000, corr: float = 0.5, seed: int = 0) -> list[torch.Tensor]:
    """n deltas sharing a common direction (pairwise cosine about `corr`), norms within 20%."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=g, dtype=torch.float64)
    out = []
    for _ in range(n):
        d = math.sqrt(corr) * common + math.sqrt(1 - corr) * torch.randn(size, generator=g, dtype=torch.float64)
        out.append(d * (0.8 + 0.4 * torch.rand((), generator=g, dtype=torch.float64)))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_healthy_rounds_reject_nothing(seed):
    rnd = random.Random(seed)
    n = rnd.randint(MIN_DELTAS, 12)
    deltas = _healthy(n, corr=rnd.uniform(0.0, 0.9), seed=seed)
    weights = [float(rnd.randint(500, 3000)) for _ in deltas]
    rejected, info = _round(deltas, weights)
    assert rejected == {}, info


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("bad", ["x100", "x0.01", "flipped"])
def test_one_bad_delta_among_healthy_ones_is_the_one_rejected(seed, bad):
    rnd = random.Random(seed)
    n = rnd.randint(MIN_DELTAS, 10)
    deltas = _healthy(n, corr=rnd.uniform(0.6, 0.9), seed=seed)  # flipping is visible where deltas agree
    i = rnd.randrange(n)
    deltas[i] = {"x100": 100.0, "x0.01": 0.01, "flipped": -1.0}[bad] * deltas[i]
    rejected, info = _round(deltas)
    assert set(rejected) == {i}, (rejected, info)
    assert ("norm" in rejected[i]) == (bad != "flipped") and ("cosine" in rejected[i]) == (bad == "flipped")
    assert "outer.screen_" in rejected[i]


@pytest.mark.parametrize("scale", [6.5, 1 / 6.5])
def test_a_delta_from_fresh_moments_gets_a_wider_norm_band_but_x100_is_still_rejected(scale):
    """A joiner's first delta (fresh AdamW moments, its sidecar's fresh_moments) was 6.5x the median of 2 established
    workers' in a real run: rejected without the slack, kept with it; x100 stays out either way."""
    from train.exchange.screen import FRESH_SLACK

    d = _healthy(3, corr=0.8)
    d[2] = d[2] * scale
    assert set(_round(d)[0]) == {2}
    rejected, info = _round(d, fresh={2})
    assert rejected == {} and info[2]["fresh_moments"] is True
    d[2] = d[2] / scale * 100
    rejected, _ = _round(d, fresh={2})
    assert set(rejected) == {2} and f"x {FRESH_SLACK:g}, fresh moments" in rejected[2]


def test_two_deltas_are_not_screened_by_norm_and_cosine():
    """With 2 deltas there is no majority for the norm and cosine rules (a pair: decide_pair, tests below)."""
    d = _healthy(2, corr=0.8)
    assert _round([d[0], 100 * d[1]])[0] == {}
    assert _round([d[0], -d[1]])[0] == {}


def test_a_subtle_bias_passes_but_same_norm_noise_is_at_the_noise_floor():
    """What the screen cannot see (docs/protocol.md): a small bias added to a healthy delta. Noise of the same norm
    (cosine about 0) is caught by the noise floor, with its figures."""
    deltas = _healthy(4, corr=0.7, seed=3)
    g = torch.Generator().manual_seed(9)
    noise = torch.randn(2000, generator=g, dtype=torch.float64)
    deltas[1] = noise * deltas[1].norm() / noise.norm()
    deltas[2] = deltas[2] + 0.3 * deltas[2].norm() / math.sqrt(2000)  # every value shifted a little
    rejected, info = _round(deltas)
    assert set(rejected) == {1}, info
    assert "noise floor" in rejected[1] and "3/sqrt(2000) = 0.0671" in rejected[1] and "others' median" in rejected[1]
    assert info[1]["cos_floor"] == 0.0671 and info[1]["cos_ref"] > 4 * 0.0671


def test_the_norm_check_comes_first_so_a_huge_delta_does_not_hide_a_flipped_one():
    deltas = _healthy(5, corr=0.8, seed=4)
    deltas[0] = 100 * deltas[0]
    deltas[3] = -deltas[3]
    rejected, _ = _round(deltas)
    assert set(rejected) == {0, 3} and "norm" in rejected[0] and "cosine" in rejected[3]


def test_the_decision_does_not_depend_on_the_order_of_arrival():
    deltas = _healthy(6, corr=0.8, seed=5)
    deltas[2] = -deltas[2]
    rejected, info = _round(deltas)
    perm = [4, 2, 0, 5, 1, 3]
    rej2, info2 = _round([deltas[p] for p in perm])
    assert {perm[k] for k in rej2} == set(rejected) == {2}
    assert {perm[k]: v for k, v in info2.items()} == info


def test_sampled_cosines_of_a_large_model_match_the_exact_ones():
    """Above SAMPLE values only a strided sample is kept: the cosine it gives is within 0.05 of the exact one."""
    from train.exchange import screen

    shapes = {"emb": (300, 64), "w": (64, 64), "b": (64,)}
    total = sum(math.prod(s) for s in shapes.values())
    deltas = _healthy(4, size=total, corr=0.5, seed=6)
    _, exact = _round(deltas, shapes=shapes)
    old = screen.SAMPLE
    screen.SAMPLE = 2000  # 1 in 13 values
    try:
        assert stride_for(total) == 13
        _, sampled = _round(deltas, shapes=shapes)
    finally:
        screen.SAMPLE = old
    for k in exact:
        assert abs(exact[k]["cos"] - sampled[k]["cos"]) < 0.05, (exact, sampled)
        assert exact[k]["norm_ratio"] == sampled[k]["norm_ratio"]  # norms are always exact


def test_wide_rounds_sample_less_so_the_gram_matrix_stays_bounded():
    """A round awaiting N deltas samples at most GRAM_BUDGET / N² values of each: the Gram matrix and the samples'
    memory stay bounded in N (bench/scale.py); up to 16 deltas nothing changes."""
    from train.exchange.screen import GRAM_BUDGET, MIN_SAMPLE, SAMPLE, sample_size

    assert sample_size(1) == sample_size(16) == SAMPLE
    assert sample_size(64) == 1 << 16 and sample_size(256) == MIN_SAMPLE == sample_size(4096)
    for n in (17, 100, 256):
        assert n * n * sample_size(n) <= GRAM_BUDGET
    shapes = {"w": (1000, 1000)}
    st = DeltaStats(shapes, deltas=256)
    assert st.stride == stride_for(10 ** 6, MIN_SAMPLE) and 10 ** 6 // st.stride <= MIN_SAMPLE
    st.observe(0, "w", torch.ones(1000, 1000))
    assert st.sample(0).numel() <= MIN_SAMPLE + 1 and st.norm2[0] == 10 ** 6


def test_the_gram_grown_on_arrival_is_the_gram_of_the_samples():
    """seal() on arrival (any order, past the awaited count, a forgotten delta between) gives the same matrix as
    the samples' S Sᵀ, for any subset and order of keys; an unsealed key is sealed by gram()."""
    shapes = {"a": (37, 11), "b": (300,)}
    g = torch.Generator().manual_seed(0)
    st = DeltaStats(shapes, deltas=3)
    for k in (5, 2, 9, 7, 1):
        st.observe(k, "a", torch.randn(37, 11, generator=g))
        st.observe(k, "b", torch.randn(300, generator=g))
        if k != 1:
            st.seal(k)
    st.forget(9)
    keys = [1, 2, 5, 7]
    S = torch.stack([st.sample(k) for k in keys])
    assert torch.allclose(st.gram(keys), S @ S.T, rtol=1e-12, atol=1e-12)
    assert torch.allclose(st.gram([7, 2]), (S @ S.T)[[3, 1]][:, [3, 1]], rtol=1e-12, atol=1e-12)
    assert 9 not in st.norm2 and st.samples == {}


def test_stride_is_prime_and_one_for_small_models():
    assert stride_for(10) == 1 and stride_for(1 << 20) == 1
    s = stride_for(500_000_000)
    assert s >= 477 and all(s % p for p in range(2, int(s ** 0.5) + 1))


@pytest.mark.parametrize("seed", range(5))
def test_the_cosines_equal_the_sums_over_every_pair(seed):
    # decide takes each delta's cosine with the weighted sum of the others from the Gram matrix in O(N²); the
    # definition, Σ_j Σ_l w_j w_l G_jl over the others for each i, is O(N³): both give the same cosines
    rng = random.Random(seed)
    n = rng.randint(3, 24)
    S = torch.randn(n, 50, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    S *= torch.tensor([rng.uniform(0.7, 1.4) for _ in range(n)], dtype=torch.float64)[:, None]
    gram = (S @ S.T).tolist()
    weights = [rng.randint(500, 5000) for _ in range(n)]
    norms = [math.sqrt(gram[i][i]) for i in range(n)]
    _, info = decide(list(range(n)), norms, gram, weights, ratio=3.0, min_cos=-1.0)
    for i in range(n):
        o = [j for j in range(n) if j != i]
        dot = sum(weights[j] * gram[i][j] for j in o)
        o2 = sum(weights[j] * weights[k] * gram[j][k] for j in o for k in o)
        assert info[i]["cos"] == pytest.approx(round(dot / math.sqrt(gram[i][i] * o2), 4), abs=1e-4)


# -- the noise floor ---------------------------------------------------------------------------------------------------
def _noise_like(d: torch.Tensor, seed: int) -> torch.Tensor:
    n = torch.randn(d.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return n * d.norm() / n.norm()


def _topk(d: torch.Tensor, frac: float = 0.1) -> torch.Tensor:
    """A top-k delta as the sum sees it: the largest |values|, zeros elsewhere."""
    k = int(frac * d.numel())
    out = torch.zeros_like(d)
    idx = d.abs().topk(k).indices
    out[idx] = d[idx]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_noise_among_healthy_deltas_is_rejected_and_nothing_else(seed):
    rnd = random.Random(seed)
    n = rnd.randint(MIN_DELTAS, 8)
    deltas = _healthy(n, size=20000, corr=rnd.uniform(0.2, 0.9), seed=seed)
    assert _round(deltas)[0] == {}
    i = rnd.randrange(n)
    deltas[i] = _noise_like(deltas[i], 100 + seed)
    rejected, info = _round(deltas)
    assert set(rejected) == {i}, info
    assert "noise floor" in rejected[i]


@pytest.mark.parametrize("seed", range(8))
def test_topk_like_deltas_with_low_cosines_keep_their_healthy_ones_and_lose_noise(seed):
    """topk's healthy cosines are 0.18-0.53 (sparse selections overlap less): still far over the floor."""
    rnd = random.Random(seed)
    n = rnd.randint(MIN_DELTAS, 6)
    deltas = [_topk(d) for d in _healthy(n, size=80000, corr=rnd.uniform(0.3, 0.6), seed=seed)]
    rejected, info = _round(deltas)
    assert rejected == {}, info
    assert 0.15 < min(v["cos"] for v in info.values()) and max(v["cos"] for v in info.values()) < 0.55
    i = rnd.randrange(n)
    deltas[i] = _topk(_noise_like(deltas[i], 7 + seed))
    rejected, info = _round(deltas)
    assert set(rejected) == {i}, info


def test_a_fresh_moments_delta_is_not_judged_by_the_noise_floor():
    deltas = _healthy(4, size=20000, corr=0.6, seed=2)
    deltas[3] = _noise_like(deltas[3], 5)  # as unlike the others as a delta gets
    assert set(_round(deltas)[0]) == {3}
    rejected, info = _round(deltas, fresh={3})
    assert rejected == {} and info[3]["fresh_moments"] is True


def test_a_delta_of_fewer_inner_steps_aligns_less_and_is_not_taken_for_noise():
    """Rounds by time: a delta of 1 inner step (common part x 1, data noise x 1) among deltas of 400 (x 400, x 20):
    its cosine with the others is about sqrt(1/400) of theirs, under the floor; the floor scales the others' level
    by it."""
    g = torch.Generator().manual_seed(4)
    size = 80000
    common = torch.randn(size, generator=g, dtype=torch.float64)

    def delta(s):
        return s * 0.015 * common + math.sqrt(s) * torch.randn(size, generator=g, dtype=torch.float64)
    deltas = [delta(400) for _ in range(4)] + [delta(1) * 20]  # (its norm brought into the band)
    rejected, info = _round(deltas)
    assert set(rejected) == {4} and info[4]["cos"] < info[4]["cos_floor"], info  # judged on equal steps: noise
    rejected, info = _round(deltas, steps=[400, 400, 400, 400, 1])
    assert rejected == {}, info


# -- rounds of 2: the pair's cosine against its history ---------------------------------------------------------------
class _Acc:
    """The accumulator's face that screen_round reads: stats, workers, weights, metas, loss, drop."""

    def __init__(self, deltas, steps=None, fresh=(), losses=None, base=0.0):
        from train.exchange.screen import DeltaStats

        self.stats = DeltaStats({"a": (deltas[0].numel(),)}, len(deltas))
        self.workers = list(range(len(deltas)))
        self.weights = {w: 1.0 for w in self.workers}
        self.metas = {w: {"inner_steps": (steps or [5] * len(deltas))[w], "fresh_moments": w in fresh}
                      for w in self.workers}
        for w, d in enumerate(deltas):
            self.stats.observe(w, "a", d)
        if losses is not None:
            self.loss = type("L", (), {"losses": dict(enumerate(losses)), "base_loss": base})()

    def drop(self, ws):
        self.workers = [w for w in self.workers if w not in ws]


def _pair_run(rounds: int, corr: float = 0.2, size: int = 20000, seed: int = 0):
    """A 2-worker run's deltas: a slowly turning common direction (consecutive rounds' updates agree)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=g, dtype=torch.float64)
    out = []
    for _ in range(rounds):
        common = 0.95 * common + math.sqrt(1 - 0.95 ** 2) * torch.randn(size, generator=g, dtype=torch.float64)
        out.append([math.sqrt(corr) * common + math.sqrt(1 - corr) * torch.randn(size, generator=g,
                                                                                  dtype=torch.float64)
                    for _ in range(2)])
    return out


def test_a_pair_with_noise_is_told_apart_by_its_history_and_the_previous_update():
    from train.exchange.screen import ScreenHistory, screen_round

    h = ScreenHistory()
    run = _pair_run(8)
    for r, pair in enumerate(run[:7]):
        rejected, info = screen_round(_Acc(pair), 5.0, -0.5, 0.03, h, r)
        assert rejected == {}, (r, info)
    pair = run[7]
    pair[1] = _noise_like(pair[1], 3)
    rejected, info = screen_round(_Acc(pair), 5.0, -0.5, 0.03, h, 7)
    assert set(rejected) == {1}, info
    assert "the pair's cosine" in rejected[1] and "previous round's update" in rejected[1]
    assert info["w001"]["cos_prev"] < info["w000"]["cos_prev"]


def test_a_restarted_coordinator_has_no_pair_history_and_keeps_both():
    from train.exchange.screen import ScreenHistory, screen_round

    pair = _pair_run(1)[0]
    pair[0] = _noise_like(pair[0], 4)
    rejected, info = screen_round(_Acc(pair), 5.0, -0.5, 0.03, ScreenHistory(), 30)
    assert rejected == {} and "cos_ref" not in info["w000"]


def test_without_the_previous_update_the_loss_gain_decides_or_neither_is_rejected():
    from train.exchange.screen import CLEAR, decide_pair, noise_floor

    d = _pair_run(1)[0]
    d[1] = _noise_like(d[1], 5)
    G = torch.stack(d) @ torch.stack(d).T
    level = 0.2
    assert level > CLEAR * noise_floor(20000)
    rejected, _ = decide_pair([0, 1], G, 20000, level, [None, None], [0.010, -0.025], 0.03)
    assert set(rejected) == {1} and "loss gain -0.0250" in rejected[1]
    rejected, info = decide_pair([0, 1], G, 20000, level, [None, None], [0.010, -0.005], 0.03)
    assert rejected == {} and "neither delta is clearly the bad one" in info[0]["pair"]
    # a fresh delta, or one of far fewer inner steps, is not judged so
    assert decide_pair([0, 1], G, 20000, level, [None, None], [0.010, -0.025], 0.03, fresh={1})[0] == {}
    assert decide_pair([0, 1], G, 20000, level, [None, None], [0.010, -0.025], 0.03, steps=[25, 1])[0] == {}


@pytest.mark.parametrize("seed", range(6))
def test_healthy_pairs_are_never_rejected_over_a_run(seed):
    from train.exchange.screen import ScreenHistory, screen_round

    rnd = random.Random(seed)
    h = ScreenHistory()
    for r, pair in enumerate(_pair_run(20, corr=rnd.uniform(0.02, 0.6), seed=seed)):
        rejected, info = screen_round(_Acc(pair), 5.0, -0.5, 0.03, h, r)
        assert rejected == {}, (r, info)


def test_a_flipped_delta_in_the_others_mean_does_not_push_a_healthy_one_to_the_noise_floor():
    """Weighted by tokens 1, 2, 3 with the third flipped, the others' mean of a fourth has no common part left: its
    cosine was 0 there. The noise floor takes the cosines again without the deltas the cosine rule rejected."""
    deltas = _healthy(4, size=20000, corr=0.64, seed=1)
    deltas[2] = -deltas[2]
    rejected, info = _round(deltas, weights=[1.0, 2.0, 3.0, 4.0])
    assert set(rejected) == {2} and "outer.screen_min_cosine" in rejected[2], info
