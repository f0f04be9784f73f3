"""Which windows of the data stream each worker trains on in each round, as the run's membership changes.

The data is one stream (train/core/data.py StreamSampler: a seeded permutation of every training window per
epoch). The layout cuts it into rounds and slots: a *segment* says that from round `from_round` on, `slots` workers
each read `windows` consecutive stream windows per round (local_steps x total_batch_size), starting at `offset`:

    worker w in round r  (segment k: from_round_k <= r < from_round_{k+1}, w < slots_k)
        reads stream[offset_k + (r - from_round_k) * Σ_v windows_k,v + Σ_{v<w} windows_k,v  :  ... + windows_k,w]

Every (round, worker) slice is disjoint from every other, and segment k + 1 starts where segment k's last round
ends, so no window is read twice in an epoch: not across restarts (a replay reads the same slice), not when a
round goes on without a worker (its slice is skipped, never given to anyone else), and not when the number of
workers changes. That is how a run resumes with a different `outer.num_workers` (the coordinator adds a segment at
the first round no worker has started) and how a worker joins a live run (the coordinator adds a segment with one
slot more at the next round boundary, docs/elastic.md), and how H changes over the rounds
(outer.local_steps_schedule: a segment with other `windows` where H changes), and how each worker gets its own H
with rounds by time (outer.round_time_s: `windows` is then a list, one count per slot; train/diloco/pace.py).
The file is the coordinator's alone, rewritten atomically before the commit that makes its new segment reachable;
workers read it at the start of every round.

    data/layout.json = {"config_workers": N, "segments": [{"from_round", "slots", "windows", "offset", "why"}]}
    (windows: one count for every slot, or a list of one per slot; with rounds by time, "calibrate": the slots
    whose H is a calibration, not yet from a measured speed)

The layout also places each round on the inner learning-rate schedule (schedule_position): the schedule counts the
run's windows per slot, not each worker's own steps, so a worker that returns or joins trains at the run's rate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from train.core import sharedfs
from train.core.store import ProtocolError, RunPaths, atomic_write_json, read_json


@dataclass
class Layout:
    segments: list[dict] = field(default_factory=list)
    config_workers: int = 0  # outer.num_workers of the config that made the last resize (resumes compare to it)

    @staticmethod
    def path(paths: RunPaths) -> Path:
        return paths.data / "layout.json"

    @classmethod
    def load(cls, paths: RunPaths) -> "Layout | None":
        f = cls.path(paths)
        if not sharedfs.exists(f):  # a listing, not a lookup (NFS lookup cache: train/core/sharedfs.py)
            return None
        raw = read_json(f)
        try:
            segs = [{k: int(s[k]) for k in ("from_round", "slots", "offset")}
                    | {"windows": _windows(s["windows"], int(s["slots"])), "why": s.get("why", "")}
                    | ({"calibrate": [int(w) for w in s["calibrate"]]} if s.get("calibrate") else {})
                    for s in raw["segments"]]
            lay = cls(segs, int(raw["config_workers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"{f}: not a data layout ({type(e).__name__}: {e}); it is the coordinator's file, "
                                f"do not edit it") from None
        if not segs or any(b["from_round"] <= a["from_round"] for a, b in zip(segs, segs[1:])):
            raise ProtocolError(f"{f}: segments must start at increasing rounds")
        return lay

    @classmethod
    def single(cls, num_workers: int, windows: "int | list[int]") -> "Layout":
        """One segment from round 0 (a new run; also what DiLoCoOptimizer-style tools can use to draw the same
        batches as the file protocol)."""
        return cls([{"from_round": 0, "slots": num_workers, "windows": _windows(windows, num_workers), "offset": 0,
                     "why": f"start: {num_workers} workers"}], num_workers)

    def save(self, paths: RunPaths) -> None:
        atomic_write_json(self.path(paths), {"config_workers": self.config_workers, "segments": self.segments})

    # -- lookups ----------------------------------------------------------------------------------------------------
    def index(self, r: int) -> int:
        """The segment of round r."""
        k = 0
        for i, s in enumerate(self.segments):
            if s["from_round"] <= r:
                k = i
        return k

    def segment(self, r: int) -> dict:
        return self.segments[self.index(r)]

    def slots(self, r: int) -> int:
        return self.segment(r)["slots"]

    @property
    def last(self) -> dict:
        return self.segments[-1]

    def slice(self, r: int, w: int) -> tuple[int, int]:
        """(first stream offset, windows) of worker w in round r."""
        s = self.segment(r)
        if not 0 <= w < s["slots"]:
            raise ProtocolError(f"round {r} has {s['slots']} worker slots (segment from round {s['from_round']}): "
                                f"worker {w} has none")
        per = per_slot(s)
        return s["offset"] + (r - s["from_round"]) * sum(per) + sum(per[:w]), per[w]

    def end_offset(self, r: int) -> int:
        """The stream offset where round r's slices start when a new segment begins at round r."""
        s = self.segment(r)
        return s["offset"] + (r - s["from_round"]) * sum(per_slot(s))

    def windows_of(self, r: int, w: int) -> int:
        """Windows worker w reads in round r (its H x the batch)."""
        return self.slice(r, w)[1]

    def mean_windows(self, r: int) -> float:
        """Windows per slot in round r, averaged over the slots (the round's mean H x the batch)."""
        per = per_slot(self.segment(r))
        return sum(per) / len(per)

    def schedule_position(self, r: int) -> float:
        """Where round r starts on the inner learning-rate schedule, in windows per slot: the mean windows a slot
        read in every round before r (the rounds' mean H x the batch, summed). Every worker of round r, whenever it
        joined or came back, starts there (train/diloco/pace.py); with one H for all it is r x H x batch."""
        pos, segs = 0.0, self.segments
        for i, s in enumerate(segs):
            if s["from_round"] >= r:
                break
            end = min(r, segs[i + 1]["from_round"]) if i + 1 < len(segs) else r
            pos += (end - s["from_round"]) * sum(per_slot(s)) / s["slots"]
        return pos

    # -- changes (coordinator) ----------------------------------------------------------------------------------------
    def resize(self, from_round: int, slots: int, windows: "int | list[int]", why: str) -> dict:
        """A new segment from `from_round` (>= every existing segment's start; an unreached later one is replaced)."""
        if from_round < self.last["from_round"]:
            raise ValueError(f"a segment from round {from_round} would rewrite rounds of the segment from round "
                             f"{self.last['from_round']}")
        if from_round == self.last["from_round"] and len(self.segments) > 1:
            self.segments.pop()  # not reached yet by anyone: replace it
        seg = {"from_round": from_round, "slots": slots, "windows": _windows(windows, slots),
               "offset": self.end_offset(from_round), "why": why}
        if from_round == 0:
            self.segments = [seg]
        else:
            self.segments.append(seg)
        return seg


def per_slot(seg: dict) -> list[int]:
    """A segment's windows per slot: one number for all (one H), or a list, one per slot (rounds by time)."""
    w = seg["windows"]
    return list(w) if isinstance(w, list) else [w] * seg["slots"]


def _windows(value, slots: int) -> "int | list[int]":
    """A segment's `windows` as stored: an int, or a list of one int per slot (all equal: stored as one int)."""
    if isinstance(value, list):
        per = [int(v) for v in value]
        if len(per) != slots or any(v < 1 for v in per):
            raise ValueError(f"windows {value} must list one count >= 1 for each of the {slots} slots")
        return per[0] if len(set(per)) == 1 else per
    return int(value)
