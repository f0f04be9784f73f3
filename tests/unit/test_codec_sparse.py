"""The topk codec (train/exchange/sparse.py): what is selected round-trips, error feedback with β, deterministic
selection on ties, packed offsets, and what a reader refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from train.exchange.codec import CodecError, Residual
from train.exchange.sparse import IDX, SCALE, VAL, SparseCodec, pack_bits, sparse_step, unpack_bits

floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)
codecs = st.builds(SparseCodec, density=st.sampled_from([0.05, 0.1, 0.25, 0.5]), chunk=st.sampled_from([8, 20, 64]),
                   values=st.sampled_from(["2bit", "int4", "int8"]))


def _chunks(c: SparseCodec, n: int):
    return [(a, min(a + c.chunk, n)) for a in range(0, n, c.chunk)]


@settings(max_examples=40, deadline=None)
@given(values=st.lists(floats, min_size=1, max_size=200), c=codecs)
def test_round_trip_of_what_was_selected(values, c):
    x = torch.tensor(values, dtype=torch.float32)
    stored = c.encode("t", x)
    for k, (dtype, shape) in c.specs("t", tuple(x.shape)).items():  # the header the reader expects, exactly
        assert stored[k].dtype == dtype and tuple(stored[k].shape) == shape
    c.check_values("t", stored, tuple(x.shape))
    y = c.decode("t", stored, tuple(x.shape))
    pos, _ = c._unpack("t", stored, x.numel())
    sel = torch.zeros(x.numel(), dtype=torch.bool)
    sel[torch.from_numpy(pos)] = True
    assert not bool(y[~sel].any())  # nothing outside the selection
    for a, b in _chunks(c, x.numel()):
        k = c.k_of(b - a)
        assert int(sel[a:b].sum()) == k
        # the k largest magnitudes of the chunk: nothing left out is larger than what was kept
        kept, left = x[a:b][sel[a:b]].abs(), x[a:b][~sel[a:b]].abs()
        if left.numel():
            assert float(left.max()) <= float(kept.min())
        # each kept value within half a code step of its chunk's scale (2bit: levels ±s, ±3s cover [s, 3s] by s)
        s = float(stored["t" + SCALE][a // c.chunk])
        err = (x[a:b] - y[a:b])[sel[a:b]].abs()
        bound = s if c.vbits == 2 else s / 2
        assert bool((err <= bound * (1 + 1e-5) + 1e-30).all())


@settings(max_examples=12, deadline=None)
@given(seq=st.lists(st.lists(floats, min_size=30, max_size=30), min_size=2, max_size=8),
       values=st.sampled_from(["2bit", "int8"]))
def test_error_feedback_sum_sent_tracks_sum_meant(seq, values):
    """β = 1: Σ sent + residual == Σ meant (up to float rounding); nothing is lost, only delayed."""
    c = SparseCodec(density=0.1, chunk=10, values=values, ef_decay=1.0)
    res = Residual(c)
    meant = torch.zeros(30, dtype=torch.float64)
    sent = torch.zeros(30, dtype=torch.float64)
    for v in seq:
        x = torch.tensor(v, dtype=torch.float32)
        meant += x.double()
        sent += res.send("t", x)[1].double()
    tol = 1e-4 * (1 + float(meant.abs().max()) * len(seq))
    torch.testing.assert_close(sent + res.error["t"].double(), meant, rtol=0, atol=tol)


def test_error_feedback_decays_with_beta():
    """e <- β e + Δ before the selection (SparseLoCo): with nothing new, the carried error shrinks by β a round."""
    c = SparseCodec(density=0.25, chunk=4, values="int8", ef_decay=0.5)
    res = Residual(c)
    x = torch.tensor([8.0, 1.0, 1.0, 1.0])
    _, seen = res.send("t", x)
    assert seen[0] == 8.0 and not bool(seen[1:].any())
    assert torch.equal(res.error["t"], torch.tensor([0.0, 1.0, 1.0, 1.0]))
    _, seen = res.send("t", torch.zeros(4))
    assert torch.equal(seen, torch.tensor([0.0, 0.5, 0.0, 0.0]))  # 0.5 · e; the tie goes to the lower offset
    assert torch.equal(res.error["t"], torch.tensor([0.0, 0.0, 0.5, 0.5]))


@settings(max_examples=25, deadline=None)
@given(base=st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.0]), min_size=16, max_size=64))
def test_selection_on_ties_is_deterministic_and_prefers_the_lower_offset(base):
    c = SparseCodec(density=0.25, chunk=16, values="int8")
    x = torch.tensor(base, dtype=torch.float32)
    a, b = c.encode("t", x), c.encode("t", x.clone())
    assert all(torch.equal(a[k], b[k]) for k in a)
    pos, _ = c._unpack("t", a, x.numel())
    for lo, hi in _chunks(c, x.numel()):
        mine = [p - lo for p in pos if lo <= p < hi]
        k = c.k_of(hi - lo)
        want = sorted(sorted(range(hi - lo), key=lambda i: (-abs(base[lo + i]), i))[:k])
        assert mine == want


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), data=st.data())
def test_selection_without_the_sort_is_the_stable_sorts_first_k(rows, cols, data):
    """SparseCodec._select (torch.topk's k-th value as a threshold, ties at it by lowest offset) against the first
    k of a stable descending sort, on rows full of ties (few distinct magnitudes, +0.0 and −0.0), every k, and a
    NaN (the sort's answer)."""
    level = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 3.0, float("nan")])
    mat = torch.tensor(data.draw(st.lists(st.lists(level, min_size=cols, max_size=cols), min_size=rows,
                                          max_size=rows)), dtype=torch.float32)
    k = data.draw(st.integers(1, cols))
    order = torch.sort(mat.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(SparseCodec._select(mat, k), torch.sort(order, dim=1).values)


@settings(max_examples=60, deadline=None)
@given(vals=st.lists(st.integers(0, 4095), min_size=1, max_size=200),
       bits=st.sampled_from([1, 2, 4, 7, 8, 12, 13]))
def test_bit_packing_round_trips_in_ceil_bits(vals, bits):
    v = np.array([x % (1 << bits) for x in vals], dtype=np.uint32)
    packed = pack_bits(v, bits)
    assert packed.dtype == np.uint8 and packed.size == -(-v.size * bits // 8)
    assert np.array_equal(unpack_bits(packed, bits, v.size), v)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(min_size=0, max_size=300), bits=st.sampled_from([1, 2, 4, 8, 12]), data=st.data())
def test_the_byte_arithmetic_widths_read_any_bytes_as_the_bit_planes_do(raw, bits, data):
    """unpack_bits' fast widths against the general bit-plane reading, on arbitrary bytes (the trailing bits of
    the last byte included) and any count that fits."""
    n = data.draw(st.integers(0, len(raw) * 8 // bits))
    b = np.frombuffer(raw, dtype=np.uint8)
    planes = np.unpackbits(b, count=n * bits, bitorder="little")
    want = (planes.reshape(n, bits).astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(axis=1,
                                                                                               dtype=np.uint32)
    assert np.array_equal(unpack_bits(b, bits, n), want)


def test_offsets_take_12_bits_at_chunk_4096_and_a_round_is_under_2_percent_of_fp32():
    c = SparseCodec()  # the paper's 64 of 4096, 2-bit values
    assert c.ibits == 12 and c.k_of(4096) == 64
    specs = c.specs("w", (576, 4096 * 4))
    K = 576 * 4 * 64
    assert specs["w" + IDX] == (torch.uint8, (K * 12 // 8,)) and specs["w" + VAL] == (torch.uint8, (K // 4,))
    assert c.bytes_per_value() / 4 < 0.0072


def _stored(c, n=300, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return c.encode("t", x)


@pytest.mark.parametrize("case", ["out_of_range", "repeated", "nan_scale"])
def test_reader_refuses_bad_indices_and_scales(case):
    c = SparseCodec(density=0.05, chunk=100, values="2bit")  # offsets in 7 bits: 100..127 are representable
    s = _stored(c)
    off = unpack_bits(s["t" + IDX].numpy(), c.ibits, c.count(300)[0])
    if case == "out_of_range":
        off[4] = 120
        msg = "out of range"
    elif case == "repeated":
        off[1] = off[0]
        msg = "repeat"
    if case == "nan_scale":
        s["t" + SCALE][1] = float("nan")
        msg = "not finite"
    else:
        s["t" + IDX] = torch.from_numpy(pack_bits(off, c.ibits))
    with pytest.raises(CodecError, match=msg):
        c.check_values("t", s, (300,))


def test_header_check_refuses_another_density_a_truncated_index_block_and_another_codec():
    c = SparseCodec(density=0.05, chunk=100)
    shapes = {"t": (300,)}

    def header(stored):
        from train.core.tensorio import _DTYPES
        return {k: {"shape": list(v.shape), "dtype": _DTYPES[v.dtype]} for k, v in stored.items()}

    s = _stored(c)
    c.check_header(header(s), shapes, c.metadata())
    other = SparseCodec(density=0.1, chunk=100)
    with pytest.raises(CodecError, match="declares density 0.1, the run uses 0.05"):
        c.check_header(header(other.encode("t", torch.randn(300))), shapes, other.metadata())
    s["t" + IDX] = s["t" + IDX][:-1]
    with pytest.raises(CodecError, match=r"t::idx: index block of shape .* \(truncated\?\)"):
        c.check_header(header(s), shapes, c.metadata())
    with pytest.raises(CodecError, match="declares codec 'int8'"):
        c.check_header(header(s), shapes, {"codec": "int8", "block": "128"})


def test_sparse_step_leaves_unsent_values_bit_identical():
    theta = torch.tensor([1.0, -0.0, 3.0, 1e-30])
    mean = torch.tensor([0.0, 0.0, 0.5, 0.0])
    out = sparse_step(theta, mean, 0.7)
    assert out[0] == 1.0 and out[3] == 1e-30 and out[2] == torch.tensor(3.0) + torch.tensor(0.5) * -0.7


@pytest.mark.parametrize("weights", [(1, 1, 1), (1000, 7, 123456), (1000, 38.5, 77)])
def test_the_sparse_mean_adds_only_what_was_sent_and_gives_the_dense_sum_bit_for_bit(tmp_path, weights):
    """SparseAccumulator.mean adds each delta's K sent values (put_, accumulating) where its weight is a whole
    number, the dense decoded tensor otherwise (a fractional weight: a late delta): the same float32 mean, bit for
    bit, as the dense sum in the same fixed order, on values whose sums round (a wide spread of magnitudes,
    overlapping positions, cancellations)."""
    import math

    from train.exchange.sparse import SparseAccumulator

    c = SparseCodec(density=0.25, chunk=64, values="int8")
    shape = (37, 29)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(3)
    acc = SparseAccumulator.__new__(SparseAccumulator)
    acc.shapes, acc.codec, acc.stored, acc._sel = {"t": shape}, c, {}, {}
    dense = torch.zeros(n, dtype=torch.float64)
    for w, a in enumerate(weights):
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
        stored = c.encode("t", x.reshape(shape))
        acc.stored[(0, w)] = (float(a), stored)
        dense.add_(c.decode("t", stored, shape).reshape(-1).to(torch.float64), alpha=float(a))
    want = (dense / float(sum(weights))).to(torch.float32).reshape(shape)
    got = acc.mean("t")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("weights", [(1, 1, 1), (1000, 7, 123456), (1000, 38.5, 77)])
@pytest.mark.parametrize("range_", [100, 1 << 18])
def test_step_into_gives_the_dense_step_bit_for_bit(weights, range_, monkeypatch):
    """SparseAccumulator.step_into (θ_{r+1} range by range, the float64 sum of a range at a time) against
    sparse_step(θ, mean()) — the way every copy stepped before — on θ with ±0.0 and tiny values, deltas whose sent
    positions overlap, ranges smaller than a chunk and than the tensor (some with nothing sent: density 0.02 of
    chunks of 512) and one range for all; into a new tensor (θ untouched) and in place. A fractional weight (a
    late delta) is refused with nothing written (the caller steps the dense way)."""
    import math

    from train.exchange import sparse
    from train.exchange.sparse import SparseAccumulator

    monkeypatch.setattr(sparse, "RANGE", range_)
    c = SparseCodec(density=0.02, chunk=512, values="int8")
    shapes = {"a": (37, 29), "b": (3000,)}
    g = torch.Generator().manual_seed(5)
    acc = SparseAccumulator.__new__(SparseAccumulator)
    acc.shapes, acc.codec, acc.stored, acc._sel = shapes, c, {}, {}
    for w, a in enumerate(weights):
        stored = {}
        for name, shape in shapes.items():
            n = math.prod(shape)
            x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
            stored.update(c.encode(name, x.reshape(shape)))
        acc.stored[(0, w)] = (float(a), stored)
    fractional = any(a != int(a) for a in weights)
    for name, shape in shapes.items():
        theta = torch.randn(shape, generator=g)
        theta.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-38])
        before = theta.clone()
        want = sparse_step(theta, acc.mean(name), 0.7)
        out = torch.full(shape, 9.0)
        assert acc.step_into(name, theta, 0.7, out) is not fractional
        assert torch.equal(theta.view(torch.int32), before.view(torch.int32))  # θ itself untouched
        if fractional:
            assert (out == 9.0).all()
            continue
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), name
        assert acc.step_into(name, theta, 0.7, theta)  # in place (the coordinator's own θ)
        assert torch.equal(theta.view(torch.int32), want.view(torch.int32)), name
        assert not torch.equal(want, before)


def test_the_screen_statistics_from_the_sent_values_are_the_dense_decodes():
    """SparseAccumulator.sparse_stats against DeltaStats.chunk_stats of the dense decoded tensor: the same sample
    bit for bit (+0.0 where nothing was sent), the same squared norm up to the order of its float64 additions."""
    import math

    from train.exchange.screen import DeltaStats
    from train.exchange.sparse import SparseAccumulator

    c = SparseCodec(density=0.05, chunk=64, values="2bit")
    shapes = {"a": (370, 290), "b": (30001,)}
    stats = DeltaStats(shapes, 256)  # 4096 sampled values: every 33rd
    assert stats.stride > 1
    acc = SparseAccumulator.__new__(SparseAccumulator)
    acc.shapes, acc.codec, acc.stats = shapes, c, stats
    g = torch.Generator().manual_seed(7)
    for name, shape in shapes.items():
        n = math.prod(shape)
        stored = c.encode(name, torch.randn(n, generator=g).reshape(shape))
        norm2, sample = acc.sparse_stats(name, stored, n)
        want_norm2, want_sample = stats.chunk_stats(name, 0, c.decode(name, stored, shape))
        assert torch.equal(sample.view(torch.int64), want_sample.view(torch.int64)), name
        assert (sample != 0).any()
        assert norm2 == pytest.approx(want_norm2, rel=1e-12)



def test_take_back_undoes_the_last_send_once():
    """Residual(undo=True).take_back(): the error is what it was before the last send (the receivers took none of
    that delta), once; the resume state (tensors / load) holds the error alone, and a restarted sender has nothing to
    take back; without undo nothing is kept."""
    c = SparseCodec(density=0.25, chunk=16, values="int8")
    g = torch.Generator().manual_seed(11)
    res = Residual(c, undo=True)
    res.send("t", torch.randn(64, generator=g))
    e1 = res.error["t"].clone()
    res.send("t", 100 * torch.randn(64, generator=g))  # a bad delta: it leaves a large error
    assert res.error["t"].norm() > 10 * e1.norm()
    saved = {k: v.clone() for k, v in res.tensors().items()}
    assert set(saved) == {"residual::t"}
    again = Residual(c, undo=True)
    again.load(saved)
    assert not again.take_back() and torch.equal(again.error["t"], res.error["t"])
    assert res.take_back() and torch.equal(res.error["t"], e1)
    assert not res.take_back()  # once
    plain = Residual(c)
    plain.send("t", torch.randn(64, generator=g))
    plain.send("t", torch.randn(64, generator=g))
    assert not plain.take_back() and set(plain.tensors()) == {"residual::t"}


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_a_worker_takes_back_the_error_feedback_of_its_rejected_delta(tmp_path, overlap):
    """Worker.take_back_rejected before round 5 is encoded (synchronous rounds): back to the error before round 4's
    delta when round 5's commit record rejected it; not for another worker's rejection, nor without a record, nor
    with overlap (its residual keeps no undo)."""
    from types import SimpleNamespace

    from train.core.store import atomic_write_json
    from train.diloco.worker import Worker
    from train.exchange.store import DiLoCoPaths

    paths = DiLoCoPaths(tmp_path / "run")
    g = torch.Generator().manual_seed(12)

    def worker(w: int):
        res = Residual(SparseCodec(density=0.25, chunk=16), undo=overlap == "none")
        res.send("t", torch.randn(64, generator=g))
        before = res.error["t"].clone()
        res.send("t", 100 * torch.randn(64, generator=g))  # round 4's delta
        return SimpleNamespace(residual=res, paths=paths, w=w), before

    me, before = worker(2)
    Worker.take_back_rejected(me, 5)  # no record of round 5 yet
    assert not torch.equal(me.residual.error["t"], before)
    paths.round_dir(5).mkdir(parents=True)
    atomic_write_json(paths.committed(5), {"round": 5, "rejected": {"w002": "screen: norm 39.4 is 14.7x"}})
    other, other_before = worker(1)
    Worker.take_back_rejected(other, 5)
    assert not torch.equal(other.residual.error["t"], other_before)
    Worker.take_back_rejected(me, 5)
    assert torch.equal(me.residual.error["t"], before) is (overlap == "none")
