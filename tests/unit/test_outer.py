"""The DiLoCo outer step (train/exchange/outer.py) against torch.optim.SGD and against its definitions."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from train.exchange.outer import average_deltas, diloco_round, outer_step, outer_step_tensor

SETTINGS = settings(max_examples=25, deadline=None)

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


def _rand_state(gen: torch.Generator, shapes_: list[tuple[int, ...]], scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.randn(s, generator=gen) * scale for i, s in enumerate(shapes_)}


def _sgd_reference(theta0: dict, rounds_grads: list[dict], lr: float, mu: float, nesterov: bool):
    """torch.optim.SGD applied to the given gradients, round after round: [(params, momentum_buffers)]."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in theta0.items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=mu, nesterov=nesterov)
    out = []
    for grads in rounds_grads:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
        out.append(({k: p.detach().clone() for k, p in params.items()},
                    {k: opt.state[p]["momentum_buffer"].clone() for k, p in params.items()}))
    return out


@SETTINGS
@given(shape_list=st.lists(shapes, min_size=1, max_size=3),
       n_workers=st.integers(1, 4),
       n_rounds=st.integers(1, 4),
       lr=st.floats(0.05, 1.5),
       mu=st.floats(0.05, 0.99),
       nesterov=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_outer_step_equals_torch_sgd_over_rounds(shape_list, n_workers, n_rounds, lr, mu, nesterov, seed):
    gen = torch.Generator().manual_seed(seed)
    theta0 = _rand_state(gen, shape_list)
    # the workers' pseudo-gradients for every round, fixed up front (independent of θ so both sides see them)
    rounds = [[_rand_state(gen, shape_list, 0.1) for _ in range(n_workers)] for _ in range(n_rounds)]
    avg = [{k: torch.stack([d[k] for d in ds]).mean(0) for k in theta0} for ds in rounds]
    ref = _sgd_reference(theta0, avg, lr, mu, nesterov)

    params, momentum = {k: v.clone() for k, v in theta0.items()}, None
    for r, ds in enumerate(rounds):
        params, momentum = diloco_round(params, ds, None, momentum, lr, mu, nesterov)
        ref_p, ref_m = ref[r]
        for k in theta0:
            assert_close(params[k], ref_p[k], rtol=1e-5, atol=1e-6)
            assert_close(momentum[k], ref_m[k], rtol=1e-5, atol=1e-6)
    # it really moved (guards against a no-op implementation agreeing with a no-op reference)
    assert any(not torch.equal(params[k], theta0[k]) for k in theta0)


def test_first_step_matches_the_written_formula():
    theta = {"w": torch.tensor([1.0, -2.0, 3.0])}
    g = {"w": torch.tensor([0.5, 0.25, -1.0])}
    lr, mu = 0.7, 0.9
    p1, m1 = outer_step(theta, g, None, lr, mu, nesterov=True)
    assert_close(m1["w"], g["w"])  # m_1 = g
    assert_close(p1["w"], theta["w"] - lr * (g["w"] + mu * g["w"]))
    p2, m2 = outer_step(p1, g, m1, lr, mu, nesterov=True)
    assert_close(m2["w"], mu * g["w"] + g["w"])
    assert_close(p2["w"], p1["w"] - lr * (g["w"] + mu * m2["w"]))
    q1, _ = outer_step(theta, g, None, lr, mu, nesterov=False)
    q2, _ = outer_step(q1, g, m1, lr, mu, nesterov=False)
    assert_close(q1["w"], theta["w"] - lr * g["w"])
    assert_close(q2["w"], q1["w"] - lr * (mu * g["w"] + g["w"]))
    assert not torch.allclose(p2["w"], q2["w"])  # nesterov changes the result


@SETTINGS
@given(shape=shapes, n_workers=st.integers(1, 5), mu_prev=st.floats(0.0, 0.99), seed=st.integers(0, 2**31 - 1))
def test_lr1_momentum0_is_parameter_averaging(shape, n_workers, mu_prev, seed):
    gen = torch.Generator().manual_seed(seed)
    theta = {"a": torch.randn(shape, generator=gen), "b": torch.randn(3, generator=gen)}
    workers = [{k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in theta.items()}
               for _ in range(n_workers)]
    deltas = [{k: theta[k] - w[k] for k in theta} for w in workers]
    # a stale momentum from an earlier round must not matter when μ = 0
    old_m = {k: torch.randn(v.shape, generator=gen) * mu_prev for k, v in theta.items()}
    for momentum in (None, old_m):
        new, _ = diloco_round(theta, deltas, None, momentum, lr=1.0, mu=0.0, nesterov=True)
        for k in theta:
            assert_close(new[k], torch.stack([w[k] for w in workers]).mean(0), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), nesterov=st.booleans())
def test_one_worker_gives_that_workers_model(shape, seed, nesterov):
    gen = torch.Generator().manual_seed(seed)
    theta = {"w": torch.randn(shape, generator=gen)}
    worker = {"w": theta["w"] - 0.5 * torch.randn(shape, generator=gen)}
    delta = {"w": theta["w"] - worker["w"]}
    for weights in (None, [12345.0]):
        new, mom = diloco_round(theta, [delta], weights, None, lr=1.0, mu=0.0, nesterov=nesterov)
        assert_close(new["w"], worker["w"], rtol=1e-6, atol=1e-6)
        assert_close(new["w"], theta["w"] - delta["w"])
        assert_close(mom["w"], delta["w"])


@SETTINGS
@given(shape=shapes, weights=st.lists(st.floats(1.0, 1e6), min_size=2, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_token_weighted_average_matches_definition(shape, weights, seed):
    gen = torch.Generator().manual_seed(seed)
    deltas = [torch.randn(shape, generator=gen) for _ in weights]
    got = average_deltas(deltas, weights)
    want = sum(w * d.double() for w, d in zip(weights, deltas)) / sum(weights)
    assert got.dtype == torch.float32
    assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    # integer token counts work the same, and equal weights give the plain mean
    assert_close(average_deltas(deltas, [7] * len(deltas)), torch.stack(deltas).mean(0), rtol=1e-5, atol=1e-6)
    assert_close(average_deltas(deltas), torch.stack(deltas).mean(0), rtol=1e-5, atol=1e-6)


def test_token_weighting_changes_the_round_result():
    theta = {"w": torch.zeros(2)}
    deltas = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}]
    new, _ = diloco_round(theta, deltas, [3000, 1000], None, lr=1.0, mu=0.0)
    assert_close(new["w"], torch.tensor([-0.75, -0.25]))
    new_eq, _ = diloco_round(theta, deltas, None, None, lr=1.0, mu=0.0)
    assert_close(new_eq["w"], torch.tensor([-0.5, -0.5]))


def test_low_precision_deltas_are_accumulated_in_float32():
    # 300 bf16 deltas of 1 + 2^-7 (exact in bf16): a bf16 accumulator is off by ~1e-2, float32 by ~1e-6
    d = torch.full((3,), 1 + 2 ** -7, dtype=torch.bfloat16)
    got = average_deltas([d] * 300)
    assert got.dtype == torch.float32
    assert_close(got, torch.full((3,), 1 + 2 ** -7), rtol=1e-4, atol=0.0)


def test_outer_step_keeps_dtype_and_does_not_modify_inputs():
    theta = {"w": torch.randn(4, 3, dtype=torch.bfloat16)}
    g = {"w": torch.randn(4, 3)}
    m = {"w": torch.randn(4, 3)}
    copies = [{k: v.clone() for k, v in x.items()} for x in (theta, g, m)]
    new, new_m = outer_step(theta, g, m, 0.7, 0.9)
    assert new["w"].dtype == torch.bfloat16 and new_m["w"].dtype == torch.float32
    for orig, copy in zip((theta, g, m), copies):
        assert torch.equal(orig["w"], copy["w"])
    want = (theta["w"].float() - 0.7 * (g["w"] + 0.9 * (0.9 * m["w"] + g["w"]))).to(torch.bfloat16)
    assert torch.equal(new["w"], want)


def test_bad_inputs_are_rejected():
    import pytest

    with pytest.raises(ValueError, match="names differ"):
        outer_step({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, None, 0.7, 0.9)
    with pytest.raises(ValueError, match="no deltas"):
        average_deltas([])
    with pytest.raises(ValueError, match="sum to > 0"):
        average_deltas([torch.zeros(2), torch.ones(2)], [0, 0])
    p, m = outer_step_tensor(torch.ones(2), torch.ones(2), None, 0.5, 0.0, nesterov=False)
    assert_close(p, torch.full((2,), 0.5))



# -- the eager overlap's start (docs/overlap.md) ---------------------------------------------------------------------
@SETTINGS
@given(n_workers=st.integers(1, 5), n_rounds=st.integers(1, 5), lr=st.floats(0.1, 1.5), seed=st.integers(0, 2 ** 16))
def test_eager_start_is_kale_et_al_eager_update_without_momentum(n_workers, n_rounds, lr, seed):
    """Kale et al.'s eager update, simulated as they define it: every worker keeps its own outer parameters and
    steps them with its fresh Δ / M plus the others' one-round-late deltas (the delayed mean minus its own stale
    share). Where each worker then starts its next segment equals our eager start θ_k + γ p_k, with θ_k the
    coordinator's committed model (round k − 1 combined) and γ = eager_gain — for every worker and round."""
    from types import SimpleNamespace

    from train.exchange.outer import eager_gain

    gen = torch.Generator().manual_seed(seed)
    shp = [(3, 4), (5,)]
    theta = _rand_state(gen, shp)
    deltas = [[_rand_state(gen, shp, 0.1) for _ in range(n_workers)] for _ in range(n_rounds)]
    zero = {k: torch.zeros_like(v) for k, v in theta.items()}
    oc = SimpleNamespace(lr=lr, momentum=0.0, nesterov=True, lr_schedule="constant")
    kale = [dict(theta) for _ in range(n_workers)]          # each worker's outer parameters
    committed = [dict(theta)]                                # θ_0, θ_1, ... as the coordinator commits them
    for t in range(n_rounds):
        mean_prev = _mean_delta(deltas[t - 1]) if t else zero
        for m in range(n_workers):
            own_prev = deltas[t - 1][m] if t else zero
            eager = {k: deltas[t][m][k] / n_workers + mean_prev[k] - own_prev[k] / n_workers for k in theta}
            kale[m], _ = outer_step(kale[m], eager, None, lr, 0.0)
            # ours: segment t + 1 starts from θ_t (round t − 1 committed) + γ p_t, p_t = −Δ_t
            gain = eager_gain(t, oc, n_workers)
            ours = {k: committed[t][k] + gain * -deltas[t][m][k] for k in theta}
            for k in theta:
                assert_close(ours[k], kale[m][k], atol=1e-5, rtol=1e-5)
        committed.append(diloco_round(committed[t], deltas[t], None, None, lr, 0.0)[0])


def _mean_delta(ds: list[dict]) -> dict:
    return {k: average_deltas([d[k] for d in ds]) for k in ds[0]}


def test_eager_gain_is_the_weight_of_one_worker_in_the_outer_step():
    """γ: how far one worker's pseudo-gradient moves θ in one outer step, measured with outer_step itself."""
    from types import SimpleNamespace

    from train.exchange.outer import eager_gain

    gen = torch.Generator().manual_seed(1)
    theta, m, g = (_rand_state(gen, [(6,)]) for _ in range(3))
    for nesterov in (True, False):
        oc = SimpleNamespace(lr=0.7, momentum=0.9, nesterov=nesterov, lr_schedule="constant")
        base, _ = outer_step(theta, {"p0": torch.zeros(6)}, m, 0.7, 0.9, nesterov)
        moved, _ = outer_step(theta, {"p0": g["p0"] / 4}, m, 0.7, 0.9, nesterov)  # one of 4 workers' share
        assert_close(base["p0"] - moved["p0"], eager_gain(5, oc, 4) * g["p0"])
    # one averaging worker: the delayed rule (the whole progress)
    assert eager_gain(0, SimpleNamespace(lr=1.0, momentum=0.0, nesterov=True, lr_schedule="constant"), 1) == 1.0


def test_the_start_up_line_names_the_outer_step_as_it_acts():
    """lr 1, momentum 0 is parameter averaging (Nesterov changes nothing without momentum): the start-up line says
    so rather than "momentum 0.0 nesterov" (issue #36)."""
    from train.diloco.coordinator import outer_step_words

    assert outer_step_words(1.0, 0.0, True) == \
        "parameter averaging (DiLoCo's Nesterov outer step at lr 1, momentum 0)"
    assert outer_step_words(0.7, 0.9, True) == "SGD with Nesterov momentum 0.9, lr 0.7"
    assert outer_step_words(0.7, 0.9, False) == "SGD with momentum 0.9, lr 0.7"
    assert "nesterov" not in outer_step_words(0.5, 0.0, True).lower()
