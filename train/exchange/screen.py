"""The screen (outer.screen): well-formed but bad deltas — scaled by a broken loss scale, sign-flipped, a diverged
worker — rejected before they are averaged, in rounds with at least MIN_DELTAS on-time deltas.

A round's deltas are screened as a set once the round closes, so the decision depends only on which deltas came,
never on the order they arrived in:

- **norm**: a delta whose L2 norm is over `ratio` x the median norm of the round's deltas, or under 1 / `ratio` x
  (outer.screen_norm_ratio, default 5). A delta trained from fresh inner optimizer moments (its sidecar's
  `fresh_moments`: a worker that joined, or restarted without its moments) gets FRESH_SLACK x that band: AdamW's
  first steps move every parameter by about the lr, so its delta is legitimately larger (6.5x the median was seen
  for a 5-step joiner), while a x100 corruption is still far outside;
- **direction**: then, among the deltas the norm check kept (at least MIN_DELTAS of them), a delta whose cosine with
  the weighted mean of the others is below `min_cos` (outer.screen_min_cosine, default -0.5).

Memory stays bounded while the coordinator reduces on arrival (it never holds the deltas): each delta's exact squared
norm is summed while it is decoded, and a fixed strided sample of its decoded values is kept (every `stride`-th value
of the model's flat parameter vector, `stride` a prime so it does not line up with tensor shapes; all of them for
models of up to SAMPLE values), at most SAMPLE float64 values (8 MB) per delta. The cosines come from the small Gram
matrix of these samples: exact up to SAMPLE parameters, an unbiased estimate above (its error, about 1/sqrt(SAMPLE)
= 0.001 for dense deltas, is far below any threshold that matters). Nothing is read twice; the cost on the tail is
an N x N matrix taken from the Gram matrix that grew as the deltas came (`seal`: each accepted delta's dot
products with those before it, computed on arrival), and, only when something is rejected, the sum rebuilt from the
accepted files.

That Gram matrix costs N² x (sample size) multiplications, and the samples N x (sample size) x 8 bytes: at N = 256
with full 1M-value samples, 0.3 s of the coordinator's tail for the micro model already (bench/scale.py) and 2 GB
for the 135M one. So a round that awaits N deltas samples at most GRAM_BUDGET / N² values of each (never fewer than
MIN_SAMPLE): the full SAMPLE up to 16 deltas, 65,536 at 64, 4,096 at 256 (a cosine within about 1/sqrt(4096) =
0.016 of the exact one: still far from the -0.5 threshold; the norms stay exact). The sample size depends only on the
round's expected count, so every process that screens the same round samples the same values.

`decide` is the decision itself, on numbers only (unit-tested in tests/unit/test_screen.py).
"""
from __future__ import annotations

import math
import statistics

import torch

SAMPLE = 1 << 20   # sampled values kept per delta for the cosines (exact below this many parameters)
GRAM_BUDGET = SAMPLE * 16 * 16  # N² x sample size: the full SAMPLE up to 16 deltas a round, less above
MIN_SAMPLE = 4096  # ... but never fewer sampled values than this per delta
MIN_DELTAS = 3     # the screen applies where a round has at least this many deltas
STREAK = 3         # a worker screened out this many rounds in a row is reported (coordinator log and metrics)
FRESH_SLACK = 4.0  # the norm band is this much wider for a delta trained from fresh optimizer moments
# The noise floor (the direction rule): noise's cosine with any fixed direction is 0 ± 1/sqrt(values sampled), so a
# cosine under NOISE_SIGMAS / sqrt(sample) is one noise would have; the rule applies only where the healthy level
# (the others' median cosine, or the history's pair cosine) is at least CLEAR x that floor, so a healthy delta would
# have to fall to a quarter of its peers' cosine to be taken for noise. Evidence: healthy cosines with the others'
# mean 0.63-0.87 (fp32, int8) and 0.18-0.53 (topk) at H = 30; the soaks' figures are in docs/protocol.md.
NOISE_SIGMAS = 3.0
CLEAR = 8.0
HISTORY = 8        # rounds of pair cosines the coordinator remembers (ScreenHistory) ...
MIN_HISTORY = 3    # ... and how many it needs before it judges a round of 2 by them


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, math.isqrt(n) + 1))


def stride_for(numel: int, sample: int | None = None) -> int:
    """1 (every value) for up to `sample` (SAMPLE) values, else the smallest prime >= numel / sample."""
    sample = SAMPLE if sample is None else sample
    if numel <= sample:
        return 1
    s = -(-numel // sample)
    while not _is_prime(s):
        s += 1
    return s


def sample_size(deltas: int) -> int:
    """Values sampled per delta in a round that awaits `deltas` deltas: SAMPLE, less where the Gram matrix of
    that many samples would pass GRAM_BUDGET multiplications (never under MIN_SAMPLE)."""
    return max(MIN_SAMPLE, min(SAMPLE, GRAM_BUDGET // max(1, int(deltas)) ** 2))


class DeltaStats:
    """Per delta: its exact squared norm and its strided sample, fed tensor by tensor in the model's order.
    `deltas`: how many the round awaits (the sample size, `sample_size`)."""

    def __init__(self, shapes: dict[str, tuple], deltas: int = 1):
        self.order = list(shapes)
        total = sum(math.prod(s) for s in shapes.values())
        self.stride = stride_for(total, sample_size(deltas))
        self.start: dict[str, int] = {}
        pos = 0
        for n in self.order:
            self.start[n] = pos
            pos += math.prod(shapes[n])
        self.norm2: dict = {}
        self.samples: dict = {}      # key -> the pieces of its sample, until seal()
        self._slot: dict = {}        # key -> its row in _S and _G (sealed)
        self._S: torch.Tensor | None = None  # the sealed samples, one row each
        self._G: torch.Tensor | None = None  # their dot products (the Gram matrix, grown as deltas are sealed)
        self._cap = max(4, int(deltas))
        self._rows = 0               # rows of _S / _G used

    def observe(self, key, name: str, d: torch.Tensor) -> None:
        """Delta `key`'s decoded tensor `name` (any float dtype; read, not kept)."""
        self.observe_chunk(key, name, 0, d)

    def observe_chunk(self, key, name: str, offset: int, d: torch.Tensor) -> None:
        """The values `offset`.. of delta `key`'s decoded tensor `name`, pieces fed in order (the accumulator's
        pieces: the samples are the same every-s-th values of the flat model as a whole tensor's)."""
        self.take(key, self.chunk_stats(name, offset, d))

    def chunk_stats(self, name: str, offset: int, d: torch.Tensor) -> tuple[float, torch.Tensor]:
        """observe_chunk's work without its bookkeeping (any thread): the piece's squared norm and its sample."""
        flat = d.reshape(-1).to(torch.float64)
        phase = (-(self.start[name] + offset)) % self.stride
        return float(flat.dot(flat)), flat[phase::self.stride].clone()

    def take(self, key, stats: tuple[float, torch.Tensor]) -> None:
        """One piece's chunk_stats for delta `key`, taken in the pieces' order (the norm's float sum is summed in
        that order, the sample concatenated in it)."""
        self.norm2[key] = self.norm2.get(key, 0.0) + stats[0]
        self.samples.setdefault(key, []).append(stats[1])

    def seal(self, key) -> None:
        """Delta `key` is whole (every tensor observed; the accumulator accepted it): its sample becomes a row of
        the Gram matrix now, while the round is still collecting (its dot products with the deltas sealed before
        it, N x sample multiplications), so the screen at the round's close multiplies nothing: the whole N x N
        Gram there was 13-24 ms of the coordinator's tail at N = 256 (bench/scale.py). Does nothing for a key
        sealed already or never observed."""
        if key in self._slot or key not in self.samples:
            return
        v = torch.cat(self.samples.pop(key))
        slot = self._rows  # rows are never reused: forget() only hides one (a round rejects few)
        if self._S is None:
            self._S = torch.empty(self._cap, v.numel(), dtype=torch.float64)
            self._G = torch.zeros(self._cap, self._cap, dtype=torch.float64)
        elif v.numel() != self._S.shape[1]:
            raise ValueError(f"delta {key!r}: a sample of {v.numel()} values, the others have {self._S.shape[1]}")
        if slot == self._S.shape[0]:  # more than the round awaited (a late joiner): twice the room
            cap = 2 * slot
            S = torch.empty(cap, v.numel(), dtype=torch.float64)
            S[:slot] = self._S
            G = torch.zeros(cap, cap, dtype=torch.float64)
            G[:slot, :slot] = self._G
            self._S, self._G = S, G
        self._S[slot] = v
        row = self._S[:slot + 1] @ v
        self._G[slot, :slot + 1] = row
        self._G[:slot + 1, slot] = row
        self._slot[key] = slot
        self._rows += 1

    def sample(self, key) -> torch.Tensor:
        """Delta `key`'s sampled values (float64), sealed or not."""
        return self._S[self._slot[key]] if key in self._slot else torch.cat(self.samples[key])

    def forget(self, key) -> None:
        self.norm2.pop(key, None)
        self.samples.pop(key, None)
        self._slot.pop(key, None)

    def gram(self, keys: list) -> torch.Tensor:
        """The float64 Gram matrix of the keys' samples, in their order (keys not sealed yet are sealed first)."""
        if not keys:
            return torch.zeros(0, 0, dtype=torch.float64)
        for k in keys:
            self.seal(k)
        idx = torch.tensor([self._slot[k] for k in keys], dtype=torch.long)
        return self._G[idx][:, idx]


def noise_floor(sample: int) -> float:
    """The cosine under which a direction is indistinguishable from noise's, with `sample` values sampled."""
    return NOISE_SIGMAS / math.sqrt(sample) if sample > 0 else math.inf


def step_scale(s: float, s_ref: float) -> float:
    """How much lower a delta of s inner steps may align than one of s_ref: a delta's common (signal) part grows
    with its steps, its data noise with their square root, so its cosine with a fixed direction goes as sqrt(s)."""
    return math.sqrt(min(1.0, s / s_ref)) if s > 0 and s_ref > 0 else 1.0


def decide(keys: list, norms: list[float], gram, weights: list[float], ratio: float,
           min_cos: float, fresh: set | frozenset = frozenset(), sample: int = 0,
           steps: list[float] | None = None) -> tuple[dict, dict]:
    """The screen's verdict on one round: ({key: reason} of the rejected, {key: {norm_ratio, cos}} of everyone).
    `norms[i]`: delta i's exact L2 norm; `gram[i][j]`: the dot product of deltas i and j (of their samples: a float64
    tensor, or nested lists);
    `weights[i]`: its weight in the mean (tokens); `fresh`: the keys trained from fresh optimizer moments (their norm
    band is FRESH_SLACK x wider; the noise floor does not judge them). `sample`: values per sample (the noise floor,
    `noise_floor`; 0: no floor rule); `steps[i]`: delta i's inner steps. Fewer than MIN_DELTAS deltas: nothing is
    screened (a round of 2: `decide_pair`)."""
    info: dict = {k: {} for k in keys}
    if len(keys) < MIN_DELTAS:
        return {}, info
    med = statistics.median(norms)
    rejected: dict = {}
    for k, n in zip(keys, norms):
        q = n / med if med > 0 else (1.0 if n == 0 else math.inf)
        info[k]["norm_ratio"] = round(q, 4)
        band, why = (ratio * FRESH_SLACK, f" x {FRESH_SLACK:g}, fresh moments") if k in fresh else (ratio, "")
        if k in fresh:
            info[k]["fresh_moments"] = True
        if q > band:
            rejected[k] = f"screen: norm {n:.4g} is {q:.3g}x the round's median {med:.4g} (over " \
                          f"outer.screen_norm_ratio = {ratio:g}{why})"
        elif q < 1 / band:
            rejected[k] = f"screen: norm {n:.4g} is {q:.3g}x the round's median {med:.4g} (under 1 / " \
                          f"outer.screen_norm_ratio = {1 / ratio:.3g}{why})"
    kept = [i for i, k in enumerate(keys) if k not in rejected]
    if len(kept) < MIN_DELTAS:
        return rejected, info
    exact = _cos_with_others(gram, kept, weights)
    for i, cos in exact.items():
        info[keys[i]]["cos"] = round(cos, 4)
        if cos < min_cos:
            rejected[keys[i]] = f"screen: cosine {cos:.3f} with the mean of the round's other deltas (below " \
                                f"outer.screen_min_cosine = {min_cos:g})"
    # the noise floor: a delta whose cosine noise would have while the others' (their median) clearly align; the
    # cosines taken again without the deltas the cosine rule rejected (a flipped delta in the others' mean cancels a
    # healthy one: a healthy delta's cosine was seen at 0 beside it)
    floor = noise_floor(sample)
    kept = [i for i in exact if keys[i] not in rejected]
    cos_of = exact if len(kept) == len(exact) else _cos_with_others(gram, kept, weights)
    for i, cos in cos_of.items():
        k = keys[i]
        others = [c for j, c in cos_of.items() if j != i]
        if len(others) < MIN_DELTAS - 1 or not math.isfinite(floor):
            continue
        ref = statistics.median(others)
        s_ref = statistics.median([float(steps[j]) for j in cos_of if j != i]) if steps else 1.0
        scale = step_scale(float(steps[i]), s_ref) if steps else 1.0
        info[k].update(cos_ref=round(ref, 4), cos_floor=round(floor, 4))
        if k in fresh or ref * scale < CLEAR * floor or cos >= floor:
            continue
        why = f", x {scale:.2f} for its {steps[i]:g} inner steps against {s_ref:g}" if scale < 1 else ""
        rejected[k] = (f"screen: cosine {cos:.4f} with the mean of the round's other deltas is at the noise floor "
                       f"(under {NOISE_SIGMAS:g}/sqrt({sample}) = {floor:.4f}) while the others' median is "
                       f"{ref:.4f} (over {CLEAR:g} x the floor{why}): noise, not a direction")
    return rejected, info


def _cos_with_others(gram, kept: list[int], weights: list[float]) -> dict[int, float]:
    """{i: the cosine of delta i with the weighted sum of the other kept deltas} (i in `kept`, indices of gram)."""
    # o_i = Σ_{j≠i} w_j s_j through the Gram matrix of the kept: ⟨s_i, o_i⟩ = (G w)_i − w_i G_ii and |o_i|² =
    # wᵀG w − 2 w_i (G w)_i + w_i² G_ii, O(N²) (the sums over every pair for every i were O(N³) Python: 3 s of the
    # coordinator's tail at N = 256, bench/scale.py). float64; the kept norms lie within outer.screen_norm_ratio of
    # each other, so no term dwarfs the result it is subtracted into
    idx = torch.tensor(kept, dtype=torch.long)
    G = torch.as_tensor(gram, dtype=torch.float64)[idx][:, idx]
    w = torch.tensor([float(weights[i]) for i in kept], dtype=torch.float64)
    Gw = G @ w
    diag = torch.diagonal(G)
    dots = (Gw - w * diag).tolist()
    o2s = (w @ Gw - 2 * w * Gw + w * w * diag).tolist()
    sq = diag.tolist()
    return {i: dots[x] / math.sqrt(sq[x] * o2s[x]) for x, i in enumerate(kept) if sq[x] > 0 and o2s[x] > 0}


def pair_cosines(gram) -> list[float]:
    """The cosines of every pair of the Gram matrix's deltas."""
    G = torch.as_tensor(gram, dtype=torch.float64)
    d = torch.diagonal(G).clamp_min(1e-300).sqrt()
    C = G / d[:, None] / d[None, :]
    n = G.shape[0]
    return [float(C[i, j]) for i in range(n) for j in range(i + 1, n)]


def decide_pair(keys: list, gram, sample: int, level: float | None, prev_cos: list[float | None],
                gains: list[float] | None, margin: float, steps: list[float] | None = None,
                fresh: set | frozenset = frozenset()) -> tuple[dict, dict]:
    """The noise floor in a round of exactly 2 deltas, where there is no median of others: their cosine with each
    other against `level`, the median pair cosine of the recent rounds (ScreenHistory; None: too few remembered).
    Where the history's level is clearly above the floor (CLEAR x) and this pair's cosine is at the floor, one of the
    two is not a direction; the one rejected is, first, the one whose cosine with the previous round's update
    (`prev_cos`: a healthy worker keeps going where its optimizer's moments point) is at the floor while the other's
    is over twice it, else the one whose loss gain (`gains`, the loss screen's) is lower by more than `margin`; else
    neither, said in the metrics (`pair`). Returns ({key: reason}, {key: {...}})."""
    info: dict = {k: {} for k in keys}
    floor = noise_floor(sample)
    if len(keys) != 2 or not math.isfinite(floor):
        return {}, info
    c = pair_cosines(gram)[0]
    scale = step_scale(min(steps), max(steps)) if steps else 1.0
    for x, k in enumerate(keys):
        info[k].update(cos=round(c, 4), cos_floor=round(floor, 4))
        if level is not None:
            info[k]["cos_ref"] = round(level, 4)
        if prev_cos[x] is not None:
            info[k]["cos_prev"] = round(prev_cos[x], 4)
    if level is None or level * scale < CLEAR * floor or c >= floor or set(keys) & set(fresh):
        return {}, info
    said = (f"screen: the pair's cosine {c:.4f} is at the noise floor (under {NOISE_SIGMAS:g}/sqrt({sample}) = "
            f"{floor:.4f}) while the recent rounds' pair cosine is {level:.4f} (over {CLEAR:g} x the floor)")
    p = prev_cos
    if p[0] is not None and p[1] is not None:
        for x in (0, 1):
            if p[x] < floor and p[1 - x] >= 2 * floor:
                return {keys[x]: f"{said}; its cosine with the previous round's update is {p[x]:.4f}, the other's "
                                 f"{p[1 - x]:.4f}: noise, not a direction"}, info
    if gains is not None and all(math.isfinite(g) for g in gains):
        for x in (0, 1):
            if gains[x] < gains[1 - x] - margin:
                return {keys[x]: f"{said}; its loss gain {gains[x]:+.4f} is below the other's {gains[1 - x]:+.4f} by "
                                 f"more than outer.screen_loss_margin = {margin:g}: noise, not a direction"}, info
    for k in keys:
        info[k]["pair"] = f"{said}, and neither delta is clearly the bad one: both kept"
    return {}, info


class ScreenHistory:
    """What the coordinator remembers of the last HISTORY rounds for the noise floor in rounds of 2: each round's
    median pair cosine of its accepted deltas, and the direction of the last round's accepted update (the token-
    weighted sum of their samples). In memory only: a restarted coordinator starts without it (a round of 2 is then
    judged by the loss screen alone until MIN_HISTORY rounds are remembered again)."""

    def __init__(self):
        self.pair: dict[int, float] = {}
        self.update: tuple[int, torch.Tensor] | None = None

    def level(self, r: int) -> float | None:
        """The median pair cosine of the remembered rounds before r, or None with fewer than MIN_HISTORY."""
        past = [c for q, c in sorted(self.pair.items()) if q < r][-HISTORY:]
        return statistics.median(past) if len(past) >= MIN_HISTORY else None

    def prev_cos(self, r: int, v: torch.Tensor) -> float | None:
        """The cosine of a sample with the update of round r − 1 (None: not remembered, or sampled otherwise)."""
        if self.update is None or self.update[0] != r - 1 or self.update[1].numel() != v.numel():
            return None
        u = self.update[1]
        den = float(u.norm() * v.norm())
        return float(u.dot(v)) / den if den > 0 else None

    def record(self, r: int, gram, samples: list[torch.Tensor], weights: list[float]) -> None:
        """Round r's accepted deltas (not fresh ones), their Gram matrix and samples."""
        if len(samples) >= 2:
            self.pair[r] = statistics.median(pair_cosines(gram))
            for q in sorted(self.pair)[:-HISTORY]:
                del self.pair[q]
        if samples:
            self.update = (r, sum(w * v for w, v in zip(weights, samples)))


def screen_round(acc, ratio: float, min_cos: float, margin: float = 0.0, history: ScreenHistory | None = None,
                 r: int | None = None) -> tuple[dict[int, str], dict]:
    """Screen the on-time deltas an accumulator (accumulate.py's or sparse.py's, made with screen=True) added, and
    drop the rejected from it: the norm, cosine and noise-floor rules (`decide`, rounds of at least MIN_DELTAS),
    then, where the accumulator has a LossScreen (`acc.loss`: outer.screen_loss), the loss rule among the deltas they
    kept, in rounds of any size (train/exchange/loss_screen.py `decide_loss`, `margin`: outer.screen_loss_margin),
    then, where 2 deltas are left, the noise floor of a pair (`decide_pair`, with `history`: the coordinator's
    ScreenHistory, recorded here for round `r`).
    Returns ({worker: reason}, {"w000": {norm_ratio, cos, loss, loss_gain, loss_bar}, ...})."""
    st = acc.stats
    if st is None:
        return {}, {}
    keys = sorted(w for w in acc.workers if w in st.norm2)
    norms = [math.sqrt(st.norm2[w]) for w in keys]
    fresh = {w for w in keys if (acc.metas.get(w) or {}).get("fresh_moments")}
    steps = {w: float((acc.metas.get(w) or {}).get("inner_steps") or 1) for w in keys}
    gram = st.gram(keys) if keys else None  # (seals every delta: their samples are rows of the Gram matrix)
    sample = st.sample(keys[0]).numel() if keys else 0
    rejected, info = decide(keys, norms, gram if len(keys) >= MIN_DELTAS else None,
                            [acc.weights[w] for w in keys], ratio, min_cos, fresh, sample,
                            [steps[w] for w in keys])
    ls = getattr(acc, "loss", None)
    if ls is not None:
        from train.exchange.loss_screen import decide_loss

        kept = [w for w in keys if w not in rejected and w in ls.losses]
        out, linfo = decide_loss(kept, [ls.losses[w] for w in kept], ls.base_loss, margin,
                                 [steps[w] for w in kept], fresh)
        rejected.update(out)
        for w, v in linfo.items():
            info[w].update(v)
    kept = [w for w in keys if w not in rejected]
    if len(kept) == 2 and history is not None and r is not None:
        idx = [keys.index(w) for w in kept]
        g2 = gram[idx][:, idx]
        gains = [ls.base_loss - ls.losses[w] for w in kept] if ls is not None and all(
            w in ls.losses for w in kept) else None
        out, pinfo = decide_pair(kept, g2, sample, history.level(r), [history.prev_cos(r, st.sample(w)) for w in kept],
                                 gains, margin, [steps[w] for w in kept], fresh)
        rejected.update(out)
        for w, v in pinfo.items():
            info[w].update(v)
    if history is not None and r is not None and gram is not None:
        ok = [w for w in keys if w not in rejected and w not in fresh]
        idx = [keys.index(w) for w in ok]
        history.record(r, gram[idx][:, idx], [st.sample(w) for w in ok], [acc.weights[w] for w in ok])
    if rejected:
        acc.drop(set(rejected))
    return rejected, {f"w{w:03d}": v for w, v in info.items() if v}
