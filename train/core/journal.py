"""Append-only JSON-lines journals (metrics.jsonl, timeline.jsonl, lineage.jsonl) on a shared disk or a bucket.

A disk (local, NFS, a FUSE mount): one file, a record a line, each appended by one write of the whole line; a
retry after a transient error first checks whether the line landed; a line torn by a crash is skipped on reading.

An object store has no append, and rewriting the whole object every round both grows with the run and can lose a
record: a PUT that timed out on the client may still land on the server later (a gateway paused mid-request), over
the newer object that held one more line. So on a bucket a journal `x.jsonl` is a folder `x.jsonl.d/` of objects
that are never rewritten, each named by the records it holds:

    x.jsonl.d/00000007-00000007.jsonl    record 7 alone (an append)
    x.jsonl.d/00000000-00000099.jsonl    records 0..99 (a chunk, written once record 99 is in; the singles it covers
                                         are deleted after it)

An append creates the next number with If-None-Match: a retry, or a late copy of the same request, writes the same
bytes under the same name again; a writer that finds the number taken by another record takes the next one.
Reading lists the folder once and takes every record once, in order: a chunk wins over whatever singles it covers
are left (a crash between the chunk and the deletes, a late copy of a single landing after them).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Callable
from train.core import objstore, sharedfs

log = logging.getLogger("store")

CHUNK = 100  # records per chunk object on a bucket (a reader of a 10 000-round run fetches ~100 objects)
_PART = re.compile(r"^(\d{8})-(\d{8})\.jsonl$")


def parts_folder(path: str | os.PathLike) -> Path:
    """Where a journal's objects live on a bucket."""
    path = Path(path)
    return path.with_name(path.name + ".d")


def _part_name(first: int, last: int) -> str:
    return f"{first:08d}-{last:08d}.jsonl"


def _ranges(names: list[str]) -> list[tuple[int, int, str]]:
    out = []
    for n in names:
        if (m := _PART.match(n)) and int(m.group(1)) <= int(m.group(2)):
            out.append((int(m.group(1)), int(m.group(2)), n))
    return sorted(out, key=lambda x: (x[0], -x[1]))


def covering(names: list[str]) -> list[tuple[int, int, str]]:
    """The parts to read, in order, each record once: the widest part first where several start at one number,
    and no part whose records are all read already."""
    picked, upto = [], -1
    for first, last, name in _ranges(names):
        if last > upto:
            picked.append((first, last, name))
            upto = last
    return picked


def combine(parts: list[tuple[int, int, bytes]]) -> list[dict]:
    """The records of `parts` ((first, last, bytes) from `covering`, in order), each number once."""
    out, upto = [], -1
    for first, _, data in parts:
        for i, line in enumerate(data.decode().splitlines()):
            if first + i <= upto:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("journal part starting at %d: line %d is not JSON; skipped", first, i)
                continue
            upto = first + i
    return out


def read_parts(names: list[str], get: Callable[[str], bytes]) -> list[dict]:
    """A journal's records from the names in its parts folder and a reader of one part by name (a tool reading a
    bucket with its own client: tests, benches)."""
    return combine([(a, b, get(name)) for a, b, name in covering(names)])


def _line(record: dict) -> bytes:
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record (a single write of a whole line; one writer per file at a time). A retry after a transient
    error first checks whether the line already landed, so a record is never written twice."""
    line = _line(record)
    if objstore.store_for(path) is not None:
        _append_object(path, line)
        return
    sharedfs.makedirs(path.parent)
    tried = [False]

    def once() -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            data = line
            if size:
                tail = os.pread(fd, len(line) + 1, max(0, size - len(line) - 1))
                if tried[0] and tail.endswith(line) and (len(tail) <= len(line) or tail[-len(line) - 1:][:1] == b"\n"):
                    return  # the attempt that failed landed after all
                if not tail.endswith(b"\n"):
                    data = b"\n" + line  # a crash tore the last line: never glue the next record onto it
            tried[0] = True
            try:
                os.pwrite(fd, data, size)
                os.fsync(fd)
            except OSError as e:
                if sharedfs.is_disk_full(e):  # nothing torn stays behind while it waits for space
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
    sharedfs.retry("append", path, once)


def _append_object(path: Path, line: bytes) -> None:
    folder = parts_folder(path)
    sharedfs.makedirs(folder)
    names = sharedfs.listdir(folder)
    n = max((last for _, last, _ in _ranges(names)), default=-1) + 1
    while True:
        single = folder / _part_name(n, n)
        if sharedfs.create_new(single, line) or sharedfs.read_bytes(single) == line:
            break  # ours: new, or an earlier attempt of this call (or its late copy) holds the same bytes
        n += 1     # another writer's record has this number
    if (n + 1) % CHUNK == 0:
        _chunk(folder, n + 1 - CHUNK, n)
    elif (prev := n - n % CHUNK - CHUNK) >= 0 and _part_name(prev, prev + CHUNK - 1) not in names \
            and _part_name(prev, prev) in names:
        _chunk(folder, prev, prev + CHUNK - 1)  # a writer that died before chunking the last full range


def _chunk(folder: Path, first: int, last: int) -> None:
    """Records first..last in one object, then their singles deleted (best effort: a reader skips leftovers)."""
    names = sharedfs.listdir(folder)
    have = {a: name for a, b, name in _ranges(names) if a == b and first <= a <= last}
    if _part_name(first, last) in names:  # a writer that died between the chunk and the deletes
        for name in have.values():
            sharedfs.unlink(folder / name)
        return
    if len(have) != last - first + 1:
        log.warning("journal %s: records %d..%d are not all singles; left unchunked", folder, first, last)
        return
    data = b"".join(sharedfs.read_bytes(folder / have[i]) for i in range(first, last + 1))
    sharedfs.create_new(folder / _part_name(first, last), data)
    for name in have.values():
        sharedfs.unlink(folder / name)


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a journal, in order ([] without one). A disk: a torn last line (a crash mid-append) is
    skipped. A bucket: the parts of `parts_folder(path)`, each record once."""
    if objstore.store_for(path) is not None:
        return _read_objects(path)
    out = []
    if not sharedfs.exists(path):
        return out
    for line in sharedfs.read_text(path).splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _read_objects(path: Path) -> list[dict]:
    folder = parts_folder(path)
    for _ in range(5):  # a single deleted by a chunk between the listing and its read: list again
        if not sharedfs.exists(folder):
            return []
        try:
            return read_parts(sharedfs.listdir(folder), lambda name: sharedfs.read_bytes(folder / name))
        except FileNotFoundError:
            continue
    raise sharedfs.SharedDiskError(errno.EIO, f"journal {objstore.where(folder)}: its parts kept changing while it "
                                              f"was read (five listings); try again")
