"""The delta exchange of a DiLoCo round on BASE_DIR: what a worker writes (delta + sidecar), how the reducer checks
it, and the round record that commits it. One writer for the worker process (train/diloco/worker.py) and the in-loop
`DiLoCoOptimizer` (train/diloco/optimizer.py), next to the reader that checks what they wrote (train/exchange/reduce.py
streams the accepted deltas).

A delta of round r by worker w: `rounds/r/deltas/w<w>.safetensors` (Δ_w = θ_r − θ_w in the global file's tensor
order, in the run's delta dtype), published by an atomic rename, then its sidecar `w<w>.json` (atomic) which marks it
complete. The sidecar carries the protocol version, round, worker, inner steps, tokens, losses, sha256 and size.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Mapping

import torch

from train.core import digest, sharedfs
from train.core.model import WEIGHTS
from train.core.store import PROTOCOL_VERSION, atomic_write_json, read_json
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import StreamingWriter, read_header
from train.exchange.codec import Codec, CodecError, Residual, all_finite, get_codec

# every sidecar has these; the reducer refuses one that lacks any
SIDECAR_REQUIRED = ("round", "worker", "tokens", "sha256", "bytes", "inner_steps", "loss")
CHECKSUM_DIFFERS = "checksum of the file differs from its sidecar (torn or corrupt)"


class RejectedDelta(Exception):
    def __init__(self, worker: int, reason: str):
        super().__init__(f"w{worker:03d}: {reason}")
        self.worker, self.reason = worker, reason


@torch.no_grad()
def write_delta(path: Path, names: list[str], theta_r: Mapping[str, torch.Tensor],
                params: Mapping[str, torch.Tensor], codec: "Codec | str", r: int, w: int,
                residual: Residual | None = None, phases=None, like: str | None = None) -> dict:
    """Stream Δ = θ_r − θ_w to `path` tensor by tensor (in `names` order, the global file's), encoded with `codec`
    (a Codec, or a dtype name: float32, bfloat16, float16); with `residual`, error feedback: what the codec loses
    is carried into the next round's delta. Returns the sidecar's file fields {sha256, bytes, dtype, codec, finite}
    (`sha256`: the file's checksum, train/core/digest.py; with `like`, in the algorithm of that stored checksum).
    `phases`: a train/core/phases.py Phases that learns where the time goes (bench/outer_step.py)."""
    from train.core.phases import NO_PHASES

    ph = phases or NO_PHASES
    codec = get_codec(codec) if isinstance(codec, str) else codec
    specs: dict = {}
    for n in names:
        specs.update(codec.specs(n, tuple(theta_r[n].shape)))
    finite = True
    with StreamingWriter(path, specs, metadata={"round": str(r), "worker": str(w), **codec.metadata()},
                         phases=ph, like=like) as wr:
        for n in names:
            with ph("Δ = θ_r − θ_w, finite"):
                d = theta_r[n] - params[n].detach().to("cpu", torch.float32)
                finite = finite and all_finite(d)
            with ph("encode (+ error feedback)"):
                stored = residual.send(n, d)[0] if residual is not None else codec.encode(n, d)
            for k, t in stored.items():
                wr.write(k, t)
    dtype = "float32" if codec.lossless else codec.name
    return {"sha256": wr.digest, "bytes": wr.nbytes, "dtype": dtype, "codec": codec.name, "block": codec.block,
            "finite": finite}


def delta_sidecar(r: int, w: int, file: dict, *, inner_steps: int, tokens: int, loss: float | None,
                  last_loss: float | None = None, train_seconds: float | None = None,
                  load_seconds: float | None = None, processes: int = 1, fold_step: int | None = None,
                  trained_at: float | None = None, handoff_seconds: float | None = None,
                  fresh_moments: bool = False, planned_steps: int | None = None,
                  lr: list[float] | None = None) -> dict:
    """The sidecar of worker w's delta of round r; `file` is what write_delta returned; `fold_step`: with overlap,
    the step at which the segment folded θ_r in (docs/overlap.md); `trained_at`: when its last inner step ended
    (`time` is when the sidecar was written: with overlap, the publication runs while the next segment trains);
    `handoff_seconds`: with overlap, how long the hand-off waited for the previous round's publication;
    `fresh_moments`: the segment started from fresh inner optimizer moments (a joiner, a restart without its
    snapshot): its delta's norm may differ from the others' more than usual (the screen allows it, screen.py);
    `planned_steps`: the H its round gave it (rounds by time: inner_steps is fewer where its deadline stopped it);
    `lr`: the inner learning rate of its first and last step (the run's schedule, train/diloco/pace.py)."""
    return {"protocol": PROTOCOL_VERSION, "round": r, "worker": w, "inner_steps": inner_steps, "tokens": tokens,
            "loss": loss, "last_loss": last_loss, "sha256": file["sha256"], "bytes": file["bytes"],
            "dtype": file["dtype"], "codec": file.get("codec", file["dtype"]), "host": socket.gethostname(),
            "train_seconds": train_seconds,
            "load_seconds": load_seconds, "processes": processes, "time": time.time(),
            **{k: v for k, v in (("fold_step", fold_step), ("trained_at", trained_at),
                                 ("handoff_seconds", handoff_seconds), ("planned_steps", planned_steps), ("lr", lr))
               if v is not None},
            **({"fresh_moments": True} if fresh_moments else {})}


def publish_sidecar(paths: DiLoCoPaths, sidecar: dict) -> None:
    """The atomic marker that makes a delta complete (its file is already in place)."""
    atomic_write_json(paths.delta_meta(sidecar["round"], sidecar["worker"]), sidecar)


def check_sidecar(paths: DiLoCoPaths, r: int, w: int, codec: "Codec | str", shapes: dict | None = None,
                  listed: set[str] | None = None, file_checks: bool = True) -> dict:
    """Cheap checks before reading tensors: sidecar fields, round, worker, size, and the header against the codec
    (`codec`: a Codec or a dtype name) and the shapes the delta must have (`shapes`: the round's fragment; default
    the global model's). `listed`: the names of the deltas folder in the caller's listing that showed the sidecar
    (the delta file was moved in before it; a name missing there is looked for in a new listing). `file_checks=False`
    (a caller that adds the delta next: both accumulators check size and header from the open they read it with):
    the delta file's presence only, not its size and header (a stat, an open and two reads less per delta)."""
    try:
        meta = read_json(paths.delta_meta(r, w))
    except (OSError, ValueError) as e:
        raise RejectedDelta(w, f"unreadable sidecar ({e})")
    for key in SIDECAR_REQUIRED:
        if key not in meta:
            raise RejectedDelta(w, f"sidecar lacks {key!r}")
    if meta["round"] != r:
        raise RejectedDelta(w, f"sidecar says round {meta['round']}, expected {r}")
    if meta["worker"] != w:
        raise RejectedDelta(w, f"sidecar says worker {meta['worker']}, file belongs to worker {w}")
    if meta.get("protocol") != PROTOCOL_VERSION:
        raise RejectedDelta(w, f"protocol {meta.get('protocol')}, expected {PROTOCOL_VERSION}")
    if not isinstance(meta["tokens"], (int, float)) or meta["tokens"] <= 0:
        raise RejectedDelta(w, f"tokens = {meta['tokens']!r} (must be > 0)")
    try:
        digest.algorithm_of(meta["sha256"])
    except ValueError as e:
        raise RejectedDelta(w, f"sidecar's sha256: {e}")
    f = paths.delta_file(r, w)
    if not (listed is not None and f.name in listed) and not sharedfs.exists(f):  # a listing (NFS lookup cache)
        raise RejectedDelta(w, "sidecar present but the delta file is missing")
    if not file_checks:
        return meta
    size = sharedfs.stat(f).st_size
    if size != meta["bytes"]:
        raise RejectedDelta(w, f"file has {size} bytes, sidecar says {meta['bytes']}")
    try:
        header, fmeta = read_header(f)
    except (ValueError, OSError) as e:
        raise RejectedDelta(w, f"not a safetensors file ({e})")
    codec = get_codec(codec) if isinstance(codec, str) else codec
    if shapes is None:
        g, _ = read_header(paths.global_dir(0) / WEIGHTS)
        shapes = {n: tuple(i["shape"]) for n, i in g.items()}
    try:
        codec.check_header(header, shapes, fmeta)
    except CodecError as e:
        raise RejectedDelta(w, str(e))
    return meta



def round_record(r: int, ok: list[int], metas: dict[int, dict], rejected: dict[int, str], missing: list[int],
                 io: dict, prev: dict | None, **timings) -> dict:
    """The metrics.jsonl record of round r + 1 (tokens and inner steps cumulative); `timings` go in as given."""
    tokens = sum(metas[w]["tokens"] for w in ok)
    losses = {w: metas[w]["loss"] for w in ok}
    train_loss = (sum(losses[w] * metas[w]["tokens"] for w in ok) / tokens
                  if tokens and all(isinstance(v, (int, float)) for v in losses.values()) else None)
    prev = prev or {}
    # what the workers read and wrote on BASE_DIR for this round (their sidecars' `io`; older sidecars lack it:
    # then the delta file is all they are known to have written)
    wread = sum(int((metas[w].get("io") or {}).get("read", 0)) for w in ok)
    wwritten = sum(int((metas[w].get("io") or {}).get("written", metas[w]["bytes"])) for w in ok)
    return {"round": r + 1, "time": time.time(), "train_loss": train_loss,
            "worker_loss": {f"w{w:03d}": v for w, v in losses.items()},
            "tokens": prev.get("tokens", 0) + tokens,
            "inner_steps": prev.get("inner_steps", 0) + max(metas[w]["inner_steps"] for w in ok),
            "workers_used": ok, "missing": missing, "rejected": {f"w{w:03d}": why for w, why in rejected.items()},
            "bytes_read": io["bytes_read"], "bytes_written": io["bytes_written"],
            "bytes_deltas": sum(metas[w]["bytes"] for w in ok),
            "worker_bytes_read": wread, "worker_bytes_written": wwritten,
            "bytes_total": io["bytes_read"] + io["bytes_written"] + wread + wwritten, **timings}


def commit(paths: DiLoCoPaths, r: int, record: dict) -> None:
    """The atomic marker that makes round r (global model + outer state) trusted."""
    atomic_write_json(paths.committed(r), {"round": r, "time": time.time(), **record})


