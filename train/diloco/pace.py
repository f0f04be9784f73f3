"""Rounds by time (outer.round_time_s): each worker trains the inner steps it can in the round's time.

Machines differ (an A100 beside two 3090s, a node shared with another job, a box that slows when it is hot). With one
H for all, every round lasts as long as the slowest worker's H steps and the fast ones idle. With rounds by time the
coordinator gives each worker its own H (HALoS's synchronous baseline, torchft's per-replica sync_every; Liu et al.
2024, "Asynchronous Local-SGD Training for Language Modeling", dynamic local updates):

    H_w = clamp(floor(round_time_s x rate_w), 1, local_steps)      rate_w: w's inner steps per second, measured

Where the H come from, round by round:
  * round 0, and a worker's first round after it joins: `calibration_steps` (local_steps / 4, at most 32) or CALIBRATE x
    round_time_s of training, whichever ends first: a short round that measures the worker instead of a full slow
    one, and in which a fast worker does not wait for a slow one;
  * after that, the median rate of the worker's last three deltas (each its sidecar's inner_steps / train_seconds):
    step times wander by 10-20% from round to round on a shared box, and a plan that chased each round's figure made
    the next round's slowest worker later still. A rate more than STEP_CHANGE off that median is a change of speed,
    not noise: the history restarts from it, so a worker whose speed changes is followed within a round (two with
    outer.overlap, which plans a round further ahead);
  * outer.step_rates: given rates instead of measured ones (a fixed plan: runs reproduce bit for bit).
The plan is written into the data layout (train/exchange/layout.py: a segment whose `windows` lists one count per
slot) before the commit that makes its round reachable, so every worker's slice of the stream is disjoint and
exactly as long as the steps it was given: no window is read twice, and none is skipped while the plan holds. A new
segment is written only when some worker's H moves by more than HYSTERESIS (the layout stays small over long runs).

A round ends for a worker once round_time_s has passed and every other worker of the round has published (or at
GRACE x round_time_s): identical workers finish 10-20% apart on a busy box, and a synchronous round would wait for
the last. What it did not read of its slice is carried over: read first in its next round, within that round's H
(split_carry; the worker's resume state holds it, so a restart reads it too). The commit record lists what was
carried and, in the last round, what is left (`skipped`): no window is read twice, none silently lost. The commit
stays one outer step per round, every delta from θ_r: nothing stale is averaged.

The inner learning-rate schedule follows the run, not each worker's step count (schedule_for): round r starts at
the layout's schedule position (the mean windows per slot of every round before it), and a worker's step moves it by
the round's mean H over its own H, so over a round every worker walks the same stretch of the schedule whether it
trains 40 steps or 10, and one that joins or comes back late starts where the run is. With rounds by time the
schedule's length is the run's projected length under the current plan (the last segment's mean H for the rounds
left), unless inner.total_steps fixes it.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from train.core.errors import ConfigError
from train.exchange.layout import Layout, per_slot

GRACE = 1.5        # a worker behind its plan stops at this x round_time_s (noise in step times stays inside it)
CALIBRATE = 0.5    # a calibration round: local_steps / 4 steps, or this x round_time_s if that comes first
HYSTERESIS = 0.05  # a new plan is written when some worker's H moves by more than this fraction (and >= 1 step)
HISTORY = 3        # a worker's rate: the median of its last HISTORY measured rates ...
STEP_CHANGE = 0.3  # ... unless the newest is this far off that median: then from the newest on (a change of speed)


CALIBRATION_MAX = 32  # steps: enough to measure a speed; what a calibration stopped by time leaves is carried over


def calibration_steps(cap: int) -> int:
    """H of a worker whose speed is not known yet (round 0, a worker that just joined): a quarter of the cap, at
    most CALIBRATION_MAX (a large cap would otherwise leave a large slice carried from run to end)."""
    return max(1, min(cap // 4, CALIBRATION_MAX))


class Pace:
    """The coordinator's plan: each worker's inner steps per second and the H that follows from it."""

    def __init__(self, oc, batch: int):
        self.oc, self.batch = oc, batch  # batch: windows per inner step (inner.total_batch_size)
        self.given = bool(oc.step_rates)
        self.rates: dict[int, float] = {int(k): float(v) for k, v in oc.step_rates.items()}
        self.history: dict[int, deque] = {}  # each worker's last measured rates

    # -- measurements ---------------------------------------------------------------------------------------------
    def observe(self, metas: dict[int, dict]) -> None:
        """The rates of a round's deltas (their sidecars): inner steps over training seconds."""
        if self.given:
            return
        for w, m in metas.items():
            try:
                steps, secs = int(m.get("inner_steps") or 0), float(m.get("train_seconds") or 0.0)
            except (TypeError, ValueError):
                continue
            if steps > 0 and secs > 0:
                rate = steps / secs
                hist = self.history.setdefault(w, deque(maxlen=HISTORY))
                if hist and abs(rate / statistics.median(hist) - 1) > STEP_CHANGE:
                    hist.clear()  # a change of speed, not noise
                hist.append(rate)
                self.rates[w] = statistics.median(hist)

    def learn_from(self, lay: Layout, r: int) -> None:
        """A resumed coordinator: the H of round r's plan stand for the rates it learned (rate = H / round time),
        until the next deltas measure them again."""
        if self.given or not self.oc.paced:
            return
        seg = lay.segment(r)
        if not isinstance(seg["windows"], list):
            return  # calibrating (or a run that had one H): nothing learned yet
        for w, n in enumerate(per_slot(seg)):
            self.rates.setdefault(w, n / self.batch / self.oc.round_time_s)

    # -- the plan -------------------------------------------------------------------------------------------------
    def steps_for(self, w: int) -> int:
        cap = self.oc.local_steps
        rate = self.rates.get(w)
        if rate is None:
            return calibration_steps(cap)
        return max(1, min(cap, math.floor(self.oc.round_time_s * rate + 1e-9)))

    def check(self) -> None:
        """outer.round_time_s must hold at least one inner step of the fastest worker."""
        if not self.rates:
            return
        fastest = max(self.rates.values())
        if self.oc.round_time_s * fastest < 1:
            raise ConfigError(f"outer.round_time_s = {self.oc.round_time_s:g} is below the time of one inner step "
                              f"(the fastest worker takes {1 / fastest:.3g} s a step): set it to at least "
                              f"{2 / fastest:.3g} s (a few steps a round), or 0 for a fixed H; the run resumes "
                              f"from its last committed round")

    def windows(self, slots: int) -> list[int]:
        """The plan for a round of `slots` workers: each one's windows (its H x the batch)."""
        return [self.steps_for(w) * self.batch for w in range(slots)]

    def calibrating(self, slots: int) -> list[int]:
        """The slots whose speed is not known yet: their round measures them and has no early end."""
        return [w for w in range(slots) if w not in self.rates]

    def mark(self, seg: dict) -> dict:
        """A new layout segment of this plan, its calibrating slots named."""
        cal = self.calibrating(seg["slots"])
        if cal:
            seg["calibrate"] = cal
        else:
            seg.pop("calibrate", None)
        return seg

    def replan(self, current: list[int]) -> list[int] | None:
        """The new plan for the same slots, or None while every worker's H stays within HYSTERESIS of `current`."""
        self.check()
        new = self.windows(len(current))
        moved = [abs(a - b) > max(self.batch, HYSTERESIS * b) for a, b in zip(new, current)]
        return new if any(moved) else None


def split_carry(carry: list, budget: int) -> tuple[list, list]:
    """The windows a worker carries over from earlier rounds ([[offset, n], ...], oldest first) split into what its
    round reads first (at most `budget`: its slice's length) and what it keeps for later."""
    used, kept, left = [], [], budget
    for off, n in carry:
        take = min(n, left)
        if take > 0:
            used.append([off, take])
            left -= take
        if n > take:
            kept.append([off + take, n - take])
    return used, kept


def data_record(metas: dict[int, dict], late: dict[int, dict], r: int, last: bool) -> tuple[dict, dict, dict]:
    """From the sidecars of round r's deltas (and the late ones of r - 1 folded in): the record's `data` ({key:
    [first offset, windows read]}, one key per range read: wXXX its own slice, wXXX+i what it carried in, wXXX@q a
    late delta of round q), `carried` ({wXXX: windows passed on to its next round}) and `skipped` ({wXXX: windows
    nobody will read}: what is still carried when the run ends, or what a worker without carry-over left unread)."""
    data, carried, skipped = {}, {}, {}
    for tag, group in (("", metas), (f"@{r - 1}", late)):
        for w, m in sorted(group.items()):
            d, key = m["data"], f"w{w:03d}{tag}"
            data[key] = [d["offset"], d["read"]]
            for i, (off, n) in enumerate(d.get("carried_in") or []):
                data[f"{key}+{i}"] = [off, n]
            if tag:
                continue
            if "carry_out" in d:
                n = sum(int(x[1]) for x in d["carry_out"])
                if n:
                    (skipped if last else carried)[key] = n
            elif int(d.get("windows", 0)) > int(d["read"]):
                skipped[key] = int(d["windows"]) - int(d["read"])
    return data, carried, skipped


def describe(windows: list[int], batch: int) -> str:
    return "H = " + ", ".join(f"w{w}: {n // batch}" for w, n in enumerate(windows))


def schedule_for(lay: Layout, r: int, w: int, cfg) -> tuple[float, float, float | None]:
    """(where worker w's round r starts on the inner schedule, how far each of its steps moves it, the schedule's
    length; None: cfg.total_inner_steps), in inner steps of the run's mean worker. With one H for all this is
    (Σ_{k<r} H_k, 1, None): each worker's own step count, had it trained every round."""
    batch = cfg.inner.total_batch_size
    mine = lay.windows_of(r, w)
    start = lay.schedule_position(r) / batch
    per_step = lay.mean_windows(r) / mine
    total = None
    if cfg.outer.paced and not cfg.inner.total_steps:
        total = lay.schedule_position(cfg.outer.rounds) / batch  # the last segment's plan for the rounds left
    return _exact(start), _exact(per_step), total


def _exact(x: float) -> float | int:
    """An integral value as an int (the step counts of a fixed H stay the ints they always were)."""
    return int(x) if float(x).is_integer() else x
