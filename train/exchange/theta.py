"""One θ: every process's copy of the global model, kept current the same way, so all copies are bit-identical.

Without compression the coordinator publishes θ_{r+1} in full every round (rounds/r/global/) and a copy is just that
file. With compression (outer.compression = int8, int4, bfloat16, float16) it publishes the *update*
u_{r+1} = θ_{r+1} − θ_r in the codec's format (rounds/r+1/update.safetensors) and every copy — each worker's and the
coordinator's master — does θ_{r+1} = θ_r + decode(u_{r+1}) in float32 on the CPU. Decoding is one IEEE multiply per
value and the add one IEEE add, so the result is the same bits everywhere; the commit record carries the sha256 of
θ_{r+1}'s bytes and every copy checks it (`verify`): a copy that drifted stops with a ProtocolError instead of
training on a different model.

With topk (train/exchange/sparse.py) there is no update file: θ_{r+1} = θ_r − α · mean of the sparse deltas the
commit record of round r + 1 lists, read, checked and summed in one fixed order by every copy (`apply_sparse`).

A process that starts late or restarts loads the last fp32 checkpoint c <= r (rounds/c/global/, written every
outer.checkpoint_every rounds, round 0 and the last round) and applies the updates c+1..r; pruning keeps them.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from train.core import digest, sharedfs
from train.core.errors import ProtocolError
from train.core.model import WEIGHTS
from train.core.store import read_json
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import SequentialReader, read_header, tensor_bytes
from train.core.threads import intra_op_threads, lanes, ordered_map
from train.exchange.codec import Codec, CodecError


def theta_checksum(tensors: dict[str, torch.Tensor], names: list[str], like: str | None = None) -> str:
    """The checksum of the tensors' raw bytes in `names` order (file order): the same bits give the same checksum
    (train/core/digest.py; `like`: in the algorithm of that stored checksum)."""
    h = digest.Hasher(like)
    for n in names:
        h.update(tensor_bytes(tensors[n]))
    return h.text()


def file_order(path: Path) -> list[str]:
    header, _ = read_header(path)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def read_update(paths: DiLoCoPaths, r: int, codec: Codec,
                shapes: dict[str, tuple]) -> tuple[dict[str, torch.Tensor], int]:
    """The decoded update of round r ({name: float32}), checked against its codec and the commit record's checksum;
    returns (update, bytes read)."""
    stored, nbytes = read_update_stored(paths, r, codec, shapes)
    return {n: codec.decode(n, stored, tuple(s)) for n, s in shapes.items()}, nbytes


def read_update_stored(paths: DiLoCoPaths, r: int, codec: Codec,
                       shapes: dict[str, tuple]) -> tuple[dict[str, torch.Tensor], int]:
    """read_update's file as stored (codes, scales), checked the same way, not decoded; returns (stored, bytes)."""
    f = paths.update_file(r)
    rec = read_json(paths.committed(r))
    try:
        header, meta = read_header(f)
        codec.check_header(header, shapes, meta)
    except (OSError, ValueError) as e:
        raise ProtocolError(f"{f}: not a valid {codec.name} update ({e})") from None
    rd = SequentialReader(f, like=rec.get("update_sha256") or None)
    stored: dict[str, torch.Tensor] = {}
    try:
        for k in rd.names_in_order:
            stored[k] = rd.read(k)
        sha = rd.finish()
    finally:
        rd.close()
    if rec.get("update_sha256") and sha != rec["update_sha256"]:
        raise ProtocolError(f"{f}: checksum differs from the commit record (torn or corrupt update)")
    for n in shapes:
        try:
            codec.check_values(n, stored)
        except CodecError as e:
            raise ProtocolError(f"{f}: {e}") from None
    return stored, sharedfs.stat(f).st_size


def own_lanes() -> int:
    """Lanes for a copy of θ brought forward: a worker's share of the cores is its torch threads (--threads; the
    simulator gives each worker of a shared box one), so no more lanes than those (train/core/threads.py)."""
    return max(1, min(lanes(), torch.get_num_threads()))


PIECE = 1 << 20  # values of θ + decode(u) one lane adds at a time (rounded down to whole blocks)


class GlobalTheta:
    """θ_r as float32 CPU tensors in the global file's order, advanced round by round (see the module doc)."""

    def __init__(self, paths: DiLoCoPaths, codec: Codec | None, fragments: int = 1):
        from train.exchange.fragments import Fragments

        self.paths = paths
        self.codec = codec            # None: the full model is published every round (no compression)
        self.round: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.names: list[str] = file_order(paths.global_dir(0) / WEIGHTS)
        h, _ = read_header(paths.global_dir(0) / WEIGHTS)
        self.shapes = {n: tuple(h[n]["shape"]) for n in self.names}
        # streaming DiLoCo: the update of round k holds the pieces of the fragment round k − 1 synced
        self.frags = Fragments(self.shapes, fragments)
        self.bytes_read = 0           # BASE_DIR bytes read since the last `take_bytes()`

    def take_bytes(self) -> int:
        b, self.bytes_read = self.bytes_read, 0
        return b

    def load_checkpoint(self, c: int) -> None:
        from train.core.tensorio import iter_tensors

        f = self.paths.global_dir(c) / WEIGHTS
        self.tensors = {n: t.to(torch.float32) for n, t in iter_tensors(f, self.names)}
        self.round = c
        self.bytes_read += sharedfs.stat(f).st_size

    def last_checkpoint(self, r: int) -> int:
        return max(c for c in [0, *self.paths.committed_rounds()] if c <= r and self.paths.is_checkpoint(c))

    def _start(self, r: int) -> int | None:
        """The round θ_r is built from: our copy's round when the updates after it are on disk, else the newest
        checkpoint <= r with every update after it on disk (None: θ_r cannot be built from the run's files)."""
        if self.codec is None:
            return r if self.paths.is_checkpoint(r) else None
        if getattr(self.codec, "sparse", False):  # topk: round k is built from the deltas its commit lists
            have = lambda a: all(self._sparse_inputs_exist(k) for k in range(a + 1, r + 1))  # noqa: E731
        else:
            have = lambda a: all(sharedfs.exists(self.paths.update_file(k)) for k in range(a + 1, r + 1))  # noqa: E731
        if self.round is not None and self.round <= r and have(self.round):
            return self.round
        for c in sorted((c for c in {0, *self.paths.committed_rounds()} if c <= r), reverse=True):
            if self.paths.is_checkpoint(c) and have(c):
                return c
        return None

    def buildable(self, r: int) -> bool:
        """Whether θ_r can be brought about from the run's files (the rounds it needs were not pruned)."""
        return self.paths.is_committed(r) and self._start(r) is not None

    def advance_to(self, r: int) -> bool:
        """Bring θ to committed round r; returns True when θ changed."""
        if self.round == r:
            return False
        start = self._start(r)
        if start is None:
            raise ProtocolError(f"{self.paths.round_dir(r)}: the global model of round {r} cannot be rebuilt: its "
                                f"checkpoint or an update since the last checkpoint is missing (pruned?); restart "
                                f"from a checkpoint")
        if start != self.round:
            self.load_checkpoint(start)
        for k in range(self.round + 1, r + 1):
            self.apply(k)
        return True

    def _sparse_inputs(self, k: int) -> tuple[dict, list[tuple[int, int, float | None]]]:
        """(commit record of round k, [(round, worker, late weight or None)]: the deltas θ_k is built from)."""
        rec = read_json(self.paths.committed(k))
        ins = [(k - 1, int(w), None) for w in rec.get("workers", [])]
        ins += [(k - 2, int(w[1:]), float(v["weight"])) for w, v in (rec.get("late") or {}).items()]
        return rec, ins

    def _sparse_inputs_exist(self, k: int) -> bool:
        try:
            _, ins = self._sparse_inputs(k)
        except (OSError, ValueError):
            return False
        return all(sharedfs.exists(self.paths.delta_meta(q, w)) for q, w, _ in ins)

    def apply_sparse(self, k: int) -> None:
        """topk: θ_k = θ_{k−1} − α · mean of the sparse deltas round k accepted (train/exchange/sparse.py)."""
        from train.exchange.protocol import RejectedDelta, check_sidecar
        from train.exchange.sparse import SparseAccumulator, sparse_step

        rec, ins = self._sparse_inputs(k)
        step = rec.get("sparse_step")
        if not isinstance(step, dict):
            raise ProtocolError(f"{self.paths.committed(k)}: no sparse_step (outer lr) in the commit record of a "
                                f"topk run: written by another version? Restart the run with this version")
        acc = SparseAccumulator(self.paths, k - 1, self.frags.shapes(k - 1), self.codec, step["token_weighted"])
        try:
            for q, w, late in ins:
                acc.add(w, check_sidecar(self.paths, q, w, self.codec, acc.shapes), late_weight=late)
        except RejectedDelta as e:
            raise ProtocolError(f"round {k}: a delta the commit accepted does not check here ({e}): the run's "
                                f"files changed after the commit") from None
        self.bytes_read += acc.bytes_read
        lr = float(step["lr"])

        def step_piece(n: str) -> tuple[str, torch.Tensor]:
            # into a new tensor: a worker may still hold θ_{k−1}'s (overlap's segment base)
            t = self.frags.get(self.tensors, n)
            new = torch.empty(t.shape, dtype=torch.float32)
            return n, (new if acc.step_into(n, t, lr, new) else sparse_step(t, acc.mean(n), lr))
        n_lanes = own_lanes()
        with intra_op_threads(1):
            for n, new in ordered_map(step_piece, self.frags.pieces(k - 1), n_lanes):
                self.frags.put(self.tensors, n, new)
        self.round = k
        self.verify(k)

    def apply(self, k: int) -> None:
        """θ_k = θ_{k−1} + decode(u_k), then check θ_k's checksum against the commit record."""
        if getattr(self.codec, "sparse", False):
            return self.apply_sparse(k)
        shapes = self.frags.shapes(k - 1)
        u, nbytes = read_update_stored(self.paths, k, self.codec, shapes)
        self.bytes_read += nbytes
        # θ_{k−1} + decode(u) into new tensors (a worker may still hold θ_{k−1}'s: overlap's segment base), in
        # pieces decoded where they are added (Codec.decode_range: the same bits as the whole tensor's decode), on
        # the lanes
        new = {n: torch.empty(tuple(shapes[n]), dtype=torch.float32) for n in shapes}
        numel = {n: math.prod(shapes[n]) for n in shapes}
        local = threading.local()

        def add(piece: tuple[str, int, int]) -> None:
            n, i, j = piece
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = torch.empty(PIECE + self.codec.block, dtype=torch.float32)
            t = self.frags.get(self.tensors, n).reshape(-1)
            torch.add(t[i:j], self.codec.decode_range(n, u, numel[n], i, j, buf), out=new[n].view(-1)[i:j])
        size = PIECE - PIECE % self.codec.block if self.codec.quantised else PIECE  # whole blocks per piece
        pieces = [(n, i, min(numel[n], i + size)) for n in shapes for i in range(0, max(1, numel[n]), size)]
        n_lanes = own_lanes()
        with intra_op_threads(1):
            for _ in ordered_map(add, pieces, n_lanes):
                pass
        for n in self.frags.pieces(k - 1):
            self.frags.put(self.tensors, n, new[n])
        self.round = k
        self.verify(k)

    def verify(self, k: int) -> None:
        want = read_json(self.paths.committed(k)).get("theta_sha256")
        if want and theta_checksum(self.tensors, self.names, like=want) != want:
            raise ProtocolError(f"round {k}: this copy of θ differs from the coordinator's (checksum mismatch); "
                                f"its files may be corrupt. Restart the process: it reloads from the last "
                                f"checkpoint")

    def load_into(self, model: torch.nn.Module) -> None:
        from train.core.model import params_of

        params = params_of(model)
        with torch.no_grad():
            for n in self.names:
                params[n].copy_(self.tensors[n])
