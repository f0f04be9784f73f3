"""The DiLoCo outer step against torch.optim.SGD, and its two exact special cases."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from train.outer import average_deltas, diloco_round, outer_step

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3)


def _rand(shape, g):
    return torch.randn(*shape, generator=g)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, n_workers=st.integers(1, 4), rounds=st.integers(1, 4), lr=st.floats(0.05, 1.5),
       mu=st.floats(0.0, 0.95), nesterov=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_outer_step_equals_torch_sgd_over_rounds(shape, n_workers, rounds, lr, mu, nesterov, seed):
    g = torch.Generator().manual_seed(seed)
    theta0 = _rand(shape, g)
    ref = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([ref], lr=lr, momentum=mu, nesterov=nesterov and mu > 0)
    params, momentum = {"w": theta0.clone()}, None
    for _ in range(rounds):
        deltas = [{"w": _rand(shape, g)} for _ in range(n_workers)]
        tokens = [float(torch.randint(1, 100, (1,), generator=g)) for _ in range(n_workers)]
        avg = sum(d["w"] * t for d, t in zip(deltas, tokens)) / sum(tokens)
        ref.grad = avg.clone()
        opt.step()
        params, momentum = diloco_round(params, deltas, tokens, momentum, lr, mu, nesterov and mu > 0)
        torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-5, atol=1e-6)
    if mu > 0:  # torch keeps no buffer without momentum
        torch.testing.assert_close(momentum["w"], opt.state[ref]["momentum_buffer"], rtol=1e-5, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, n_workers=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_lr_one_momentum_zero_is_parameter_averaging(shape, n_workers, seed):
    g = torch.Generator().manual_seed(seed)
    theta = _rand(shape, g)
    workers = [_rand(shape, g) for _ in range(n_workers)]  # the workers' locally trained models
    deltas = [{"w": theta - w} for w in workers]
    new, _ = diloco_round({"w": theta}, deltas, None, None, lr=1.0, mu=0.0)
    torch.testing.assert_close(new["w"], torch.stack(workers).mean(0), rtol=1e-5, atol=1e-6)


def test_one_worker_with_lr_one_is_that_workers_model():
    g = torch.Generator().manual_seed(0)
    theta, local = _rand((3, 4), g), _rand((3, 4), g)
    new, mom = diloco_round({"w": theta}, [{"w": theta - local}], [123.0], None, lr=1.0, mu=0.0)
    torch.testing.assert_close(new["w"], local)


def test_first_step_nesterov_by_hand():
    # m1 = g; θ1 = θ0 − lr (g + μ g)
    theta, grad = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    new, mom = outer_step({"w": theta}, {"w": grad}, None, lr=0.7, mu=0.9, nesterov=True)
    torch.testing.assert_close(new["w"], theta - 0.7 * 1.9 * grad)
    torch.testing.assert_close(mom["w"], grad)


def test_token_weights_and_inputs_untouched():
    a, b = torch.ones(3), torch.zeros(3)
    a0 = a.clone()
    torch.testing.assert_close(average_deltas([a, b], [3, 1]), torch.full((3,), 0.75))
    assert torch.equal(a, a0)


def test_bf16_params_keep_their_dtype_and_math_is_fp32():
    theta = torch.randn(8, dtype=torch.bfloat16)
    grad = torch.randn(8)
    new, mom = outer_step({"w": theta}, {"w": grad}, None, lr=0.5, mu=0.0, nesterov=False)
    assert new["w"].dtype == torch.bfloat16 and mom["w"].dtype == torch.float32
    torch.testing.assert_close(new["w"], (theta.float() - 0.5 * grad).bfloat16())


def test_mismatched_names_raise():
    import pytest
    with pytest.raises(ValueError, match="names differ"):
        outer_step({"a": torch.ones(1)}, {"b": torch.ones(1)}, None, 1.0, 0.0)
