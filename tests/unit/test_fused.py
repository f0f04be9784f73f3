"""The fused outer-step kernels (train/exchange/fused.py) give torch's eager ops' bits: the mean and the step
without a codec, and the whole block-coded segment (step, target, residual, encode, decode, θ) with int8 / int4 —
on drawn values, block sizes, momentum, Nesterov and decay settings; a block that is not finite is left to torch's
ops with nothing written; the self-check refuses a kernel that rounds where torch fuses; EDT_FUSED=0 turns them
off; and the coordinator's no-codec step writes the same θ_{r+1} and momentum bytes either way."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import tiny_config
from tests.helpers.master import master_at_round_0, two_deltas
from train.config import build_config
from train.exchange import fused
from train.exchange.codec import get_codec

pytest.importorskip("numba")


@pytest.fixture(scope="module")
def k():
    """The kernels. A compile error fails here; a CPU whose torch ops round otherwise (no fused multiply-add in its
    vector unit) is one where the coordinator keeps torch's ops, so the tests that need the kernels skip, saying
    why."""
    bad = fused._self_check(fused._compile())
    if bad:
        pytest.skip(f"on this CPU torch's ops differ from the kernels ({bad}): the coordinator uses torch's ops")
    kern = fused.kernels()
    assert kern is not None, "the kernels pass their self-check, but kernels() refused them"
    return kern


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return fused._same(a, b)


def _values(n: int, seed: int, mag: float, halves: bool):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=g, dtype=torch.float64) * mag
    if halves:  # quotients on exact ties, and zeros
        s[: n // 2] = torch.randint(-40, 40, (n // 2,), generator=g).double() * 0.5
    theta = torch.randn(n, generator=g) * 0.05
    m = torch.randn(n, generator=g) * 1e-3 * mag
    e = torch.randn(n, generator=g) * 1e-5 * mag
    return s, theta, m, e


@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16), mag=st.sampled_from([1e-6, 1.0, 1e3]),
       halves=st.booleans(), mu=st.floats(0.0, 0.99), lr=st.floats(0.01, 2.0),
       total=st.sampled_from([1.0, 2.0, 3.0, 12345.0, 2.0**20 + 7]), nesterov=st.booleans(), has_m=st.booleans())
def test_mean_step_equals_torch(k, n, seed, mag, halves, mu, lr, total, nesterov, has_m):
    s, theta, m, _ = _values(n, seed, mag, halves)
    p1, m1, p2, m2 = theta.clone(), m.clone(), theta.clone(), m.clone()
    fused.eager_mean_step(s, total, p1, m1, mu, lr, nesterov, has_m)
    fused.mean_step(k, s, total, p2, m2, mu, lr, nesterov, has_m)
    assert _same(p1, p2) and _same(m1, m2)


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(["int8", "int4"]), block=st.sampled_from([8, 12, 64, 128]), n=st.integers(1, 1500),
       seed=st.integers(0, 2**16), mag=st.sampled_from([1e-3, 1.0, 1e3]), halves=st.booleans(),
       decay=st.sampled_from([1.0, 0.9, 0.5]), has_m=st.booleans(), has_e=st.booleans(), nesterov=st.booleans(),
       zero_block=st.booleans())
def test_coded_step_equals_torch(k, name, block, n, seed, mag, halves, decay, has_m, has_e, nesterov, zero_block):
    from types import SimpleNamespace

    codec = get_codec(name, block)
    s, theta, m, e = _values(n, seed, mag, halves)
    if zero_block:  # a block whose target is all zeros: scale 0, codes 0
        s[:block], theta[:block], m[:block], e[:block] = 0.0, 0.0, 0.0, 0.0
    oc = SimpleNamespace(momentum=0.9, nesterov=nesterov)
    t1, m1, e1, t2, m2, e2 = theta.clone(), m.clone(), e.clone(), theta.clone(), m.clone(), e.clone()
    want = fused.eager_coded_step(codec, "w", s, 7.0, t1, m1, e1, 0.9, 0.7, nesterov, has_m, has_e, decay)
    got = fused.coded_step(k, codec, s, 7.0, t2, m2, e2, oc, 0.7, has_m, has_e, decay, torch.empty(n),
                           torch.empty(n), "w")
    assert got is not None
    assert want.keys() == got.keys() and all(_same(want[x], got[x]) for x in want)
    assert _same(t1, t2) and _same(m1, m2) and _same(e1, e2)


@pytest.mark.parametrize("case", ["inf", "nan", "inverse overflows"])
def test_a_block_torch_must_take_is_left_to_it_untouched(k, case):
    """A segment with a value that is not finite, or a block so small that its scale's inverse overflows, returns
    None with θ, m and the residual as they were (the caller then runs torch's ops on the same inputs)."""
    from types import SimpleNamespace

    codec = get_codec("int8", 8)
    s, theta, m, e = _values(64, 1, 1.0, False)
    if case == "inf":
        s[40] = float("inf")
    elif case == "nan":
        s[5] = float("nan")
    else:  # the second block's target: e alone, subnormal (scale = 1e-41 / 127: its inverse is inf)
        s[8:16], theta[8:16], m[8:16], e[8:16] = 0.0, 0.0, 0.0, 1e-41
    before = [x.clone() for x in (theta, m, e)]
    got = fused.coded_step(k, codec, s, 3.0, theta, m, e, SimpleNamespace(momentum=0.9, nesterov=True), 0.7, True,
                           True, 1.0, torch.empty(64), torch.empty(64), "w")
    assert got is None
    assert all(_same(a, b) for a, b in zip(before, (theta, m, e)))


def test_the_self_check_refuses_a_kernel_that_rounds_twice(k):
    """torch's add with alpha is one fused multiply-add: a kernel that rounds the product first differs, and the
    self-check says so (the coordinator then keeps torch's ops)."""
    def two_roundings(s, total, p, m, mu, lr, nesterov, has_m):
        f32 = np.float32
        g = (s / total).astype(f32)
        b = (m * f32(mu) + g).astype(f32) if has_m else g
        m[:] = b
        st_ = (g + f32(mu) * b).astype(f32) if nesterov else b
        p[:] = (p - f32(lr) * st_).astype(f32)

    assert fused._self_check(k) is None
    assert "mean_step" in fused._self_check({**k, "mean_step": two_roundings})


def test_edt_fused_0_turns_the_kernels_off(monkeypatch, k):
    monkeypatch.setenv("EDT_FUSED", "0")
    assert fused.kernels() is None
    monkeypatch.delenv("EDT_FUSED")
    assert fused.kernels() is k


def _no_codec_rounds(root, monkeypatch, on: bool) -> list:
    """Three rounds of the coordinator's no-codec step (OuterMaster._step_full) on the micro model."""
    from train.exchange.protocol import commit

    if not on:
        monkeypatch.setenv("EDT_FUSED", "0")
    cfg = build_config(tiny_config(root, outer={"num_workers": 2, "rounds": 3, "momentum": 0.8, "lr": 0.6}))
    m, paths, names = master_at_round_0(cfg, 3)
    out = []
    for r in range(3):
        acc = two_deltas(m, paths, r, names)
        fields = m.step(r, acc)
        commit(paths, r + 1, {"workers": [0, 1], "checkpoint": True, "codec": "none"})
        out.append(((paths.global_dir(r + 1) / "model.safetensors").read_bytes(),
                    paths.outer_state(r + 1).read_bytes(), fields["bytes_written"]))
    monkeypatch.delenv("EDT_FUSED", raising=False)
    return out


def test_the_no_codec_step_writes_the_same_bytes_fused_or_not(tmp_path, monkeypatch, k):
    assert _no_codec_rounds(tmp_path / "on", monkeypatch, True) == _no_codec_rounds(tmp_path / "off", monkeypatch,
                                                                                    False)
