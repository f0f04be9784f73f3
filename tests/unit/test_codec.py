"""The exchange codecs (train/exchange/codec.py): error bounds, packing, error feedback, and what a reader refuses."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.exchange.codec import SCALE, Codec, CodecError, Residual, get_codec, pack_int4, unpack_int4

floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(floats, min_size=1, max_size=300), name=st.sampled_from(["int8", "int4"]),
       block=st.sampled_from([8, 16, 64]))
def test_quantiser_error_is_at_most_half_a_step_of_its_block(values, name, block):
    x = torch.tensor(values, dtype=torch.float32)
    c = get_codec(name, block)
    stored = c.encode("t", x)
    y = c.decode("t", stored, tuple(x.shape))
    n = x.numel()
    pad = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    step = pad.abs().amax(dim=1) / c.qmax  # one code step per block
    bound = (step / 2).repeat_interleave(block)[:n]
    assert torch.all((x - y).abs() <= bound * (1 + 1e-5) + 1e-30)


@settings(max_examples=100, deadline=None)
@given(codes=st.lists(st.integers(-7, 7), min_size=1, max_size=99))
def test_int4_packing_round_trips(codes):
    c = torch.tensor(codes, dtype=torch.int8)
    packed = pack_int4(c)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(codes) + 1) // 2
    assert torch.equal(unpack_int4(packed, len(codes)), c)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(["int8", "int4", "bfloat16"]),
       rounds=st.integers(1, 25))
def test_error_feedback_keeps_the_sum_sent_within_one_error_of_the_sum_meant(seed, name, rounds):
    """Σ sent = Σ true − the residual left over, exactly what error feedback promises: the gap never accumulates."""
    g = torch.Generator().manual_seed(seed)
    c = get_codec(name, 16)
    ef = Residual(c)
    total_true = torch.zeros(100)
    total_sent = torch.zeros(100, dtype=torch.float64)
    for _ in range(rounds):
        x = torch.randn(100, generator=g) * torch.rand(1, generator=g).item()
        total_true += x
        _, seen = ef.send("t", x)
        total_sent += seen.double()
    gap = (total_true.double() - total_sent).abs()
    # the gap is the last residual: bounded by one quantisation error, not growing with the rounds
    assert torch.allclose(gap, ef.error["t"].double().abs(), atol=1e-4)
    step = (total_true.abs().max() + 10) / (c.qmax if c.quantised else 100)
    assert gap.max() <= step


def test_without_error_feedback_the_bias_accumulates():
    """The control of the test above: a constant small delta below half a step is lost every round without EF."""
    c = get_codec("int8", 4)
    x = torch.tensor([1.0, 0.003, 0.003, 0.003])  # 0.003 < 1/127/2: rounds to 0
    plain = sum(c.decode("t", c.encode("t", x), (4,)) for _ in range(100))
    ef = Residual(c)
    fed = sum(ef.send("t", x)[1] for _ in range(100))
    assert plain[1] == 0.0
    assert abs(float(fed[1]) - 0.3) < 0.01


def test_decode_is_deterministic_and_exact_for_representable_values():
    c = get_codec("int8", 4)
    x = torch.tensor([127.0, -3.0, 0.0, 64.0, 1.0, 2.0, 3.0, 4.0])
    s = c.encode("t", x)
    assert torch.equal(c.decode("t", s, (8,))[:4], x[:4])  # scale 1: exact
    a = c.decode("t", s, (8,))
    b = c.decode("t", {k: v.clone() for k, v in s.items()}, (8,))
    assert torch.equal(a, b)


def test_zero_and_tiny_blocks_decode_to_zero_without_nan():
    c = get_codec("int4", 8)
    x = torch.zeros(20)
    s = c.encode("t", x)
    assert torch.equal(c.decode("t", s, (20,)), x)
    assert torch.all(s["t" + SCALE] == 0)


@pytest.mark.parametrize("name,per_value", [("int8", 1 + 4 / 64), ("int4", 0.5 + 4 / 64), ("bfloat16", 2),
                                            ("none", 4)])
def test_stored_size_matches_the_advertised_bytes_per_value(name, per_value):
    c = get_codec(name, 64)
    specs = c.specs("w", (256, 64))
    nbytes = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in specs.values())
    assert nbytes == pytest.approx(256 * 64 * per_value)
    assert c.bytes_per_value() == pytest.approx(per_value)


# -- what a reader refuses --------------------------------------------------------------------------------------------
def _header(stored: dict) -> dict:
    from train.core.tensorio import _DTYPES
    return {k: {"dtype": _DTYPES[v.dtype], "shape": list(v.shape)} for k, v in stored.items()}


def test_header_checks_name_the_problem():
    c = get_codec("int8", 64)
    x = torch.randn(10, 30)
    stored = c.encode("w", x)
    shapes = {"w": (10, 30)}
    c.check_header(_header(stored), shapes, c.metadata())  # fine
    with pytest.raises(CodecError, match="block size 32"):
        c.check_header(_header(stored), shapes, {"codec": "int8", "block": "32"})
    with pytest.raises(CodecError, match="declares codec 'int4'"):
        c.check_header(_header(stored), shapes, {"codec": "int4", "block": "64"})
    with pytest.raises(CodecError, match="does not declare its codec"):
        c.check_header(_header(stored), shapes, {})
    truncated = dict(stored, w=stored["w"][:-5])
    with pytest.raises(CodecError, match=r"w: shape \[295\]"):
        c.check_header(_header(truncated), shapes, c.metadata())
    no_scale = {"w": stored["w"]}
    with pytest.raises(CodecError, match="tensor names differ"):
        c.check_header(_header(no_scale), shapes, c.metadata())


def test_value_checks_refuse_nan_scales_and_out_of_range_codes():
    c = get_codec("int8", 64)
    s = c.encode("w", torch.randn(100))
    bad = dict(s)
    bad["w" + SCALE] = s["w" + SCALE].clone()
    bad["w" + SCALE][0] = float("nan")
    with pytest.raises(CodecError, match="scales are not finite"):
        c.check_values("w", bad)
    bad = dict(s, w=s["w"].clone())
    bad["w"][0] = -128
    with pytest.raises(CodecError, match="-128"):
        c.check_values("w", bad)
    f = get_codec("bfloat16")
    with pytest.raises(CodecError, match="non-finite"):
        f.check_values("w", {"w": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)})


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        get_codec("int3")
    assert Codec("int8").quantised and get_codec("float32").lossless


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.one_of(floats, st.sampled_from([0.0, -0.0, 1e-38, -1e-38])), min_size=1, max_size=300),
       name=st.sampled_from(["int8", "int4", "bfloat16"]), block=st.sampled_from([8, 16, 64]),
       zero_block=st.booleans())
def test_round_trip_gives_encode_then_decode_bit_for_bit(values, name, block, zero_block):
    """Codec.round_trip (the coordinator's segment-wise step) against encode + decode: the same stored tensors and
    decoded values, bit for bit — short last blocks, blocks of zeros and of −0.0 (whose scale must be +0.0), tiny
    values, a reused buffer holding another piece's values."""
    x = torch.tensor(values, dtype=torch.float32)
    if zero_block and x.numel() >= block:
        x[:block] = -0.0
    c = get_codec(name, block)
    want = c.encode("t", x)
    want_seen = c.decode("t", want, tuple(x.shape))
    buf = torch.full((x.numel() + block,), 7.5)
    got, seen = c.round_trip("t", x.clone(), buf)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    assert torch.equal(seen.view(torch.int32), want_seen.view(torch.int32))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(floats, min_size=1, max_size=300), name=st.sampled_from(["int8", "int4", "bfloat16"]),
       block=st.sampled_from([8, 16, 64]), data=st.data())
def test_decode_range_is_decode_sliced_bit_for_bit(values, name, block, data):
    """Codec.decode_range (pieces of a tensor decoded where they are added: the accumulator, θ + decode(u)) gives
    decode()'s values of the range, bit for bit, for ranges starting on any block boundary and ending anywhere
    after it, with and without a reused buffer."""
    x = torch.tensor(values, dtype=torch.float32)
    n = x.numel()
    c = get_codec(name, block)
    stored = c.encode("t", x)
    whole = c.decode("t", stored, (n,))
    i = data.draw(st.integers(0, (n - 1) // block)) * block
    j = data.draw(st.integers(i + 1, n))
    for buf in (None, torch.full((n + block,), 3.0)):
        got = c.decode_range("t", stored, n, i, j, buf)
        assert torch.equal(got.view(torch.int32), whole[i:j].view(torch.int32)), (i, j)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       bad=st.lists(st.tuples(st.integers(0, 4999), st.sampled_from([math.nan, math.inf, -math.inf])), max_size=3),
       seed=st.integers(0, 2**16))
def test_all_finite_is_isfinite_all(n, dtype, bad, seed):
    """all_finite (the least and greatest values) says what isfinite().all() says, at any position of a NaN or an
    infinity, in every float width the deltas come in, and for an empty tensor."""
    from train.exchange.codec import all_finite

    t = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e3).to(dtype)
    for i, v in bad:
        if i < n:
            t[i] = v
    assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(t.view(-1, 1) if n else t) == bool(torch.isfinite(t).all())
