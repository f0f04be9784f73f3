"""Reduce on arrival: the coordinator checks and adds each worker's delta of a round the moment it is published, so
the work left after the last arrival (one delta, the outer step, the commit) does not grow with the number of workers.

Each delta is read once (its bytes hashed against the sidecar's sha256 on the way), its header checked against the
run's codec and the global model's shapes, its values checked (finite, scales >= 0), and only then decoded and added:
a rejected delta leaves the sum untouched. The sum is kept in float64 with the raw token counts as weights
(Σ_w tokens_w · Δ_w, divided once at the end), so the mean does not depend on the order in which deltas arrive
(a float32 value times an integer token count is exact in float64, and a float64 sum of a few of them rounds to
the same float32 whatever the order); with one worker the mean is exactly its delta.
"""
from __future__ import annotations

import hashlib

import torch
from safetensors.torch import load as load_safetensors

from train.core import sharedfs
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import read_header
from train.exchange.codec import Codec, CodecError
from train.exchange.protocol import RejectedDelta
from train.exchange.screen import DeltaStats


def read_checked_delta(acc, r: int, w: int, meta: dict) -> dict[str, torch.Tensor]:
    """Worker w's delta file of round r, checked against its sidecar `meta` (size, sha256) and the codec of `acc`
    (an Accumulator or train/exchange/sparse.py's SparseAccumulator: its paths, codec, shapes; the bytes read are
    added to its bytes_read, a rejected file's too): its tensors, or RejectedDelta with the reason."""
    paths, codec, shapes = acc.paths, acc.codec, acc.shapes
    f = paths.delta_file(r, w)
    try:
        data = sharedfs.read_bytes(f)  # retried on a flaky mount (train/core/sharedfs.py)
    except OSError as e:
        raise RejectedDelta(w, f"unreadable delta file ({e})")
    acc.bytes_read += len(data)
    if len(data) != meta["bytes"]:
        raise RejectedDelta(w, f"file has {len(data)} bytes, sidecar says {meta['bytes']} (truncated?)")
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise RejectedDelta(w, "sha256 of the file differs from its sidecar (torn or corrupt)")
    try:
        header, fmeta = read_header(f)
        codec.check_header(header, shapes, fmeta)
        stored = load_safetensors(data)
        for n, shape in shapes.items():
            codec.check_values(n, stored, shape)
    except (CodecError, ValueError, OSError) as e:
        raise RejectedDelta(w, str(e))
    return stored


class Accumulator:
    """Σ_w a_w Δ_w over the accepted deltas of round r (a_w = tokens, or 1 without token weighting)."""

    def __init__(self, paths: DiLoCoPaths, r: int, shapes: dict[str, tuple], codec: Codec, token_weighted: bool,
                 screen: bool = False):
        self.paths, self.r, self.shapes, self.codec = paths, r, shapes, codec
        self.token_weighted = token_weighted
        self.sum: dict[str, torch.Tensor] = {}
        self.total = 0.0
        self.workers: list[int] = []      # in the order they were added
        self.metas: dict[int, dict] = {}
        self.late: dict[int, dict] = {}   # late deltas of round r - 1 folded in (their sidecars)
        self.late_weights: dict[int, float] = {}
        self.weights: dict[int, float] = {}  # each on-time delta's weight a_w
        self.bytes_read = 0
        # outer.screen: each on-time delta's norm and sample, taken as it is decoded (train/exchange/screen.py)
        self.stats = DeltaStats(shapes) if screen else None

    def add(self, w: int, meta: dict, late_weight: float | None = None, observe: bool = True) -> None:
        """Check worker w's delta (its sidecar already passed check_sidecar) and add it; RejectedDelta otherwise.
        `late_weight`: the delta is w's late one of round r - 1, folded in with that factor on its weight."""
        late = late_weight is not None
        stored = read_checked_delta(self, self.r - 1 if late else self.r, w, meta)
        a = (float(meta["tokens"]) if self.token_weighted else 1.0) * (late_weight if late else 1.0)
        watch = self.stats is not None and not late and observe
        for n, shape in self.shapes.items():
            d = self.codec.decode(n, stored, shape).to(torch.float64)
            if watch:
                self.stats.observe(w, n, d)
            if n in self.sum:
                self.sum[n].add_(d, alpha=a)
            else:
                self.sum[n] = d.mul_(a)
        self.total += a
        if late:
            self.late[w] = meta
            self.late_weights[w] = late_weight
            return
        self.workers.append(w)
        self.metas[w] = meta
        self.weights[w] = a

    def drop(self, out: set[int]) -> None:
        """Take the on-time deltas of workers `out` back out (the screen rejected them): the sum is rebuilt from the
        files of the others in one fixed order (workers by id, then late deltas by id), never by subtracting."""
        keep = [(w, self.metas[w]) for w in sorted(self.workers) if w not in out]
        late = [(w, self.late[w], self.late_weights[w]) for w in sorted(self.late)]
        self.sum, self.total = {}, 0.0
        self.workers, self.metas, self.weights, self.late, self.late_weights = [], {}, {}, {}, {}
        for w in out:
            if self.stats is not None:
                self.stats.forget(w)
        for w, meta in keep:
            self.add(w, meta, observe=False)
        for w, meta, lw in late:
            self.add(w, meta, late_weight=lw)

    def mean(self, name: str) -> torch.Tensor:
        """The weighted mean delta of one tensor, float32."""
        return (self.sum[name] / self.total).to(torch.float32)
