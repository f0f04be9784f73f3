"""Selection, fitness and DNA: properties (hypothesis) of the pure functions in train/edt/genes.py."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from train.edt.genes import (GENES, crossover_dna, decode, fit_dna, fitness_function, generation_rng, mutate_dna,
                                 rank_order, rank_weights, select_pairs, tournament)

fitness_lists = st.lists(st.one_of(st.floats(-10, 10, allow_nan=False), st.just(float("-inf")),
                                   st.just(float("nan"))), min_size=1, max_size=12)
methods = st.sampled_from(["tournament", "rank"])


def _k(f):
    return f if math.isfinite(f) else float("-inf")


@settings(max_examples=200, deadline=None)
@given(fit=fitness_lists, n=st.integers(1, 16), elitism=st.integers(0, 5), method=methods,
       size=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_elites_survive_paired_with_themselves(fit, n, elitism, method, size, seed):
    pairs = select_pairs(fit, n, elitism, method, size, random.Random(seed))
    assert len(pairs) == n
    k = min(elitism, n, len(fit))
    elites = [a for a, b in pairs[:k]]
    assert all(a == b for a, b in pairs[:k])
    best = sorted(range(len(fit)), key=lambda i: -_k(fit[i]))[:k]
    assert sorted(_k(fit[i]) for i in elites) == sorted(_k(fit[i]) for i in best)  # the k fittest (ties: any)
    assert len(set(elites)) == k


@settings(max_examples=200, deadline=None)
@given(fit=fitness_lists, n=st.integers(1, 16), elitism=st.integers(0, 3), method=methods,
       size=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_no_member_is_paired_with_itself_when_two_exist(fit, n, elitism, method, size, seed):
    pairs = select_pairs(fit, n, elitism, method, size, random.Random(seed))
    k = min(elitism, n, len(fit))
    for a, b in pairs[k:]:
        assert 0 <= a < len(fit) and 0 <= b < len(fit)
        if len(fit) >= 2:
            assert a != b


@settings(max_examples=100, deadline=None)
@given(fit=fitness_lists)
def test_rank_weights_sum_to_one_and_follow_fitness(fit):
    w = rank_weights(fit)
    assert math.isclose(sum(w), 1.0, rel_tol=1e-9) and all(x > 0 for x in w)
    order = rank_order(fit)
    assert all(w[order[i]] > w[order[i + 1]] for i in range(len(order) - 1))


@settings(max_examples=100, deadline=None)
@given(fit=fitness_lists, n=st.integers(1, 10), method=methods, seed=st.integers(0, 10**6))
def test_selection_is_deterministic_for_a_seed(fit, n, method, seed):
    one = select_pairs(fit, n, 1, method, 3, random.Random(seed))
    two = select_pairs(fit, n, 1, method, 3, random.Random(seed))
    assert one == two
    assert generation_rng(7, 3).random() == generation_rng(7, 3).random() != generation_rng(7, 4).random()


@settings(max_examples=100, deadline=None)
@given(fit=st.lists(st.floats(-5, 5), min_size=3, max_size=8, unique=True), seed=st.integers(0, 10**6))
def test_a_full_size_tournament_returns_the_fittest_and_never_the_excluded(fit, seed):
    rng = random.Random(seed)
    best = max(range(len(fit)), key=lambda i: fit[i])
    assert tournament(fit, len(fit), rng) == best
    assert tournament(fit, len(fit), rng, exclude=best) != best


def test_tournament_pressure_prefers_fitter_members():
    fit = [float(i) for i in range(10)]
    rng = random.Random(0)
    wins = [tournament(fit, 3, rng) for _ in range(2000)]
    assert sum(w >= 5 for w in wins) > 0.75 * len(wins)
    with pytest.raises(ValueError, match="unknown method"):
        select_pairs(fit, 2, method="roulette")


def test_diverged_members_rank_last():
    fit = [float("nan"), 0.2, float("-inf"), 0.1]
    assert rank_order(fit)[:2] == [1, 3]
    assert select_pairs(fit, 2, elitism=2)[:2] == [(1, 1), (3, 3)]


# -- fitness ---------------------------------------------------------------------------------------------------------
def test_fitness_functions():
    assert fitness_function("inverse_loss")({"eval_loss": 4.0}) == 0.25
    assert fitness_function("neg_loss")({"eval_loss": 4.0}) == -4.0
    assert fitness_function("inverse_loss")({"eval_loss": float("nan")}) == float("-inf")
    assert fitness_function("math:fabs") is math.fabs  # module:function is pluggable
    with pytest.raises(ValueError, match="cannot import"):
        fitness_function("no_such_module_xyz:f")


# -- DNA -------------------------------------------------------------------------------------------------------------
GENE_RANGES = {"inner_lr": [0.5, 2.0], "outer_lr": [0.5, 1.0], "outer_momentum": [0.0, 0.9], "data_mix": [0.0, 0.5]}
BASE = {"inner_lr": 1e-3, "outer_lr": 0.7, "outer_momentum": 0.9, "data_mix": 0.0}


@settings(max_examples=100, deadline=None)
@given(u=st.dictionaries(st.sampled_from(sorted(GENE_RANGES)), st.floats(0, 1)), p=st.floats(0, 1),
       s=st.floats(0, 2), seed=st.integers(0, 10**6))
def test_mutation_keeps_genes_in_the_unit_interval(u, p, s, seed):
    out, mutated = mutate_dna(u, p, s, random.Random(seed))
    assert set(out) == set(u) and all(0.0 <= v <= 1.0 for v in out.values())
    if not mutated:
        assert out == u
    out0, m0 = mutate_dna(u, 0.0, s, random.Random(seed))
    assert out0 == u and not m0


def test_decode_maps_genes_onto_real_hyperparameters():
    lo = decode({g: 0.0 for g in GENE_RANGES}, GENE_RANGES, BASE)
    hi = decode({g: 1.0 for g in GENE_RANGES}, GENE_RANGES, BASE)
    mid = decode({g: 0.5 for g in GENE_RANGES}, GENE_RANGES, BASE)
    assert lo == pytest.approx({"inner_lr": 5e-4, "outer_lr": 0.5, "outer_momentum": 0.0, "data_mix": 0.0})
    assert hi == pytest.approx({"inner_lr": 2e-3, "outer_lr": 1.0, "outer_momentum": 0.9, "data_mix": 0.5})
    assert mid["inner_lr"] == pytest.approx(1e-3)  # log scale: the geometric middle of [0.5, 2] x base
    assert decode({}, {}, BASE) == BASE  # no genes: the config's values
    assert set(GENES) == set(GENE_RANGES)


def test_dna_crossover_takes_each_gene_from_a_parent_and_fit_dna_follows_the_config():
    a, b = {"inner_lr": 0.1, "data_mix": 0.2}, {"inner_lr": 0.9, "data_mix": 0.8}
    for seed in range(20):
        c = crossover_dna(a, b, random.Random(seed))
        assert all(c[g] in (a[g], b[g]) for g in a)
    fitted = fit_dna({"inner_lr": 0.3, "gone": 0.5}, {"inner_lr": [1, 2], "outer_lr": [0.5, 1]}, random.Random(0))
    assert set(fitted) == {"inner_lr", "outer_lr"} and fitted["inner_lr"] == 0.3


def test_elite_keeps_its_slot_and_every_slot_is_filled():
    from train.edt.breed import Member, assign_slots

    pool = [Member(g=1, m=m, genome={}, result={}, fitness=0.0, paths=None) for m in (2, 0, 1)]
    slots = assign_slots([(0, 0), (1, 2), (2, 1)], pool, 3)
    assert slots[0] == 2 and sorted(slots) == [0, 1, 2]


def test_initial_population_is_filled_by_random_choice(tmp_path):
    from tests.helpers import tiny_config
    from train.config import ConfigError, build_config
    from train.edt.breed import initial_specs

    cfg = build_config(tiny_config(tmp_path, edt={"initial_population": ["a.json", "b-dir"]}))
    specs = initial_specs(cfg, 5)
    assert specs[:2] == ["a.json", "b-dir"] and set(specs) <= {"a.json", "b-dir"} and len(specs) == 5
    assert initial_specs(cfg, 5) == specs  # seeded
    assert initial_specs(build_config(tiny_config(tmp_path)), 3) == [cfg.model.name] * 3  # empty: model.name
    with pytest.raises(ConfigError, match="population is 1"):
        initial_specs(cfg, 1)
