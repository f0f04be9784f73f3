"""Checksums of the files and tensors the protocol writes and checks.

They catch accidents — a process killed mid-write, a torn or truncated file, bytes changed on an NFS server, a file
pruned under its reader — before anything of it is averaged in or loaded. They are not a defence against an
attacker: whoever can write BASE_DIR can write a delta and its sidecar both (docs/protocol.md, "Trust").

A checksum is stored as text that names its algorithm:

    xxh3-128:<32 hex digits>   XXH3 with 128 bits (the `xxhash` package): what every file and θ checksum is
                               written with. ~7 GB/s on one core against sha256's ~1.1 GB/s: the coordinator's tail
                               hashes the last delta and θ_{r+1} (538 MB each at the SmolLM2-135M shape), 0.15 s
                               instead of 1 s of CPU (bench/outer_step.py, issue #38). 128 bits: a random change goes
                               unnoticed with probability 2^-128.
    <64 hex digits>            sha256: what runs written before #38 carry. Still checked, with sha256, so they resume.

The record fields keep their names (a sidecar's `sha256`, the commit record's `theta_sha256` / `update_sha256`, a
MANIFEST's `sha256`): a run written before resumes with this code. A reader always hashes with the algorithm of the
checksum it will compare against (`like=`), so an old record is never compared with a new algorithm's text.
"""
from __future__ import annotations

import hashlib
import os
import re

import xxhash

WRITE = "xxh3-128"  # the algorithm of every checksum written now
_PREFIX = WRITE + ":"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def algorithm_of(recorded: str) -> str:
    """The algorithm of a stored checksum: "xxh3-128" or "sha256"; ValueError for anything else."""
    if isinstance(recorded, str):
        if recorded.startswith(_PREFIX) and len(recorded) == len(_PREFIX) + 32:
            return WRITE
        if _SHA256.fullmatch(recorded):
            return "sha256"
    raise ValueError(f"not a checksum this version knows: {str(recorded)[:80]!r} (expected 'xxh3-128:<32 hex>' or "
                     f"a sha256 in hex)")


class Hasher:
    """An incremental checksum; `text()` gives it in the stored form. Algorithm: WRITE, or that of `like` (a stored
    checksum this one will be compared with). `update` takes bytes-like objects (a tensor's memoryview too) and, like
    hashlib, releases the GIL on large ones, so it runs beside the arithmetic on a background thread."""

    def __init__(self, like: str | None = None):
        self.algorithm = WRITE if like is None else algorithm_of(like)
        self._h = xxhash.xxh3_128() if self.algorithm == WRITE else hashlib.sha256()

    def update(self, data) -> None:
        self._h.update(data)

    def text(self) -> str:
        hexd = self._h.hexdigest()
        return _PREFIX + hexd if self.algorithm == WRITE else hexd


def of_bytes(data, like: str | None = None) -> str:
    h = Hasher(like)
    h.update(data)
    return h.text()


def feed_file(h, path: str | os.PathLike, bufsize: int = 1 << 22):
    """Feed a file's bytes to `h` (anything with `update`: a Hasher, a hashlib object), read through the shared
    disk's retry policy (train/core/sharedfs.py); returns `h`."""
    from train.core import sharedfs

    fd = sharedfs.open_fd(path, os.O_RDONLY)
    try:
        off = 0
        while chunk := sharedfs.pread(fd, bufsize, off, path):
            h.update(chunk)
            off += len(chunk)
    finally:
        os.close(fd)
    return h


def of_file(path: str | os.PathLike, like: str | None = None, bufsize: int = 1 << 22) -> str:
    """The checksum of a file's bytes (in the algorithm of `like`, a stored checksum, when given)."""
    return feed_file(Hasher(like), path, bufsize).text()
