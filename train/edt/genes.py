"""Evolution as pure functions: fitness, parent selection, and the DNA (genes that pick real hyperparameters).

Selection (one call per generation, deterministic for a seed):
  * the pool is every evaluated member of the current and the previous generation (the prototype's rule);
  * the `elitism` fittest members of the pool are carried, each paired with itself;
  * every other child gets two parents by tournament (`tournament_size` contestants drawn without replacement, the
    fittest wins) or by linear rank weights; the second parent is drawn from the pool without the first, so a
    member is never paired with itself when two or more members exist.
Non-finite fitness (a diverged member) ranks below everything.

DNA: a dict gene -> u in [0, 1]; `decode` maps it onto the ranges in `edt.genes` (GENES says what each gene
drives). A child's DNA is a uniform crossover of its parents' (each gene from one parent, chosen at random), then
each gene is perturbed by N(0, mutation_strength) with probability mutation_probability and clipped to [0, 1]; the
genome records whether any gene was perturbed (`mutated`). Elites keep their DNA unchanged.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from train.core.plugins import import_attr
from train.core.errors import ConfigError

DNA = dict  # gene name -> position in [0, 1]


@dataclass(frozen=True)
class Gene:
    name: str
    drives: str
    log: bool        # log-scale interpolation between low and high
    relative: bool   # the decoded value multiplies the configured base value


GENES: dict[str, Gene] = {g.name: g for g in (
    Gene("inner_lr", "peak AdamW lr of the mutation = inner.lr x factor (factor log-uniform in [low, high])",
         log=True, relative=True),
    Gene("outer_lr", "lr of the outer_sgd crossover step that makes the child", log=False, relative=False),
    Gene("outer_momentum", "momentum of that outer step (Nesterov when outer.nesterov)", log=False, relative=False),
    Gene("data_mix", "fraction of training windows drawn from the whole corpus instead of the member's own shard",
         log=False, relative=False),
)}


# -- fitness ---------------------------------------------------------------------------------------------------------
def inverse_loss(result: Mapping) -> float:
    loss = result.get("eval_loss")
    return 1.0 / loss if isinstance(loss, (int, float)) and math.isfinite(loss) and loss > 0 else float("-inf")


def neg_loss(result: Mapping) -> float:
    loss = result.get("eval_loss")
    return -float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else float("-inf")


def tasks(result: Mapping) -> float:
    """EvoMerge: the weighted sum of the member's task scores (evomerge.tasks), computed by the worker."""
    v = result.get("task_fitness")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else float("-inf")


def lm_eval(result: Mapping) -> float:
    """EvoMerge: the weighted sum of the member's lm-evaluation-harness scores (evomerge.lm_eval; lower-is-better
    metrics such as perplexity counted negatively), computed by the worker."""
    v = result.get("lm_eval_fitness")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else float("-inf")


FITNESS: dict[str, Callable[[Mapping], float]] = {"inverse_loss": inverse_loss, "neg_loss": neg_loss, "tasks": tasks,
                                                  "lm_eval": lm_eval}


def fitness_function(spec: str) -> Callable[[Mapping], float]:
    """A built-in name or `package.module:function` taking the member's result dict (eval_loss, train_loss,
    tokens, ...) and returning a float, higher = fitter."""
    if spec in FITNESS:
        return FITNESS[spec]
    try:
        return import_attr(spec)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"edt.fitness = {spec!r}: cannot import it ({type(e).__name__}: {e}); give a built-in "
                          f"({', '.join(FITNESS)}) or package.module:function importable on every machine") from None


def _key(f: float) -> float:
    return f if isinstance(f, (int, float)) and math.isfinite(f) else float("-inf")


# -- selection -------------------------------------------------------------------------------------------------------
def rank_order(fitness: Sequence[float]) -> list[int]:
    """Indices from fittest to least fit (ties: lower index first)."""
    return sorted(range(len(fitness)), key=lambda i: (-_key(fitness[i]), i))


def rank_weights(fitness: Sequence[float]) -> list[float]:
    """Linear ranking: the best of n weighs n, the worst 1, normalised to sum to 1."""
    n = len(fitness)
    if n == 0:
        return []
    w = [0.0] * n
    for r, i in enumerate(rank_order(fitness)):
        w[i] = float(n - r)
    total = sum(w)
    return [x / total for x in w]


def tournament(fitness: Sequence[float], size: int, rng: random.Random, exclude: int | None = None) -> int:
    """Draw `size` distinct contestants (fewer if the pool is smaller) and return the fittest."""
    cands = [i for i in range(len(fitness)) if i != exclude]
    if not cands:
        raise ValueError("tournament: empty pool")
    picked = rng.sample(cands, min(size, len(cands)))
    return min(picked, key=lambda i: (-_key(fitness[i]), i))


def rank_pick(fitness: Sequence[float], rng: random.Random, exclude: int | None = None) -> int:
    w = rank_weights(fitness)
    cands = [i for i in range(len(fitness)) if i != exclude]
    if not cands:
        raise ValueError("rank selection: empty pool")
    return rng.choices(cands, weights=[w[i] for i in cands])[0]


def select_pairs(fitness: Sequence[float], n_children: int, elitism: int = 1, method: str = "tournament",
                 tournament_size: int = 3, rng: random.Random | None = None) -> list[tuple[int, int]]:
    """Parent index pairs for `n_children` children: first the elites (i, i), best first, then drawn pairs with
    two distinct parents whenever the pool holds two or more members."""
    if not fitness:
        raise ValueError("select_pairs: empty pool")
    if method not in ("tournament", "rank"):
        raise ValueError(f"select_pairs: unknown method {method!r} (tournament or rank)")
    rng = rng or random.Random(0)
    order = rank_order(fitness)
    n_elite = min(elitism, n_children, len(fitness))
    pairs = [(i, i) for i in order[:n_elite]]
    pick = (lambda ex=None: tournament(fitness, tournament_size, rng, ex)) if method == "tournament" else \
        (lambda ex=None: rank_pick(fitness, rng, ex))
    while len(pairs) < n_children:
        a = pick()
        b = pick(a) if len(fitness) > 1 else a
        pairs.append((a, b))
    return pairs


def generation_rng(seed: int, generation: int, stream: int = 0) -> random.Random:
    """The RNG of one generation's decisions: the same after a restart, different per generation and stream."""
    return random.Random((seed * 1_000_003 + generation) * 7 + stream)


# -- DNA -------------------------------------------------------------------------------------------------------------
def random_dna(genes: Mapping[str, Sequence[float]], rng: random.Random) -> DNA:
    return {g: rng.random() for g in sorted(genes)}


def crossover_dna(a: DNA, b: DNA, rng: random.Random) -> DNA:
    """Uniform crossover: each gene from one parent (a gene only one parent has is taken from it)."""
    out = {}
    for g in sorted(set(a) | set(b)):
        if g in a and g in b:
            out[g] = a[g] if rng.random() < 0.5 else b[g]
        else:
            out[g] = a.get(g, b.get(g))
    return out


def mutate_dna(dna: DNA, probability: float, strength: float, rng: random.Random) -> tuple[DNA, bool]:
    """Perturb each gene with `probability` by N(0, strength), clipped to [0, 1]; returns (dna, any perturbed)."""
    out, mutated = {}, False
    for g in sorted(dna):
        u = dna[g]
        if rng.random() < probability:
            u = min(1.0, max(0.0, u + rng.gauss(0.0, strength)))
            mutated = True
        out[g] = u
    return out, mutated


def fit_dna(dna: DNA, genes: Mapping[str, Sequence[float]], rng: random.Random) -> DNA:
    """Keep the configured genes: drop unknown ones, draw missing ones (a config that gained a gene on resume)."""
    return {g: dna[g] if g in dna else rng.random() for g in sorted(genes)}


def decode(dna: DNA, genes: Mapping[str, Sequence[float]], base: Mapping[str, float]) -> dict[str, float]:
    """The hyperparameters a DNA selects: every gene of GENES, from the DNA when configured, else `base`
    (inner_lr, outer_lr, outer_momentum, data_mix taken from the config)."""
    out = {}
    for name, gene in GENES.items():
        if name not in genes or name not in dna:
            out[name] = float(base[name])
            continue
        lo, hi = (float(x) for x in genes[name])
        u = min(1.0, max(0.0, float(dna[name])))
        v = lo * (hi / lo) ** u if gene.log and lo > 0 else lo + (hi - lo) * u
        out[name] = v * float(base[name]) if gene.relative else v
    return out

