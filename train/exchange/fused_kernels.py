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


@njit(nogil=True, cache=True)
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


@njit(nogil=True, cache=True)
def coded_step(s, total, theta, m, e, mu, lr, nesterov, has_m, has_e, decay, q, block, codes, scales, vbuf, mbuf):
    """One segment of OuterMaster._step_coded with a block code; False, having written nothing to theta, m, e,
    where a block is not finite or its scale's inverse overflows (the eager code takes that segment)."""
    mu32, nlr, dec, q32 = np.float32(mu), -np.float32(lr), np.float32(decay), np.float32(q)
    one, zero = np.float32(1.0), np.float32(0.0)
    n = s.shape[0]
    nb = (n + block - 1) // block
    for k in range(nb):  # first pass: m', v and each block's absmax into the lane's buffers
        a = zero
        for i in range(k * block, min(n, (k + 1) * block)):
            g = np.float32(s[i] / total)
            if has_m:
                b = np.float32(m[i] * mu32) + g
            else:
                b = g
            mbuf[i] = b
            st = fma(mu32, b, g) if nesterov else b
            new = fma(nlr, st, theta[i])
            v = new - theta[i]
            if has_e:
                v = v + (e[i] if decay == 1.0 else np.float32(e[i] * dec))
            vbuf[i] = v
            x = abs(v)
            if not (x <= a):  # (a NaN is not <= anything)
                if not math.isfinite(x):
                    return False
                a = x
        sc = np.float32(a / q32)
        if sc > zero and not math.isfinite(np.float32(one / sc)):
            return False
        scales[k] = sc
    for k in range(nb):  # second pass: the codes, the decoded values, the residual, θ
        sc = scales[k]
        inv = np.float32(one / sc) if sc > zero else zero
        for i in range(k * block, min(n, (k + 1) * block)):
            m[i] = mbuf[i]
            v = vbuf[i]
            t = np.rint(np.float32(v * inv))
            t = min(max(t, -q32), q32)
            c = np.int8(t)
            codes[i] = c
            seen = np.float32(np.float32(c) * sc)
            e[i] = v - seen
            theta[i] = theta[i] + seen
    return True
