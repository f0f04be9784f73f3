"""Crossover of two models: pure functions on tensors / state dicts, and their streaming form over safetensors.

Three methods (EDT generation, docs/edt.md):

* outer_sgd — the prototype's pairwise outer step. With parents a, b, their pre-mutation weights θ_a, θ_b (what they
  started their mutation from), their mutated weights θ'_a, θ'_b and their outer momenta m_a, m_b:
      base = (θ_a + θ_b) / 2
      Δ    = ((θ'_a − base) + (θ'_b − base)) / 2          the pseudo-gradient: mean move of the parents
      child, m = SGD-Nesterov step on `base` with gradient −Δ (DiLoCo's sign: train.exchange.outer) from momentum (m_a +
      m_b)/2
  With lr 1 and momentum 0 the child is the mean of the mutated parents; an elite (paired with itself) takes exactly
  a one-worker DiLoCo step.
* linear — (1 − t) θ'_a + t θ'_b.
* slerp  — spherical interpolation with mergekit's semantics: the angle comes from the tensors normalised as a whole
  (flattened), the coefficients apply to the unnormalised tensors, and when |cos| > 0.9995 it falls back to lerp.

t comes from per-tensor curves (mergekit "gradients"): {"self_attn": [0, 0.5, 1], "mlp": 0.3, "default": 0.5}.
A filter matches tensor names that contain it (first match wins, `default` otherwise); layer i of N reads the curve
at p = i/(N−1) by piecewise-linear interpolation; tensors outside the layers (embeddings, final norm, lm_head) use
the curve's first value. Tied embeddings: a missing lm_head.weight is read from model.embed_tokens.weight.

The file form streams tensor by tensor (memory-mapped reads, StreamingWriter), so a merge holds about one tensor of
each input in memory, whatever the model size.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open

from train.core import sharedfs
from train.exchange.outer import outer_step_tensor
from train.core.tensorio import SequentialReader, StreamingWriter

DOT_THRESHOLD = 0.9995  # mergekit's: above it the two directions are treated as colinear (lerp)
Curves = Mapping[str, "float | list[float]"]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


# -- tensors ---------------------------------------------------------------------------------------------------------
def lerp(t: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1 − t) a + t b, computed in float32, returned in a's dtype."""
    out = a.to(torch.float32) * (1.0 - t) + b.to(torch.float32) * t
    return out.to(a.dtype)


def slerp(t: float, a: torch.Tensor, b: torch.Tensor, dot_threshold: float = DOT_THRESHOLD,
          eps: float = 1e-8) -> torch.Tensor:
    """Spherical interpolation of two same-shape tensors (mergekit semantics, see the module doc)."""
    if a.shape != b.shape:
        raise ValueError(f"slerp: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    na = a32 / a32.norm().clamp_min(eps)
    nb = b32 / b32.norm().clamp_min(eps)
    dot = float((na * nb).sum())
    if abs(dot) > dot_threshold:
        return lerp(t, a, b)
    theta0 = math.acos(max(-1.0, min(1.0, dot)))
    sin0 = math.sin(theta0)
    s0 = math.sin(theta0 - theta0 * t) / sin0
    s1 = math.sin(theta0 * t) / sin0
    return (a32 * s0 + b32 * s1).to(a.dtype)


def outer_sgd_tensor(pre_a: torch.Tensor, pre_b: torch.Tensor, mut_a: torch.Tensor, mut_b: torch.Tensor,
                     mom_a: torch.Tensor | None, mom_b: torch.Tensor | None, lr: float, momentum: float,
                     nesterov: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairwise outer step for one tensor: (child, child's outer momentum). Missing momenta count as zeros
    (the first step from a momentum-free parent is then exactly torch.optim.SGD's first step)."""
    base = (pre_a.to(torch.float32) + pre_b.to(torch.float32)) * 0.5
    # DiLoCo sign: the pseudo-gradient points from the mutated models back to the base (uphill).
    grad = base - (mut_a.to(torch.float32) + mut_b.to(torch.float32)) * 0.5
    moms = [m for m in (mom_a, mom_b) if m is not None]
    mom = None if not moms else (sum(m.to(torch.float32) for m in moms) / 2.0)  # a missing one is zero
    child, buf = outer_step_tensor(base, grad, mom, lr, momentum, nesterov)
    return child.to(pre_a.dtype), buf


# -- t curves --------------------------------------------------------------------------------------------------------
def layer_index(name: str) -> int | None:
    """i for `model.layers.i....` tensor names, None for tensors outside the decoder layers."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def curve_value(curve: "float | list[float]", p: float) -> float:
    """A mergekit gradient read at p in [0, 1] (piecewise linear over evenly spaced points); a number is constant."""
    if not isinstance(curve, (list, tuple)):
        return float(curve)
    if len(curve) == 1:
        return float(curve[0])
    scaled = min(max(p, 0.0), 1.0) * (len(curve) - 1)
    i0 = min(int(math.floor(scaled)), len(curve) - 2)
    frac = scaled - i0
    return float(curve[i0]) * (1.0 - frac) + float(curve[i0 + 1]) * frac


def t_for(name: str, curves: Curves, num_layers: int) -> float:
    """The t of tensor `name` under t-curves {filter: t or [t, ...]} in a model of `num_layers` layers, by
    mergekit's rule (mergekit/plan.py MergePlanner.plan_module / plan_slice, config.py evaluate_setting and
    ConfigReader.parameter; read at v0.1.4):

    * the curve: the first filter (dict order) contained in the name, else `default`, else 0.5 (mergekit: the
      first entry whose `filter` is a substring of the tensor name; our `default` is its filter-less entry, kept
      as the fallback wherever it stands in the dict);
    * the position p along the curve: layer i of N at i/(N−1), and p = 1 when the model has a single layer
      (mergekit's plan_slice); every tensor outside the layers (no `layers.<i>.` in its name) at p = 0, i.e. the
      curve's first value: embeddings before the layers and the final norm and lm_head after them alike. mergekit
      builds one ConfigReader with t = 0 for a module's pre_weights and post_weights (since v0.1.2, #534); up to
      v0.1.1 it read the post-layer weights at t = 1 (the last value), which we do not follow;
    * a list is read piecewise linearly at p (evenly spaced anchors, train.merge.crossover.curve_value); a number is
    constant.
    """
    curve = curves.get("default", 0.5)
    for filt, c in curves.items():
        if filt != "default" and filt in name:
            curve = c
            break
    i = layer_index(name)
    if i is None:
        p = 0.0
    else:
        p = i / (num_layers - 1) if num_layers > 1 else 1.0
    return curve_value(curve, p)


def count_layers(names) -> int:
    idx = [layer_index(n) for n in names]
    return max([i for i in idx if i is not None], default=-1) + 1


# -- state dicts (notebooks, tests) ----------------------------------------------------------------------------------
def _get(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name in sd:
        return sd[name]
    if name in TIED and TIED[name] in sd:  # tied embeddings: one stored tensor serves both names
        return sd[TIED[name]]
    raise KeyError(f"tensor {name!r} is missing from a parent")


def interpolate(method: str, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                curves: Curves | None = None, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """linear or slerp of two state dicts with per-tensor t (names of `a`, tied embeddings resolved)."""
    fn = {"linear": lerp, "slerp": slerp}[method]
    curves = curves if curves is not None else {"default": 0.5}
    n = num_layers if num_layers is not None else count_layers(a)
    return {k: fn(t_for(k, curves, n), a[k], _get(b, k)) for k in a}


def outer_sgd_crossover(pre_a, pre_b, mut_a, mut_b, mom_a=None, mom_b=None, lr: float = 0.7,
                        momentum: float = 0.9, nesterov: bool = True):
    """The pairwise outer step on whole state dicts: (child, child's momentum)."""
    child, mom = {}, {}
    for k in mut_a:
        child[k], mom[k] = outer_sgd_tensor(_get(pre_a, k), _get(pre_b, k), mut_a[k], _get(mut_b, k),
                                            None if mom_a is None else _get(mom_a, k),
                                            None if mom_b is None else _get(mom_b, k), lr, momentum, nesterov)
    return child, mom


# -- files (the coordinator) -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParentFiles:
    """One parent on disk: weights before and after its mutation, and its outer momentum (None = zeros)."""
    pre: Path
    mutated: Path
    momentum: Path | None = None


@dataclass(frozen=True)
class MergeSpec:
    method: str                      # outer_sgd | linear | slerp
    curves: Curves | None = None     # linear / slerp
    lr: float = 0.7                  # outer_sgd
    momentum: float = 0.9
    nesterov: bool = True


class _Tensors:
    """Memory-mapped tensor access by name (tied names resolved); counts the bytes read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = safe_open(str(sharedfs.local_copy(self.path)), framework="pt")  # an object store: downloaded
        self.names = set(self._f.keys())
        self.bytes_read = 0

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names and name in TIED:
            name = TIED[name]
        t = self._f.get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t


def merge_files(spec: MergeSpec, a: ParentFiles, b: ParentFiles, out_weights: Path,
                out_momentum: Path | None = None) -> dict:
    """Write the child's weights (names and order of a's mutated file) and, for outer_sgd, its outer momentum;
    streaming, each file atomic. Returns {bytes_read, bytes_written, sha256, finite}."""
    head = SequentialReader(a.mutated, hash_bytes=False)
    names, specs = head.names_in_order, {n: (head.dtype_of(n), tuple(head.header[n]["shape"]))
                                         for n in head.names_in_order}
    head.close()
    opened: dict[Path, _Tensors] = {}

    def reader(path: Path | None) -> _Tensors | None:  # one reader per distinct file (an elite is both parents)
        if path is None or not sharedfs.is_file(path):
            return None
        return opened.setdefault(Path(path), _Tensors(Path(path)))

    r = {"mut_a": reader(a.mutated), "mut_b": reader(b.mutated)}
    if spec.method == "outer_sgd":
        r.update(pre_a=reader(a.pre), pre_b=reader(b.pre), mom_a=reader(a.momentum), mom_b=reader(b.momentum))
    n_layers = count_layers(names)
    curves = spec.curves or {"default": 0.5}
    finite = True
    with contextlib.ExitStack() as stack:
        pw = stack.enter_context(StreamingWriter(out_weights, specs, metadata={"format": "pt"}))
        mw = None
        if spec.method == "outer_sgd" and out_momentum is not None:
            mw = stack.enter_context(StreamingWriter(out_momentum, {n: (torch.float32, s) for n, (_, s) in
                                                                     specs.items()}))
        for n in names:
            if spec.method == "outer_sgd":
                child, mom = outer_sgd_tensor(
                    r["pre_a"].get(n), r["pre_b"].get(n), r["mut_a"].get(n), r["mut_b"].get(n),
                    r["mom_a"].get(n) if r["mom_a"] else None, r["mom_b"].get(n) if r["mom_b"] else None,
                    spec.lr, spec.momentum, spec.nesterov)
                if mw is not None:
                    mw.write(n, mom)
            else:
                fn = lerp if spec.method == "linear" else slerp
                child = fn(t_for(n, curves, n_layers), r["mut_a"].get(n), r["mut_b"].get(n))
            finite = finite and bool(torch.isfinite(child).all())
            pw.write(n, child)
    return {"bytes_read": sum(x.bytes_read for x in opened.values()),
            "bytes_written": pw.nbytes + (mw.nbytes if mw else 0), "sha256": pw.digest, "finite": finite}
