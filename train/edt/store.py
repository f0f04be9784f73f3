"""The EDT side of the BASE_DIR protocol: generation folders, the job queue (claims, leases, re-queue), results.

Layout of one EDT run (under BASE_DIR/<project_name>/, next to run.json, config.json, data/, logs/, workers/):

    generations/g000002/jobs/m001/        the child made by crossover (HF model dir + MANIFEST.json),
                                          outer_momentum.safetensors and job.json (what to run, with which genes)
    generations/g000002/jobs/m001.claim   a worker's claim (created with O_CREAT|O_EXCL: exactly one worker wins);
                                          its mtime is the lease, renewed while the worker runs the job
    generations/g000002/jobs/m001.stale-1 a claim whose lease expired (renamed away: the job is queued again)
    generations/g000002/members/m001/     the mutated member: HF model dir, optimizer.safetensors, result.json and
                                          MANIFEST.json, published by one rename (create-once), + genome.json
                                          (written by the coordinator once the generation's fitness is known)
    generations/g000002/COMMITTED         the coordinator's marker: every job of generation 2 is in place
    lineage.jsonl                         every genome ever evaluated (survives cleanup), lineage.png, fitness.png
    DONE.json                             the run finished (workers exit)

Commit order: jobs/*/ (temp dir, manifest, rename) → COMMITTED. Workers only read committed generations; the
coordinator trusts a member only when its folder (published whole) has a MANIFEST.json.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from pathlib import Path

from train.core import sharedfs
from train.core.store import MANIFEST, PROTOCOL_VERSION, RunPaths, atomic_write_json, fsync_dir, read_json


class EDTPaths(RunPaths):
    """Paths of an EDT run (RunPaths adds run.json, config.json, logs, data, workers)."""

    generations = property(lambda self: self.root / "generations")
    lineage = property(lambda self: self.root / "lineage.jsonl")
    lineage_png = property(lambda self: self.root / "lineage.png")
    fitness_png = property(lambda self: self.root / "fitness.png")
    done = property(lambda self: self.root / "DONE.json")

    def gen_dir(self, g: int) -> Path:
        return self.generations / f"g{g:06d}"

    def gen_committed(self, g: int) -> Path:
        return self.gen_dir(g) / "COMMITTED"

    def jobs_dir(self, g: int) -> Path:
        return self.gen_dir(g) / "jobs"

    def job_dir(self, g: int, m: int) -> Path:
        return self.jobs_dir(g) / f"m{m:03d}"

    def job_json(self, g: int, m: int) -> Path:
        return self.job_dir(g, m) / "job.json"

    def claim(self, g: int, m: int) -> Path:
        return self.jobs_dir(g) / f"m{m:03d}.claim"

    def members_dir(self, g: int) -> Path:
        return self.gen_dir(g) / "members"

    def member_dir(self, g: int, m: int) -> Path:
        return self.members_dir(g) / f"m{m:03d}"

    def genome(self, g: int, m: int) -> Path:
        return self.member_dir(g, m) / "genome.json"

    def result(self, g: int, m: int) -> Path:
        return self.member_dir(g, m) / "result.json"

    def rel(self, p: Path) -> str:
        return str(Path(p).relative_to(self.root))

    # -- committed state --------------------------------------------------------------------------------------------
    def committed_generations(self) -> list[int]:
        # from listings, never a lookup of a name that may not exist yet (NFS lookup cache: train/core/sharedfs.py)
        return sorted(int(n[1:]) for n in sharedfs.names(self.generations)
                      if n.startswith("g") and n[1:].isdigit() and sharedfs.is_file(self.gen_committed(int(n[1:]))))

    def latest_generation(self) -> int | None:
        gs = self.committed_generations()
        return gs[-1] if gs else None

    def population(self, g: int) -> int:
        return int(read_json(self.gen_committed(g))["population"])

    def has_result(self, g: int, m: int) -> bool:
        return sharedfs.exists(self.member_dir(g, m) / MANIFEST)


def member_id(g: int, m: int) -> str:
    return f"g{g:06d}/m{m:03d}"


def parse_member_id(mid: str) -> tuple[int, int]:
    g, m = mid.split("/")
    return int(g[1:]), int(m[1:])


# -- claims and leases -----------------------------------------------------------------------------------------------
def try_claim(paths: EDTPaths, g: int, m: int, worker: int) -> str | None:
    """Claim job (g, m) for this process: O_CREAT|O_EXCL, so of any number of workers exactly one succeeds.
    Returns the attempt id, or None when someone holds it (or its member is already published)."""
    if paths.has_result(g, m):
        return None
    attempt = f"w{worker:03d}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(paths.claim(g, m), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        json.dump({"worker": worker, "pid": os.getpid(), "host": socket.gethostname(), "attempt": attempt,
                   "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
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
        os.utime(paths.claim(g, m))
    except FileNotFoundError:
        return False
    return True


def release_claim(paths: EDTPaths, g: int, m: int, attempt: str) -> None:
    if holds_claim(paths, g, m, attempt):
        paths.claim(g, m).unlink(missing_ok=True)


def requeue(paths: EDTPaths, g: int, m: int, why: str) -> int:
    """Move a claim aside (jobs/mXXX.stale-N, with the reason): the job is free to claim again. Returns N."""
    n = stale_count(paths, g, m) + 1
    dst = paths.jobs_dir(g) / f"m{m:03d}.stale-{n}"
    try:
        os.replace(paths.claim(g, m), dst)
    except FileNotFoundError:
        return n - 1
    try:
        info = json.loads(dst.read_text() or "{}")
    except ValueError:
        info = {}
    atomic_write_json(dst, {**info, "requeued": why, "requeued_at": time.time()})
    return n


def stale_count(paths: EDTPaths, g: int, m: int) -> int:
    return len(list(paths.jobs_dir(g).glob(f"m{m:03d}.stale-*")))


def server_now(paths: EDTPaths, g: int) -> float:
    """The shared disk's clock: touch a file there and read its mtime, so lease ages never mix two hosts' clocks."""
    clock = paths.jobs_dir(g) / ".clock"
    clock.touch()
    os.utime(clock)
    return clock.stat().st_mtime


def lease_age(paths: EDTPaths, g: int, m: int, now: float) -> float | None:
    try:
        return now - paths.claim(g, m).stat().st_mtime
    except FileNotFoundError:
        return None


# -- publishing a member (create-once) -------------------------------------------------------------------------------
def publish_once(tmp_dir: Path, final_dir: Path) -> bool:
    """rename(tmp_dir, final_dir) when final_dir does not exist yet: True when we published, False when another
    attempt was first (then our temp dir is left for the caller to delete). Atomic on POSIX and NFS."""
    fsync_dir(tmp_dir)
    sharedfs.makedirs(final_dir.parent)
    if sharedfs.exists(final_dir):
        return False
    try:  # onto a non-empty directory this fails: the first attempt wins
        sharedfs.retry("rename", final_dir, lambda: os.rename(tmp_dir, final_dir))
    except FileNotFoundError:
        if sharedfs.exists(tmp_dir):
            raise
        return sharedfs.exists(final_dir)  # a retried rename whose first attempt landed (NFS): ours
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    fsync_dir(final_dir.parent)
    return True


def tmp_member_dir(paths: EDTPaths, g: int, m: int, attempt: str) -> Path:
    d = paths.members_dir(g) / f".m{m:03d}.tmp-{attempt}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_committed(paths: EDTPaths, g: int, info: dict) -> None:
    atomic_write_json(paths.gen_committed(g), {"generation": g, "protocol": PROTOCOL_VERSION, "time": time.time(),
                                               **info})

