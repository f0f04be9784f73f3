"""The DiLoCo outer step as pure functions on tensors / state dicts, plus its streaming file form.

DiLoCo (Douillard et al., 2023, arXiv:2311.08105), Algorithm 1: every worker starts round r from θ_r, runs H inner
steps and reports Δ_w = θ_r − θ_w (a "pseudo-gradient": it points uphill, like a gradient). The outer optimizer
treats the average Δ as the gradient of θ_r:

    g      = Σ_w a_w Δ_w / Σ_w a_w            (a_w = tokens of worker w, or 1)
    m_{r+1} = μ m_r + g                       (m_0 = 0, so the first step has m_1 = g, as torch.optim.SGD)
    θ_{r+1} = θ_r − η (g + μ m_{r+1})         Nesterov;  θ_r − η m_{r+1} without it

exactly torch.optim.SGD(lr=η, momentum=μ, nesterov=...) with dampening 0 and no weight decay. With η = 1, μ = 0 this
is parameter averaging; with one worker, the worker's own model.
"""
from __future__ import annotations

from typing import Sequence

import torch


def average_deltas(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> torch.Tensor:
    """Weighted mean of same-shape tensors, accumulated in float32."""
    if not deltas:
        raise ValueError("average_deltas: no deltas")
    w = [1.0] * len(deltas) if weights is None else [float(x) for x in weights]
    total = sum(w)
    if total <= 0:
        raise ValueError(f"average_deltas: weights must sum to > 0, got {w}")
    acc = deltas[0].to(torch.float32) * (w[0] / total)
    for d, wi in zip(deltas[1:], w[1:]):
        acc.add_(d.to(torch.float32), alpha=wi / total)
    return acc


def outer_step_tensor(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor | None, lr: float,
                      mu: float, nesterov: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD(+Nesterov) step for one tensor: returns (new_param, new_momentum); inputs are not modified."""
    g = grad.to(torch.float32)
    buf = g.clone() if momentum is None else momentum.to(torch.float32).mul(mu).add_(g)
    step = g.add(buf, alpha=mu) if nesterov else buf
    new = param.to(torch.float32).sub(step, alpha=lr)
    return new.to(param.dtype), buf


def outer_step_piece(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor | None, lr: float, mu: float,
                     nesterov: bool = True) -> torch.Tensor:
    """outer_step_tensor in place, on float32 pieces (views) of θ, g and m: `param` becomes θ_{r+1}, `momentum`
    m_{r+1} (None, the first step: a new buffer, returned), `grad` is overwritten. Element by element the same
    IEEE operations as outer_step_tensor (m·μ + g; g + μ·m; θ − η·step), so the same bits, in any pieces
    (tests/unit/test_outer.py); no temporary. Returns the momentum piece."""
    if momentum is None:
        buf = grad.clone()
    else:
        buf = momentum.mul_(mu).add_(grad)
    step = grad.add_(buf, alpha=mu) if nesterov else buf
    param.sub_(step, alpha=lr)
    return buf


def outer_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
               momentum: dict[str, torch.Tensor] | None, lr: float, mu: float, nesterov: bool = True,
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The outer step on whole state dicts: (θ_{r+1}, m_{r+1}) from θ_r, the averaged pseudo-gradient and m_r."""
    if set(params) != set(grads):
        raise ValueError(f"outer_step: parameter and gradient names differ: "
                         f"{sorted(set(params) ^ set(grads))[:5]}")
    new_p, new_m = {}, {}
    for name, p in params.items():
        new_p[name], new_m[name] = outer_step_tensor(
            p, grads[name], None if momentum is None else momentum.get(name), lr, mu, nesterov)
    return new_p, new_m


def diloco_round(params: dict[str, torch.Tensor], worker_deltas: Sequence[dict[str, torch.Tensor]],
                 weights: Sequence[float] | None, momentum: dict[str, torch.Tensor] | None, lr: float, mu: float,
                 nesterov: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Average the workers' pseudo-gradients and apply the outer step (the notebook-friendly entry point)."""
    grads = {k: average_deltas([d[k] for d in worker_deltas], weights) for k in params}
    return outer_step(params, grads, momentum, lr, mu, nesterov)


def outer_lr_at(round: int, oc) -> float:
    """The outer learning rate of the step that makes θ_{round+1} from θ_round (`oc`: the run's OuterConfig).

    constant: oc.lr every round (DiLoCo; Charles et al. 2025 keep it constant too).
    warmup:   oc.lr · min(1, (round + 1) / W) with W = oc.lr_warmup_rounds: lr / W at round 0, the full lr from
              round W − 1 on (a gentler start while the outer momentum buffer fills).
    A pure function of the round, so a resumed coordinator takes the same step as an uninterrupted one."""
    if round < 0:
        raise ValueError(f"outer_lr_at: round must be >= 0, got {round}")
    if oc.lr_schedule == "constant":
        return oc.lr
    if oc.lr_schedule == "warmup":
        return oc.lr * min(1.0, (round + 1) / oc.lr_warmup_rounds)
    raise ValueError(f"outer_lr_at: unknown outer.lr_schedule {oc.lr_schedule!r}")


def eager_gain(round: int, oc, workers: int) -> float:
    """γ, the weight of one worker's progress in its eager start (docs/overlap.md): the factor with which one
    pseudo-gradient, at weight 1 / `workers` in the mean, moves θ in the outer step of `round` (θ_{round+1} from
    θ_round): η (1 + μ) / M with Nesterov (g appears in g + μ m' = (1 + μ) g + μ² m), η / M without. With averaging
    (η = 1, μ = 0) it is 1 / M, and the eager start θ_r + γ p_r is exactly the model of Kale et al.'s eager update."""
    lr = outer_lr_at(round, oc)
    return lr * ((1.0 + oc.momentum) if oc.nesterov else 1.0) / max(1, workers)
