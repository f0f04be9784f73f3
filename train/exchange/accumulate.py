"""Reduce on arrival: the coordinator checks and adds each worker's delta of a round the moment it is published, so
the work left after the last arrival (one delta, the outer step, the commit) does not grow with the number of workers.

Each delta is read once, front to back, on a background thread that hashes its bytes as they come
(train/core/tensorio.py's PipelinedReader), while the lanes (one thread per core, train/core/threads.py) check and
add the tensors before it: its size and
header are checked against the sidecar, the run's codec and the global model's shapes before a value is used (from
the reader's own open of the file: one open per delta), each tensor's values (finite, scales >= 0) just before it is
added, and the file's checksum (train/core/digest.py) against the sidecar's once
the last byte is in. A delta rejected after some of its tensors went into the sum (a torn file whose checksum differs,
a NaN in its last tensor) is taken back out by rebuilding the sum from the accepted files in one fixed order, as the
screen's `drop` does, never by subtracting: a rejected delta leaves no trace in the sum.

The sum is kept in float64 with the raw token counts as weights (Σ_w tokens_w · Δ_w, divided once at the end), added
in pieces of CHUNK values so no temporary is larger than a piece. Why float64, and why nothing less: a float32 value
times an integer token count below 2^29 is exact in float64, so the first add is exact and each later one rounds
once, at 2^-53 relative — 2^-29 of the float32 ulp the mean is rounded to; the float32 mean of N deltas is then the
correctly rounded weighted mean except within N · 2^-29 ulp of a rounding boundary, so it does not depend on the
order of arrival (the replay after a restart adds the deltas in the commit record's order, the screen's rebuild by
worker id, late deltas arrive in between: all give the same bits), and with one worker the mean is exactly its
delta (tokens · Δ / tokens). A float32 sum (even in a fixed order) loses both: tokens · Δ rounds, so one worker's
mean is not its delta, and the rounding of each add depends on the order. Every other copy of θ never sums dense
deltas: it loads θ_{r+1} or applies the coordinator's update (topk's fixed-order sum is train/exchange/sparse.py's).
"""
from __future__ import annotations

import math
import threading

import torch

from train.core import digest, sharedfs
from train.core.phases import NO_PHASES
from train.core.threads import intra_op_threads, lanes, ordered_map
from train.core.tensorio import PipelinedReader, read_header
from train.exchange.codec import Codec, CodecError, all_finite
from train.exchange.protocol import CHECKSUM_DIFFERS, RejectedDelta
from train.exchange.screen import DeltaStats
from train.exchange.store import DiLoCoPaths

CHUNK = 1 << 20  # values per piece of the float64 add (8 MB): the temporaries stay small and in cache
_LANE = threading.local()  # each thread's float64 piece (add_range)


def _whole_file_reason(acc, f, meta: dict) -> str | None:
    """After another check failed: the size or checksum reason when the file is not the one its sidecar vouches for
    (the truer reason: a torn file whose header happens to break), else None."""
    try:
        data = sharedfs.read_bytes(f)
    except OSError as e:
        return f"unreadable delta file ({e})"
    acc.bytes_read += len(data)
    if len(data) != meta["bytes"]:
        return f"file has {len(data)} bytes, sidecar says {meta['bytes']} (truncated?)"
    if digest.of_bytes(data, like=meta["sha256"]) != meta["sha256"]:
        return CHECKSUM_DIFFERS
    return None


def open_checked(acc, w: int, f, meta: dict) -> None:
    """The checks before any data is read: the file's size against the sidecar's, its header against the codec of
    `acc` (its codec, shapes; bytes read go to its bytes_read) and the global model's shapes."""
    try:
        size = sharedfs.stat(f).st_size
    except OSError as e:
        raise RejectedDelta(w, f"unreadable delta file ({e})")
    if size != meta["bytes"]:
        acc.bytes_read += size
        raise RejectedDelta(w, f"file has {size} bytes, sidecar says {meta['bytes']} (truncated?)")
    try:
        header, fmeta = read_header(f)
        acc.codec.check_header(header, acc.shapes, fmeta)
    except (CodecError, ValueError, OSError) as e:
        raise RejectedDelta(w, _whole_file_reason(acc, f, meta) or str(e))


def read_checked_delta(acc, r: int, w: int, meta: dict) -> dict[str, torch.Tensor]:
    """Worker w's delta file of round r, checked against its sidecar `meta` (size, checksum) and the codec of `acc`
    (an Accumulator or train/exchange/sparse.py's SparseAccumulator: its paths, codec, shapes; the bytes read are
    added to its bytes_read, a rejected file's too): its tensors, or RejectedDelta with the reason. One pass over
    the file (hashed while it is read)."""
    codec, shapes = acc.codec, acc.shapes
    f = acc.paths.delta_file(r, w)
    open_checked(acc, w, f, meta)
    names = [k for n, s in shapes.items() for k in codec.specs(n, tuple(s))]
    try:
        rd = PipelinedReader(f, [(None, names)], phases=getattr(acc, "phases", None), like=meta["sha256"])
        try:
            stored = next(iter(rd))[1]
            sha = rd.finish()
        finally:
            rd.close()
            acc.bytes_read += rd.nbytes
    except (ValueError, OSError, StopIteration) as e:
        raise RejectedDelta(w, _whole_file_reason(acc, f, meta) or str(e))
    if sha != meta["sha256"]:
        raise RejectedDelta(w, CHECKSUM_DIFFERS)
    try:
        for n, shape in shapes.items():
            codec.check_values(n, stored, shape)
    except (CodecError, ValueError) as e:
        raise RejectedDelta(w, str(e))
    return stored


class _Decoded:
    """A block-coded tensor's decoded values, made piece by piece as they are sliced (Codec.decode_range, into a
    buffer of the lane's): what add_range reads as `dec[i:j]`, without a tensor-sized temporary."""

    _local = threading.local()

    def __init__(self, codec, name: str, stored: dict, n: int, phases):
        self.codec, self.name, self.stored, self.n, self.phases = codec, name, stored, n, phases

    def __getitem__(self, sl: slice) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < sl.stop - sl.start + self.codec.block:
            buf = self._local.buf = torch.empty(max(CHUNK, sl.stop - sl.start) + self.codec.block)
        with self.phases("decode"):
            return self.codec.decode_range(self.name, self.stored, self.n, sl.start, sl.stop, buf)


def delta_weight(tokens: int, weighting: "bool | str") -> float:
    """A delta's weight a_w in the mean Σ a_w Δ_w / Σ a_w, by outer.weighting: "tokens" (or True) its tokens, "equal"
    (or False) 1, "per_step" 1 / its tokens (each delta scaled to the harmonic mean H of the round: with unequal H a
    delta of 2H steps is about twice one of H, docs/hetero.md)."""
    mode = weighting if isinstance(weighting, str) else ("tokens" if weighting else "equal")
    if mode == "tokens":
        return float(tokens)
    if mode == "per_step":
        return 1.0 / max(1.0, float(tokens))
    return 1.0


class Accumulator:
    """Σ_w a_w Δ_w over the accepted deltas of round r (a_w = delta_weight: tokens, 1, or 1 / tokens)."""

    def __init__(self, paths: DiLoCoPaths, r: int, shapes: dict[str, tuple], codec: Codec, token_weighted: bool,
                 screen: bool = False, phases=None, expected: int = 1):
        self.paths, self.r, self.shapes, self.codec = paths, r, shapes, codec
        self.token_weighted = token_weighted
        self.sum: dict[str, torch.Tensor] = {}   # flat float64, one per tensor
        self.total = 0.0
        self.workers: list[int] = []      # in the order they were added
        self.metas: dict[int, dict] = {}
        self.late: dict[int, dict] = {}   # late deltas of round r - 1 folded in (their sidecars)
        self.late_weights: dict[int, float] = {}
        self.weights: dict[int, float] = {}  # each on-time delta's weight a_w
        self.bytes_read = 0
        self.phases = phases or NO_PHASES  # where the time goes (bench/outer_step.py)
        # outer.screen: each on-time delta's norm and sample, taken as it is decoded (train/exchange/screen.py; its
        # sample size from the `expected` deltas of the round)
        self.stats = DeltaStats(shapes, expected) if screen else None
        # outer.screen_loss: θ_r − Δ of each observed delta, written piece by piece as it is decoded and evaluated
        # when whole (train/exchange/loss_screen.py's LossScreen, set by the coordinator; None: off)
        self.loss = None

    def add(self, w: int, meta: dict, late_weight: float | None = None, observe: bool = True) -> None:
        """Check worker w's delta (its sidecar already passed check_sidecar) and add it; RejectedDelta otherwise.
        `late_weight`: the delta is w's late one of round r - 1, folded in with that factor on its weight."""
        late = late_weight is not None
        f = self.paths.delta_file(self.r - 1 if late else self.r, w)
        a = self.weight_of(meta) * (late_weight if late else 1.0)
        key = w if self.stats is not None and not late and observe else None
        ph = self.phases
        touched = False
        rd = self.open_delta(w, meta, late=late)  # size and header checked before a value is used
        try:
            flat = None if self.codec.quantised else rd.flat(list(self.shapes))
            if flat is not None:  # a small file of one dtype in the model's order: all of it as one tensor
                with ph("checks"):
                    self._check_flat(flat)
                touched = True
                self._add_flat(flat, a, key)
            started: list[bool] = []  # a lane began adding (a rejection then rebuilds the sum)
            # with the screen's statistics, their squared norm is the finite check: a float64 sum of squares of
            # values of <= 32 bits is finite exactly when every value is (NaN or an infinity makes it so, and finite
            # squares below 2^256 cannot overflow a sum of fewer than 2^700 of them), so a cast
            # delta is not read a second time for it; a NaN found so is found after its piece was added (rebuild)
            by_norm = key is not None and not self.codec.quantised

            def check_and_add(item) -> list:
                n, stored = item
                if not by_norm:
                    with ph("checks"):
                        self.codec.check_values(n, stored, self.shapes[n])
                started.append(True)
                stats = self._add_tensor(n, stored, a, key is not None)
                if by_norm and not all(math.isfinite(st[0]) for st in stats):
                    raise CodecError(f"{n}: non-finite values (NaN/inf)")
                return stats

            # the tensors on the lanes as the reader thread brings them (each tensor's sum is its own: the same bits
            # whichever lane adds it); the screen's statistics taken here in the model's order
            with intra_op_threads(1):
                try:
                    for stats in ordered_map(check_and_add, rd, lanes(), ahead=4):
                        for st in stats:
                            self.stats.take(key, st)
                finally:
                    touched = touched or bool(started)
            sha = rd.finish()
            reason = None if sha == meta["sha256"] else CHECKSUM_DIFFERS
        except (CodecError, ValueError, OSError) as e:
            rd.close()
            reason = _whole_file_reason(self, f, meta) or str(e)
        finally:
            rd.close()
            self.bytes_read += rd.nbytes
        if reason is not None:
            if key is not None:
                self.stats.forget(w)
                self.forget_loss(w)
            if touched:  # take its tensors back out: the sum of the accepted files, rebuilt in a fixed order
                self.drop(set())
            raise RejectedDelta(w, reason)
        self.total += a
        if late:
            self.late[w] = meta
            self.late_weights[w] = late_weight
            return
        if key is not None:
            self.stats.seal(w)  # its Gram row now, while the round collects (screen.py)
            self.finish_loss(w)
        self.workers.append(w)
        self.metas[w] = meta
        self.weights[w] = a

    def _check_flat(self, flat: torch.Tensor) -> None:
        """codec.check_values over the whole file at once; the tensor that fails is named as check_values would."""
        if all_finite(flat):
            return
        pos = 0
        for n, shape in self.shapes.items():
            k = math.prod(shape)
            self.codec.check_values(n, {n: flat[pos:pos + k]}, shape)
            pos += k

    def _add_flat(self, flat: torch.Tensor, a: float, key) -> None:
        """Every tensor of a delta from one flat tensor (PipelinedReader.flat): the same sums bit for bit as
        _add_tensor's (each value added once, elementwise), the screen's norm and sample of the same values."""
        ph = self.phases
        with ph("accumulate"):
            d = flat.to(torch.float64)
        if key is not None:
            with ph("screen"):
                self.stats.observe_chunk(key, next(iter(self.shapes)), 0, d)
            if self.loss is not None:
                with ph("screen: θ_r − Δ"):
                    pos = 0
                    for n, shape in self.shapes.items():
                        k = math.prod(shape)
                        self.loss.candidate(n, 0, d[pos:pos + k])
                        pos += k
        with ph("accumulate"):
            pos = 0
            for n, shape in self.shapes.items():
                k = math.prod(shape)
                s = self.sum.get(n)
                if s is None:
                    self.sum[n] = torch.mul(d[pos:pos + k], a)
                else:
                    s.add_(d[pos:pos + k], alpha=a)
                pos += k

    def _add_tensor(self, n: str, stored: dict[str, torch.Tensor], a: float, observe: bool) -> list:
        """sum[n] += a · decode(stored), in pieces of CHUNK values; with `observe`, the screen's statistics of each
        piece (DeltaStats.chunk_stats, for the caller to take in order) on the way. Touches only sum[n]: the
        tensors of a delta can be added on different threads."""
        shape = self.shapes[n]
        numel = math.prod(shape)
        if not self.codec.quantised:  # a cast, decoded piece by piece below
            dec = stored[n].reshape(-1)
        elif CHUNK % self.codec.block == 0:  # block codes and scales: decoded piece by piece as add_range takes them
            dec = _Decoded(self.codec, n, stored, numel, self.phases)
        else:  # blocks that straddle add_range's pieces: decoded whole (a tensor-sized temporary)
            with self.phases("decode"):
                dec = self.codec.decode(n, stored, shape).reshape(-1)
        first = n not in self.sum
        if first:
            self.sum[n] = torch.empty(numel, dtype=torch.float64)
        return self.add_range(n, dec, a, observe, 0, numel, first)

    def add_range(self, n: str, dec: torch.Tensor, a: float, observe: bool, i0: int, j0: int, first: bool) -> list:
        """sum[n][i0:j0] += a · dec[i0:j0] (dec: the decoded flat tensor; `first`: sum[n] holds nothing yet, the
        product is stored), piece by piece; the screen's statistics of each piece with `observe`. Touches only
        that range of sum[n]: ranges of one tensor can be added on different threads."""
        ph, s, stats = self.phases, self.sum[n], []
        buf = getattr(_LANE, "d64", None)
        if buf is None:  # this lane's float64 piece, reused: no fresh 8 MB temporary (and its page faults) per piece
            buf = _LANE.d64 = torch.empty(CHUNK, dtype=torch.float64)
        for i in range(i0, j0, CHUNK):
            j = min(j0, i + CHUNK)
            with ph("accumulate"):
                d = buf[:j - i].copy_(dec[i:j])  # exact, from float32 (and from the 16-bit casts)
            if observe:
                with ph("screen"):
                    stats.append(self.stats.chunk_stats(n, i, d))
                if self.loss is not None:
                    with ph("screen: θ_r − Δ"):
                        self.loss.candidate(n, i, d)
            with ph("accumulate"):
                if first:
                    torch.mul(d, a, out=s[i:j])
                else:
                    s[i:j].add_(d, alpha=a)
        return stats

    # -- the last delta of a round, added inside the outer step (OuterMaster.step's `last`) ---------------------------
    def weight_of(self, meta: dict) -> float:
        """An on-time delta's weight a_w (delta_weight)."""
        return delta_weight(meta["tokens"], self.token_weighted)

    def open_delta(self, w: int, meta: dict, late: bool = False) -> PipelinedReader:
        """Worker w's delta of this round (`late`: its late one of round r - 1) opened for reading tensor by tensor,
        its size and header checked from the reader's own open (one per delta); RejectedDelta otherwise."""
        f = self.paths.delta_file(self.r - 1 if late else self.r, w)
        groups = [(n, list(self.codec.specs(n, tuple(s)))) for n, s in self.shapes.items()]
        try:
            rd = PipelinedReader(f, groups, phases=self.phases, like=meta["sha256"])
        except (ValueError, OSError) as e:
            raise RejectedDelta(w, _whole_file_reason(self, f, meta) or f"unreadable delta file ({e})")
        try:
            with self.phases("checks"):
                if rd.size != meta["bytes"]:
                    raise ValueError(f"file has {rd.size} bytes, sidecar says {meta['bytes']} (truncated?)")
                self.codec.check_header(rd.header, self.shapes, rd.metadata)
        except (CodecError, ValueError, OSError) as e:
            rd.close()
            self.bytes_read += rd.nbytes
            raise RejectedDelta(w, _whole_file_reason(self, f, meta) or str(e))
        return rd

    def bad_delta_reason(self, w: int, meta: dict, e: BaseException) -> str:
        """Why worker w's delta of this round is refused after `e` came up while reading or checking it: the size
        or checksum reason when the file is not the one its sidecar vouches for, else e's message."""
        return _whole_file_reason(self, self.paths.delta_file(self.r, w), meta) or str(e)

    def accepted(self, w: int, meta: dict, a: float, observed: bool) -> None:
        """Worker w's delta, added (and its weight counted in total) by its caller, joins the accepted ones."""
        if observed and self.stats is not None:
            self.stats.seal(w)
            self.finish_loss(w)
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
            self.forget_loss(w)
        for w, meta in keep:
            self.add(w, meta, observe=False)
        for w, meta, lw in late:
            self.add(w, meta, late_weight=lw)

    def finish_loss(self, w: int) -> None:
        """outer.screen_loss: worker w's delta is whole and accepted: the loss of θ_r − Δ_w (one evaluation)."""
        if self.loss is not None:
            with self.phases("screen: loss of θ_r − Δ"):
                self.loss.finish(w)

    def forget_loss(self, w: int) -> None:
        if self.loss is not None:
            self.loss.forget(w)

    def mean(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weighted mean delta of one tensor, float32 (into `out` when given: a flat float32 tensor)."""
        s = self.sum[name]
        res = torch.empty(s.numel(), dtype=torch.float32) if out is None else out
        for i in range(0, s.numel(), CHUNK):
            j = min(s.numel(), i + CHUNK)
            torch.div(s[i:j], self.total, out=res[i:j])  # one pass: the float64 quotient rounded as it is stored
        return res.reshape(self.shapes[name])

    def mean_piece(self, name: str, i: int, j: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values i..j of the flat weighted mean of one tensor, float32 (into `out`, a float32 buffer of at least
        j − i values, when given; the outer step overwrites it). One pass: the quotient is taken in float64 and
        rounded once to float32 as it is stored, the same bits as (sum / total).to(float32)
        (tests/unit/test_accumulate.py)."""
        s = self.sum[name][i:j]
        res = torch.empty(j - i, dtype=torch.float32) if out is None else out[:j - i]
        return torch.div(s, self.total, out=res)
