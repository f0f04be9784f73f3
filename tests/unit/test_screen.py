"""The screen's decision (train/exchange/screen.py): on numbers, and on real deltas through the accumulators."""
from __future__ import annotations

import math
import random

import pytest
import torch

from train.exchange.screen import MIN_DELTAS, DeltaStats, decide, stride_for


def _round(deltas: list[torch.Tensor], weights=None, ratio=5.0, min_cos=-0.5, shapes=None, fresh=frozenset()):
    """decide() on deltas given as flat tensors, through DeltaStats (as the accumulators feed it)."""
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
                  ratio, min_cos, fresh)


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


def test_two_deltas_are_never_screened():
    """With 2 deltas there is no majority: neither can be told from the other."""
    d = _healthy(2, corr=0.8)
    assert _round([d[0], 100 * d[1]])[0] == {}
    assert _round([d[0], -d[1]])[0] == {}


def test_a_subtle_bias_and_same_norm_noise_pass_by_default():
    """What the screen cannot see (docs/protocol.md): a delta of the same norm pointing elsewhere (noise: cosine
    about 0), or a small bias added to a healthy delta."""
    deltas = _healthy(4, corr=0.7, seed=3)
    g = torch.Generator().manual_seed(9)
    noise = torch.randn(2000, generator=g, dtype=torch.float64)
    deltas[1] = noise * deltas[1].norm() / noise.norm()
    deltas[2] = deltas[2] + 0.3 * deltas[2].norm() / math.sqrt(2000)  # every value shifted a little
    assert _round(deltas)[0] == {}
    rejected, _ = _round(deltas, min_cos=0.2)  # a stricter bound catches the noise (where healthy rounds allow it)
    assert set(rejected) == {1}


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
