"""Merge methods against their definitions (mergekit semantics) on small random tensors (no tied magnitudes)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from train import merge_methods as mm
from train.merge import slerp, t_for
from train.merge_methods import (MergeError, Recipe, dare_merge, linear_merge, merge_state_dicts, merge_tensor,
                                 memory_source, task_arithmetic, tensor_seed, ties_merge)


def rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * scale


def parents(n=3, shape=(6, 7), seed=0):
    base = rand(shape, seed)
    return base, [base + rand(shape, seed + 1 + i, 0.1 * (i + 1)) for i in range(n)]


# -- reference definitions, written independently of the implementation -------------------------------------------
def ref_topk(delta, density):
    """mergekit's magnitude(): keep exactly k = int(density · numel) largest |δ| (argsort)."""
    if density >= 1:
        return delta.clone()
    k = int(density * delta.numel())
    keep = torch.zeros(delta.numel(), dtype=torch.bool)
    keep[torch.argsort(delta.abs().reshape(-1), descending=True)[:k]] = True
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


def test_ties_pruned_zeros_do_not_vote_and_all_pruned_gives_the_base():
    base = rand((10,), 1)
    a = base + torch.tensor([5.0, 0.1, 0, 0, 0, 0, 0, 0, 0, 0.2])
    b = base + torch.tensor([4.0, -0.3, 0, 0, 0, 0, 0, 0, 0, -0.01])
    # density 0.1: each keeps one entry (position 0); position 1 is pruned in both, so it stays the base,
    # and position 0 divides by the two agreeing weights
    got = ties_merge(base, [a, b], [1.0, 3.0], density=0.1)
    expect = base.clone()
    expect[0] += (5.0 + 3 * 4.0) / 4.0
    assert torch.allclose(got, expect, atol=1e-6)
    for d in (0.0, 0.05):  # k = int(d · 10) = 0: everything pruned
        assert torch.equal(ties_merge(base, [a, b], [1.0, 3.0], density=d), base)


def test_radix_selection_finds_the_kth_largest_magnitude_across_chunks():
    x = rand((50_000,), 9).abs()
    for k in (1, 17, 25_000, 49_999, 50_000):
        got = mm._kth_largest(lambda: (x[s:s + 4096] for s in range(0, x.numel(), 4096)), k)
        assert got == float(torch.kthvalue(x, x.numel() - k + 1).values)


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
    code = "from train.merge_methods import tensor_seed; print(tensor_seed(5, 'model.norm.weight'))"
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
