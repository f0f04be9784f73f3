"""The coordinator's side of a round: the master θ, the outer momentum and the way-back residual, kept in memory;
the outer step from the accumulated deltas; the files that commit round r + 1; resume after a crash.

Without compression (outer.compression = none) round r + 1 publishes the full θ_{r+1} (rounds/r+1/global/) and the
momentum (outer_state.safetensors), as protocol 1 always did; a restart loads both.

With topk (train/exchange/sparse.py) nothing is published but the commit record: every copy, the master too, sums
the accepted sparse deltas itself; no momentum, no residual, checkpoints of θ only.

With a codec, round r + 1 publishes only u = encode(θ* − θ_r + e) (update.safetensors), where θ* is the outer step's
result and e the residual of earlier rounds; θ_{r+1} = θ_r + decode(u) on every copy (train/exchange/theta.py). The
global directory and outer_state (momentum + residual) are written every outer.checkpoint_every rounds and after the
last. A restart loads the last checkpoint c and replays rounds c..r−1 from the deltas kept on disk: the same sums,
the same outer steps, the same encodings — it checks each re-encoded update against the committed one's checksum —
so the momentum and residual it ends with are those of an uninterrupted run.
"""
from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import torch

from train.core import sharedfs
from train.core.errors import ProtocolError
from train.core.model import WEIGHTS
from train.core.phases import NO_PHASES
from train.exchange.outer import outer_lr_at, outer_step_tensor
from train.core.store import publish_dir, read_json
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import StreamingWriter, iter_tensors
from train.core.threads import intra_op_threads, lanes, ordered_map
from train.exchange.accumulate import CHUNK, Accumulator
from train.exchange import fused
from train.exchange.codec import Codec, Residual, all_finite
from train.exchange.protocol import CHECKSUM_DIFFERS, RejectedDelta, check_sidecar
from train.exchange.theta import GlobalTheta, read_update, theta_checksum

log = logging.getLogger("coordinator")
RESIDUAL = "residual::"
SEGMENT = 4 * CHUNK  # values of a tensor one lane steps at a time (the no-codec step, _step_full)
# values one lane steps at a time with a dense codec (_step_coded), rounded down to whole pairs of the codec's blocks:
# its passes (the fused kernel's 3, torch's ~12) stay in the core's cache and torch's float64 -> float32 mean needs no
# fresh temporary pages (3.6x faster per value than 4M-value segments: docs/benchmarks.md, "Outer step")
CODED_SEGMENT = 1 << 18


class _BadDelta(Exception):
    """The round's last delta, read inside the step, is refused (its reason)."""


class _FillAgain(Exception):
    """publish_dir would fill θ_{r+1}'s folder a second time (after a transient error): the step that reads the
    round's last delta itself read it once, so step() falls back to the ordinary way instead."""


def exchange_codecs(oc) -> tuple[Codec, Codec | None]:
    """(codec of the workers' deltas, codec of the way back or None when the full θ is published every round)."""
    from train.exchange.codec import get_codec

    if oc.compression == "none":
        # streaming DiLoCo's fragments: a round commits one fragment, as an fp32 update of it (θ_{r+1} = θ_r + u on
        # every copy), not the whole model (docs/streaming.md)
        return get_codec(oc.delta_dtype), (get_codec("float32") if getattr(oc, "fragments", 1) > 1 else None)
    if oc.compression == "topk":  # the sparse deltas are the way back too (train/exchange/sparse.py)
        from train.exchange.sparse import get_sparse_codec

        c = get_sparse_codec(oc)
        return c, c
    c = get_codec(oc.compression, oc.block_size)
    return c, c


def write_global(paths: DiLoCoPaths, r: int, names: list[str], tensors: dict[str, torch.Tensor]) -> int:
    """rounds/r/global/: the weights (fp32, file order), θ_0's config files, MANIFEST; returns bytes written."""
    def fill(tmp: Path) -> dict:
        for fname in ("config.json", "generation_config.json"):
            if sharedfs.exists(paths.global_dir(0) / fname):
                sharedfs.copy_file(paths.global_dir(0) / fname, tmp / fname)
        specs = {n: (torch.float32, tuple(tensors[n].shape)) for n in names}
        with StreamingWriter(tmp / WEIGHTS, specs, {"format": "pt"}) as wr:
            for n in names:
                wr.write(n, tensors[n])
        nbytes.append(wr.nbytes)
        return {WEIGHTS: wr.digest}
    nbytes: list[int] = []
    publish_dir(paths.global_dir(r), fill)
    return nbytes[-1]


class OuterMaster:
    """θ_r, m_r and the way-back residual of the coordinator, and the step to round r + 1."""

    def __init__(self, paths: DiLoCoPaths, oc, last_round: int):
        self.paths, self.oc, self.last_round = paths, oc, last_round
        self.delta_codec, self.codec = exchange_codecs(oc)
        self.theta = GlobalTheta(paths, self.codec, getattr(oc, "fragments", 1))
        self.names, self.shapes = self.theta.names, self.theta.shapes
        self.frags = self.theta.frags  # round r steps fragment r mod P's pieces (every tensor with P = 1)
        self.momentum: dict[str, torch.Tensor] = {}
        self.phases = NO_PHASES  # where the tail's time goes (bench/outer_step.py sets a Phases)
        # topk: every copy sums the sparse deltas itself: no update, no residual of ours, no momentum (SparseLoCo)
        self.sparse = bool(getattr(self.codec, "sparse", False))
        self.residual = Residual(self.codec) if self.codec is not None and not self.sparse else None
        if not self.sparse:  # numba's import and the kernels' self-check now, not in round 0's tail (fused.py)
            fused.kernels()
        if self.sparse and oc.momentum:
            log.info("outer.compression = topk: the outer step is θ − lr · mean (SparseLoCo); outer.momentum = %g is "
                     "not used (the workers' error feedback, outer.ef_decay = %g, plays its part)", oc.momentum,
                     oc.ef_decay)

    @property
    def round(self) -> int | None:
        return self.theta.round

    def new_accumulator(self, r: int, expected: int = 1) -> Accumulator:
        """Round r's accumulator; `expected`: the deltas the round awaits (the screen's sample size)."""
        screen = getattr(self.oc, "screen", False)
        if self.sparse:
            from train.exchange.sparse import SparseAccumulator

            acc = SparseAccumulator(self.paths, r, self.frags.shapes(r), self.delta_codec, self.oc.delta_weighting,
                                    screen=screen, expected=expected)
            acc.phases = self.phases
            acc.decode_on_arrival = True  # the commit after the last delta decodes that one alone
            return acc
        return Accumulator(self.paths, r, self.frags.shapes(r), self.delta_codec, self.oc.delta_weighting,
                           screen=screen, phases=self.phases, expected=expected)

    def is_checkpoint_round(self, r: int) -> bool:
        return self.codec is None or r % self.oc.checkpoint_every == 0 or r >= self.last_round

    # -- resume ------------------------------------------------------------------------------------------------------
    def _load_state(self, c: int) -> None:
        self.momentum, err = {}, {}
        f = self.paths.outer_state(c)
        if c > 0 and sharedfs.is_file(f):
            for k, t in iter_tensors(f):
                (err if k.startswith(RESIDUAL) else self.momentum)[k] = t.to(torch.float32)
        if self.residual is not None:
            self.residual.load(err, prefix=RESIDUAL)

    def resume(self, r: int) -> None:
        """Bring the master to committed round r (see the module doc)."""
        if self.codec is None:
            self.theta.advance_to(r)
            self._load_state(r)
            return
        if self.sparse:  # the same rebuild as every worker's: checkpoint + the committed rounds' sparse deltas
            self.theta.advance_to(r)
            return
        c = self.theta.last_checkpoint(r)
        self.theta.load_checkpoint(c)
        self._load_state(c)
        for k in range(c, r):
            rec = read_json(self.paths.committed(k + 1))
            acc = self.new_accumulator(k)
            late = {int(w[1:]): v for w, v in (rec.get("late") or {}).items()}
            try:
                for w in rec.get("workers", []):
                    acc.add(w, check_sidecar(self.paths, k, w, self.delta_codec, acc.shapes))
                for w, v in late.items():
                    acc.add(w, check_sidecar(self.paths, k - 1, w, self.delta_codec, acc.shapes),
                            late_weight=v["weight"])
            except RejectedDelta as e:
                raise ProtocolError(f"cannot replay round {k} from the deltas on disk ({e}); the run's files "
                                    f"were changed after the commit") from None
            stored, _ = self._step(k, acc)
            sha = self._sha_of(stored, like=rec.get("update_sha256") or None)
            if rec.get("update_sha256") and sha != rec["update_sha256"]:
                log.warning("replaying round %d gave a different update than the committed one (non-deterministic "
                            "kernels?); continuing from the committed update", k)
                u, _ = read_update(self.paths, k + 1, self.codec, self.frags.shapes(k))
                for n in self.frags.pieces(k):  # what every copy applied, and the residual that goes with it
                    self.residual.error[n] = self._pre[n] - u[n]
                    self.frags.put(self.theta.tensors, n, self.frags.get(self.theta.tensors, n).add(u[n]))
            else:
                for n in self.frags.pieces(k):
                    self.frags.put(self.theta.tensors, n, self.frags.get(self.theta.tensors, n).add(self._seen[n]))
            self.theta.round = k + 1
            self.theta.verify(k + 1)
        if r > c:
            log.info("resumed the outer state at round %d: checkpoint %d + %d replayed rounds", r, c, r - c)

    def _sha_of(self, stored: dict[str, torch.Tensor], like: str | None = None) -> str:
        """The checksum the update file of `stored` would have (in the algorithm of the stored checksum `like`)."""
        import os
        import tempfile

        fd, tmp = tempfile.mkstemp(suffix=".safetensors")
        os.close(fd)
        try:
            return self._write_update(Path(tmp), stored, self.theta.round + 1, self.theta.round, like=like)[0]
        finally:
            Path(tmp).unlink(missing_ok=True)

    # -- one round ---------------------------------------------------------------------------------------------------
    def _step(self, r: int, acc: Accumulator, lr: float | None = None) -> tuple[dict, dict]:
        """The outer step of round r from the accumulated deltas: updates momentum (and, with a codec, the residual
        and self._seen / self._pre); returns (stored update tensors or {}, θ* for no codec)."""
        oc = self.oc
        lr = outer_lr_at(r, oc) if lr is None else lr
        stored: dict[str, torch.Tensor] = {}
        new_theta: dict[str, torch.Tensor] = {}
        self._seen, self._pre = {}, {}
        for n in self.frags.pieces(r):
            theta = self.frags.get(self.theta.tensors, n)
            new, self.momentum[n] = outer_step_tensor(theta, acc.mean(n), self.momentum.get(n), lr, oc.momentum,
                                                      oc.nesterov)
            if self.codec is None:
                new_theta[n] = new
                continue
            target = new - theta
            e = self.residual.error.get(n)
            self._pre[n] = target if e is None else target + e
            s, seen = self.residual.send(n, target)
            stored.update(s)
            self._seen[n] = seen
        return stored, new_theta

    def _step_full(self, r: int, acc: Accumulator, lr: float | None = None, last: tuple | None = None) -> int:
        """No codec: θ_{r+1} and m_{r+1} computed in place, piece by piece (train/exchange/outer.py's
        outer_step_piece on the mean's pieces: no model-sized temporary), in segments of SEGMENT values on every
        core's lane (train/core/threads.py), each segment handed to two writers as soon as it is stepped — the
        global model and the outer state, written with O_DIRECT (hashed: the model) and fsync'd on their own
        threads while the next segments are computed. Returns the bytes written. A retried global folder (publish_dir
        starts `fill` again after a transient error) writes the segments already stepped as they are: each is
        stepped once.

        `last` = (w, its sidecar, its open reader): the round's last delta, not yet in `acc`, is read here and each
        piece of it is checked and added just before that piece is stepped (step() says what happens when it turns
        out bad)."""
        oc, ph = self.oc, self.phases
        if last is not None:
            w, meta, rd = last  # rd: its reader, open, size and header checked (Accumulator.open_delta)
        lr = outer_lr_at(r, oc) if lr is None else lr
        specs = {n: (torch.float32, tuple(self.shapes[n])) for n in self.names}
        numel = {n: math.prod(self.shapes[n]) for n in self.names}
        had = set(self.momentum)  # m_r exists (every round but the first: m_1 starts as the mean)
        for n in self.names:
            if n not in had:
                self.momentum[n] = torch.empty(self.shapes[n], dtype=torch.float32)
        # segments of up to SEGMENT values, stepped on the lanes, each to the writers as soon as it is stepped
        segments = [(n, i, min(numel[n], i + SEGMENT)) for n in self.names for i in range(0, max(1, numel[n]), SEGMENT)]
        done: set[tuple[str, int]] = set()  # (tensor, first value) of the segments stepped (publish_dir may retry)
        local = threading.local()  # each lane's buffer for the mean's piece, overwritten by the step
        kern = fused.kernels()
        nbytes: list[int] = []
        if last is not None:
            a, observe = acc.weight_of(meta), acc.stats is not None
            by_norm = observe and not acc.codec.quantised  # the squared norm is the finite check (accumulate.py)
            first = {n: n not in acc.sum for n in self.names}
            for n in self.names:
                if first[n]:
                    acc.sum[n] = torch.empty(numel[n], dtype=torch.float64)
            acc.total += a

        def step_segment(seg) -> tuple[str, int, int, list]:
            n, i0, j0, dec = seg
            if (n, i0) in done:
                return n, i0, j0, []
            stats: list = []
            if dec is not None:  # the last delta's values of this segment into the sum first
                if not by_norm:
                    with ph("checks"):
                        if not all_finite(dec[i0:j0]):
                            raise _BadDelta(f"{n}: non-finite values (NaN/inf)")
                stats = acc.add_range(n, dec, a, observe, i0, j0, first[n])
                if by_norm and not all(math.isfinite(st[0]) for st in stats):
                    raise _BadDelta(f"{n}: non-finite values (NaN/inf)")
            gbuf = getattr(local, "gbuf", None)
            if gbuf is None:
                gbuf = local.gbuf = torch.empty(CHUNK, dtype=torch.float32)
            with ph("outer step"):
                p, m = self.theta.tensors[n].view(-1), self.momentum[n].view(-1)
                if kern is not None:  # the mean and the step in one pass, torch's bits (train/exchange/fused.py)
                    fused.mean_step(kern, acc.sum[n][i0:j0], acc.total, p[i0:j0], m[i0:j0], oc.momentum, lr,
                                    oc.nesterov, n in had)
                    done.add((n, i0))
                    return n, i0, j0, stats
                for i in range(i0, j0, CHUNK):  # torch's ops: the mean's piece, outer.outer_step_piece
                    j = min(j0, i + CHUNK)
                    fused.eager_mean_step(acc.sum[n][i:j], acc.total, p[i:j], m[i:j], oc.momentum, lr,
                                          oc.nesterov, n in had, gbuf)
            done.add((n, i0))
            return n, i0, j0, stats

        def items():
            if last is None:
                for n, i, j in segments:
                    yield n, i, j, None
                return
            it = iter(rd)
            for n in self.names:
                try:
                    got, stored = next(it)
                except (StopIteration, ValueError, OSError) as e:
                    raise _BadDelta(str(e) or "the file ends before its last tensor") from None
                if got != n:
                    raise _BadDelta(f"tensor {got!r} where {n!r} was expected")
                dec = stored[n].reshape(-1)  # a cast: decoded piece by piece as it is added
                for i in range(0, max(1, numel[n]), SEGMENT):
                    yield n, i, min(numel[n], i + SEGMENT), dec

        filled: list[bool] = []
        with intra_op_threads(1), \
                StreamingWriter(self.paths.outer_state(r + 1), specs, {"round": str(r + 1)}, hash_bytes=False,
                                phases=ph, direct=True) as mw:
            sent: set[tuple[str, int]] = set()  # segments handed to the momentum writer (once, whatever publish_dir
            # retries)

            def fill(tmp: Path) -> dict:
                if last is not None and filled:  # the last delta was read once: step() falls back instead
                    raise _FillAgain()
                filled.append(True)
                for fname in ("config.json", "generation_config.json"):
                    if sharedfs.exists(self.paths.global_dir(0) / fname):
                        sharedfs.copy_file(self.paths.global_dir(0) / fname, tmp / fname)
                with StreamingWriter(tmp / WEIGHTS, specs, {"format": "pt"}, phases=ph, direct=True) as wr:
                    for n, i0, j0, stats in ordered_map(step_segment, items(), lanes()):
                        for st in stats:  # the screen's statistics of the last delta, in the model's order
                            acc.stats.take(w, st)
                        # each segment to the writers as soon as it is stepped: the disk starts on the first one
                        wr.write_part(n, self.theta.tensors[n].view(-1)[i0:j0])
                        if (n, i0) not in sent:
                            mw.write_part(n, self.momentum[n].view(-1)[i0:j0])
                            sent.add((n, i0))
                    if last is not None:  # every byte read: the file's checksum against its sidecar's
                        try:
                            sha = rd.finish()
                        except (ValueError, OSError) as e:
                            raise _BadDelta(str(e)) from None
                        if sha != meta["sha256"]:
                            raise _BadDelta(CHECKSUM_DIFFERS)
                nbytes.append(wr.nbytes)
                return {WEIGHTS: wr.digest}
            publish_dir(self.paths.global_dir(r + 1), fill)
        if last is not None:
            acc.accepted(w, meta, a, observe)
        return nbytes[-1] + mw.nbytes

    def streams_coded(self, r: int) -> bool:
        """Whether round r's step with a dense codec (int8, int4, a cast) can run segment by segment
        (_step_coded): one fragment, every tensor whole."""
        c = self.codec
        return c is not None and not self.sparse and self.frags.pieces(r) == self.names

    def coded_segment(self) -> int:
        """_step_coded's segment: CODED_SEGMENT values rounded down to whole pairs of the codec's blocks (so a
        block never straddles two segments, nor int4's byte of two codes), at least one pair."""
        if not self.codec.quantised:
            return CODED_SEGMENT
        pair = 2 * self.codec.block
        return max(1, CODED_SEGMENT // pair) * pair

    def _step_coded(self, r: int, acc: Accumulator, lr: float | None) -> tuple[str, int, str]:
        """The step with a dense codec, in segments of coded_segment() values on every core's lane, each one taken all
        the way while it is in cache: the mean's piece, the outer step (θ* and m_{r+1}), the target θ* − θ_r plus the
        residual, its encoding and decoding, the new residual, θ_{r+1} = θ_r + decode(u) in place; each encoded segment
        goes to the update file's writer (O_DIRECT) at once (a tensor's scales after its codes, as the file stores
        them), and θ_{r+1}'s checksum is taken segment by segment. A block codec's segment is one fused kernel
        (train/exchange/fused.py) where it runs. Element by element the same IEEE operations as _step, then
        θ + decode(u) (the codec's blocks never straddle a segment: coded_segment), so the same bits
        (tests/unit/test_master_coded.py). Returns (the update file's checksum, its bytes, θ_{r+1}'s checksum)."""
        from train.core import digest
        from train.core.tensorio import tensor_bytes
        from train.exchange.codec import SCALE

        oc, ph, codec, res = self.oc, self.phases, self.codec, self.residual
        lr = outer_lr_at(r, oc) if lr is None else lr
        numel = {n: math.prod(self.shapes[n]) for n in self.names}
        had_m, had_e = set(self.momentum), set(res.error)
        for n in self.names:
            if n not in had_m:
                self.momentum[n] = torch.empty(self.shapes[n], dtype=torch.float32)
            if n not in had_e and not codec.lossless:
                res.error[n] = torch.empty(self.shapes[n], dtype=torch.float32)
        seg_len = self.coded_segment()
        segments = [(n, i, min(numel[n], i + seg_len)) for n in self.names
                    for i in range(0, max(1, numel[n]), seg_len)]
        decay = res.decay
        local = threading.local()  # each lane's buffer for the codes and the decoded values
        kern = fused.kernels() if codec.quantised else None

        def step_segment(seg) -> tuple[str, int, int, dict]:
            n, i0, j0 = seg
            theta, m = self.theta.tensors[n].view(-1)[i0:j0], self.momentum[n].view(-1)[i0:j0]
            if kern is not None:  # one kernel, torch's bits (train/exchange/fused.py); None: a block that is not
                # finite, nothing written, the eager ops below
                with ph("outer step, encode the update (+ error feedback)"):
                    if getattr(local, "vbuf", None) is None:
                        local.vbuf, local.mbuf = (torch.empty(seg_len, dtype=torch.float32) for _ in range(2))
                    stored = fused.coded_step(kern, codec, acc.sum[n][i0:j0], acc.total, theta, m,
                                              res.error[n].view(-1)[i0:j0], oc, lr, n in had_m, n in had_e, decay,
                                              local.vbuf, local.mbuf, n)
                if stored is not None:
                    return n, i0, j0, stored
            with ph("outer step, encode the update (+ error feedback)"):
                if getattr(local, "bufs", None) is None:  # this lane's: reused, no fresh pages per segment
                    local.bufs = tuple(torch.empty(seg_len, dtype=torch.float32) for _ in range(3))
                e = res.error[n].view(-1)[i0:j0] if n in res.error else None
                stored = fused.eager_coded_step(codec, n, acc.sum[n][i0:j0], acc.total, theta, m, e, oc.momentum, lr,
                                                oc.nesterov, n in had_m, n in had_e, decay, local.bufs)
            return n, i0, j0, stored

        specs: dict = {}
        for n in self.names:
            specs.update(codec.specs(n, tuple(self.shapes[n])))
        th = digest.Hasher()
        with intra_op_threads(1), \
                StreamingWriter(self.paths.update_file(r + 1), specs, {"round": str(r + 1), **codec.metadata()},
                                phases=ph, direct=True) as wr:  # O_DIRECT, as θ without a codec
            scales: list[torch.Tensor] = []
            for n, i0, j0, stored in ordered_map(step_segment, segments, lanes()):
                wr.write_part(n, stored[n].reshape(-1))
                with ph("θ checksum"):
                    th.update(tensor_bytes(self.theta.tensors[n].view(-1)[i0:j0]))
                if codec.quantised:
                    scales.append(stored[n + SCALE])
                    if j0 == numel[n]:
                        wr.write(n + SCALE, torch.cat(scales) if len(scales) > 1 else scales[0])
                        scales = []
        return wr.digest, wr.nbytes, th.text()

    def _step_last(self, r: int, acc: Accumulator, lr: float | None, last: tuple[int, dict]) -> dict | None:
        """step() with the round's last delta read inside it (see step)."""
        w, meta = last
        rd = acc.open_delta(w, meta)  # size and header: RejectedDelta before anything is touched
        try:
            written = self._step_full(r, acc, lr, (w, meta, rd))
        except BaseException as e:
            rd.close()
            acc.bytes_read += rd.nbytes
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the process ends (nothing committed)
                raise
            reason = acc.bad_delta_reason(w, meta, e) if isinstance(e, _BadDelta) else None
            self.roll_back(r)
            if acc.stats is not None:
                acc.stats.forget(w)
            acc.drop(set())  # the sum of the accepted files, rebuilt without w's pieces
            if reason is not None:
                raise RejectedDelta(w, reason) from None
            log.info("round %d: the step with worker %d's delta read inside it failed (%s); adding that delta first "
                     "and stepping again", r, w, e if not isinstance(e, _FillAgain) else "a transient error")
            return None
        rd.close()
        acc.bytes_read += rd.nbytes
        self.theta.round = r + 1
        return {"checkpoint": True, "codec": "none", "bytes_written": written}

    def can_take_last(self, acc: Accumulator) -> bool:
        """Whether step() can read the round's last delta itself (`last`): no codec either way, one fragment, the
        delta's tensors in the model's order one file tensor each."""
        return (self.codec is None and not self.sparse and not acc.codec.quantised and list(acc.shapes) == self.names
                and all(list(acc.codec.specs(n, tuple(s))) == [n] for n, s in acc.shapes.items()))

    def roll_back(self, r: int) -> None:
        """Back to θ_r and m_r, from round r's files (committed), after a step of round r that is not committed:
        what it wrote is removed."""
        self.discard_uncommitted(r)
        self.theta.load_checkpoint(r)
        self._load_state(r)

    def _write_update(self, path: Path, stored: dict[str, torch.Tensor], r: int, step_round: int,
                      like: str | None = None) -> tuple[str, int]:
        """The update file of round r (`step_round` = r − 1: the round whose fragment it updates)."""
        specs = {}
        for n, shape in self.frags.shapes(step_round).items():
            specs.update(self.codec.specs(n, shape))
        with StreamingWriter(path, specs, {"round": str(r), **self.codec.metadata()}, phases=self.phases,
                             like=like) as wr:
            for k in specs:
                wr.write(k, stored[k])
        return wr.digest, wr.nbytes

    def step(self, r: int, acc: Accumulator, lr: float | None = None, last: tuple[int, dict] | None = None
             ) -> dict | None:
        """Compute round r + 1 from round r's accepted deltas and write its files (not yet committed: the caller
        writes COMMITTED with the returned fields {update_sha256, theta_sha256, checkpoint, bytes_written}).

        `last` = (w, its sidecar, checked) — only where can_take_last(acc): the round's last delta, not yet added,
        is read, checked and added piece by piece inside the step, just before each piece is stepped, so the disk
        writes θ_{r+1} while that delta is still being read (the tail after the last arrival: docs/benchmarks.md,
        "Outer step"). It is then in `acc` like every other. When it turns out bad (a NaN, a checksum that differs
        from its sidecar's: found after some of θ_{r+1} was computed), nothing of the step stays: θ_r and m_r are
        read back from round r's files, the sum is rebuilt without it, and RejectedDelta is raised (the caller goes
        on without it, as with any rejected delta). Any other failure inside (a transient error that would restart
        the folder) is rolled back the same way and returns None: the caller adds the delta the ordinary way and
        steps again. Returns the fields otherwise."""
        if self.theta.round != r:
            raise ProtocolError(f"the master θ is at round {self.theta.round}, the step needs round {r}")
        if last is not None:
            if not self.can_take_last(acc):
                raise ValueError("step(last=...) needs can_take_last(acc)")
            return self._step_last(r, acc, lr, last)
        written, fields = 0, {}
        if self.sparse:
            from train.exchange.sparse import sparse_step

            lr = outer_lr_at(r, self.oc) if lr is None else lr
            # the weighting every copy of θ applies (a bool in runs from before outer.weighting)
            w = self.oc.delta_weighting
            fields["sparse_step"] = {"lr": lr, "token_weighted": {"tokens": True, "equal": False}.get(w, w)}
            with self.phases("sums of the sparse deltas, outer step"):
                stored, new_theta = {}, dict(self.theta.tensors)

                def step_piece(n: str) -> None:  # the master's θ is its own: stepped in place (step_into)
                    t = self.frags.get(self.theta.tensors, n)
                    if not (t.is_contiguous() and acc.step_into(n, t, lr, t)):
                        self.frags.put(new_theta, n, sparse_step(t, acc.mean(n), lr))
                with intra_op_threads(1):
                    for _ in ordered_map(step_piece, self.frags.pieces(r), lanes()):
                        pass
        elif self.codec is None:  # θ_{r+1} and the momentum, computed and written together
            written += self._step_full(r, acc, lr)
            self.theta.round = r + 1
            fields.update(checkpoint=True, codec="none", bytes_written=written)
            return fields
        elif self.streams_coded(r):  # θ_{r+1} in place, the update written as it is encoded, θ's checksum taken
            fields["update_sha256"], nbytes, fields["theta_sha256"] = self._step_coded(r, acc, lr)
            written += nbytes
        else:
            with self.phases("outer step, encode the update (+ error feedback)"):
                stored, new_theta = self._step(r, acc, lr)
            sha, nbytes = self._write_update(self.paths.update_file(r + 1), stored, r + 1, r)
            written += nbytes
            fields["update_sha256"] = sha
            with self.phases("θ + decoded update"):
                for n in self.frags.pieces(r):
                    self.frags.put(self.theta.tensors, n, self.frags.get(self.theta.tensors, n).add(self._seen[n]))
        if self.sparse:
            self.theta.tensors = new_theta
        self.theta.round = r + 1
        checkpoint = self.is_checkpoint_round(r + 1)
        if checkpoint:
            written += write_global(self.paths, r + 1, self.names, self.theta.tensors)
        if checkpoint and not self.sparse:  # topk keeps no outer state
            state = dict(self.momentum)
            if self.residual is not None:
                state.update(self.residual.tensors(RESIDUAL))
            specs = {k: (torch.float32, tuple(v.shape)) for k, v in state.items()}
            with StreamingWriter(self.paths.outer_state(r + 1), specs, {"round": str(r + 1)}) as mw:
                for k, v in state.items():
                    mw.write(k, v)
            written += mw.nbytes
        if self.codec is not None and "theta_sha256" not in fields:  # (without a codec every copy loads the file
            # itself: its MANIFEST has the sha256)
            with self.phases("θ checksum"):
                fields["theta_sha256"] = theta_checksum(self.theta.tensors, self.names)
        fields.update(checkpoint=checkpoint, codec=self.codec.name if self.codec else "none", bytes_written=written)
        return fields

    def discard_uncommitted(self, r: int) -> None:
        """Remove what a failed step of round r + 1 left (nothing of it is trusted without COMMITTED)."""
        sharedfs.unlink(self.paths.update_file(r + 1))
        sharedfs.unlink(self.paths.outer_state(r + 1))
        sharedfs.rmtree(self.paths.global_dir(r + 1))

