"""Every file an EDT run writes on BASE_DIR, in one module (as train/exchange/protocol.py is for DiLoCo): the job
queue's claims and leases, jobs and members published whole, the generation's records (COMMITTED, genome.json,
lineage.jsonl, EVALUATED.json, PRUNED, DONE.json). The layout and the readers of committed state:
train/edt/store.py. Writers: the EDT coordinator, its breeding step (train/edt/breed.py) and the workers.

A claim is created with O_CREAT|O_EXCL (NFS: an exclusive create on the server), so of any number of workers exactly
one wins a job; its mtime is the lease, judged on the shared disk's clock (`server_now`). A member's folder appears
by one rename (create-once: the first attempt wins, `publish_once`); a job's by `store.publish_dir`.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

from train.core import sharedfs
from train.core.model import WEIGHTS
from train.core.store import PROTOCOL_VERSION, append_jsonl, atomic_write_json, fsync_dir, publish_dir, \
    write_manifest
from train.edt.store import EDTPaths


# -- claims and leases -----------------------------------------------------------------------------------------------
def create_claim(paths: EDTPaths, g: int, m: int, record: dict) -> bool:
    """Create job (g, m)'s claim holding `record` (+ pid, host, time): O_CREAT|O_EXCL, so of any number of
    processes exactly one succeeds (True)."""
    data = json.dumps({**record, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}).encode()
    return sharedfs.create_new(paths.claim(g, m), data)


def try_claim(paths: EDTPaths, g: int, m: int, worker: int) -> str | None:
    """Claim job (g, m) for worker `worker`. Returns the attempt id, or None when someone holds it (or its member is
    already published)."""
    if paths.has_result(g, m):
        return None
    attempt = f"w{worker:03d}-{uuid.uuid4().hex[:8]}"
    if not create_claim(paths, g, m, {"worker": worker, "attempt": attempt}):
        return None
    if paths.has_result(g, m):  # published between our check and our claim: nothing to do
        release_claim(paths, g, m, attempt)
        return None
    return attempt


def read_claim(paths: EDTPaths, g: int, m: int) -> dict | None:
    """The claim's JSON; {} while its writer is still filling it; None when there is no claim."""
    if not sharedfs.exists(paths.claim(g, m)):
        return None
    try:
        return json.loads(sharedfs.read_text(paths.claim(g, m)) or "{}")
    except FileNotFoundError:
        return None
    except ValueError:
        return {}


def holds_claim(paths: EDTPaths, g: int, m: int, attempt: str) -> bool:
    c = read_claim(paths, g, m)
    return bool(c) and c.get("attempt") == attempt


def renew_lease(paths: EDTPaths, g: int, m: int, attempt: str) -> bool:
    """Touch our claim (its mtime is the lease). False when the claim is gone or another attempt's: we lost it."""
    if not holds_claim(paths, g, m, attempt):
        return False
    try:
        sharedfs.touch(paths.claim(g, m))
    except FileNotFoundError:
        return False
    return True


def release_claim(paths: EDTPaths, g: int, m: int, attempt: str) -> None:
    if holds_claim(paths, g, m, attempt):
        sharedfs.unlink(paths.claim(g, m))


def requeue(paths: EDTPaths, g: int, m: int, why: str) -> int:
    """Move a claim aside (jobs/mXXX.stale-N, with the reason): the job is free to claim again. Returns N."""
    n = stale_count(paths, g, m) + 1
    dst = paths.jobs_dir(g) / f"m{m:03d}.stale-{n}"
    try:
        sharedfs.replace(paths.claim(g, m), dst)
    except FileNotFoundError:
        return n - 1
    try:
        info = json.loads(sharedfs.read_text(dst) or "{}")
    except ValueError:
        info = {}
    atomic_write_json(dst, {**info, "requeued": why, "requeued_at": time.time()})
    return n


def stale_count(paths: EDTPaths, g: int, m: int) -> int:
    return sum(name.startswith(f"m{m:03d}.stale-") for name in sharedfs.names(paths.jobs_dir(g)))


def server_now(paths: EDTPaths, g: int) -> float:
    """The shared disk's clock: touch a file there and read its mtime, so lease ages never mix two hosts' clocks (an
    object store: the Date of its answer)."""
    if (now := sharedfs.server_now(paths.jobs_dir(g))) is not None:
        return now
    clock = paths.jobs_dir(g) / ".clock"
    sharedfs.retry("touch", clock, lambda: (clock.touch(), os.utime(clock)))
    return sharedfs.stat(clock).st_mtime


def lease_age(paths: EDTPaths, g: int, m: int, now: float) -> float | None:
    try:
        return now - sharedfs.stat(paths.claim(g, m)).st_mtime
    except FileNotFoundError:
        return None


# -- publishing a member (create-once) -------------------------------------------------------------------------------
def publish_once(tmp_dir: Path, final_dir: Path) -> bool:
    """rename(tmp_dir, final_dir) when final_dir does not exist yet: True when we published, False when another
    attempt was first (then our temp dir is left for the caller to delete). Atomic on POSIX and NFS; on an object
    store the MANIFEST.json, uploaded last, is created only if absent (sharedfs.publish_once)."""
    fsync_dir(tmp_dir)
    sharedfs.makedirs(final_dir.parent)
    if sharedfs.exists(final_dir):
        return False
    published = sharedfs.publish_once(tmp_dir, final_dir)  # onto a folder that exists this fails: the first wins
    if published:
        sharedfs.remember_dir(final_dir)
        fsync_dir(final_dir.parent)
    return published


def tmp_member_dir(paths: EDTPaths, g: int, m: int, attempt: str) -> Path:
    d = paths.members_dir(g) / f".m{m:03d}.tmp-{attempt}"
    sharedfs.makedirs(d)
    return d


def publish_member(paths: EDTPaths, g: int, m: int, attempt: str, fill: Callable[[Path], tuple[dict, dict | None]],
                   check: Callable[[], None] = lambda: None) -> tuple[dict, bool]:
    """members/mXXX/ of attempt `attempt`: `fill(tmp)` writes the member's files and returns (result, hashes it
    knows); result.json and the MANIFEST.json follow, then `check()` (e.g. the claim is still ours) and one rename,
    create-once. Returns (result, whether this attempt published: False when another was first)."""
    tmp = tmp_member_dir(paths, g, m, attempt)
    published = False
    try:
        result, hashes = fill(tmp)
        atomic_write_json(tmp / "result.json", result)
        write_manifest(tmp, hashes=hashes)
        check()
        published = publish_once(tmp, paths.member_dir(g, m))
    finally:
        if not published:  # ours failed, or another attempt was first: nothing of ours stays
            shutil.rmtree(tmp, ignore_errors=True)
    return result, published


# -- jobs and a generation's records ---------------------------------------------------------------------------------
def publish_job(paths: EDTPaths, g: int, m: int, fill: Callable[[Path], str | None], job: dict) -> None:
    """jobs/mXXX/ as one unit: `fill(tmp)` writes the model files (returns the weights' sha256 if known)."""
    def fill_job(tmp: Path) -> dict | None:
        sha = fill(tmp)
        atomic_write_json(tmp / "job.json", job)
        return {WEIGHTS: sha} if sha else None
    publish_dir(paths.job_dir(g, m), fill_job)


def write_genome(paths: EDTPaths, g: int, m: int, genome: dict, new_in_lineage: bool) -> None:
    """members/mXXX/genome.json (when the member's folder exists) and, once per member, its lineage.jsonl line."""
    if sharedfs.exists(paths.member_dir(g, m)):
        atomic_write_json(paths.genome(g, m), genome)
    if new_in_lineage:
        append_jsonl(paths.lineage, genome)


def write_evaluated(paths: EDTPaths, g: int, best: int, best_id: str, fitness: dict) -> None:
    atomic_write_json(paths.gen_dir(g) / "EVALUATED.json", {"generation": g, "best": best, "best_id": best_id,
                                                            "fitness": fitness})


def mark_pruned(paths: EDTPaths, g: int, kept: str) -> None:
    atomic_write_json(paths.gen_dir(g) / "PRUNED", {"kept": kept, "time": time.time()})


def write_done(paths: EDTPaths, generations: int, best: str) -> None:
    """DONE.json: the run is finished (workers exit when they see it)."""
    atomic_write_json(paths.done, {"generations": generations, "best": best, "time": time.time()})


def write_committed(paths: EDTPaths, g: int, info: dict) -> None:
    atomic_write_json(paths.gen_committed(g), {"generation": g, "protocol": PROTOCOL_VERSION, "time": time.time(),
                                               **info})

