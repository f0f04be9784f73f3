"""Merge methods with mergekit's semantics, as pure functions on tensors / state dicts (EvoMerge crossover).

Every method works tensor by tensor, and inside a tensor chunk by chunk over its flattened elements (CHUNK of them
at a time), so the streaming file form (train.merge.stream) holds O(CHUNK × inputs) of working memory plus the one
output tensor, whatever the model size. Math is float32; the result has the first model's dtype. Definitions, with
models x_1..x_n, weights w_i, base x_0 and task vectors δ_i = x_i − x_0 (mergekit: merge_methods/linear.py,
slerp.py, generalized_task_arithmetic.py, sparsify.py):

* linear           Σ w_i x_i, divided by Σ w_i when `normalize` (a zero sum is an error then).
* slerp            exactly two models, t per tensor from t-curves with filters (merge.t_for: layer i of N at i/(N−1),
                   a lone layer at 1, embeddings / final norm / lm_head at the curve's first value, as mergekit's
                   planner); spherical interpolation with the angle of the whole flattened tensors, lerp when
                   |cos| > 0.9995 (train.merge.crossover).
* task_arithmetic  x_0 + λ Σ w_i δ_i  (÷ Σ w_i when `normalize`, a |sum| < 1e-8 counts as 1; mergekit's default is
                   not to normalise).
* ties             δ_i keeps exactly its top k = int(density_i · numel) entries by magnitude (density_i ≥ 1: all):
                   entries above the k-th largest magnitude, then as many equal to it as make k, lowest flat index
                   first (mergekit's argsort(descending)[:k] keeps exactly k too; which of the tied entries it keeps
                   is up to torch's unstable sort). k = 0 (a density below 1/numel) is a MergeError, as mergekit's
                   `assert k > 0`: a whole task vector is never pruned silently. Sign election per position
                   (consensus_method): "sum" (default, TIES) elects the sign of Σ w_i δ_i, "count" the sign of
                   Σ sign(w_i δ_i) (one vote per model); ≥ 0 elects + either way. An entry votes only if its
                   weighted delta is nonzero and has the elected sign (pruned zeros never vote);
                   x_0 + λ Σ_agree w_i δ_i / Σ_agree w_i when `normalize` (an empty agreeing set divides by 1).
* dare_linear      δ_i keeps each entry with probability density_i (independent Bernoulli), then is rescaled so
  dare_ties        its L1 norm equals the unpruned δ_i's (mergekit's `rescale` with the L1 norm, not 1/p; no
                   rescale when either norm is < 1e-7; density 0 prunes all, no error); then as task_arithmetic
                   (dare_linear) or ties' sign consensus (dare_ties, "sum" or "count"). The random stream: for
                   each chunk in order, for each model in order with density < 1,
                   `torch.rand(len(chunk), generator) < density`; the streaming merge seeds one
                   generator per tensor with tensor_seed(seed, name), so a merge is reproducible across processes.

Tied embeddings: a model without lm_head.weight reads model.embed_tokens.weight for it (train.merge.crossover.TIED);
the output
keeps the first model's names. Non-floating tensors (none in HF causal LMs) are copied from the first model.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from train.merge.crossover import DOT_THRESHOLD, TIED, count_layers, t_for
from train.core.errors import MergeError  # noqa: F401  (raised here, imported from here by merge_stream)

CHUNK = 1 << 20          # elements per chunk: 4 MB of float32 per input
L1_EPS = 1e-7            # mergekit's rescaled_masked_tensor eps
METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties")
CONSENSUS_METHODS = ("sum", "count")       # mergekit's ConsensusMethod: sign election by weighted mass / by votes
SIGN_ELECTING = ("ties", "dare_ties")      # the methods with a sign consensus (their default: "sum")
# mergekit's default `normalize` per method (registry.py): used when a Recipe leaves it out
DEFAULT_NORMALIZE = {"linear": True, "slerp": True, "task_arithmetic": False, "ties": True,
                     "dare_linear": False, "dare_ties": False}

Source = Callable[[int, int], Tensor]  # flat element range [start, stop) of one tensor → 1-D float32


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one tensor's random stream: stable across processes and runs (sha256, not hash())."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# -- chunked sources -------------------------------------------------------------------------------------------------
class _Cached:
    """A Source that keeps its last chunk, so a tensor of one chunk is read once even by a two-pass method."""

    def __init__(self, src: Source):
        self.src, self.key, self.val = src, None, None

    def __call__(self, start: int, stop: int) -> Tensor:
        if self.key != (start, stop):
            self.key, self.val = (start, stop), self.src(start, stop)
        return self.val


def memory_source(t: Tensor) -> Source:
    flat = t.detach().reshape(-1)
    return lambda start, stop: flat[start:stop].to(torch.float32)


def _ranges(numel: int, chunk: int):
    return [(s, min(s + chunk, numel)) for s in range(0, numel, chunk)] or [(0, 0)]


def _densities(density, n: int) -> list[float]:
    ds = [float(density)] * n if isinstance(density, numbers.Real) else [float(d) for d in density]
    if len(ds) != n:
        raise ValueError(f"density: {len(ds)} values for {n} models")
    if any(not 0.0 <= d <= 1.0 for d in ds):
        raise ValueError(f"density: every value must lie in [0, 1], got {ds}")
    return ds


# -- kernels (chunked; write into a flat float32 view of the output) ---------------------------------------------------
def _linear(numel, xs: list[Source], weights, normalize: bool, out: Tensor, chunk: int) -> None:
    total = sum(weights)
    if normalize and total == 0:
        raise ValueError(f"linear: weights {list(weights)} sum to 0, cannot normalise")
    scale = 1.0 / total if normalize else 1.0
    for s, e in _ranges(numel, chunk):
        acc = out[s:e].zero_()
        for w, x in zip(weights, xs):
            acc.add_(x(s, e), alpha=w * scale)


def _slerp(numel, a: Source, b: Source, t: float, out: Tensor, chunk: int, eps: float = 1e-8) -> None:
    dot = na2 = nb2 = 0.0
    for s, e in _ranges(numel, chunk):  # pass 1: the angle of the whole tensors
        ca, cb = a(s, e), b(s, e)
        dot += float(torch.dot(ca, cb))
        na2 += float(torch.dot(ca, ca))
        nb2 += float(torch.dot(cb, cb))
    cos = dot / (max(math.sqrt(na2), eps) * max(math.sqrt(nb2), eps))
    if abs(cos) > DOT_THRESHOLD:  # colinear: lerp
        s0, s1 = 1.0 - t, t
    else:
        theta0 = math.acos(max(-1.0, min(1.0, cos)))
        s0 = math.sin(theta0 - theta0 * t) / math.sin(theta0)
        s1 = math.sin(theta0 * t) / math.sin(theta0)
    for s, e in _ranges(numel, chunk):
        torch.mul(a(s, e), s0, out=out[s:e]).add_(b(s, e), alpha=s1)


def _kth_largest(chunks: Callable[[], Iterable[Tensor]], k: int) -> tuple[float, int, int]:
    """(v, g, q): v the k-th largest of non-negative float32 values given as chunks (k ≥ 1), g how many values are
    strictly greater than v, q how many equal it (g < k ≤ g + q: k − g of the q complete the top k). Exact, in
    O(chunk) memory: radix selection on the float bits (non-negative floats order like their int32 bit patterns),
    2 passes."""
    hist = torch.zeros(1 << 16, dtype=torch.int64)
    for c in chunks():
        hist += torch.bincount(c.contiguous().view(torch.int32) >> 16, minlength=1 << 16)
    from_top = hist.flip(0).cumsum(0)
    i = int(torch.searchsorted(from_top, k))
    hi, above = (1 << 16) - 1 - i, (int(from_top[i - 1]) if i else 0)
    hist.zero_()
    for c in chunks():
        bits = c.contiguous().view(torch.int32)
        hist += torch.bincount(bits[(bits >> 16) == hi] & 0xFFFF, minlength=1 << 16)
    from_top = hist.flip(0).cumsum(0)
    j = int(torch.searchsorted(from_top, k - above))
    lo, greater = (1 << 16) - 1 - j, above + (int(from_top[j - 1]) if j else 0)
    return float(torch.tensor([(hi << 16) | lo], dtype=torch.int32).view(torch.float32)), greater, int(hist[lo])


def _task(numel, base: Source, xs: list[Source], weights, out: Tensor, chunk: int, *, normalize: bool,
          lambda_: float, sparsify: str | None = None, density=1.0, consensus: str | None = None,
          generator: torch.Generator | None = None, name: str = "tensor") -> None:
    """The generalized task arithmetic of the module doc: sparsify ('magnitude' | 'random' | None) each δ_i,
    weight, optional sign consensus (None | 'sum' | 'count'), normalise, scale by λ, add to the base. In-place ops
    keep the working set at a few chunks. `name` is the tensor's, for errors."""
    if consensus not in (None, *CONSENSUS_METHODS):
        raise ValueError(f"consensus_method must be one of {', '.join(CONSENSUS_METHODS)}, got {consensus!r}")
    n = len(xs)
    dens = _densities(density, n)
    ranges = _ranges(numel, chunk)
    cache: dict = {}  # a one-chunk tensor's deltas and their magnitudes, computed once for both passes

    def delta(i, s, e):
        if len(ranges) == 1:
            if i not in cache:
                cache[i] = xs[i](s, e) - base(s, e)
            return cache[i]
        return xs[i](s, e) - base(s, e)

    def magnitude(i, s, e):
        if len(ranges) == 1:
            if ("abs", i) not in cache:
                cache["abs", i] = delta(i, s, e).abs()
            return cache["abs", i]
        return delta(i, s, e).abs()

    # pass 1 (ties): each δ_i's k-th largest magnitude (None = keep all) and, when more entries than the top k
    # needs equal it, how many of them it needs (quota; None: all): pass 2 keeps the first ones in flat order,
    # so exactly k survive
    thr: list[float | None] = [None] * n
    quota: list[int | None] = [None] * n
    if sparsify == "magnitude":
        for i, d in enumerate(dens):
            k = int(d * numel)
            if d >= 1.0 or k >= numel or numel == 0:
                continue
            if k <= 0:
                raise _nothing_kept(d, None if isinstance(density, numbers.Real) else i, numel, name)
            thr[i], greater, equal = _kth_largest(lambda i=i: (magnitude(i, s, e) for s, e in ranges), k)
            if greater + equal > k:
                quota[i] = k - greater
    # pass 1 (DARE): L1 norms before / after the Bernoulli mask, then replay the same random stream in pass 2
    scale = [1.0] * n
    if sparsify == "random":
        if generator is None:
            raise ValueError("dare: a torch.Generator is required (seed it with tensor_seed(seed, name))")
        state = generator.get_state()
        before, after = [0.0] * n, [0.0] * n
        for s, e in ranges:
            for i, d in enumerate(dens):
                if d < 1.0:
                    keep = torch.rand(e - s, generator=generator) < d
                    dl = delta(i, s, e).abs()
                    before[i] += float(dl.sum(dtype=torch.float64))
                    after[i] += float(dl.masked_fill_(~keep, 0.0).sum(dtype=torch.float64))
        scale = [b / a if dens[i] < 1.0 and b >= L1_EPS and a >= L1_EPS else 1.0
                 for i, (b, a) in enumerate(zip(before, after))]
        generator.set_state(state)
    w_total = sum(weights)
    for s, e in ranges:  # pass 2: the merge
        wd = []  # weighted, sparsified deltas of this chunk
        for i, (w, d) in enumerate(zip(weights, dens)):
            di = delta(i, s, e)
            if sparsify == "magnitude" and thr[i] is not None:
                mag = magnitude(i, s, e)
                if quota[i] is None:  # every entry ≥ the threshold is in the top k
                    di = di.masked_fill(mag < thr[i], 0.0)
                else:  # magnitude ties at the threshold: keep the first quota[i] of them (flat order)
                    tied = mag == thr[i]
                    n_tied = int(tied.sum())
                    if n_tied > quota[i]:
                        tied &= tied.cumsum(0, dtype=torch.int32) <= quota[i]
                        n_tied = quota[i]
                    quota[i] -= n_tied
                    di = di.masked_fill(~(mag > thr[i]).logical_or_(tied), 0.0)
            elif sparsify == "random" and d < 1.0:
                di = di.masked_fill(torch.rand(e - s, generator=generator) >= d, 0.0)
                di.mul_(scale[i] * w)
                wd.append(di)
                continue
            wd.append(di * w)
        mixed = out[s:e]
        mixed.copy_(wd[0])
        for x in wd[1:]:
            mixed.add_(x)
        if consensus:  # elect a sign per position (≥ 0: +); an entry votes if nonzero and agreeing
            if consensus == "count":  # one vote per model: Σ sign(w_i δ_i)
                votes = torch.zeros_like(mixed)
                for x in wd:
                    votes.add_(torch.sign(x))
                plus = votes >= 0
                del votes
            else:  # "sum": the sign of the weighted sum
                plus = mixed >= 0
            mixed.zero_()
            divisor = torch.zeros_like(mixed)
            for w, x in zip(weights, wd):
                agree = torch.where(plus, x > 0, x < 0)
                mixed.add_(x.mul_(agree))
                divisor.add_(agree, alpha=w)
            divisor[divisor == 0] = 1.0
            if normalize:
                mixed.div_(divisor)
        elif normalize:
            mixed.div_(w_total if abs(w_total) >= 1e-8 else 1.0)
        mixed.mul_(lambda_).add_(base(s, e))


def _nothing_kept(density: float, model: int | None, numel: int, name: str) -> MergeError:
    of = "" if model is None else f" of model {model}"
    return MergeError(f"ties: density {density:g}{of} keeps int({density:g} × {numel}) = 0 entries of tensor "
                      f"{name!r}; pruning a whole task vector is refused (as mergekit does): use a density of at "
                      f"least {1 / numel:.3g} (≥ 1 entry) or 1 to keep it all")


def check_density(recipe: "Recipe", name: str, numel: int) -> None:
    """Raise the MergeError that merging tensor `name` (numel elements) by `recipe` would: a ties density that
    keeps int(density · numel) = 0 of its entries. From the shape alone, so a file merge refuses before reading."""
    if recipe.method != "ties" or numel == 0:
        return
    per_model = isinstance(recipe.density, tuple)
    for i, d in enumerate(recipe.density if per_model else (recipe.density,)):
        if d < 1.0 and int(d * numel) <= 0:
            raise _nothing_kept(d, i if per_model else None, numel, name)


def _run(kernel, numel: int, shape, dtype: torch.dtype, chunk: int | None, *args, **kw) -> Tensor:
    chunk = chunk or CHUNK
    flat = torch.empty(numel, dtype=torch.float32)
    kernel(numel, *args, out=flat, chunk=chunk, **kw)
    return flat.reshape(shape).to(dtype)


def _check_same_shape(tensors: Sequence[Tensor], what: str) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise MergeError(f"{what}: shapes differ: {sorted(shapes)}")


# -- the public tensor functions -------------------------------------------------------------------------------------
def linear_merge(tensors: Sequence[Tensor], weights: Sequence[float], normalize: bool = True) -> Tensor:
    _check_same_shape(tensors, "linear_merge")
    x = tensors[0]
    return _run(_linear, x.numel(), x.shape, x.dtype, None, [memory_source(t) for t in tensors],
                [float(w) for w in weights], normalize)


def _gta(base: Tensor, tensors, weights, **kw) -> Tensor:
    _check_same_shape([base, *tensors], "merge")
    x = tensors[0]
    return _run(_task, x.numel(), x.shape, x.dtype, None, _Cached(memory_source(base)),
                [_Cached(memory_source(t)) for t in tensors], [float(w) for w in weights], **kw)


def task_arithmetic(base: Tensor, tensors, weights, normalize: bool = False, lambda_: float = 1.0) -> Tensor:
    return _gta(base, tensors, weights, normalize=normalize, lambda_=lambda_)


def ties_merge(base, tensors, weights, density: float | Sequence[float], normalize: bool = True,
               lambda_: float = 1.0, consensus_method: str = "sum") -> Tensor:
    return _gta(base, tensors, weights, normalize=normalize, lambda_=lambda_, sparsify="magnitude",
                density=density, consensus=consensus_method)


def dare_merge(base, tensors, weights, density, generator: torch.Generator, ties: bool, normalize: bool = False,
               lambda_: float = 1.0, consensus_method: str = "sum") -> Tensor:
    return _gta(base, tensors, weights, normalize=normalize, lambda_=lambda_, sparsify="random",
                density=density, consensus=consensus_method if ties else None, generator=generator)


# -- recipes ---------------------------------------------------------------------------------------------------------
def _finite(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise ValueError(f"recipe: {what} must be a finite number, got {x!r}")
    return float(x)


@dataclass(frozen=True)
class Recipe:
    """One merge: the method and its parameters (mergekit's names). JSON round-trip with to_dict / from_dict."""
    method: str                                   # linear | slerp | task_arithmetic | ties | dare_linear | dare_ties
    weights: tuple[float, ...] | None = None      # one per model (None = 1/n each); not for slerp
    density: float | tuple[float, ...] = 1.0      # ties / dare: fraction of each task vector kept, in [0, 1]
    t_curves: Mapping | None = None               # slerp: {filter: t or [t, ...]} (merge.t_for); None = 0.5
    normalize: bool | None = None                 # None = mergekit's default for the method (DEFAULT_NORMALIZE)
    lambda_: float = 1.0                          # scales the merged task vector; serialised as "lambda"
    seed: int = 0                                 # DARE's random stream (with each tensor's name)
    consensus_method: str | None = None           # ties / dare_ties: sign election "sum" | "count"; None = "sum"
    NEEDS_BASE: ClassVar = frozenset({"task_arithmetic", "ties", "dare_linear", "dare_ties"})
    _FIELDS: ClassVar = ("method", "weights", "density", "t_curves", "normalize", "lambda", "seed",
                         "consensus_method")

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"recipe: method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.weights is not None:
            if isinstance(self.weights, (str, bytes)) or not isinstance(self.weights, Sequence) or not self.weights:
                raise ValueError(f"recipe: weights must be a non-empty list of numbers or null, got {self.weights!r}")
            object.__setattr__(self, "weights", tuple(_finite(w, "every weight") for w in self.weights))
            if self.method == "slerp":
                raise ValueError("recipe: slerp takes t_curves, not weights (set weights to null)")
            if self.method == "linear" and self.normalize is not False and sum(self.weights) == 0:
                raise ValueError(f"recipe: linear weights {list(self.weights)} sum to 0; cannot normalise")
        dens = self.density
        if isinstance(dens, (list, tuple)):
            dens = tuple(_finite(d, "every density") for d in dens)
            if not dens:
                raise ValueError("recipe: density must be a number or a non-empty list")
        else:
            dens = _finite(dens, "density")
        if any(not 0.0 <= d <= 1.0 for d in (dens if isinstance(dens, tuple) else (dens,))):
            raise ValueError(f"recipe: density must lie in [0, 1], got {dens}")
        if self.method == "ties" and 0.0 in (dens if isinstance(dens, tuple) else (dens,)):
            raise ValueError(f"recipe: ties density {dens} has a 0: it would prune a whole task vector "
                             f"(k = 0), which mergekit refuses; use a density > 0")
        object.__setattr__(self, "density", dens)
        if self.t_curves is not None:
            if self.method != "slerp":
                raise ValueError(f"recipe: t_curves are for slerp, not {self.method}")
            if not isinstance(self.t_curves, Mapping) or not self.t_curves:
                raise ValueError(f"recipe: t_curves must be a non-empty {{filter: t or [t, ...]}}, "
                                 f"got {self.t_curves!r}")
            curves = {}
            for k, v in self.t_curves.items():
                if not isinstance(k, str):
                    raise ValueError(f"recipe: t_curves filter {k!r} must be a string")
                if isinstance(v, (list, tuple)):
                    if not v:
                        raise ValueError(f"recipe: t_curves[{k!r}] is an empty list")
                    curves[k] = tuple(_finite(x, f"t_curves[{k!r}] values") for x in v)
                else:
                    curves[k] = _finite(v, f"t_curves[{k!r}]")
            object.__setattr__(self, "t_curves", curves)
        if self.normalize is None:
            object.__setattr__(self, "normalize", DEFAULT_NORMALIZE[self.method])
        elif not isinstance(self.normalize, bool):
            raise ValueError(f"recipe: normalize must be true or false, got {self.normalize!r}")
        object.__setattr__(self, "lambda_", _finite(self.lambda_, "lambda"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"recipe: seed must be a non-negative integer, got {self.seed!r}")
        if self.consensus_method is None:
            if self.method in SIGN_ELECTING:
                object.__setattr__(self, "consensus_method", "sum")
        elif self.method not in SIGN_ELECTING:
            raise ValueError(f"recipe: consensus_method is for {' / '.join(SIGN_ELECTING)} (sign election), not "
                             f"{self.method} (set it to null)")
        elif self.consensus_method not in CONSENSUS_METHODS:
            raise ValueError(f"recipe: consensus_method must be one of {', '.join(CONSENSUS_METHODS)}, "
                             f"got {self.consensus_method!r}")

    def check_models(self, n_models: int, has_base: bool) -> None:
        """Raise ValueError unless this recipe can merge n_models models (with / without a base)."""
        if n_models < 1:
            raise ValueError("recipe: no models to merge")
        if self.method == "slerp" and n_models != 2:
            raise ValueError(f"recipe: slerp merges exactly 2 models, got {n_models}")
        if self.weights is not None and len(self.weights) != n_models:
            raise ValueError(f"recipe: {len(self.weights)} weights for {n_models} models")
        if isinstance(self.density, tuple) and len(self.density) != n_models:
            raise ValueError(f"recipe: {len(self.density)} densities for {n_models} models")
        if self.method in self.NEEDS_BASE and not has_base:
            raise ValueError(f"recipe: {self.method} needs a base model (task vectors are model − base)")

    def weights_for(self, n_models: int) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0 / n_models] * n_models

    def to_dict(self) -> dict:
        return {"method": self.method, "weights": None if self.weights is None else list(self.weights),
                "density": list(self.density) if isinstance(self.density, tuple) else self.density,
                "t_curves": None if self.t_curves is None else
                {k: list(v) if isinstance(v, tuple) else v for k, v in self.t_curves.items()},
                "normalize": self.normalize, "lambda": self.lambda_, "seed": self.seed,
                "consensus_method": self.consensus_method}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Recipe":
        if not isinstance(d, Mapping):
            raise ValueError(f"recipe: expected a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls._FIELDS))
        if unknown:
            raise ValueError(f"recipe: unknown field(s) {unknown}; allowed: {', '.join(cls._FIELDS)}")
        if "method" not in d:
            raise ValueError("recipe: 'method' is required")
        kw = {k: v for k, v in d.items() if k != "lambda"}
        if "lambda" in d:
            kw["lambda_"] = d["lambda"]
        return cls(**kw)


# -- one tensor of a recipe (shared by the state-dict and the streaming form) ------------------------------------------
def merge_tensor(recipe: Recipe, name: str, sources: Sequence[Source], base: Source | None, numel: int, shape,
                 dtype: torch.dtype, num_layers: int, chunk: int | None = None) -> Tensor:
    """The merged tensor `name` from its per-model sources (and the base's), in `dtype`. `chunk` defaults to
    CHUNK read at call time: DARE's random stream depends on it, so every form uses the same."""
    chunk = chunk or CHUNK
    srcs = [_Cached(s) for s in sources]
    w = recipe.weights_for(len(srcs))
    m = recipe.method
    if m == "linear":
        return _run(_linear, numel, shape, dtype, chunk, srcs, w, recipe.normalize)
    if m == "slerp":
        t = t_for(name, recipe.t_curves or {"default": 0.5}, num_layers)
        return _run(_slerp, numel, shape, dtype, chunk, srcs[0], srcs[1], t)
    kw = dict(normalize=recipe.normalize, lambda_=recipe.lambda_, consensus=recipe.consensus_method, name=name)
    if m == "ties":
        kw.update(sparsify="magnitude", density=recipe.density)
    elif m in ("dare_linear", "dare_ties"):
        kw.update(sparsify="random", density=recipe.density,
                  generator=torch.Generator().manual_seed(tensor_seed(recipe.seed, name)))
    return _run(_task, numel, shape, dtype, chunk, _Cached(base), srcs, w, **kw)


def _lookup(sd: Mapping[str, Tensor], name: str, who: str) -> Tensor:
    if name in sd:
        return sd[name]
    if name in TIED and TIED[name] in sd:  # tied embeddings
        return sd[TIED[name]]
    raise MergeError(f"{who}: tensor {name!r} is missing (present in model 0)")


def merge_state_dicts(recipe: Recipe, models: Sequence[Mapping[str, Tensor]],
                      base: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Merge whole state dicts in memory (names and dtypes of models[0]); see merge_stream for the file form."""
    recipe.check_models(len(models), base is not None)
    use_base = recipe.method in Recipe.NEEDS_BASE
    first = models[0]
    num_layers = count_layers(first)
    out = {}
    for name, x in first.items():
        ts = [x] + [_lookup(sd, name, f"model {j}") for j, sd in enumerate(models[1:], 1)]
        b = _lookup(base, name, "base model") if use_base else None
        for who, t in [(f"model {j}", t) for j, t in enumerate(ts)] + ([("base model", b)] if use_base else []):
            if tuple(t.shape) != tuple(x.shape):
                raise MergeError(f"{who}: tensor {name!r} has shape {tuple(t.shape)}, model 0 has {tuple(x.shape)}")
        if not x.is_floating_point():
            out[name] = x.clone()
            continue
        out[name] = merge_tensor(recipe, name, [memory_source(t) for t in ts],
                                 memory_source(b) if use_base else None, x.numel(), x.shape, x.dtype, num_layers)
    return out
