"""The coordinator's outer step in one pass per piece: numba kernels that give torch's eager ops' bits.

The eager step is 5 torch passes over the model without a codec (the mean's quotient, m·μ, + g, g + μ·m, θ − η·step)
and ~15 with int8 / int4 (the step, the target θ* − θ, + the residual, |x|, the blocks' maxima, the scaling,
rounding, clamping, the int8 cast and back, the decoded values, the new residual, θ + decode). On a CPU each pass is
a trip through memory and a kernel launch, and the tail after the last arrival was their sum (docs/benchmarks.md,
"Outer step"). The kernels here do the same IEEE operations value by value, in one loop without a codec and in
three passes over a cache-sized segment with a block code (fused_kernels.py):

    g      = float32(S / total)                  the float64 quotient rounded once (torch.div(..., out=float32))
    m'     = fl(m · μ) + g                       m.mul_(μ).add_(g); μ, η rounded to float32 as torch's scalars are
    step   = fma(μ, m', g)  (Nesterov; else m')  g.add_(m', alpha=μ): torch's add with alpha is one fused
    θ*     = fma(−η, step, θ)                    multiply-add (vec::fmadd), θ.sub_(step, alpha=η) too

and for a block code (int8, int4), per block of B values: v = fl(θ* − θ) (+ e, or + fl(e · decay)), its absmax,
scale = fl(absmax / q), inv = fl(1 / scale) (0 for a block of zeros), codes = clamp(rint(fl(v · inv)), −q, q),
seen = fl(codes · scale), e' = fl(v − seen), θ' = fl(θ + seen) — Codec.round_trip's operations.

Bit-identity is checked, not assumed: the first use in a process runs every kernel beside the eager code on values
made to find a difference (ties at .5 after scaling, zeros, blocks of zeros, a partial last block, tiny and huge
magnitudes) and keeps torch's ops if any byte differs (one warning). A block whose values are not finite or whose
scale's inverse overflows is left to the eager code (its NaN and int8-cast behaviour is torch's own): the kernel
writes nothing of such a segment and says so. EDT_FUSED=0 turns the kernels off (the bench's A/B,
tests/unit/test_fused.py); without numba (import error) the eager ops are used.
"""
from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("coordinator")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool once decided; "k": the compiled kernels


def _compile() -> dict:
    """The kernels (train/exchange/fused_kernels.py: numba, compiled on first call and cached on disk)."""
    from train.exchange import fused_kernels

    return {"mean_step": fused_kernels.mean_step, "coded_step": fused_kernels.coded_step}


def _np(t: torch.Tensor):
    return t.detach().numpy()


def mean_step(k: dict, s: torch.Tensor, total: float, p: torch.Tensor, m: torch.Tensor, mu: float, lr: float,
              nesterov: bool, has_m: bool) -> None:
    """In place on flat float32 pieces p (θ → θ_{r+1}) and m (m_r → m_{r+1}; has_m False: m is written with the
    mean, as the first step starts it) from the float64 sum piece s: Accumulator.mean_piece + outer_step_piece."""
    k["mean_step"](_np(s), float(total), _np(p), _np(m), float(mu), float(lr), bool(nesterov), bool(has_m))


def coded_step(k: dict, codec, s: torch.Tensor, total: float, theta: torch.Tensor, m: torch.Tensor,
               e: torch.Tensor, oc, lr: float, has_m: bool, has_e: bool, decay: float, vbuf: torch.Tensor,
               mbuf: torch.Tensor, name: str) -> dict | None:
    """OuterMaster._step_coded's segment for a block codec (int8, int4) in one kernel: θ_{r+1}, m_{r+1} and the
    residual in place, the stored tensors returned (codes, scales); None, with nothing written, where the segment
    needs the eager code (see the module doc)."""
    from train.exchange.codec import SCALE, pack_int4

    n = s.numel()
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(-(-n // codec.block), dtype=torch.float32)
    ok = k["coded_step"](_np(s), float(total), _np(theta), _np(m), _np(e), float(oc.momentum), float(lr),
                         bool(oc.nesterov), bool(has_m), bool(has_e), float(decay), float(codec.qmax), codec.block,
                         _np(codes), _np(scales), _np(vbuf[:n]), _np(mbuf[:n]), _np(vbuf[:n].view(torch.int32)),
                         _np(scales.view(torch.int32)))
    if not ok:
        return None
    return {name: pack_int4(codes) if codec.name == "int4" else codes, name + SCALE: scales}


def eager_mean_step(s: torch.Tensor, total: float, p: torch.Tensor, m: torch.Tensor, mu: float, lr: float,
                    nesterov: bool, has_m: bool, g: torch.Tensor | None = None) -> None:
    """mean_step with torch's ops (the kernel's reference, and what runs without it): the mean's piece divided
    into `g` (a float32 buffer of at least s.numel() values, overwritten), then outer.outer_step_piece."""
    from train.exchange.outer import outer_step_piece

    n = s.numel()
    g = torch.div(s, total, out=torch.empty(n, dtype=torch.float32) if g is None else g[:n])
    b = outer_step_piece(p, g, m if has_m else None, lr, mu, nesterov)
    if not has_m:
        m.copy_(b)


def eager_coded_step(codec, name: str, s: torch.Tensor, total: float, theta: torch.Tensor, m: torch.Tensor,
                     e: torch.Tensor | None, mu: float, lr: float, nesterov: bool, has_m: bool, has_e: bool,
                     decay: float, bufs: tuple | None = None) -> dict:
    """coded_step with torch's ops, for any dense codec (int8, int4, a cast): the mean's piece, the outer step on
    a copy of θ, the target θ* − θ (+ the residual), Codec.round_trip, the new residual (a lossy codec's), θ + the
    decoded values; returns the stored tensors. `bufs`: three float32 buffers of at least s.numel() values rounded
    up to a block (the round trip's, the mean's, the copy's), reused by the caller."""
    from train.exchange.outer import outer_step_piece

    n = s.numel()
    if bufs is None:
        bufs = tuple(torch.empty(-(-n // codec.block) * codec.block, dtype=torch.float32) for _ in range(3))
    buf, gbuf, nbuf = bufs
    g = torch.div(s, total, out=gbuf[:n])
    new = nbuf[:n].copy_(theta)
    b = outer_step_piece(new, g, m if has_m else None, lr, mu, nesterov)
    if not has_m:
        m.copy_(b)
    v = new.sub_(theta)  # the target θ* − θ_r
    if has_e:
        v.add_(e if decay == 1.0 else e * decay)
    stored, seen = codec.round_trip(name, v, buf)
    if not codec.lossless:
        torch.sub(v, seen, out=e)
    theta.add_(seen)
    return stored


def kernels() -> dict | None:
    """The compiled kernels where they give torch's bits on this machine (checked once per process), else None."""
    if os.environ.get("EDT_FUSED", "1") == "0":
        return None
    with _lock:
        if "ok" not in _state:
            _state["ok"] = False
            try:
                k = _compile()
                bad = _self_check(k)
            except Exception as e:  # numba missing, or a compiler error: the eager ops
                log.info("fused outer-step kernels unavailable (%s: %s); using torch's ops", type(e).__name__, e)
            else:
                if bad:
                    log.warning("the fused outer-step kernels differ from torch's ops on this machine (%s); using "
                                "torch's ops", bad)
                else:
                    _state["ok"], _state["k"] = True, k
        return _state.get("k") if _state["ok"] else None


def _probe(n: int, seed: int) -> dict:
    """Values meant to find a difference: normal and tiny magnitudes, exact ties after scaling, zeros and a block of
    zeros, signed zeros, a sum whose quotient rounds."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=g, dtype=torch.float64) * 3e3
    a, b = n // 8, n // 4
    s[:a] *= 1e-30
    s[a:b] = torch.randint(-300, 300, (b - a,), generator=g).double() * 0.5
    s[b: b + 64] = 0.0
    s[b + 64: b + 70] = -0.0
    theta = torch.randn(n, generator=g) * 0.05
    theta[b: b + 64] = 0.0
    m = torch.randn(n, generator=g) * 1e-3
    e = torch.randn(n, generator=g) * 1e-5
    e[b: b + 64] = 0.0
    return {"s": s, "theta": theta, "m": m, "e": e}


def _self_check(k: dict) -> str | None:
    """Each kernel against the eager code on _probe's values; the first difference, or None."""
    from types import SimpleNamespace

    from train.exchange.codec import get_codec

    n, total = 3 * 64 + 37, 1234567.0
    for nesterov in (True, False):
        for has_m in (True, False):
            v = _probe(n, 1)
            p1, m1, p2, m2 = v["theta"].clone(), v["m"].clone(), v["theta"].clone(), v["m"].clone()
            eager_mean_step(v["s"], total, p1, m1, 0.9, 0.7, nesterov, has_m)
            mean_step(k, v["s"], total, p2, m2, 0.9, 0.7, nesterov, has_m)
            if not (_same(p1, p2) and _same(m1, m2)):
                return f"mean_step nesterov={nesterov} momentum={has_m}"
    for name in ("int8", "int4"):
        codec = get_codec(name, 64)
        for decay, has_e, has_m in ((1.0, True, True), (0.9, True, True), (1.0, False, False)):
            oc = SimpleNamespace(momentum=0.9, nesterov=True)
            v = _probe(n, 2)
            th1, m1, e1 = v["theta"].clone(), v["m"].clone(), v["e"].clone()
            stored1 = eager_coded_step(codec, "x", v["s"], total, th1, m1, e1, 0.9, 0.7, True, has_m, has_e, decay)
            th2, m2, e2 = v["theta"].clone(), v["m"].clone(), v["e"].clone()
            stored2 = coded_step(k, codec, v["s"], total, th2, m2, e2, oc, 0.7, has_m, has_e, decay,
                                 torch.empty(n), torch.empty(n), "x")
            if stored2 is None or not all(_same(stored1[x], stored2[x]) for x in stored1):
                return f"coded_step {name} decay={decay}: the stored tensors"
            if not (_same(th1, th2) and _same(m1, m2) and _same(e1, e2)):
                return f"coded_step {name} decay={decay}: θ, m or the residual"
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy())
