"""The numba kernels of train/exchange/fused.py (imported only there, on first use: numba's import and the kernels'
compile, or their load from numba's on-disk cache, cost the coordinator ~0.5 s once). What each computes, and why
those are torch's eager ops' bits: fused.py's module doc."""
from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.extending import intrinsic


@intrinsic
def fma(typingctx, a, b, c):
    """a · b + c rounded once (llvm.fma), as torch's add / sub with alpha (vec::fmadd)."""
    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return a(a, b, c), codegen


# error_model="numpy": a float division by zero gives inf / NaN as torch's does, with no Python exception check in
# the loop (which keeps LLVM from vectorising it). Loops index from 0 or with unsigned indices: numba wraps a negative
# index around, and a loop whose index may be negative is not vectorised either.


@njit(nogil=True, cache=True, error_model="numpy")
def mean_step(s, total, p, m, mu, lr, nesterov, has_m):
    """p (θ) and m in place from the float64 sum s: Accumulator.mean_piece + outer.outer_step_piece."""
    mu32, nlr = np.float32(mu), -np.float32(lr)
    for i in range(s.shape[0]):
        g = np.float32(s[i] / total)
        if has_m:
            b = np.float32(m[i] * mu32) + g
        else:
            b = g
        m[i] = b
        st = fma(mu32, b, g) if nesterov else b
        p[i] = fma(nlr, st, p[i])


@njit(nogil=True, cache=True, error_model="numpy")
def _target(s, total, theta, m, e, mu32, nlr, nesterov, has_m, has_e, dec, decay_one, vbuf, mbuf):
    """m_{r+1} into mbuf and the target θ* − θ (+ the residual) into vbuf; θ, m, e untouched."""
    for i in range(s.shape[0]):
        g = np.float32(s[i] / total)
        b = np.float32(m[i] * mu32) + g if has_m else g
        mbuf[i] = b
        st = fma(mu32, b, g) if nesterov else b
        v = fma(nlr, st, theta[i]) - theta[i]
        if has_e:
            v = v + (e[i] if decay_one else np.float32(e[i] * dec))
        vbuf[i] = v


@njit(nogil=True, cache=True, error_model="numpy")
def _absmax_bits(vbits, sbits, n, block):
    """Each block's max |v| as float32 bits into sbits (the bits of |x| order as |x| does, NaN above inf);
    True where a block holds a value that is not finite."""
    bad = False
    for k in range((n + block - 1) // block):
        a = np.int32(0)
        for i in range(np.uint64(k * block), np.uint64(min(n, (k + 1) * block))):
            a = max(a, vbits[i] & np.int32(0x7FFFFFFF))
        sbits[k] = a
        bad |= a >= 0x7F800000
    return bad


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"nnan"})
def _encode(vbuf, codes, e, theta, scales, n, block, q32):
    """The codes, the decoded values, the new residual and θ + decoded, block by block (every value finite here:
    coded_step checked, so the no-NaN promise holds). rint by the 1.5 · 2^23 trick: for |t| < 2^22,
    fl(fl(t + 1.5 · 2^23) − 1.5 · 2^23) is t rounded to the nearest integer, ties to even, as torch.round — but for
    the sign of a zero, which the int8 code does not keep; here |t| <= q (1 + 2^-22)."""
    one, zero, magic = np.float32(1.0), np.float32(0.0), np.float32(12582912.0)
    for k in range((n + block - 1) // block):
        sc = scales[k]
        inv = np.float32(one / sc) if sc > zero else zero
        for i in range(np.uint64(k * block), np.uint64(min(n, (k + 1) * block))):
            v = vbuf[i]
            t = np.float32(np.float32(v * inv) + magic) - magic
            t = min(max(t, -q32), q32)
            c = np.int8(t)
            codes[i] = c
            seen = np.float32(np.float32(c) * sc)
            e[i] = v - seen
            theta[i] = theta[i] + seen


@njit(nogil=True, cache=True, error_model="numpy")
def coded_step(s, total, theta, m, e, mu, lr, nesterov, has_m, has_e, decay, q, block, codes, scales, vbuf, mbuf,
               vbits, sbits):
    """One segment of OuterMaster._step_coded with a block code; False, having written nothing to theta, m, e,
    where a block is not finite or its scale's inverse overflows (the eager code takes that segment). vbits and
    sbits: int32 views of vbuf and scales."""
    mu32, nlr, dec, q32 = np.float32(mu), -np.float32(lr), np.float32(decay), np.float32(q)
    one, zero = np.float32(1.0), np.float32(0.0)
    n = s.shape[0]
    _target(s, total, theta, m, e, mu32, nlr, nesterov, has_m, has_e, dec, decay == 1.0, vbuf, mbuf)
    if _absmax_bits(vbits, sbits, n, block):
        return False
    for k in range((n + block - 1) // block):
        sc = np.float32(scales[k] / q32)
        if sc > zero and not math.isfinite(np.float32(one / sc)):
            return False
        scales[k] = sc
    for i in range(n):
        m[i] = mbuf[i]
    _encode(vbuf, codes, e, theta, scales, n, block, q32)
    return True
