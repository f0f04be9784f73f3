"""The sparse exchange (outer.compression = topk): chunked top-k of (Δ + β·residual), values at 2 bits (or int4 /
int8), offsets packed in as few bits as the chunk needs, error feedback keeping everything not sent — SparseLoCo's
recipe (Sarfi et al. 2025, arXiv 2508.15706; docs/compression.md says what we took and where we differ).

Per tensor of n values, cut into chunks of C (the last one may be shorter, L = n mod C): each chunk keeps its
k_L = max(1, round(density · L)) entries of largest magnitude (ties: the lower offset wins, so the selection is a
function of the values alone), listed by offset in increasing order. Stored, in file order:

    <name>::idx    uint8   the offsets, ceil(log2 C) bits each (12 for C = 4096), little-endian bit stream
    <name>::val    uint8   the value codes, 2 or 4 bits each (int8: one int8 each)
    <name>::scale  float32 one absmax scale per chunk

Every shape is a function of (n, C, density, value bits): a truncated index block, a missing scale or another density
is a header mismatch, refused before any tensor is read. Offsets out of range or repeated (not strictly increasing
within a chunk) and non-finite scales are refused by `check_values`.

Values: 2 bits code the levels (2c − 3) · s ∈ {−3s, −s, s, 3s} with s = max|v| / 3 over the chunk's selected values
(they are the chunk's largest, so no level at 0 is needed); int4 / int8 are the block codecs' codes in [−7, 7] /
[−127, 127] with s = max|v| / qmax. Decoding is one IEEE multiply of a small integer by s, scattered into zeros: the
same bits on every device.

The aggregate (train/exchange/theta.py, master.py): no update file. Every copy of θ — each worker's and the
coordinator's — reads the accepted sparse deltas of the round (the commit record lists them, and the late ones),
sums them in float64 in one fixed order (workers by id, then late deltas by id) and applies
θ_{r+1} = θ_r + (−α) · mean, α the outer lr the commit record carries: the same arithmetic on the same bits, so every
copy is bit-identical and theta_sha256 still checks it. There is no outer momentum: the error feedback's decay β
plays its part (SparseLoCo). bench/compression.py measures why this beats a coordinator update for N <= 16.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from train.core.phases import NO_PHASES
from train.core.store import RunPaths
from train.exchange.accumulate import delta_weight, read_checked_delta
from train.exchange.codec import CodecError

IDX, VAL, SCALE = "::idx", "::val", "::scale"
VALUE_CODECS = {"2bit": 2, "int4": 4, "int8": 8}


def pack_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned integers < 2**bits -> a little-endian bit stream, `bits` per value (uint8, ceil(n·bits/8) bytes)."""
    x = np.ascontiguousarray(x, dtype=np.uint32)
    planes = ((x[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_bits(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    """pack_bits' inverse: the first n values (uint32). The widths the codec uses most are read with byte
    arithmetic (2 and 4 bits: values within a byte; 8; 12: two values in three bytes, chunk_size 4096's offsets):
    the same values as the general way, bit planes, which makes bits x n uint32s (the sparse sums at the commit
    unpack N deltas' offsets: bench/outer_step.py)."""
    b = np.ascontiguousarray(b, dtype=np.uint8)
    if bits in (1, 2, 4) and len(b) * 8 >= n * bits:
        per = 8 // bits
        m = -(-n // per)
        v = (b[:m, None] >> np.arange(0, 8, bits, dtype=np.uint8)) & np.uint8((1 << bits) - 1)
        return v.reshape(-1)[:n].astype(np.uint32)
    if bits == 8 and len(b) >= n:
        return b[:n].astype(np.uint32)
    if bits == 12 and len(b) * 8 >= n * 12:
        m = -(-n // 2)
        t = np.zeros(3 * m, dtype=np.uint8)
        t[:min(len(b), 3 * m)] = b[:3 * m]
        t = t.reshape(m, 3).astype(np.uint32)
        out = np.empty((m, 2), dtype=np.uint32)
        out[:, 0] = t[:, 0] | ((t[:, 1] & 15) << 8)
        out[:, 1] = (t[:, 1] >> 4) | (t[:, 2] << 4)
        return out.reshape(-1)[:n]
    planes = np.unpackbits(b, count=n * bits, bitorder="little")
    return (planes.reshape(n, bits).astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(axis=1,
                                                                                               dtype=np.uint32)


@functools.lru_cache(maxsize=32)
def _chunk_starts(chunk: int, full: int, k: int, rem: int, kr: int) -> np.ndarray:
    """The start of the chunk of each of the K selected values of a tensor (the same for every delta of a tensor of
    that size: kept for the next one; read-only)."""
    out = np.concatenate([np.repeat(np.arange(full, dtype=np.int64) * chunk, k),
                          np.full(kr, full * chunk, dtype=np.int64)])
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class SparseCodec:
    """The topk codec (module doc); the same interface as train/exchange/codec.py's Codec."""
    density: float = 64 / 4096
    chunk: int = 4096
    values: str = "2bit"
    ef_decay: float = 0.95     # β of the senders' error feedback (Residual reads it)
    name: str = "topk"
    sparse = True
    quantised = True
    lossless = False

    @property
    def block(self) -> int:           # what protocol.write_delta's sidecar records
        return self.chunk

    @property
    def vbits(self) -> int:
        return VALUE_CODECS[self.values]

    @property
    def qmax(self) -> int:
        return {2: 3, 4: 7, 8: 127}[self.vbits]

    @property
    def ibits(self) -> int:
        return max(1, math.ceil(math.log2(self.chunk)))

    def metadata(self) -> dict[str, str]:
        return {"codec": self.name, "block": str(self.chunk), "density": repr(self.density), "values": self.values}

    def k_of(self, length: int) -> int:
        return max(1, min(length, int(self.density * length + 0.5)))

    def layout(self, n: int) -> tuple[int, int, int, int]:
        """(full chunks, k per full chunk, length of the last short chunk or 0, its k or 0)."""
        full, rem = divmod(n, self.chunk)
        return full, self.k_of(self.chunk), rem, (self.k_of(rem) if rem else 0)

    def count(self, n: int) -> tuple[int, int]:
        """(selected values, chunks) of a tensor of n values."""
        full, k, rem, kr = self.layout(n)
        return full * k + kr, full + (1 if rem else 0)

    def specs(self, name: str, shape: tuple) -> dict[str, tuple[torch.dtype, tuple]]:
        K, nc = self.count(math.prod(shape))
        vals = (torch.int8, (K,)) if self.vbits == 8 else (torch.uint8, (-(-K * self.vbits // 8),))
        return {name + IDX: (torch.uint8, (-(-K * self.ibits // 8),)), name + VAL: vals,
                name + SCALE: (torch.float32, (nc,))}

    def bytes_per_value(self) -> float:
        """Bytes per model value (full chunks)."""
        k = self.k_of(self.chunk)
        return (k * (self.ibits + self.vbits) / 8 + 4) / self.chunk

    # -- encode / decode ---------------------------------------------------------------------------------------------
    @staticmethod
    def _select(mat: torch.Tensor, k: int) -> torch.Tensor:
        """Offsets of the k largest |values| per row, ascending; ties go to the lower offset: the first k of a
        stable descending sort, without the sort (4.1 → 0.6 s for 135M values on 2 cores). A row's k-th largest
        |value| t is torch.topk's smallest (its value, unlike which of several equal entries topk returns, is
        defined); the row keeps every offset with |x| > t and, of those with |x| = t, the lowest ones until it has
        k — exactly the sort's first k. Rows where more than k values reach t (ties at t) are resolved alone; with a NaN
        (the caller checks values before encoding) the sort answers."""
        rows = mat.shape[0]
        a = mat.abs()
        top = torch.topk(a, k, dim=1, sorted=False).values  # (a NaN is the largest, as in the sort)
        if bool(torch.isnan(top).any()):
            order = torch.sort(a, dim=1, descending=True, stable=True).indices[:, :k]
            return torch.sort(order, dim=1).values
        t = top.amin(dim=1, keepdim=True)
        take = a >= t  # at least k per row: exactly k unless a row has ties at t
        got = take.nonzero()
        if got.shape[0] != rows * k:
            over = (torch.bincount(got[:, 0], minlength=rows) > k).nonzero().squeeze(1)
            tv, sub = t[over], a[over]
            need = k - (top[over] > tv).sum(dim=1, keepdim=True)  # values above t are all among the top k
            tie = sub == tv
            take[over] = (sub > tv) | (tie & (tie.cumsum(dim=1) <= need))
            got = take.nonzero()
        return got[:, 1].view(rows, k)

    @torch.no_grad()
    def encode(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = x.detach().reshape(-1).to("cpu", torch.float32)
        full, k, rem, kr = self.layout(flat.numel())
        offs, vals = [], []
        if full:
            m = flat[:full * self.chunk].view(full, self.chunk)
            o = self._select(m, k)
            offs.append(o.reshape(-1))
            vals.append(torch.gather(m, 1, o))
        if rem:
            m = flat[full * self.chunk:].view(1, rem)
            o = self._select(m, kr)
            offs.append(o.reshape(-1))
            vals.append(torch.gather(m, 1, o))
        scales, codes = [], []
        for v in vals:
            s = v.abs().amax(dim=1) / self.qmax
            inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).unsqueeze(1)
            if self.vbits == 2:  # levels 2c − 3: c = round((v / s + 3) / 2) in 0..3
                c = torch.round((v * inv + 3) / 2).clamp_(0, 3)
            else:
                c = torch.round(v * inv).clamp_(-self.qmax, self.qmax)
            scales.append(s)
            codes.append(c.reshape(-1))
        off = torch.cat(offs).numpy()
        code = torch.cat(codes)
        idx = torch.from_numpy(pack_bits(off, self.ibits))
        if self.vbits == 8:
            val = code.to(torch.int8)
        else:
            val = torch.from_numpy(pack_bits(code.to(torch.int64).numpy() + (0 if self.vbits == 2 else 8),
                                             self.vbits))
        return {name + IDX: idx, name + VAL: val, name + SCALE: torch.cat(scales).to(torch.float32)}

    def _unpack(self, name: str, stored: Mapping[str, torch.Tensor], n: int) -> tuple[np.ndarray, torch.Tensor]:
        """(absolute positions of the K selected values, their levels as float32 integers)."""
        K, _ = self.count(n)
        off = unpack_bits(stored[name + IDX].numpy(), self.ibits, K).astype(np.int64)
        if self.vbits == 8:
            lev = stored[name + VAL].to(torch.float32)
        else:  # small integers: exact in float32 whichever way they are computed
            c = unpack_bits(stored[name + VAL].numpy(), self.vbits, K).astype(np.float32)
            lev = torch.from_numpy(2 * c - 3 if self.vbits == 2 else c - 8)
        return _chunk_starts(self.chunk, *self.layout(n)) + off, lev

    @torch.no_grad()
    def selected(self, name: str, stored: Mapping[str, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in the flat tensor of n values, their decoded float32 values): the K values a delta sends.
        Each value is its level times its chunk's scale (the scales repeated k times each, not gathered by a K-long
        index: the same products)."""
        pos, lev = self._unpack(name, stored, n)
        full, k, rem, kr = self.layout(n)
        s = stored[name + SCALE].to(torch.float32)
        per_value = torch.cat([s[:full].repeat_interleave(k), s[full:].repeat_interleave(kr)]) if kr else \
            s[:full].repeat_interleave(k)
        return torch.from_numpy(pos), lev * per_value

    @torch.no_grad()
    def decode(self, name: str, stored: Mapping[str, torch.Tensor], shape: tuple) -> torch.Tensor:
        n = math.prod(shape)
        pos, vals = self.selected(name, stored, n)
        out = torch.zeros(n, dtype=torch.float32)
        out[pos] = vals
        return out.reshape(shape)

    # -- checking a file written by someone else -----------------------------------------------------------------------
    def check_header(self, header: Mapping[str, dict], expect_shapes: Mapping[str, tuple],
                     metadata: Mapping[str, str]) -> None:
        from train.core.tensorio import _DTYPES

        if metadata.get("codec") != self.name:
            raise CodecError(f"the file declares codec {metadata.get('codec')!r}, the run uses {self.name!r}")
        for key, want in (("block", str(self.chunk)), ("density", repr(self.density)), ("values", self.values)):
            if metadata.get(key) != want:
                raise CodecError(f"the file declares {'chunk size' if key == 'block' else key} {metadata.get(key)}, "
                                 f"the run uses {want}")
        want: dict[str, tuple] = {}
        for n, s in expect_shapes.items():
            want.update(self.specs(n, tuple(s)))
        if set(header) != set(want):
            diff = sorted(set(header) ^ set(want))
            raise CodecError(f"tensor names differ from what topk stores for the global model (e.g. {diff[:3]})")
        for k, (dtype, shape) in want.items():
            info = header[k]
            if tuple(info["shape"]) != tuple(shape):
                what = "index block" if k.endswith(IDX) else "values" if k.endswith(VAL) else "scales"
                raise CodecError(f"{k}: {what} of shape {info['shape']}, topk (density {self.density}, chunk "
                                 f"{self.chunk}, {self.values}) stores {list(shape)} (truncated?)")
            if info["dtype"] != _DTYPES[dtype]:
                raise CodecError(f"{k}: dtype {info['dtype']}, expected {_DTYPES[dtype]}")

    def check_values(self, name: str, stored: Mapping[str, torch.Tensor], shape: tuple | None = None) -> None:
        """Scales finite and >= 0; offsets inside their chunk and strictly increasing (no repeats); int8 != −128."""
        s = stored[name + SCALE]
        if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
            raise CodecError(f"{name}: scales are not finite and >= 0 (NaN/inf or negative)")
        if self.vbits == 8 and bool((stored[name + VAL] == -128).any()):
            raise CodecError(f"{name}: int8 code -128 is outside [-127, 127]")
        if shape is None:
            return
        n = math.prod(shape)
        K, _ = self.count(n)
        off = unpack_bits(stored[name + IDX].numpy(), self.ibits, K).astype(np.int64)
        full, k, rem, kr = self.layout(n)
        rows = [(off[:full * k].reshape(full, k), self.chunk)] if full else []
        if kr:
            rows.append((off[full * k:].reshape(1, kr), rem))
        for o, length in rows:
            if bool((o >= length).any()):
                raise CodecError(f"{name}: an index is out of range (offset >= chunk length {length})")
            if o.shape[1] > 1 and bool((np.diff(o, axis=1) <= 0).any()):
                raise CodecError(f"{name}: indices repeat or are out of order within a chunk")


def get_sparse_codec(oc) -> SparseCodec:
    return SparseCodec(density=float(oc.density), chunk=int(oc.chunk_size), values=oc.sparse_values,
                       ef_decay=float(oc.ef_decay))


class SparseAccumulator:
    """The accepted sparse deltas of round r, summed in one fixed order (workers by id, then late deltas by id) so
    that every process that reads the same deltas computes the same mean, bit for bit. Same interface as
    train/exchange/accumulate.py's Accumulator (the coordinator adds deltas as they arrive)."""

    def __init__(self, paths: RunPaths, r: int, shapes: dict[str, tuple], codec: SparseCodec, token_weighted: bool,
                 screen: bool = False, expected: int = 1):
        from train.exchange.screen import DeltaStats

        self.paths, self.r, self.shapes, self.codec = paths, r, shapes, codec
        self.token_weighted = token_weighted
        self.stored: dict[tuple[int, int], tuple[float, dict]] = {}   # (0 on time / 1 late, worker) -> (a, tensors)
        self.workers: list[int] = []
        self.metas: dict[int, dict] = {}
        self.weights: dict[int, float] = {}
        self.late: dict[int, dict] = {}
        self.bytes_read = 0
        self._sums: dict[str, torch.Tensor] | None = None
        self.stats = DeltaStats(shapes, expected) if screen else None  # outer.screen: of the decoded deltas
        self.loss = None  # outer.screen_loss: the coordinator's LossScreen (train/exchange/loss_screen.py)
        # per delta and tensor, what the sums take: (positions within their RANGE, a · values in float64, where
        # each RANGE starts in them); made once, on arrival where decode_on_arrival (the coordinator: so the
        # commit after the last delta decodes that one alone), else when first needed (a worker's θ: on the lanes)
        self._sel: dict[tuple[int, int], dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]]] = {}
        self.decode_on_arrival = False

    def add(self, w: int, meta: dict, late_weight: float | None = None) -> None:
        late = late_weight is not None
        stored = read_checked_delta(self, self.r - 1 if late else self.r, w, meta)
        a = delta_weight(meta["tokens"], self.token_weighted) * (late_weight if late else 1.0)
        key = (int(late), w)
        self.stored[key] = (a, stored)
        self._sel.pop(key, None)
        self._sums = None
        observe = self.stats is not None and not late
        if observe or self.decode_on_arrival:
            ph = getattr(self, "phases", NO_PHASES)
            for n, shape in self.shapes.items():
                k = math.prod(shape)
                with ph("decode"):
                    pos, vals = self.codec.selected(n, stored, k)
                if observe:
                    with ph("screen"):
                        self.stats.take(w, self.sparse_stats(n, stored, k, (pos, vals)))
                    if self.loss is not None:
                        with ph("screen: θ_r − Δ"):
                            self.loss.candidate_sparse(n, pos, vals)
                if self.decode_on_arrival and _whole(a):
                    with ph("decode"):
                        self._sel.setdefault(key, {})[n] = _summand(pos, vals, a, k)
            if observe:
                with ph("screen"):
                    self.stats.seal(w)  # its Gram row now, while the round collects (screen.py)
                if self.loss is not None:
                    with ph("screen: loss of θ_r − Δ"):
                        self.loss.finish(w)
        if late:
            self.late[w] = meta
            return
        self.workers.append(w)
        self.metas[w] = meta
        self.weights[w] = a

    def sparse_stats(self, name: str, stored: Mapping[str, torch.Tensor], n: int,
                     sel: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[float, torch.Tensor]:
        """DeltaStats.chunk_stats of the decoded tensor, from the K values sent alone: the squared norm of those
        values (the others are zeros: the same sum up to the order the float64 additions are made in) and the
        strided sample, +0.0 where nothing was sent — not a dense decode of the tensor per delta (0.3 s at 135M
        values, in the tail for the round's last delta)."""
        st = self.stats
        pos, vals = self.codec.selected(name, stored, n) if sel is None else sel
        v = vals.to(torch.float64)
        phase = (-st.start[name]) % st.stride
        sample = torch.zeros(len(range(phase, n, st.stride)), dtype=torch.float64)
        hit = (pos >= phase) & ((pos - phase) % st.stride == 0)
        sample[(pos[hit] - phase) // st.stride] = v[hit]
        return float(v.dot(v)), sample

    def drop(self, out: set[int]) -> None:
        """Take the on-time deltas of workers `out` back out (the screen rejected them): the commit record then
        lists the others only, and every copy of θ sums exactly those."""
        for w in out:
            self.stored.pop((0, w), None)
            self._sel.pop((0, w), None)
            self.metas.pop(w, None)
            self.weights.pop(w, None)
            if self.stats is not None:
                self.stats.forget(w)
            if self.loss is not None:
                self.loss.forget(w)
        self.workers = [w for w in self.workers if w not in out]
        self._sums = None

    @property
    def total(self) -> float:
        return sum(a for a, _ in self.stored.values())

    def mean(self, name: str) -> torch.Tensor:
        """The weighted mean delta of one tensor (float32), summed in float64 in the fixed order.

        Each delta adds only the K values it sends (put_ with accumulate), not its decoded dense tensor: O(K) per
        delta, so the sum at the commit no longer costs N dense passes of the model (bench/outer_step.py, topk:
        the tail grew 2.65x from 2 to 8 workers, now 1.5x). The same bits as adding the dense tensor: where a
        delta sends nothing it adds a · (+0.0) = +0.0, and x + 0.0 = x for every x the sum can hold (it starts at
        +0.0, and a sum of finite values is −0.0 only from −0.0 + −0.0, which never happens from +0.0); where it
        sends v, both add the product a · v, exact in float64 for a whole weight a < 2^29 (v has 24 significant
        bits), so one rounding of x + a · v either way. A fractional weight (outer.late_weight) makes a · v round,
        and a fused multiply-add would round it differently: such a delta adds its dense tensor as before."""
        n = math.prod(self.shapes[name])
        acc = torch.zeros(n, dtype=torch.float64)
        total = 0.0
        for key in sorted(self.stored):
            a, stored = self.stored[key]
            if _whole(a):
                rel, av, cut = self.summand(key, name, n)
                pos = rel + torch.repeat_interleave(torch.arange(len(cut) - 1) * RANGE, torch.tensor(cut).diff())
                acc.put_(pos, av, accumulate=True)  # (positions unique: one add each)
            else:
                acc.add_(self.codec.decode(name, stored, self.shapes[name]).reshape(-1).to(torch.float64), alpha=a)
            total += a
        return (acc / total).to(torch.float32).reshape(self.shapes[name])

    def step_into(self, name: str, theta: torch.Tensor, lr: float, out: torch.Tensor) -> bool:
        """sparse_step(theta, self.mean(name), lr) written into `out` (contiguous float32, theta's size; theta itself
        steps in place), range by range: each range's float64 sum from +0.0, every delta's values in it added in the
        fixed order (index_add_: a delta's positions increase, so a range's are a slice found by binary
        search), then divided, scaled by −α and added to θ's range while it is in cache. Where no delta sent a value
        the sum stays +0.0, as in mean(). The same operations on the same values as mean() + sparse_step, so the
        same bits (tests/unit/test_codec_sparse.py), in ~3 passes over θ instead of ~7 and no tensor-sized
        temporaries. Returns False, writing nothing, where mean() adds a dense tensor (a fractional weight): the
        caller steps the dense way."""
        if not all(_whole(a) for a, _ in self.stored.values()):
            return False
        n = theta.numel()
        src, dst = theta.reshape(-1), out.view(-1)
        total, sent = 0.0, []
        for key in sorted(self.stored):
            sent.append(self.summand(key, name, n))
            total += self.stored[key][0]
        acc = torch.zeros(min(n, RANGE), dtype=torch.float64)
        tmp = torch.empty(min(n, RANGE), dtype=torch.float32)
        for k, i in enumerate(range(0, n, RANGE)):
            j = min(n, i + RANGE)
            for rel, vals, cut in sent:
                if cut[k + 1] > cut[k]:  # (a delta's positions are unique: one add each, in the fixed order)
                    acc.index_add_(0, rel[cut[k]:cut[k + 1]], vals[cut[k]:cut[k + 1]])
            mean = torch.div(acc[:j - i], total, out=tmp[:j - i])  # the float64 quotient rounded once to float32
            torch.add(src[i:j], mean.mul_(-float(lr)), out=dst[i:j])
            acc.zero_()
        return True

    def summand(self, key: tuple[int, int], name: str, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """What delta `key` (whole weight a) adds to tensor `name`'s sum: (positions within their RANGE, a · values
        in float64: exact, where each RANGE of the tensor starts in them); decoded on arrival or here, once. Lanes
        that ask for different tensors may call it at once."""
        got = self._sel.get(key, {}).get(name)
        if got is None:
            a, stored = self.stored[key]
            got = _summand(*self.codec.selected(name, stored, n), a, n)
            self._sel.setdefault(key, {})[name] = got
        return got


RANGE = 1 << 18  # values of a tensor SparseAccumulator.step_into sums and steps at a time (its float64 sum: 2 MB)


def _whole(a: float) -> bool:
    """A weight whose products with float32 values are exact in float64 (a whole number below 2^29)."""
    return a == int(a) and 0 < a < 2 ** 29


def _summand(pos: torch.Tensor, vals: torch.Tensor, a: float, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    starts = torch.arange(0, n + RANGE, RANGE).clamp_(max=n)
    return pos.remainder(RANGE), vals.to(torch.float64).mul_(a), torch.searchsorted(pos, starts).tolist()


def sparse_step(theta: torch.Tensor, mean: torch.Tensor, lr: float) -> torch.Tensor:
    """θ_{r+1} = θ_r + (−α · mean): one IEEE multiply, then one add (no fused multiply-add, the same bits
    everywhere). Where no worker sent a value, mean is 0 and θ keeps its value."""
    return theta.add(mean.mul(-float(lr)))
