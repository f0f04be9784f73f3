"""Validate the workers' deltas of a round, average them and write the next global model: the reduce + commit of the
BASE_DIR protocol, shared by the coordinator process (train/diloco/coordinator.py) and the in-loop reducer of
`DiLoCoOptimizer` (train/diloco/optimizer.py). One implementation, so both paths accept and reject the same files.

The outer update itself is a callback (`update(name, θ_r, g, prev) -> (θ_{r+1}, {state key: tensor})`): the
coordinator passes the pure Nesterov step of train/exchange/outer.py, DiLoCoOptimizer the user's torch outer optimizer.
Everything is streamed tensor by tensor, so the reducer holds about one tensor of every file at a time.

Commit of round r + 1 (docs/protocol.md, invariants):
  rounds/r+1/global/ (temp dir → manifest → rename) and outer_state.safetensors (atomic), then COMMITTED (atomic).
A crash before COMMITTED leaves nothing a reader trusts; rerunning recomputes the same round from the same deltas.
"""
from __future__ import annotations

import logging
import shutil
from typing import Callable

import torch

from train.core import sharedfs
from train.core.errors import ProtocolError
from train.core.model import WEIGHTS
from train.exchange.accumulate import delta_weight
from train.exchange.protocol import CHECKSUM_DIFFERS, RejectedDelta, check_sidecar
from train.core.store import atomic_publish_dir, new_tmp_dir, write_manifest
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import SequentialReader, StreamingWriter, read_header

log = logging.getLogger("reduce")

# update(name, theta_r, averaged pseudo-gradient, prev) -> (theta_{r+1}, {state key: tensor});
# prev(key) is that key's tensor in outer_state of round r, or None.
Update = Callable[[str, torch.Tensor, torch.Tensor, Callable[[str], "torch.Tensor | None"]],
                  "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
# state_specs(name, dtype, shape) -> {state key: (dtype, shape)}: what update returns for that tensor, in order.
StateSpecs = Callable[[str, torch.dtype, tuple], "dict[str, tuple[torch.dtype, tuple]]"]




def param_order(paths: DiLoCoPaths, r: int) -> list[str]:
    """Tensor names of the global model of round r in file order (deltas must be written in this order)."""
    header, _ = read_header(paths.global_dir(r) / WEIGHTS)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def arrived(paths: DiLoCoPaths, r: int, num_workers: int, listed: set[str] | None = None) -> list[int]:
    """Workers whose delta of round r is published (its sidecar marks it complete). `listed`: a set that gets the
    listing's names (check_sidecar's `listed`: the delta files it showed need no second listing)."""
    present = set(sharedfs.names(paths.deltas_dir(r)))  # a listing, not lookups (NFS: train/core/sharedfs.py)
    if listed is not None:
        listed.clear()
        listed.update(present)
    return [w for w in range(num_workers) if paths.delta_meta_name(w) in present]  # (no N Paths a poll)


def reduce_round(paths: DiLoCoPaths, r: int, workers: list[int], metas: dict[int, dict], weights: list[float],
                 update: Update, state_specs: StateSpecs) -> dict:
    """Stream θ_r, the outer state of round r and the deltas tensor by tensor; publish rounds/r+1/global/ and write
    outer_state of r + 1 (not yet committed: the caller writes COMMITTED). Raises RejectedDelta when a delta turns
    out non-finite or its bytes do not match the sidecar's checksum; nothing of round r + 1 is left behind then."""
    total = sum(weights)
    g_reader = SequentialReader(paths.global_dir(r) / WEIGHTS, hash_bytes=False)
    m_path = paths.outer_state(r)
    m_reader = SequentialReader(m_path, hash_bytes=False) if sharedfs.exists(m_path) else None
    d_readers = {w: SequentialReader(paths.delta_file(r, w), like=metas[w]["sha256"]) for w in workers}

    def prev(key: str) -> torch.Tensor | None:
        return m_reader.read(key) if m_reader is not None and key in m_reader.header else None

    names = g_reader.names_in_order
    new_dir = paths.global_dir(r + 1)
    tmp_dir = None
    try:
        for w, rd in d_readers.items():
            if rd.names_in_order != names:
                raise RejectedDelta(w, "tensors are not stored in the global model's order")
        specs = {n: (g_reader.dtype_of(n), tuple(g_reader.header[n]["shape"])) for n in names}
        m_specs = {k: v for n, (dt, s) in specs.items() for k, v in state_specs(n, dt, s).items()}
        tmp_dir = new_tmp_dir(new_dir)
        bytes_read = sum(sharedfs.stat(p).st_size for p in [g_reader.path] + [d.path for d in d_readers.values()]) \
            + (sharedfs.stat(m_path).st_size if m_reader else 0)
        for fname in ("config.json", "generation_config.json"):
            if sharedfs.exists(paths.global_dir(r) / fname):
                sharedfs.copy_file(paths.global_dir(r) / fname, tmp_dir / fname)
        with StreamingWriter(tmp_dir / WEIGHTS, specs, {"format": "pt"}) as pw, \
                StreamingWriter(paths.outer_state(r + 1), m_specs, {"round": str(r + 1)}) as mw:
            for n in names:
                theta = g_reader.read(n)
                grad, ds = None, {}
                for w, wt in zip(workers, weights):
                    ds[w] = d = d_readers[w].read(n)
                    grad = d.to(torch.float32, copy=True).mul_(wt / total) if grad is None else \
                        grad.add_(d.to(torch.float32), alpha=wt / total)
                # NaN/inf in any delta makes the weighted sum non-finite: one cheap screen per tensor,
                # the per-worker check only when it trips (a finite overflow of the sum is not a rejection).
                if not torch.isfinite(grad.sum()):
                    for w in workers:
                        if not torch.isfinite(ds[w]).all():
                            raise RejectedDelta(w, f"{n}: non-finite values (NaN/inf)")
                    raise RejectedDelta(workers[0], f"{n}: the averaged delta overflows float32")
                new, state = update(n, theta, grad, prev)
                pw.write(n, new)
                for key, t in state.items():
                    mw.write(key, t)
            for w, rd in d_readers.items():
                if rd.finish() != metas[w]["sha256"]:
                    raise RejectedDelta(w, CHECKSUM_DIFFERS)
                rd.close()
        write_manifest(tmp_dir, hashes={WEIGHTS: pw.digest})
        atomic_publish_dir(tmp_dir, new_dir)
    except BaseException:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        sharedfs.unlink(paths.outer_state(r + 1))
        raise
    finally:
        for rd in [g_reader, *d_readers.values()] + ([m_reader] if m_reader else []):
            rd.close()
    return {"bytes_read": bytes_read, "bytes_written": pw.nbytes + mw.nbytes}


def validate_and_reduce(paths: DiLoCoPaths, r: int, workers: list[int], *, delta_dtype: str, min_workers: int,
                        token_weighted: bool, update: Update, state_specs: StateSpecs,
                        ) -> tuple[list[int], dict[int, dict], dict[int, str], dict]:
    """Check every arrived delta, drop the rejected ones (logged with the reason) and reduce the rest; a delta that
    fails only while streaming (NaN, sha256) is dropped and the reduce redone without it.
    Returns (workers used, their sidecars, {worker: rejection reason}, I/O byte counts)."""
    rejected: dict[int, str] = {}
    metas: dict[int, dict] = {}
    for w in workers:
        try:
            metas[w] = check_sidecar(paths, r, w, delta_dtype)
        except RejectedDelta as e:
            rejected[w] = e.reason
            log.error("round %d: rejected delta of worker %d: %s", r, w, e.reason)
    while True:
        ok = [w for w in workers if w not in rejected]
        if len(ok) < min_workers:
            raise ProtocolError(f"round {r}: only {len(ok)} valid deltas (min_workers = {min_workers}); "
                                f"rejected: {rejected}. Fix the workers and rerun: the run resumes here.")
        weights = [delta_weight(metas[w]["tokens"], token_weighted) for w in ok]
        try:
            io = reduce_round(paths, r, ok, metas, weights, update, state_specs)
            return ok, metas, rejected, io
        except RejectedDelta as e:
            rejected[e.worker] = e.reason
            log.error("round %d: rejected delta of worker %d: %s", r, e.worker, e.reason)


def prune_rounds(paths: DiLoCoPaths, latest: int, keep: int, before_checkpoint: int = 0) -> None:
    """Delete rounds older than the last `keep` committed ones, but never those a process needs to rebuild a kept
    round's θ and the outer state: the last fp32 checkpoint at or before the oldest kept round and every round after
    it (with compression, updates and deltas since that checkpoint; without, every round is one), and
    `before_checkpoint` rounds before it (late deltas folded into the round after the checkpoint). A worker
    replaying a kept round (its state snapshot was lost) can thus always rebuild the θ it started from. θ_0 stays:
    it is the run's template."""
    floor = latest - keep + 1
    # every kept round stays buildable: keep the last checkpoint at or before the oldest kept round
    checkpoints = [c for c in paths.committed_rounds() if c <= max(floor, 0) and paths.is_checkpoint(c)]
    floor = min(floor, max(checkpoints, default=0) - before_checkpoint)
    for r in paths.committed_rounds():
        if r < floor and r != 0:
            try:
                sharedfs.rmtree(paths.round_dir(r))
            except OSError:
                pass
        elif r == 0 and floor > 0:
            # θ_0 stays: workers build the architecture from its config; its deltas can go.
            sharedfs.rmtree(paths.deltas_dir(0))
