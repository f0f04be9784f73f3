"""Crossover math against its definitions: slerp (mergekit semantics), t-curves, outer_sgd, the streaming file form."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from train.merge.crossover import (MergeSpec, ParentFiles, curve_value, interpolate, lerp, merge_files,
                                   outer_sgd_crossover, outer_sgd_tensor, slerp, t_for)
from train.exchange.outer import diloco_round
from train.core.tensorio import load_tensors, save_streaming

shapes = st.sampled_from([(7,), (3, 4), (2, 3, 5)])
seeds = st.integers(0, 2**31 - 1)


def rand(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


# -- slerp / lerp ----------------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds)
def test_slerp_and_lerp_endpoints_return_the_parents(shape, seed):
    a, b = rand(shape, seed), rand(shape, seed + 1, 3.0)
    for fn in (slerp, lerp):
        assert torch.allclose(fn(0.0, a, b), a, atol=1e-5)
        assert torch.allclose(fn(1.0, a, b), b, atol=1e-5)


def test_slerp_of_orthogonal_vectors_at_half_is_the_closed_form():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 3.0])  # unnormalised: coefficients apply to these
    # θ = π/2: s0 = s1 = sin(π/4) / sin(π/2) = √2/2
    expect = torch.tensor([2.0, 3.0]) * math.sqrt(2) / 2
    assert torch.allclose(slerp(0.5, a, b), expect, atol=1e-6)
    # general t on the unit circle: (cos(tπ/2), sin(tπ/2))
    for t in (0.1, 0.3, 0.77):
        got = slerp(t, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
        assert torch.allclose(got, torch.tensor([math.cos(t * math.pi / 2), math.sin(t * math.pi / 2)]), atol=1e-6)


def test_slerp_normalises_over_the_whole_tensor():
    a, b = rand((4, 6), 1), rand((4, 6), 2)
    assert torch.allclose(slerp(0.3, a, b), slerp(0.3, a.flatten(), b.flatten()).reshape(4, 6), atol=1e-6)
    # not row by row: a row-wise slerp gives something else
    rowwise = torch.stack([slerp(0.3, a[i], b[i]) for i in range(4)])
    assert not torch.allclose(slerp(0.3, a, b), rowwise, atol=1e-4)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_near_colinear_tensors_fall_back_to_lerp(sign):
    a = rand((5, 5), 3)
    b = sign * 2.5 * a + 1e-5 * rand((5, 5), 4)  # |cos| > 0.9995
    assert torch.equal(slerp(0.4, a, b), lerp(0.4, a, b))
    c = a + 0.5 * rand((5, 5), 5)  # clearly not colinear: real slerp, differs from lerp
    assert not torch.allclose(slerp(0.4, a, c), lerp(0.4, a, c), atol=1e-4)


def test_slerp_keeps_dtype_and_checks_shapes():
    a, b = rand((3, 3), 1).bfloat16(), rand((3, 3), 2).bfloat16()
    assert slerp(0.5, a, b).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shapes differ"):
        slerp(0.5, a, b[:2])


# -- t curves --------------------------------------------------------------------------------------------------------
def toy_model(n_layers: int, value: float) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": torch.full((6, 2), value), "model.norm.weight": torch.full((2,), value),
          "lm_head.weight": torch.full((6, 2), value)}
    for i in range(n_layers):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.full((2, 2), value)
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = torch.full((3, 2), value)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.full((2,), value)
    return sd


def test_per_layer_t_curves_on_a_five_layer_model_match_hand_computed_values():
    curves = {"self_attn": [0.0, 1.0, 0.5], "mlp": [0.2, 0.8], "default": 0.3}
    # layer i of 5 reads the curve at p = i/4. self_attn: 3 points at p = 0, .5, 1 -> i=1 is halfway 0..1 (0.5),
    # i=3 halfway 1..0.5 (0.75). mlp: 0.2 + 0.6 p. Everything else: the constant default.
    hand = {"self_attn": [0.0, 0.5, 1.0, 0.75, 0.5], "mlp": [0.2, 0.35, 0.5, 0.65, 0.8],
            "input_layernorm": [0.3] * 5}
    merged = interpolate("linear", toy_model(5, 0.0), toy_model(5, 1.0), curves)  # a=0, b=1: the value is t
    for i in range(5):
        for part, name in (("self_attn", "self_attn.q_proj"), ("mlp", "mlp.up_proj"),
                           ("input_layernorm", "input_layernorm")):
            got = merged[f"model.layers.{i}.{name}.weight"]
            assert torch.allclose(got, torch.full_like(got, hand[part][i]), atol=1e-6), (i, part)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.allclose(merged[name], torch.full_like(merged[name], 0.3))


def test_non_layer_tensors_use_the_first_value_of_a_curve():
    curves = {"default": [0.1, 0.9]}
    assert t_for("model.embed_tokens.weight", curves, 5) == pytest.approx(0.1)
    assert t_for("lm_head.weight", curves, 5) == pytest.approx(0.1)
    assert t_for("model.layers.4.post_attention_layernorm.weight", curves, 5) == pytest.approx(0.9)
    assert t_for("model.layers.0.mlp.down_proj.weight", {"mlp": 0.7}, 1) == pytest.approx(0.7)
    assert t_for("model.layers.0.mlp.down_proj.weight", {}, 3) == 0.5  # no default: halfway
    assert curve_value([0.0, 1.0], 0.25) == pytest.approx(0.25) and curve_value(0.4, 0.9) == 0.4


def test_slerp_merge_uses_each_layers_t():
    curves = {"self_attn": [0.0, 1.0], "default": 0.5}
    a, b = toy_model(3, 0.0), toy_model(3, 0.0)
    for k in a:  # orthogonal parents per tensor
        a[k] = rand(a[k].shape, 1)
        b[k] = rand(b[k].shape, 2)
    merged = interpolate("slerp", a, b, curves)
    for i, t in enumerate([0.0, 0.5, 1.0]):
        name = f"model.layers.{i}.self_attn.q_proj.weight"
        assert torch.allclose(merged[name], slerp(t, a[name], b[name]), atol=1e-6)


def test_tied_embeddings_read_lm_head_from_the_embedding():
    a = toy_model(2, 0.0)
    b = toy_model(2, 1.0)
    del b["lm_head.weight"]  # b ties lm_head to embed_tokens and stores it once
    b["model.embed_tokens.weight"] = torch.full((6, 2), 2.0)
    merged = interpolate("linear", a, b, {"default": 0.5})
    assert torch.allclose(merged["lm_head.weight"], torch.full((6, 2), 1.0))


# -- outer_sgd -------------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=seeds, lr=st.floats(0.1, 1.5), mu=st.floats(0.0, 0.95), nesterov=st.booleans())
def test_outer_sgd_with_identical_parents_and_zero_deltas_is_the_identity(shape, seed, lr, mu, nesterov):
    p = rand(shape, seed)
    child, mom = outer_sgd_tensor(p, p.clone(), p.clone(), p.clone(), None, None, lr, mu, nesterov)
    assert torch.allclose(child, p, atol=1e-6) and torch.count_nonzero(mom) == 0


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=seeds)
def test_outer_sgd_with_lr_1_momentum_0_is_the_mean_of_the_mutated_parents(shape, seed):
    pre_a, pre_b, mut_a, mut_b = (rand(shape, seed + k) for k in range(4))
    moms = rand(shape, seed + 5), rand(shape, seed + 6)
    for nesterov in (True, False):
        child, _ = outer_sgd_tensor(pre_a, pre_b, mut_a, mut_b, *moms, lr=1.0, momentum=0.0, nesterov=nesterov)
        assert torch.allclose(child, (mut_a + mut_b) / 2, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=seeds, lr=st.floats(0.1, 1.5), mu=st.floats(0.0, 0.95), nesterov=st.booleans())
def test_outer_sgd_is_a_diloco_round_from_the_mean_base_with_averaged_momentum(seed, lr, mu, nesterov):
    """base = mean(pre), Δ_p = base − mutated_p, momentum = mean(m_a, m_b): exactly DiLoCo's outer step."""
    sd = lambda s: {"w": rand((3, 4), s), "b": rand((4,), s + 100)}  # noqa: E731
    pre_a, pre_b, mut_a, mut_b, m_a, m_b = (sd(seed + 7 * k) for k in range(6))
    child, mom = outer_sgd_crossover(pre_a, pre_b, mut_a, mut_b, m_a, m_b, lr, mu, nesterov)
    base = {k: (pre_a[k] + pre_b[k]) / 2 for k in pre_a}
    deltas = [{k: base[k] - mut[k] for k in base} for mut in (mut_a, mut_b)]
    ref, ref_mom = diloco_round(base, deltas, None, {k: (m_a[k] + m_b[k]) / 2 for k in base}, lr, mu, nesterov)
    for k in base:
        assert torch.allclose(child[k], ref[k], atol=1e-5) and torch.allclose(mom[k], ref_mom[k], atol=1e-5)


# -- streaming files -------------------------------------------------------------------------------------------------
def _write(tmp_path, name, sd):
    p = tmp_path / f"{name}.safetensors"
    save_streaming(p, sd)
    return p


@pytest.mark.parametrize("method", ["outer_sgd", "linear", "slerp"])
def test_merge_files_matches_the_state_dict_functions(tmp_path, method):
    sds = {k: {n: rand(t.shape, 10 * i + j) for j, (n, t) in enumerate(toy_model(3, 0.0).items())}
           for i, k in enumerate(["pre_a", "pre_b", "mut_a", "mut_b", "mom_a"])}
    f = {k: _write(tmp_path, k, v) for k, v in sds.items()}
    a = ParentFiles(f["pre_a"], f["mut_a"], f["mom_a"])
    b = ParentFiles(f["pre_b"], f["mut_b"], tmp_path / "absent.safetensors")  # no momentum yet: zeros
    curves = {"self_attn": [0.0, 1.0], "default": 0.3}
    spec = MergeSpec(method, curves, lr=0.8, momentum=0.5, nesterov=True)
    io = merge_files(spec, a, b, tmp_path / "child.safetensors", tmp_path / "mom.safetensors")
    child = load_tensors(tmp_path / "child.safetensors")
    if method == "outer_sgd":
        zeros = {k: torch.zeros_like(v) for k, v in sds["mom_a"].items()}
        ref, ref_mom = outer_sgd_crossover(sds["pre_a"], sds["pre_b"], sds["mut_a"], sds["mut_b"], sds["mom_a"],
                                           zeros, 0.8, 0.5, True)
        mom = load_tensors(tmp_path / "mom.safetensors")
        assert all(torch.allclose(mom[k], ref_mom[k], atol=1e-6) for k in ref)
    else:
        ref = interpolate(method, sds["mut_a"], sds["mut_b"], curves)
        assert not (tmp_path / "mom.safetensors").exists()
    assert set(child) == set(ref) and all(torch.allclose(child[k], ref[k], atol=1e-6) for k in ref)
    assert io["finite"] and io["bytes_read"] > 0 and io["bytes_written"] > 0


def test_an_elite_merged_with_itself_by_linear_or_slerp_is_its_mutated_model(tmp_path):
    sd = {n: rand(t.shape, j) for j, (n, t) in enumerate(toy_model(2, 0.0).items())}
    p = ParentFiles(_write(tmp_path, "pre", sd), _write(tmp_path, "mut", sd))
    for method in ("linear", "slerp"):
        merge_files(MergeSpec(method, {"default": 0.37}), p, p, tmp_path / "c.safetensors")
        c = load_tensors(tmp_path / "c.safetensors")
        assert all(torch.allclose(c[k], sd[k], atol=1e-6) for k in sd)
