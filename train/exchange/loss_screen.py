"""The loss screen (outer.screen_loss): each delta judged by what it does to the loss on data its worker did not
choose, so it works with 1 or 2 workers and sees what the norm and cosine screens cannot (noise of a healthy norm).

For round r the coordinator evaluates, on the same small batch of held-out windows,

    L_0 = loss(θ_r)             once, when the round opens (off the tail)
    L_w = loss(θ_r − Δ_w)       for each on-time delta, when it is whole (θ_r − Δ_w is worker w's model)

and the decision (`decide_loss`) compares each delta's gain g_w = L_0 − L_w with the gain of the round's other deltas
(their median; with no other delta, θ_r's own gain, 0). This is how the peers that train with untrusted contributors
judge a pseudo-gradient (templar / Covenant: its effect on the loss on data the contributor did not pick).

The windows (`ScreenWindows`): `outer.screen_loss_windows` of the held-out split (data.eval_fraction), never a
training window, and not the windows of the reported eval loss (TokenData.eval_windows: the split's first
eval.batches x eval.batch_size), so the eval loss stays a measurement the run never selected on; drawn fresh each
round from a stream seeded by (seed, r): every coordinator that screens round r (a restart, a resume) uses the same.
Where the held-out split holds no window beyond the eval ones, the screen shares them (said in one line).

Where it runs: on the reduce-on-arrival path. The accumulators (accumulate.py, sparse.py) hand each decoded piece of
a delta, in the model's order, to `candidate`, which writes θ_r − Δ into the screen's own model (its parameters on
CPU; a CPU staging copy moved to the device in one go otherwise); when the delta is whole, `finish` evaluates it. So
the commit waits for at most one evaluation after the last delta (the last one's), and no delta is read twice. With a
codec the values are the decoded ones (what the sum gets); with streaming DiLoCo only the round's fragment is
replaced (the rest stays θ_r: the fragment's delta on its fragment); with overlap a round-r delta is taken against
θ_r (the fold replaces the stale base), the base the master holds while it collects round r. Late deltas
(outer.late_weight, taken against θ_{r−1}) are not screened, as by the norm and cosine screens.

The model's memory: one more copy of the model's parameters on the coordinator's device (+ a CPU staging copy of
the parameters when that device is a GPU).
"""
from __future__ import annotations

import logging
import math
import statistics
import time

import numpy as np
import torch

from train.core.inner import evaluate

log = logging.getLogger("coordinator")

AUTO_MAX_S = 0.25   # outer.screen_loss = "auto": on where one evaluation should take at most about this long, ...
# ... judged by its forward FLOPs (2 x parameters x tokens) against what a device type does in AUTO_MAX_S, counted
# low: one busy CPU core ~40 GFLOP/s in fp32; a data-centre GPU ~40 TFLOP/s in fp32 (an H100 / H200 does more)
AUTO_FLOPS = {"cpu": 1e10, "cuda": 1e13, "mps": 1e12}
RELATIVE = 0.25     # a delta must gain at least this share of the others' median gain (scaled by its steps), ...
SEED_SALT = 0x5C4EE  # the windows' stream: numpy's default_rng([seed, SEED_SALT, r])


class ScreenWindows:
    """The held-out windows the loss screen draws from: the held-out split past the reported eval's windows."""

    def __init__(self, data, eval_count: int, count: int, seed: int):
        self.data, self.count, self.seed = data, int(count), int(seed)
        seq = data.seq_length
        self.start = len(data.tokens) - data.n_eval_tokens
        avail = max(0, (data.n_eval_tokens - 1) // seq)
        used = min(int(eval_count), avail)
        self.shared = avail - used < 1
        # (window i starts at start + i·seq and has seq + 1 tokens: the first one here shares one token, the last
        # label of the eval's last window, with it)
        self.lo, self.hi = (0, avail) if self.shared else (used, avail)

    def describe(self) -> str:
        where = "the reported eval's windows (the held-out split has no others)" if self.shared else \
            f"held-out windows {self.lo}..{self.hi - 1} (past the {self.lo} of the reported eval loss)"
        return f"{min(self.count, self.hi - self.lo)} of {where}, drawn each round"

    def of_round(self, r: int) -> torch.Tensor:
        """Round r's batch: (count, seq_length + 1) int64, the same in every process that screens round r."""
        n = self.hi - self.lo
        rng = np.random.default_rng([self.seed, SEED_SALT, int(r)])
        pick = np.sort(rng.choice(n, size=min(self.count, n), replace=False)) + self.lo
        seq = self.data.seq_length
        return torch.from_numpy(np.stack([self.data.window(self.start + int(i) * seq) for i in pick]))


class LossScreen:
    """The coordinator's screen model: θ_r's loss and each delta's θ_r − Δ loss on the round's windows."""

    def __init__(self, model: torch.nn.Module, windows: ScreenWindows, batch_size: int, device: torch.device,
                 precision: str, names: list[str]):
        from train.core.model import params_of

        self.model, self.windows, self.batch_size = model, windows, batch_size
        self.device, self.precision, self.names = device, precision, names
        self.params = params_of(model)
        # lanes write θ_r − Δ piece by piece: into the parameters themselves on a CPU, else into a CPU copy
        self.cpu = device.type == "cpu"
        self.stage = self.params if self.cpu else {n: torch.empty(self.params[n].shape, dtype=torch.float32)
                                                   for n in names}
        self.round: int | None = None
        self.batch: torch.Tensor | None = None
        self.base_loss = math.nan
        self.losses: dict = {}
        self.seconds: list[float] = []  # each evaluation's wall time (bench/outer_step.py reports the median)

    # -- a round --------------------------------------------------------------------------------------------------
    def begin(self, r: int, theta, frags, pieces: dict[str, tuple]) -> float:
        """Round r opens: θ_r into the screen model, L_0 evaluated. `theta`: the master's GlobalTheta (its tensors
        are not copied: they do not change until the round's step, and a step that reads the last delta inside it
        steps each piece only after that piece went through `candidate`; looked up at each piece, so a step rolled
        back, whose θ_r is read back into new tensors, is followed). `frags` / `pieces`: the round's pieces."""
        self.round, self.theta, self.frags, self.pieces = r, theta, frags, pieces
        self.losses = {}
        self.batch = self.windows.of_round(r)
        with torch.no_grad():
            for n in self.names:
                self.params[n].copy_(theta.tensors[n])
                if not self.cpu:
                    self.stage[n].copy_(theta.tensors[n])
        self._flat = {p: frags.get(self.stage, p).reshape(-1) for p in pieces}
        self.base_loss = self._evaluate()
        return self.base_loss

    def _base(self, piece: str) -> torch.Tensor:
        return self.frags.get(self.theta.tensors, piece).reshape(-1)

    def candidate(self, piece: str, offset: int, d: torch.Tensor) -> None:
        """Values offset.. of a delta's decoded piece `piece` (any float dtype): θ_r − Δ there, in the screen model
        (any thread; pieces of one delta touch disjoint ranges)."""
        k = d.numel()
        dst = self._flat[piece][offset:offset + k]
        with torch.no_grad():
            dst.copy_(d.reshape(-1))
            torch.sub(self._base(piece)[offset:offset + k], dst, out=dst)

    def candidate_sparse(self, piece: str, pos: torch.Tensor, vals: torch.Tensor) -> None:
        """A sparse delta's piece: `vals` at flat positions `pos`, zero elsewhere."""
        dst = self._flat[piece]
        with torch.no_grad():
            dst.copy_(self._base(piece))
            dst.index_add_(0, pos.reshape(-1).long(), vals.reshape(-1).to(dst.dtype), alpha=-1)

    def finish(self, key) -> float:
        """The delta `key` is whole (every piece through `candidate`): its loss L_w."""
        if not self.cpu:
            with torch.no_grad():
                for p in self.pieces:  # the round's pieces only: the rest of the model is θ_r already
                    self.frags.get(self.params, p).copy_(self.frags.get(self.stage, p), non_blocking=True)
        self.losses[key] = self._evaluate()
        return self.losses[key]

    def forget(self, key) -> None:
        self.losses.pop(key, None)

    def _evaluate(self) -> float:
        t = time.perf_counter()
        loss = evaluate(self.model, self.batch, self.batch_size, self.device, self.precision)
        self.seconds.append(time.perf_counter() - t)
        return loss


def decide_loss(keys: list, losses: list[float], base: float, margin: float, steps: list[float] | None = None,
                fresh: set | frozenset = frozenset()) -> tuple[dict, dict]:
    """The loss screen's verdict: ({key: reason} of the rejected, {key: {loss, loss_gain, loss_bar}} of everyone).

    `losses[i]`: L_i = loss(θ_r − Δ_i); `base`: L_0 = loss(θ_r); `steps[i]`: delta i's inner steps (deltas of one
    round may differ: rounds by time); `fresh`: keys trained from fresh optimizer moments. Delta i's gain is
    g_i = L_0 − L_i; `ref` is the median gain of the others (0, θ_r's own, where there is no other). Delta i is
    rejected when g_i < bar_i, with

        bar_i = RELATIVE x min(1, s_i / s_ref) x ref − margin    where the others improve (ref > 0)
        bar_i = ref − |ref| − 2 x margin                          where they do not (ref <= 0)
        bar_i = −margin                                           with no other delta

    So: worse than θ_r by more than the margin while the others improve it, or not even a quarter of the others'
    gain (scaled down for fewer inner steps than theirs: a gain grows more slowly than the steps), or, in a round
    whose deltas all lose (late in a run of averaging, θ_r beats each worker's own model: a healthy one was seen
    0.014 below the others' median there), far worse than the others. A fresh-moments delta (a
    joiner's first) is held to the first rule only: bar_i = min(ref, 0) − margin. A NaN loss is always rejected."""
    info: dict = {}
    rejected: dict = {}
    gains = [base - x for x in losses]
    for i, k in enumerate(keys):
        others = [g for j, g in enumerate(gains) if j != i and math.isfinite(g)]
        ref = statistics.median(others) if others else 0.0
        if k in fresh:
            bar = min(ref, 0.0) - margin
        elif ref > 0:
            si = float(steps[i]) if steps else 1.0
            so = [float(steps[j]) for j in range(len(keys)) if j != i] if steps else [1.0]
            sref = statistics.median(so) if so else 1.0
            bar = RELATIVE * min(1.0, si / sref if sref > 0 else 1.0) * ref - margin
        elif others:
            bar = ref - abs(ref) - 2 * margin
        else:
            bar = -margin
        g = gains[i]
        info[k] = {"loss": round(losses[i], 5), "loss_gain": round(g, 5), "loss_bar": round(bar, 5)}
        if not math.isfinite(g) or g < bar:
            who = f"the others' median gain {ref:+.4f}" if others else "no other delta in the round: θ_r's own"
            rejected[k] = (f"screen: loss of θ_r − Δ on the round's held-out windows {losses[i]:.4f} against θ_r's "
                           f"{base:.4f} (gain {g:+.4f}, below {bar:+.4f}: {who}, outer.screen_loss_margin = "
                           f"{margin:g})")
    return rejected, info


def forward_flops(params: int, windows: int, seq_length: int) -> float:
    """One evaluation's forward cost, ~2 multiply-adds per parameter and token."""
    return 2.0 * params * windows * seq_length


def auto_decision(setting: str, flops: float, device_type: str, seconds: float, what: str) -> tuple[bool, str]:
    """outer.screen_loss = auto/on/off: (on, the line that says so). auto decides on the evaluation's forward FLOPs
    against AUTO_FLOPS of the device type (not on a timing: a busy box would turn it off in one start and on in the
    next); `seconds`, one evaluation measured here, is said alongside."""
    if setting == "off":
        return False, "outer.screen_loss = off: deltas are not judged by their loss"
    said = f"{what}: {flops / 1e9:.3g} GFLOP, {seconds:.3f} s measured"
    if setting == "on":
        return True, f"outer.screen_loss = on: {said}"
    budget = AUTO_FLOPS.get(device_type, AUTO_FLOPS["cpu"])
    if flops <= budget:
        return True, f"outer.screen_loss (auto): on, one evaluation of {said}"
    return False, (f"outer.screen_loss (auto): off, one evaluation of {said}, is over {budget / 1e9:g} GFLOP on "
                   f"{device_type} (about {AUTO_MAX_S:g} s); set outer.screen_loss = \"on\" to screen anyway, or "
                   f"lower outer.screen_loss_windows")
