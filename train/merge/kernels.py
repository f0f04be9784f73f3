"""mergekit's merge methods on whole tensors (float32), for `python -m train.merge CONFIG.yml` (train.merge.yaml_plan).

Each function merges one tensor from its inputs: pure tensor math, no files. Definitions read from mergekit 0.1.5
(merge_methods/*.py, sparsify.py; LGPL, read, not copied) and written here in our own form. Models x_1..x_n,
base x_0, task vectors δ_i = x_i − x_0:

* gta            the generalized task arithmetic family (task_arithmetic, ties, dare_*, breadcrumbs*, della*):
                 sparsify each δ_i (magnitude: top k = max(1, int(density·numel)) by |δ|, density 0 keeps none;
                 random: Bernoulli(density); magnitude_outliers: sort |δ| ascending, skip the smallest
                 n_bot = max(0, numel − k − int(gamma·numel)), keep the next k = int(density·numel);
                 della: per row, keep with probability density − ε + 2ε·rank/(cols−1), rank of |δ| ascending),
                 optionally rescale to the unpruned L1 norm (eps 1e-7), weight, sign consensus ("sum" | "count"),
                 ÷ Σ weights (agreeing weights under consensus) when `normalize`, × λ, + x_0.
* nuslerp        t = w_2 / (w_1 + w_2) (0.5 when |Σ| < 1e-6); slerp of x_1, x_2 (or of δ_1, δ_2, + x_0 with a
                 base) over the flattened tensor, its rows (`nuslerp_row_wise`) or its columns.
* multislerp     barycentric interpolation on the hypersphere at the weighted mean (tangent space, exp map),
                 scaled by the weighted mean norm; of δ_i (+ x_0) with a base.
* karcher        the weighted (equal weights) Karcher mean of the directions, iterated ≤ max_iter times, times
                 Σ α_i |x_i|.
* model_stock    t = n·cosθ / (1 + (n−1)·cosθ) with cosθ the mean pairwise cosine of δ_i (whole tensor or per
                 row with `filter_wise`); t·mean(x_i) + (1−t)·x_0.
* sce            select the top `select_topk` fraction of positions by variance across models, sign consensus
                 (sum), weights ∝ mean(δ_i²), merged ÷ Σ agreeing weights (≥ 1e-6), + x_0.
* nearswap       w = clamp(t / max(|x_0 − x_1|, 1e-6), 0, 1); w·x_1 + (1−w)·x_0.
* arcee_fusion   importance |x_1 − x_0|·KL(softmax x_1 ‖ softmax x_0) (last dim); keep δ where importance ≥
                 median + 1.5·IQR (quantiles by index into the sorted values).
* passthrough    the single input, times `scale` if given.
* ram            m_i = |δ_i| > ε, c = Σ m_i per position; x_0 + Σ_i m_i·δ_i·(1 where c = 1, else 1/c).
* ramplus_tl     as ram, but each model's unique positions (c = 1) are scaled by λ_i = 1 + r·clamp(ρ_i, 0, α),
                 ρ_i = #(m_i, c > 1) / max(#(m_i, c = 1), ε), counted over the whole tensor.

Randomness (dare_*, della*, arcee_fusion on > 1M elements): one torch.Generator per output tensor, seeded with
train.merge.methods.tensor_seed(--random-seed, output tensor name); each model in order draws torch.rand(numel)
(della: torch.rand of the row-shaped tensor). mergekit draws from torch's global stream in task order, so these
methods equal mergekit's in distribution, not draw for draw.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from train.core.errors import MergeError

L1_EPS = 1e-7


# -- sparsification (mergekit sparsify.py) --------------------------------------------------------------------------
def _rescale(delta: Tensor, mask: Tensor, rescale: bool) -> Tensor:
    kept = delta * mask
    if not rescale:
        return kept
    before, after = float(delta.abs().sum()), float(kept.abs().sum())
    if before < L1_EPS or after < L1_EPS:
        return kept
    return kept * (before / after)


def sparsify(delta: Tensor, how: str, density: float, rescale: bool, *, gamma: float = 0.01, epsilon: float = 0.15,
             generator: torch.Generator | None = None, name: str = "tensor") -> Tensor:
    if density >= 1:
        return delta
    n = delta.numel()
    mask = torch.zeros(n, dtype=delta.dtype, device=delta.device)
    if how == "magnitude":
        if density <= 0 or n == 0:
            return torch.zeros_like(delta)
        k = max(1, int(density * n))  # mergekit ≥ 0.1.5: a positive density keeps at least one entry
        order = torch.argsort(delta.abs().reshape(-1), descending=True, stable=True)
        mask[order[:k]] = 1
    elif how == "magnitude_outliers":
        keep, n_top = int(density * n), int(gamma * n)
        n_bot = max(0, n - keep - n_top)  # fewer outliers dropped when the density needs them
        order = torch.argsort(delta.abs().reshape(-1), stable=True)
        mask[order[n_bot:n_bot + keep]] = 1
    elif how == "random":
        mask = (torch.rand(n, generator=generator, device=delta.device) < density).to(delta.dtype)
    elif how == "della":
        if density <= 0:
            return torch.zeros_like(delta)
        if density + epsilon >= 1 or density - epsilon <= 0:
            raise MergeError(f"della: density {density:g} ± epsilon {epsilon:g} must lie inside (0, 1) "
                             f"(tensor {name!r})")
        rows = delta.reshape(1, -1) if delta.dim() < 2 else delta
        ranks = torch.argsort(torch.argsort(rows.abs(), dim=1), dim=1).to(delta.dtype) + 1
        lo, hi = ranks.min(dim=1, keepdim=True).values, ranks.max(dim=1, keepdim=True).values
        probs = (density - epsilon) + ((ranks - lo) / (hi - lo)).clamp(0, 1) * 2 * epsilon
        mask = (torch.rand(rows.shape, generator=generator, device=delta.device) < probs).to(delta.dtype)
    else:
        raise ValueError(how)
    return _rescale(delta, mask.reshape(delta.shape), rescale)


def sign_mask(weighted: Tensor, consensus: str) -> Tensor:
    """[n, ...] bool: entries whose sign equals the elected one (≥ 0 elects +; a zero never agrees)."""
    sign = weighted.sign()
    votes = weighted.sum(0) if consensus == "sum" else sign.sum(0)
    return sign == torch.where(votes >= 0, 1.0, -1.0)


def gta(base: Tensor, xs: Sequence[Tensor], weights: Sequence[float], densities: Sequence[float], *,
        sparsification: str | None, consensus: str | None, normalize: bool, rescale: bool, lambda_: float = 1.0,
        gammas: Sequence[float] | None = None, epsilons: Sequence[float] | None = None,
        generator: torch.Generator | None = None, name: str = "tensor") -> Tensor:
    if not xs:
        return base
    deltas = []
    for i, x in enumerate(xs):
        d = x - base
        if sparsification:
            d = sparsify(d, sparsification, densities[i], rescale, gamma=gammas[i] if gammas else 0.01,
                         epsilon=epsilons[i] if epsilons else 0.15, generator=generator, name=name)
        deltas.append(d)
    stacked = torch.stack(deltas)
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device).reshape(-1, *([1] * base.dim()))
    stacked = stacked * w
    if consensus:
        agree = sign_mask(stacked, consensus).to(stacked.dtype)
        mixed = (stacked * agree).sum(0)
        divisor = (w * agree).sum(0)
        divisor[divisor == 0] = 1
    else:
        mixed = stacked.sum(0)
        divisor = w.sum(0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    if lambda_ != 1:
        mixed = mixed * lambda_
    return base + mixed


# -- interpolations -------------------------------------------------------------------------------------------------
def nuslerp(t: float, v0: Tensor, v1: Tensor, dim: int = -1, flatten: bool = False, eps: float = 1e-8) -> Tensor:
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif dim != -1:
        v0, v1 = v0.transpose(dim, -1), v1.transpose(dim, -1)
    u0 = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=1e-7)
    u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = torch.sum(u0 * u1, dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= eps ** 2
    theta = torch.acos(torch.where(colinear, 0, cos))
    out = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.sin(theta)
    out = torch.where(colinear, (1 - t) * v0 + t * v1, out)
    if dim != -1 and not flatten:
        out = out.transpose(dim, -1)
    return out.reshape(shape)


def nuslerp_merge(xs: Sequence[Tensor], weights: Sequence[float], base: Tensor | None, row_wise: bool,
                  flatten: bool) -> Tensor:
    total = sum(weights)
    t = 0.5 if abs(total) < 1e-6 else weights[1] / total
    dim = 0 if row_wise else -1
    if base is None:
        return nuslerp(t, xs[0], xs[1], dim=dim, flatten=flatten)
    return base + nuslerp(t, xs[0] - base, xs[1] - base, dim=dim, flatten=flatten)


def multislerp(xs: Sequence[Tensor], weights: Sequence[float], base: Tensor | None, normalize_weights: bool = True,
               eps: float = 1e-8) -> Tensor:
    if len(xs) == 1:
        return xs[0]
    stacked = torch.stack(list(xs))
    if base is not None:
        stacked = stacked - base
    flat = stacked.reshape(len(xs), -1)
    w = torch.tensor(list(weights), dtype=flat.dtype, device=flat.device)
    if normalize_weights:
        w = w / w.sum()
    norms = torch.norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        if len(xs) != 2:
            raise MergeError("multislerp: the weighted mean direction is zero (antipodal inputs with balancing "
                             "weights); use different weights")
        out = (stacked[0] * w[0] + stacked[1] * w[1]).view(stacked.shape[1:])
        return out if base is None else out + base
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(-1, keepdim=True) * mean
    tangent = (tangents * w.view(-1, 1)).sum(0)
    tnorm = torch.norm(tangent) + eps
    out = (mean * torch.cos(tnorm) + tangent * (torch.sin(tnorm) / tnorm)) * (norms.squeeze(-1) * w).sum()
    out = out.view(stacked.shape[1:])
    return out if base is None else out + base


def karcher(xs: Sequence[Tensor], max_iter: int = 10, tol: float = 1e-5) -> Tensor:
    if len(xs) == 1:
        return xs[0]
    alphas = [1.0 / len(xs)] * len(xs)
    norms = [torch.linalg.vector_norm(x) for x in xs]
    units = [torch.zeros_like(x) if float(nm) == 0.0 else x / nm for x, nm in zip(xs, norms)]
    valid = [i for i, nm in enumerate(norms) if float(nm) > tol]
    if not valid:
        return torch.zeros_like(xs[0])
    a_sum = sum(alphas[i] for i in valid)
    a_valid = [alphas[i] / a_sum for i in valid]
    u_valid = [units[i] for i in valid]
    mean = torch.zeros_like(u_valid[0])
    for a, u in zip(a_valid, u_valid):
        mean += a * u
    mnorm = torch.linalg.vector_norm(mean)
    mean = u_valid[0].clone() if float(mnorm) < tol else mean / mnorm
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for a, u in zip(a_valid, u_valid):
            dot = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if float(theta) < tol:
                continue
            tangent += a * (theta / torch.sin(theta)) * (u - dot * mean)
        tnorm = torch.linalg.vector_norm(tangent)
        if float(tnorm) < tol:
            break
        mean = torch.cos(tnorm) * mean + torch.sin(tnorm) * (tangent / tnorm)
        unorm = torch.linalg.vector_norm(mean)
        if float(unorm) > tol:
            mean = mean / unorm
    return sum(a * nm for a, nm in zip(alphas, norms)) * mean


# -- the others -----------------------------------------------------------------------------------------------------
def model_stock(base: Tensor, xs: Sequence[Tensor], filter_wise: bool = False) -> Tensor:
    shape = base.shape
    if filter_wise:
        w0, ws = (base.unsqueeze(0), [x.unsqueeze(0) for x in xs]) if base.dim() == 1 else (base, list(xs))
    else:
        w0, ws = base.reshape(-1), [x.reshape(-1) for x in xs]
    offsets = [w - w0 for w in ws]
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1:]:
            norms = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(ws)
    denom = 1 + (n - 1) * cos
    singular = denom.abs() < 1e-6  # no finite estimate: keep the base there
    t = torch.where(singular, torch.zeros_like(cos), (n * cos) / torch.where(singular, 1.0, denom))
    return (t * (sum(ws) / n) + (1 - t) * w0).reshape(shape)


def sce(base: Tensor, xs: Sequence[Tensor], select_topk: float = 1.0) -> Tensor:
    if not xs:
        return base
    tvs = torch.stack([x - base for x in xs])
    if select_topk < 1:
        var = torch.var(tvs, dim=0, unbiased=False)
        k = 0 if select_topk <= 0 else int(int(torch.count_nonzero(var)) * select_topk)
        mask = torch.zeros_like(var)
        if k > 0:
            mask.view(-1)[torch.topk(var.abs().view(-1), k=k, largest=True).indices] = 1
        tvs = tvs * mask.unsqueeze(0)
    agree = sign_mask(tvs, "sum").to(tvs.dtype)
    energy = tvs.square().reshape(len(xs), -1).mean(dim=1)
    total = float(energy.sum())
    w = torch.ones_like(energy) / len(xs) if abs(total) < 1e-6 else energy / total
    w = w.reshape(-1, *([1] * base.dim())) * agree
    return base + (tvs * w).sum(0) / w.sum(0).clamp(min=1e-6)


def nearswap(base: Tensor, x: Tensor, t: float) -> Tensor:
    w = (t / torch.abs(base - x).clamp(min=1e-6)).clamp(min=0, max=1)
    return w * x + (1 - w) * base


def arcee_fusion(base: Tensor, x: Tensor, generator: torch.Generator | None = None,
                 sample: int = 1_000_000) -> Tensor:
    eps = 1e-8
    p = torch.softmax(x, dim=-1) + eps
    q = torch.softmax(base, dim=-1) + eps
    importance = (x - base).abs() * torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    flat = importance.reshape(-1)
    if flat.numel() > sample:
        flat = flat[torch.randint(flat.numel(), (sample,), generator=generator, device=flat.device)]
    ordered = torch.sort(flat).values
    q1, median, q3 = ordered[(torch.tensor([0.25, 0.5, 0.75], device=flat.device) * (ordered.numel() - 1)).long()]
    mask = (importance >= median + 1.5 * (q3 - q1)).to(x.dtype)
    return base + (x - base) * mask


def ram(base: Tensor, xs: Sequence[Tensor], epsilon: float = 1e-5, r: float | None = None,
        alpha: float = 0.2) -> Tensor:
    """Reinforced Agent Merging; r given: RAM+ tensor-local (ramplus_tl)."""
    if not xs:
        return base
    deltas = torch.stack([x - base for x in xs]).reshape(len(xs), -1)
    keep = deltas.abs() > epsilon
    count = keep.sum(dim=0)
    solo, shared = count == 1, count > 1
    deltas = deltas * keep
    solo_scale = torch.ones(len(xs), 1, dtype=deltas.dtype, device=deltas.device)
    if r is not None:
        n_shared = (keep & shared).sum(dim=1).to(deltas.dtype)
        n_solo = (keep & solo).sum(dim=1).to(deltas.dtype)
        solo_scale = (1 + r * (n_shared / n_solo.clamp(min=epsilon)).clamp(min=0, max=alpha)).unsqueeze(1)
    merged = (deltas * solo * solo_scale + deltas * shared / count.clamp(min=1)).sum(dim=0)
    return base + merged.reshape(base.shape)


def passthrough(x: Tensor, scale: float | None = None) -> Tensor:
    return x if scale is None else x * scale


def is_finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.numel() else True

