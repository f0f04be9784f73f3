"""Reduce on arrival, streamed (train/exchange/accumulate.py): each delta is read once, checked while it is added in
pieces, and a delta rejected after some of its tensors went into the sum leaves no trace in it."""
from __future__ import annotations

import hashlib

import pytest
import torch

from train.core.tensorio import PipelinedReader, save_streaming
from train.exchange import accumulate
from train.exchange.accumulate import Accumulator
from train.exchange.codec import get_codec
from train.exchange.protocol import RejectedDelta
from train.exchange.store import DiLoCoPaths

SHAPES = {"a": (5, 7), "b": (33,), "c": (4, 9)}


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 1e-3 for n, s in SHAPES.items()}


def _publish(paths: DiLoCoPaths, w: int, d: dict, flip_last_byte: bool = False) -> dict:
    f = paths.delta_file(0, w)
    save_streaming(f, d, {"codec": "none", "block": "128"})
    if flip_last_byte:  # a torn file of the right size: only the sha256 tells, after the last tensor was added
        raw = bytearray(f.read_bytes())
        sha = hashlib.sha256(raw).hexdigest()
        raw[-2] ^= 0x01
        f.write_bytes(bytes(raw))
    else:
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
    return {"tokens": 1000 + 7 * w, "sha256": sha, "bytes": f.stat().st_size}


@pytest.fixture(params=["pieces", "flat"])
def paths(request, tmp_path, monkeypatch):
    """Every test both ways: "pieces", each tensor read and added in CHUNK pieces (many, a short last one), as
    files over PipelinedReader.INLINE are; "flat", a small file's tensors as one flat tensor (PipelinedReader.flat:
    what the coordinator does with the deltas of small models)."""
    monkeypatch.setattr(accumulate, "CHUNK", 8)
    if request.param == "pieces":
        monkeypatch.setattr(PipelinedReader, "INLINE", 0)
    return DiLoCoPaths(tmp_path)


def _acc(paths, screen=False):
    return Accumulator(paths, 0, SHAPES, get_codec("none"), token_weighted=True, screen=screen)


def test_pieces_give_the_whole_tensor_formula_bit_for_bit(paths):
    ds = [_delta(w) for w in range(3)]
    metas = [_publish(paths, w, d) for w, d in enumerate(ds)]
    acc = _acc(paths)
    for w in (2, 0, 1):  # any order of arrival
        acc.add(w, metas[w])
    total = sum(float(m["tokens"]) for m in metas)
    for n in SHAPES:
        want = sum(float(m["tokens"]) * d[n].to(torch.float64) for m, d in zip(metas, ds))
        assert torch.equal(acc.mean(n), (want / total).to(torch.float32))
        assert torch.equal(acc.mean_piece(n, 3, 17), (want / total).to(torch.float32).reshape(-1)[3:17])
        buf = torch.full((64,), float("nan"))  # into a buffer (the outer step's), the same bits
        assert torch.equal(acc.mean_piece(n, 3, 17, out=buf), (want / total).to(torch.float32).reshape(-1)[3:17])
    assert acc.bytes_read == sum(m["bytes"] for m in metas)


def test_a_float64_quotient_stored_into_float32_is_rounded_once():
    # what mean_piece(out=) relies on: div into a float32 out computes in float64 and rounds once, as .to(float32)
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1 << 20, dtype=torch.float64, generator=g) * torch.exp2(torch.randint(-140, 130, (1 << 20,),
                                                                                           generator=g).double())
    for total in (3.0, 7.5, 1234567.0, 1e-3):
        out = torch.empty(1 << 20)
        assert torch.equal(torch.div(s, total, out=out), (s / total).to(torch.float32))


@pytest.mark.parametrize("screen", [True, False], ids=["screen", "no-screen"])
@pytest.mark.parametrize("case", ["nan_in_the_last_tensor", "inf_in_the_first_tensor", "torn"])
def test_a_delta_rejected_midway_leaves_no_trace_in_the_sum(paths, case, screen):
    """(With the screen on, a cast delta's finite check is its squared norm, taken as each piece is added.)"""
    ds = [_delta(w) for w in range(3)]
    metas = [_publish(paths, w, d) for w, d in enumerate(ds[:2])]
    bad = _delta(2)
    if case == "nan_in_the_last_tensor":
        bad["c"][3, 4] = float("nan")
    if case == "inf_in_the_first_tensor":
        bad[next(iter(SHAPES))].view(-1)[1] = float("-inf")
    metas.append(_publish(paths, 2, bad, flip_last_byte=case == "torn"))
    acc, ref = _acc(paths, screen=screen), _acc(paths)
    for w in (1, 0):
        acc.add(w, metas[w])
        ref.add(w, metas[w])
    with pytest.raises(RejectedDelta) as e:
        acc.add(2, metas[2])
    assert ("checksum of the file differs" if case == "torn" else "non-finite") in e.value.reason
    # (sorted: a delta found bad after some of its tensors were added makes the sum be rebuilt in worker order; one
    # read flat is checked whole before anything is added)
    assert sorted(acc.workers) == [0, 1] and acc.total == ref.total
    assert not screen or 2 not in acc.stats.norm2
    for n in SHAPES:
        assert torch.equal(acc.sum[n], ref.sum[n])


def test_the_screen_sees_the_same_norm_and_samples_in_pieces(paths):
    d = _delta(5)
    meta = _publish(paths, 0, d)
    acc = _acc(paths, screen=True)
    acc.add(0, meta)
    flat = torch.cat([d[n].reshape(-1) for n in SHAPES]).to(torch.float64)
    assert acc.stats.norm2[0] == pytest.approx(float(flat.dot(flat)), rel=1e-12)
    st = acc.stats
    assert torch.equal(st.sample(0), flat[::st.stride])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("first", [True, False])
def test_outer_step_in_pieces_is_outer_step_tensor_bit_for_bit(nesterov, first):
    """master.py steps θ and the momentum in place, piece by piece: the same bits as outer_step_tensor."""
    from train.exchange.outer import outer_step_piece, outer_step_tensor

    g = torch.Generator().manual_seed(3)
    p, grad, m = (torch.randn(1001, generator=g) for _ in range(3))
    want_p, want_m = outer_step_tensor(p, grad, None if first else m, 0.7, 0.9, nesterov)
    p2, m2, got_m = p.clone(), m.clone(), torch.empty(1001)
    for i in range(0, 1001, 64):
        got_m[i:i + 64] = outer_step_piece(p2[i:i + 64], grad[i:i + 64].clone(), None if first else m2[i:i + 64],
                                           0.7, 0.9, nesterov)
    assert torch.equal(p2, want_p) and torch.equal(got_m, want_m)
