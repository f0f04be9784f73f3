"""Merge methods against their definitions (mergekit semantics): small random tensors (no tied magnitudes) checked
against reference loops, and mergekit's edge cases (t of non-layer tensors, magnitude ties, k = 0, the count sign
election) against values computed by hand."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO
from train.merge import methods as mm
from train.merge.crossover import slerp, t_for
from train.merge.methods import (MergeError, Recipe, dare_merge, linear_merge, merge_state_dicts, merge_tensor,
                                 memory_source, task_arithmetic, tensor_seed, ties_merge)


def rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * scale


def parents(n=3, shape=(6, 7), seed=0):
    base = rand(shape, seed)
    return base, [base + rand(shape, seed + 1 + i, 0.1 * (i + 1)) for i in range(n)]


# -- reference definitions, written independently of the implementation -------------------------------------------
def ref_topk(delta, density):
    """mergekit's magnitude(): keep exactly k = int(density · numel) largest |δ| (a stable sort: ties by index)."""
    if density >= 1:
        return delta.clone()
    k = int(density * delta.numel())
    keep = torch.zeros(delta.numel(), dtype=torch.bool)
    keep[torch.sort(delta.abs().reshape(-1), descending=True, stable=True).indices[:k]] = True
    return delta * keep.reshape(delta.shape)


def ref_consensus(base, deltas, weights, normalize, lambda_):
    """Σ over agreeing entries w_i δ_i (÷ Σ agreeing w_i), sign elected by the weighted sum, elementwise loops."""
    out = base.clone().reshape(-1)
    flat = [d.reshape(-1) for d in deltas]
    for j in range(out.numel()):
        wd = [w * float(d[j]) for w, d in zip(weights, flat)]
        sign = 1.0 if sum(wd) >= 0 else -1.0
        agree = [i for i, x in enumerate(wd) if x != 0 and math.copysign(1.0, x) == sign]
        mixed = sum(wd[i] for i in agree)
        div = sum(weights[i] for i in agree) or 1.0
        out[j] += lambda_ * (mixed / div if normalize else mixed)
    return out.reshape(base.shape)


# -- linear / task arithmetic ----------------------------------------------------------------------------------------
def test_linear_is_the_normalised_weighted_sum():
    _, xs = parents(3)
    w = [0.2, 0.5, 1.3]
    expect = sum(wi * x for wi, x in zip(w, xs)) / sum(w)
    assert torch.allclose(linear_merge(xs, w), expect, atol=1e-6)
    assert torch.allclose(linear_merge(xs, w, normalize=False), sum(wi * x for wi, x in zip(w, xs)), atol=1e-6)
    with pytest.raises(ValueError, match="sum to 0"):
        linear_merge(xs[:2], [1.0, -1.0])
    assert linear_merge([x.bfloat16() for x in xs], w).dtype == torch.bfloat16


@pytest.mark.parametrize("normalize,lambda_", [(False, 1.0), (True, 0.7), (False, 1.8)])
def test_task_arithmetic_adds_the_weighted_task_vectors(normalize, lambda_):
    base, xs = parents(3)
    w = [0.5, -0.25, 1.0]
    mixed = sum(wi * (x - base) for wi, x in zip(w, xs))
    expect = base + lambda_ * (mixed / sum(w) if normalize else mixed)
    assert torch.allclose(task_arithmetic(base, xs, w, normalize=normalize, lambda_=lambda_), expect, atol=1e-6)


# -- TIES ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0.3, 0.55, 1.0, (0.2, 0.9, 0.5)])
@pytest.mark.parametrize("normalize,lambda_", [(True, 1.0), (False, 0.6)])
def test_ties_matches_its_definition(density, normalize, lambda_):
    base, xs = parents(3, shape=(9, 11), seed=4)
    w = [0.7, 0.4, 1.1]
    dens = density if isinstance(density, tuple) else (density,) * 3
    deltas = [ref_topk(x - base, d) for x, d in zip(xs, dens)]
    expect = ref_consensus(base, deltas, w, normalize, lambda_)
    got = ties_merge(base, xs, w, density, normalize=normalize, lambda_=lambda_)
    assert torch.allclose(got, expect, atol=1e-6)


def test_ties_zero_sum_elects_plus_and_only_agreeing_entries_count():
    base = torch.zeros(4)
    a = torch.tensor([1.0, -2.0, 3.0, 0.5])
    b = torch.tensor([-1.0, 2.0, -1.0, 0.25])
    # position 0/1: weighted sum exactly 0 → sign +: only the positive entry votes, divided by its weight alone
    got = ties_merge(base, [a, b], [1.0, 1.0], density=1.0)
    assert torch.allclose(got, torch.tensor([1.0, 2.0, 3.0, 0.375]))
    got = ties_merge(base, [a, b], [1.0, 1.0], density=1.0, normalize=False)
    assert torch.allclose(got, torch.tensor([1.0, 2.0, 3.0, 0.75]))


def test_ties_pruned_zeros_do_not_vote():
    base = rand((10,), 1)
    a = base + torch.tensor([5.0, 0.1, 0, 0, 0, 0, 0, 0, 0, 0.2])
    b = base + torch.tensor([4.0, -0.3, 0, 0, 0, 0, 0, 0, 0, -0.01])
    # density 0.1: each keeps one entry (position 0); position 1 is pruned in both, so it stays the base,
    # and position 0 divides by the two agreeing weights
    got = ties_merge(base, [a, b], [1.0, 3.0], density=0.1)
    expect = base.clone()
    expect[0] += (5.0 + 3 * 4.0) / 4.0
    assert torch.allclose(got, expect, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 2, 3])
def test_ties_keeps_exactly_k_entries_when_magnitudes_tie(chunk):
    # |δ| = 2, then four 1s at indices 0, 1, 2, 4, then 0.5: density 0.5 → k = int(0.5 · 6) = 3 keeps the 2 and
    # the first two of the tied 1s (indices 0, 1); the old threshold rule kept all five entries ≥ 1
    base = torch.zeros(6)
    x = torch.tensor([1.0, -1.0, 1.0, 0.5, -1.0, 2.0])
    args = ("model.layers.0.mlp.up_proj.weight", [memory_source(x)], memory_source(base), 6, (6,), torch.float32, 1)
    got = merge_tensor(Recipe("ties", weights=(1.0,), density=0.5), *args, chunk=chunk)  # chunks of 2 / 3: the
    assert torch.equal(got, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 2.0]))  # tie quota carries over chunks
    # every entry tied (a bf16-like task vector of ±1): density 0.37 of 100 keeps exactly the first 37
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0] * 25)
    got = ties_merge(torch.zeros(100), [signs], [1.0], density=0.37)
    assert torch.equal(got, torch.cat([signs[:37], torch.zeros(63)]))
    assert int((got != 0).sum()) == 37
    # two models, each trimmed to its own k = int(0.4 · 5) = 2 with ties broken by index, then the consensus:
    # a keeps [3, 3, 0, 0, 0] of [3, 3, 3, 1, 0]; b keeps [0, 0, -2, -2, 0] of [1, 0, -2, -2, -2]
    base = torch.zeros(5)
    a = torch.tensor([3.0, 3.0, 3.0, 1.0, 0.0])
    b = torch.tensor([1.0, 0.0, -2.0, -2.0, -2.0])
    got = ties_merge(base, [a, b], [1.0, 1.0], density=0.4)
    assert torch.equal(got, torch.tensor([3.0, 3.0, -2.0, -2.0, 0.0]))


def test_ties_density_that_rounds_k_to_zero_is_a_merge_error():
    base = torch.zeros(10)
    a, b = base + torch.arange(10.0), base - torch.arange(10.0)
    # int(0.05 · 10) = 0 keeps nothing: mergekit's magnitude() asserts k > 0, we raise MergeError naming it
    with pytest.raises(MergeError, match=r"density 0.05 keeps int\(0.05 × 10\) = 0 entries of tensor "
                                         r"'tensor'.*at least 0.1"):
        ties_merge(base, [a, b], [1.0, 1.0], density=0.05)
    with pytest.raises(MergeError, match="density 0.09 of model 1"):  # per-model densities: the culprit is named
        ties_merge(base, [a, b], [1.0, 1.0], density=(0.5, 0.09))
    # k = int(0.1 · 10) = 1 is fine: a keeps only its 9; with weights (3, 1) position 9 elects + (27 − 9) and
    # averages a alone (27 / 3), every other position is b's −i alone
    assert torch.equal(ties_merge(base, [a, b], [3.0, 1.0], density=(0.1, 1.0)),
                       torch.tensor([0.0, -1, -2, -3, -4, -5, -6, -7, -8, 9]))
    # in a state dict the tensor is named: the 4-element norms of toy() have int(0.2 · 4) = 0, the rest k ≥ 1
    a_sd, b_sd, base_sd = toy(1, 3), toy(1, 4), toy(1, 5)
    with pytest.raises(MergeError, match="tensor 'model.layers.0.input_layernorm.weight'"):
        merge_state_dicts(Recipe("ties", density=0.2), [a_sd, b_sd], base_sd)
    with pytest.raises(ValueError, match="ties density 0.0 has a 0"):  # density 0: refused by the recipe already
        Recipe("ties", density=0.0)
    # DARE's Bernoulli pruning has no k: density 0 drops everything (no rescale of a zero norm), as in mergekit
    assert torch.equal(dare_merge(base, [a, b], [1.0, 1.0], 0.0, torch.Generator().manual_seed(0), ties=True), base)


def test_count_and_sum_sign_elections_differ_where_one_big_delta_outweighs_two_small():
    base = torch.zeros(5)
    xs = [torch.tensor([5.0, 1.0, 0.0, 1.0, 3.0]),
          torch.tensor([-1.0, 1.0, 0.0, -2.0, -1.0]),
          torch.tensor([-1.0, -4.0, -1.0, 0.0, -1.0])]
    w = [1.0, 1.0, 1.0]
    # position: weighted deltas → sum: Σ, elected sign, agreeing mean  |  count: Σ sign, elected sign, agreeing mean
    # 0: 5, -1, -1  → sum +3: +, 5/1 = 5               |  count -1: −, (-1 - 1)/2 = -1
    # 1: 1, 1, -4   → sum -2: −, -4/1 = -4             |  count +1: +, (1 + 1)/2 = 1
    # 2: 0, 0, -1   → sum -1: −, -1                     |  count -1 (zeros do not vote): −, -1
    # 3: 1, -2, 0   → sum -1: −, -2                     |  count 0 → ≥ 0 elects +: 1
    # 4: 3, -1, -1  → sum +1: +, 3                      |  count -1: −, -1
    sum_expect = torch.tensor([5.0, -4.0, -1.0, -2.0, 3.0])
    count_expect = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0])
    assert torch.equal(ties_merge(base, xs, w, density=1.0), sum_expect)
    assert torch.equal(ties_merge(base, xs, w, density=1.0, consensus_method="sum"), sum_expect)
    assert torch.equal(ties_merge(base, xs, w, density=1.0, consensus_method="count"), count_expect)
    # count votes with the sign of the *weighted* delta and divides by the agreeing weights: weights (1, 2, 1) on
    # position 0 give 5, -2, -1 → count −: (-2 - 1)/(2 + 1) = -1; sum +2: +: 5/1; without normalize: -3 and 5
    wx = [x[:1] for x in xs]
    assert torch.equal(ties_merge(base[:1], wx, [1.0, 2.0, 1.0], 1.0, consensus_method="count"), torch.tensor([-1.0]))
    assert torch.equal(ties_merge(base[:1], wx, [1.0, 2.0, 1.0], 1.0, normalize=False, consensus_method="count"),
                       torch.tensor([-3.0]))
    assert torch.equal(ties_merge(base[:1], wx, [1.0, 2.0, 1.0], 1.0), torch.tensor([5.0]))
    # through a Recipe (and dare_ties, whose density 1 draws no mask): the same hand values
    sds = [{"model.layers.0.mlp.up_proj.weight": x} for x in xs]
    bsd = {"model.layers.0.mlp.up_proj.weight": base}
    for method in ("ties", "dare_ties"):
        r = Recipe(method, weights=(1.0, 1.0, 1.0), normalize=True, consensus_method="count")
        assert torch.equal(merge_state_dicts(r, sds, bsd)["model.layers.0.mlp.up_proj.weight"], count_expect)
        r = Recipe(method, weights=(1.0, 1.0, 1.0), normalize=True)
        assert torch.equal(merge_state_dicts(r, sds, bsd)["model.layers.0.mlp.up_proj.weight"], sum_expect)
    with pytest.raises(ValueError, match="consensus_method must be one of sum, count"):
        ties_merge(base, xs, w, density=1.0, consensus_method="majority")


def test_radix_selection_finds_the_kth_largest_magnitude_across_chunks():
    x = rand((50_000,), 9).abs()
    tied = (x * 4).round() / 4  # few distinct values: many ties at every threshold
    for v in (x, tied):
        for k in (1, 17, 25_000, 49_999, 50_000):
            got, greater, equal = mm._kth_largest(lambda: (v[s:s + 4096] for s in range(0, v.numel(), 4096)), k)
            assert got == float(torch.kthvalue(v, v.numel() - k + 1).values)
            assert greater == int((v > got).sum()) and equal == int((v == got).sum())
            assert greater < k <= greater + equal


@pytest.mark.parametrize("method", ["linear", "slerp", "task_arithmetic", "ties"])
def test_chunked_merge_equals_the_one_chunk_merge(method):
    base, xs = parents(2, shape=(33, 31), seed=11)
    r = Recipe(method, density=0.4 if method == "ties" else 1.0, t_curves={"default": 0.3} if method == "slerp"
               else None)
    args = ("model.layers.0.mlp.up_proj.weight", [memory_source(x) for x in xs], memory_source(base), base.numel(),
            base.shape, torch.float32, 1)
    whole = merge_tensor(r, *args)
    chunked = merge_tensor(r, *args, chunk=100)  # 11 chunks, the last one short
    assert torch.allclose(whole, chunked, atol=1e-6)


# -- DARE ------------------------------------------------------------------------------------------------------------
def test_dare_keeps_a_bernoulli_subset_rescaled_to_the_same_l1_norm():
    base, xs = parents(1, shape=(200, 50), seed=2)
    delta = xs[0] - base
    for density in (0.1, 0.5, 0.9):
        got = dare_merge(base, xs, [1.0], density, torch.Generator().manual_seed(3), ties=False) - base
        kept = got != 0
        assert abs(kept.float().mean().item() - density) < 0.03
        assert math.isclose(got.abs().sum().item(), delta.abs().sum().item(), rel_tol=1e-5)
        scale = delta.abs().sum() / delta[kept].abs().sum()  # L1-preserving, not 1/p
        assert torch.allclose(got[kept], delta[kept] * scale, atol=1e-5)


@pytest.mark.parametrize("ties", [False, True])
def test_dare_matches_its_definition_with_the_documented_random_stream(ties):
    base, xs = parents(3, shape=(8, 9), seed=6)
    w, dens = [0.6, 0.3, 0.9], (0.5, 0.7, 1.0)
    g = torch.Generator().manual_seed(123)
    masks = [torch.rand(base.numel(), generator=g).reshape(base.shape) < d for d in dens[:2]] + [None]
    deltas = []
    for x, m in zip(xs, masks):
        d = x - base
        deltas.append(d if m is None else d * m * (d.abs().sum() / (d * m).abs().sum()))
    if ties:
        expect = ref_consensus(base, deltas, w, normalize=True, lambda_=1.3)
    else:
        expect = base + 1.3 * sum(wi * d for wi, d in zip(w, deltas)) / sum(w)
    got = dare_merge(base, xs, w, dens, torch.Generator().manual_seed(123), ties=ties, normalize=True, lambda_=1.3)
    assert torch.allclose(got, expect, atol=1e-5)


def test_dare_is_reproducible_per_tensor_name_and_seed():
    base, xs = parents(2, shape=(64, 64), seed=8)
    sd = [{"model.layers.0.mlp.up_proj.weight": x, "model.layers.0.mlp.down_proj.weight": x.T.contiguous()}
          for x in xs]
    bsd = {"model.layers.0.mlp.up_proj.weight": base, "model.layers.0.mlp.down_proj.weight": base.T.contiguous()}
    r = Recipe("dare_ties", density=0.5, seed=7)
    one, two = merge_state_dicts(r, sd, bsd), merge_state_dicts(r, sd, bsd)
    assert all(torch.equal(one[k], two[k]) for k in one)
    other = merge_state_dicts(Recipe("dare_ties", density=0.5, seed=8), sd, bsd)
    assert not torch.equal(one["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    # the stream is seeded per tensor name: the same values under another name give another mask
    up, down = one["model.layers.0.mlp.up_proj.weight"], one["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal((up == base), (down.T == base))


def test_tensor_seed_is_stable_across_processes():
    code = "from train.merge.methods import tensor_seed; print(tensor_seed(5, 'model.norm.weight'))"
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert int(out.stdout) == tensor_seed(5, "model.norm.weight")
    assert tensor_seed(5, "a") != tensor_seed(5, "b") != tensor_seed(6, "b")
    assert 0 <= tensor_seed(2**40, "x") < 2**63


# -- state dicts: slerp t-curves, every tensor merged, lm_head and tied embeddings -----------------------------------
def toy(n_layers, seed, tied=False):
    g = seed * 100
    sd = {"model.embed_tokens.weight": rand((12, 4), g)}
    for i in range(n_layers):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = rand((4, 4), g + 10 + i)
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = rand((6, 4), g + 40 + i)
        sd[f"model.layers.{i}.input_layernorm.weight"] = rand((4,), g + 70 + i)
    sd["model.norm.weight"] = rand((4,), g + 99)
    if not tied:
        sd["lm_head.weight"] = rand((12, 4), g + 98)
    return sd


def test_slerp_state_dicts_follow_the_t_curves_across_layers_and_filters():
    a, b = toy(5, 1), toy(5, 2)
    curves = {"self_attn": [0.0, 0.5, 1.0], "mlp": [1.0, 0.0], "default": 0.3}
    got = merge_state_dicts(Recipe("slerp", t_curves=curves), [a, b])
    hand = {"model.layers.0.self_attn.q_proj.weight": 0.0, "model.layers.1.self_attn.q_proj.weight": 0.25,
            "model.layers.3.self_attn.q_proj.weight": 0.75, "model.layers.4.mlp.up_proj.weight": 0.0,
            "model.layers.1.mlp.up_proj.weight": 0.75, "model.layers.2.input_layernorm.weight": 0.3,
            "model.norm.weight": 0.3, "lm_head.weight": 0.3, "model.embed_tokens.weight": 0.3}
    for name, t in hand.items():
        assert t_for(name, curves, 5) == pytest.approx(t)
        assert torch.allclose(got[name], slerp(t, a[name], b[name]), atol=1e-6), name
    assert set(got) == set(a)


def test_slerp_t_of_embeddings_final_norm_and_lm_head_is_the_first_value_of_their_curve():
    # mergekit's planner reads a module's pre_weights (embeddings) and post_weights (final norm, lm_head) with one
    # ConfigReader at t = 0: the first value of the curve their filter picks, here `default`
    curves = {"self_attn": [0.2, 0.6, 1.0], "mlp": [0.9, 0.1], "default": [0.1, 0.4, 0.7]}
    hand = {"model.embed_tokens.weight": 0.1, "model.norm.weight": 0.1, "lm_head.weight": 0.1,
            "model.layers.0.input_layernorm.weight": 0.1,        # p = 0
            "model.layers.2.input_layernorm.weight": 0.4,        # p = 2/4 → the middle anchor
            "model.layers.4.input_layernorm.weight": 0.7,        # p = 1 → the last anchor
            "model.layers.1.self_attn.q_proj.weight": 0.4,       # p = 1/4 → halfway between 0.2 and 0.6
            "model.layers.3.mlp.up_proj.weight": 0.3}            # p = 3/4 → 0.9 · 0.25 + 0.1 · 0.75
    for name, t in hand.items():
        assert t_for(name, curves, 5) == pytest.approx(t), name
    # a filter that names a post-layer tensor picks its curve, still read at the start
    assert t_for("model.norm.weight", {"norm": [0.3, 0.9], "default": [0.1, 0.7]}, 5) == pytest.approx(0.3)
    assert t_for("model.layers.4.post_attention_layernorm.weight", {"norm": [0.3, 0.9]}, 5) == pytest.approx(0.9)
    # a one-layer model: mergekit's plan_slice gives its single layer t = 1 (the last value); the rest stays at 0
    assert t_for("model.layers.0.self_attn.q_proj.weight", curves, 1) == pytest.approx(1.0)
    assert t_for("lm_head.weight", curves, 1) == pytest.approx(0.1)
    assert t_for("model.norm.weight", {"mlp": 0.8}, 5) == 0.5  # no filter, no default: 0.5
    # the merge uses those t: b = 2a is colinear with a, so slerp is the lerp (1 − t) a + t · 2a = (1 + t) a
    a = toy(5, 1)
    b = {k: 2 * v for k, v in a.items()}
    got = merge_state_dicts(Recipe("slerp", t_curves=curves), [a, b])
    for name, t in hand.items():
        assert torch.allclose(got[name], (1 + t) * a[name], atol=1e-6), name
    one_a = toy(1, 2)
    one = merge_state_dicts(Recipe("slerp", t_curves=curves), [one_a, {k: 2 * v for k, v in one_a.items()}])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(one[q], 2.0 * one_a[q], atol=1e-6)  # t = 1: the second model
    assert torch.allclose(one["lm_head.weight"], 1.1 * one_a["lm_head.weight"], atol=1e-6)


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties", "dare_linear"])
def test_every_tensor_is_merged_including_lm_head_and_norms(method):
    a, b, base = toy(2, 3), toy(2, 4), toy(2, 5)
    r = Recipe(method, weights=(0.3, 0.7), density=0.6)
    got = merge_state_dicts(r, [a, b], base if method in Recipe.NEEDS_BASE else None)
    assert set(got) == set(a)
    for name in a:  # each output differs from every input: nothing was copied through
        assert not torch.equal(got[name], a[name]) and not torch.equal(got[name], b[name]), name
    if method == "linear":
        expect = (0.3 * a["lm_head.weight"] + 0.7 * b["lm_head.weight"]) / 1.0
        assert torch.allclose(got["lm_head.weight"], expect, atol=1e-6)


def test_tied_embeddings_stand_in_for_a_missing_lm_head():
    a, b = toy(2, 3), toy(2, 4, tied=True)  # b stores its lm_head as the embedding
    got = merge_state_dicts(Recipe("linear", weights=(1.0, 3.0)), [a, b])
    assert torch.allclose(got["lm_head.weight"], (a["lm_head.weight"] + 3 * b["model.embed_tokens.weight"]) / 4)
    got = merge_state_dicts(Recipe("linear"), [b, a])  # a tied first model: no lm_head in the output
    assert "lm_head.weight" not in got


def test_mismatched_state_dicts_are_a_clear_error():
    a, b = toy(2, 3), toy(2, 4)
    b["model.norm.weight"] = rand((5,), 1)
    with pytest.raises(MergeError, match=r"model 1: tensor 'model.norm.weight' has shape \(5,\), model 0 has \(4,\)"):
        merge_state_dicts(Recipe("linear"), [a, b])
    del b["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(MergeError, match="model 1: tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        merge_state_dicts(Recipe("linear"), [a, b])


# -- recipes ---------------------------------------------------------------------------------------------------------
def test_recipe_round_trips_through_json_and_fills_mergekit_defaults():
    r = Recipe("slerp", t_curves={"self_attn": [0, 0.5, 1], "default": 0.4})
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    r = Recipe("dare_ties", weights=(0.5, 0.5), density=(0.3, 0.6), lambda_=1.2, seed=9)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["lambda"] == 1.2 and "lambda_" not in d and Recipe.from_dict(d) == r
    assert [Recipe(m).normalize for m in ("linear", "task_arithmetic", "ties", "dare_linear")] == \
        [True, False, True, False]
    # the sign election: "sum" by default where there is one, None elsewhere; "count" round-trips
    assert [Recipe(m).consensus_method for m in ("ties", "dare_ties", "dare_linear", "slerp")] == \
        ["sum", "sum", None, None]
    r = Recipe("ties", density=0.4, consensus_method="count")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["consensus_method"] == "count" and Recipe.from_dict(d) == r
    old = {k: v for k, v in Recipe("dare_ties").to_dict().items() if k != "consensus_method"}  # a recipe from before
    assert Recipe.from_dict(old) == Recipe("dare_ties", consensus_method="sum")


@pytest.mark.parametrize("d,match", [
    ({"method": "fancy"}, "method 'fancy' is not one of"),
    ({"method": "ties", "density": 1.5}, r"density must lie in \[0, 1\]"),
    ({"method": "linear", "weights": [1, -1]}, "sum to 0"),
    ({"method": "linear", "weights": [1, float("nan")]}, "every weight must be a finite number"),
    ({"method": "slerp", "weights": [1, 1]}, "slerp takes t_curves"),
    ({"method": "ties", "t_curves": {"default": 0.5}}, "t_curves are for slerp"),
    ({"method": "slerp", "t_curves": {"mlp": []}}, "empty list"),
    ({"method": "ties", "lambda": "big"}, "lambda must be a finite number"),
    ({"method": "ties", "seed": -1}, "seed must be a non-negative integer"),
    ({"method": "ties", "densty": 0.5}, r"unknown field\(s\) \['densty'\]"),
    ({"method": "ties", "density": [0.5, 0]}, r"ties density \(0.5, 0.0\) has a 0"),
    ({"method": "ties", "consensus_method": "majority"}, "consensus_method must be one of sum, count"),
    ({"method": "dare_linear", "consensus_method": "count"}, "consensus_method is for ties / dare_ties"),
])
def test_bad_recipes_are_rejected_with_the_field(d, match):
    with pytest.raises(ValueError, match=match):
        Recipe.from_dict(d)


def test_recipe_checks_the_number_of_models_and_the_base():
    with pytest.raises(ValueError, match="slerp merges exactly 2 models, got 3"):
        Recipe("slerp").check_models(3, False)
    with pytest.raises(ValueError, match="ties needs a base model"):
        Recipe("ties").check_models(2, False)
    with pytest.raises(ValueError, match="3 weights for 2 models"):
        Recipe("linear", weights=(1, 2, 3)).check_models(2, False)
    with pytest.raises(ValueError, match="3 densities for 2 models"):
        Recipe("ties", density=(0.1, 0.2, 0.3)).check_models(2, True)
