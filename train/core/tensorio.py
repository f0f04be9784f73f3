"""Streaming safetensors I/O: read and write tensor by tensor with O(one tensor) memory.

The writer knows every name, dtype and shape up front, so it writes the safetensors header first and then each
tensor's bytes in order; the file appears atomically (temp name + fsync + os.replace) and its checksum
(train/core/digest.py) is computed on the fly, so publishing a 500 MB delta never holds two copies of it and never
re-reads it to hash it.

Files live on the shared disk, so every read and write is a pread / pwrite at an explicit offset through the retry
policy of train/core/sharedfs.py (a retried call repeats exactly what failed), and nothing is memory-mapped: a
mapped page that a soft NFS mount cannot read, or that another host pruned, is a SIGBUS rather than an error.

A file nobody on this host reads back soon (the coordinator's θ_{r+1} and momentum) can be written with O_DIRECT
(`direct=True`): through a page-aligned buffer in memory, straight to the disk, so the kernel does not copy it into
the page cache — on 2 cores that copy was a second of CPU per GB in the round's tail (docs/benchmarks.md, "Outer
step"). A filesystem without O_DIRECT gets the page cache, as every other file does.
"""
from __future__ import annotations

import errno
import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch
from train.core import digest, sharedfs
from train.core.store import tmp_name, fsync_dir

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Background:
    """Run callables in order on one background thread (hashing / writing overlap the caller's compute:
    the hashers and file writes release the GIL). `drain()` waits and re-raises the first error."""

    def __init__(self, depth: int = 8):
        import queue
        import threading

        self._q: "queue.Queue" = queue.Queue(maxsize=depth)
        self._err: BaseException | None = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if self._err is None:
                try:
                    job()
                except BaseException as e:  # surfaced by drain()
                    self._err = e

    def submit(self, job) -> None:
        if self._err is not None:
            raise self._err
        self._q.put(job)

    def drain(self) -> None:
        self._q.put(None)
        self._t.join()
        if self._err is not None:
            raise self._err


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor without a copy (bf16 viewed as bytes)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")  # 0-d too


DIRECT_ALIGN = 4096  # O_DIRECT's unit for memory, file offsets and lengths (covers 512-byte sectors)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for an open file (fcntl F_SETFL); False where the OS or filesystem refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except OSError:
        return False
    return True


def _direct_stage(fd: int):
    """A page-aligned buffer for writing `fd` with O_DIRECT, or None (the page cache is used) where the filesystem
    refuses O_DIRECT (tmpfs, some FUSE filesystems)."""
    import mmap

    if not _set_direct(fd, True):
        return None
    return mmap.mmap(-1, StreamingWriter.STAGE)


class StreamingWriter:
    """Write a safetensors file tensor by tensor, in the order of `specs`.

    with StreamingWriter(path, {"w": (torch.float32, (4, 4))}, metadata={...}) as w:
        w.write("w", tensor)
    """

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, hash_bytes: bool = True, phases=None,
                 like: str | None = None, direct: bool = False):
        from train.core.phases import NO_PHASES

        self.path = Path(path)
        self.phases = phases or NO_PHASES  # where the background thread's time goes (bench/outer_step.py)
        self.specs = dict(specs)
        self.order = list(specs)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name in self.order:
            dtype, shape = self.specs[name]
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
        self._header = struct.pack("<Q", len(raw)) + raw
        self.nbytes = len(self._header) + offset
        self._next = 0
        # False: a file nobody checks by its checksum; `like`: hash with the algorithm of that stored checksum
        self._hash = digest.Hasher(like) if hash_bytes else None
        self.direct = direct  # asked for; self._stage is set while the file is written with O_DIRECT
        self._part = 0  # values of tensor order[_next] queued by write_part so far

    def __enter__(self) -> "StreamingWriter":
        sharedfs.makedirs(self.path.parent)
        self._tmp = tmp_name(self.path)
        self._fd = sharedfs.open_fd(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:  # the whole file's space up front: a full disk is waited out here, before any byte is written
            sharedfs.reserve(self._fd, self.nbytes, self._tmp)
        except BaseException:
            os.close(self._fd)
            self._tmp.unlink(missing_ok=True)
            raise
        self._offset = 0
        self._unsynced = 0
        self._stage = _direct_stage(self._fd) if self.direct else None
        self._staged = 0  # bytes in the stage, which starts at file offset self._offset
        self._bg = _Background()
        self._emit(self._header)
        return self

    SYNC_EVERY = 64 << 20  # start the disk's writeback as we go (not waiting), so the final fsync has little left

    def _emit(self, data, keepalive=None) -> None:
        def job(data=data, keepalive=keepalive):  # keepalive: the tensor that owns `data`'s memory
            ph = self.phases
            if self._stage is not None:
                self._stage_in(data)
                if self._hash is not None:
                    with ph("checksum"):
                        self._hash.update(data)
                return
            with ph("write"):
                sharedfs.pwrite(self._fd, data, self._offset, self._tmp)
            self._offset += len(data)
            if self._hash is not None:
                with ph("checksum"):
                    self._hash.update(data)
            self._unsynced += len(data)
            if self._unsynced >= self.SYNC_EVERY:
                with ph("fsync"):
                    sharedfs.start_writeback(self._fd, self._offset - self._unsynced, self._unsynced, self._tmp)
                self._unsynced = 0
        self._bg.submit(job)

    STAGE = 16 << 20  # with O_DIRECT: the aligned buffer the bytes go through, written whole

    def _stage_in(self, data) -> None:
        """O_DIRECT: copy `data` into the page-aligned stage, writing the stage out each time it is full."""
        view, done, ph = memoryview(data).cast("B"), 0, self.phases
        while done < len(view):
            k = min(len(view) - done, self.STAGE - self._staged)
            with ph("write (into the O_DIRECT buffer)"):
                self._stage[self._staged:self._staged + k] = view[done:done + k]
            self._staged += k
            done += k
            if self._staged == self.STAGE:
                self._flush_stage()

    def _flush_stage(self) -> None:
        """Write the staged bytes at their offset: whole 4 KiB blocks (O_DIRECT's alignment: the last block of the
        file is padded, and __exit__ cuts the file back to its size). A filesystem that takes the O_DIRECT flag but
        refuses the write (EINVAL) gets it, and the rest of the file, through the page cache instead."""
        n = self._staged
        padded = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
        if padded > n:
            self._stage[n:padded] = bytes(padded - n)
        with self.phases("write"):
            try:
                sharedfs.pwrite(self._fd, memoryview(self._stage)[:padded], self._offset, self._tmp)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _set_direct(self._fd, False)
                sharedfs.pwrite(self._fd, memoryview(self._stage)[:n], self._offset, self._tmp)
        self._offset += n
        self._staged = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        """Queue `t` for writing; it is written (and hashed) in the background, so do not modify it in place
        before the writer is closed."""
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected or self._part:
            raise ValueError(f"{self.path.name}: expected tensor {expected!r} next, got {name!r}"
                             + (f" (its parts: {self._part} values so far)" if self._part else ""))
        dtype, shape = self.specs[name]
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.path.name}: {name}: got {t.dtype}{tuple(t.shape)}, declared {dtype}{shape}")
        t = t.detach().to("cpu").contiguous()
        self._emit(tensor_bytes(t), keepalive=t)
        self._next += 1

    def write_part(self, name: str, part: torch.Tensor) -> None:
        """Queue the next values of tensor `name` (a flat piece of it, in order: the pieces of a tensor one after
        the other, then the next tensor's), so its first bytes are written before its last ones are computed. The
        same rule as write(): do not modify `part` in place before the writer is closed."""
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise ValueError(f"{self.path.name}: expected tensor {expected!r} next, got {name!r}")
        dtype, shape = self.specs[name]
        if part.dtype != dtype or part.dim() != 1:
            raise ValueError(f"{self.path.name}: {name}: a part must be flat {dtype}, got {part.dtype}"
                             f"{tuple(part.shape)}")
        total = math.prod(shape)
        if self._part + part.numel() > total:
            raise ValueError(f"{self.path.name}: {name}: parts of {self._part + part.numel()} values, declared {total}")
        part = part.detach().to("cpu").contiguous()
        self._emit(tensor_bytes(part), keepalive=part)
        self._part += part.numel()
        if self._part == total:
            self._next += 1
            self._part = 0

    @property
    def digest(self) -> str | None:
        """The file's checksum in its stored form (train/core/digest.py); None without hashing."""
        return self._hash.text() if self._hash is not None else None

    def __exit__(self, exc_type, exc, tb) -> None:
        fd = self._fd
        try:
            with self.phases("write (waiting for the writer thread)"):
                self._bg.drain()
            if exc_type is None:
                if self._next != len(self.order):
                    raise ValueError(f"{self.path.name}: only {self._next}/{len(self.order)} tensors written")
                if self._stage is not None:
                    if self._staged:
                        self._flush_stage()
                    if self._offset % DIRECT_ALIGN:  # the padding of the last block cut off
                        sharedfs.retry("truncate", self._tmp, lambda: os.ftruncate(fd, self.nbytes))
                with self.phases("fsync"):
                    sharedfs.fsync(fd, self._tmp)
            os.close(fd)
            fd = None
            if exc_type is None:
                with self.phases("fsync"):
                    sharedfs.replace(self._tmp, self.path)
                    fsync_dir(self.path.parent)
        finally:
            if self._stage is not None:
                self._stage.close()
                self._stage = None
            if fd is not None:
                os.close(fd)  # also when we raise above (e.g. too few tensors): no leaked handle
            try:
                self._tmp.unlink(missing_ok=True)
            except OSError:
                pass


def save_streaming(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                   metadata: dict[str, str] | None = None) -> str:
    """Atomically save a dict of tensors; returns the file's checksum."""
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    with StreamingWriter(path, specs, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)
    return w.digest


def _header_of(path: Path, fd: int) -> tuple[dict, int, int]:
    """(header with __metadata__, its length n, the file size) of the open safetensors file `fd`, bounds checked."""
    size = os.fstat(fd).st_size
    head = sharedfs.pread(fd, 8, 0, path)
    if len(head) != 8:
        raise ValueError(f"{path}: too short to be safetensors")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, 100 << 20):
        raise ValueError(f"{path}: header length {n} exceeds the file")
    return json.loads(sharedfs.pread(fd, n, 8, path)), n, size


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str]]:
    """(tensors {name: {dtype, shape, data_offsets}}, metadata) from a safetensors header, validating its bounds."""
    path = Path(path)
    fd = sharedfs.open_fd(path, os.O_RDONLY)
    try:
        header, _, _ = _header_of(path, fd)
    finally:
        os.close(fd)
    meta = header.pop("__metadata__", {}) or {}
    return header, meta


def _tensor_from(buf: bytearray, info: dict) -> torch.Tensor:
    dtype = TORCH_DTYPES[info["dtype"]]
    if not buf:
        return torch.empty(info["shape"], dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])


def iter_tensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time from a safetensors file, each read in full here (pread, retried).

    Nothing is memory-mapped: a mapped tensor's bytes would be read later, on whatever thread first touches them
    (a training step, not the prefetch thread), and on NFS a file another host deletes (a pruned round) or a page
    a soft mount cannot read turns that access into SIGBUS."""
    path = Path(path)
    fd = sharedfs.open_fd(path, os.O_RDONLY)
    try:
        header, n, size = _header_of(path, fd)
        header.pop("__metadata__", None)
        base = 8 + n
        for name in (names if names is not None else header):
            if name not in header:
                raise KeyError(f"{path}: no tensor {name!r}")
            start, end = header[name]["data_offsets"]
            if base + end > size or end < start:
                raise ValueError(f"{path}: tensor {name!r} lies outside the file (truncated?)")
            buf = bytearray(end - start)
            if sharedfs.preadinto(fd, buf, base + start, path) != len(buf):
                raise ValueError(f"{path}: truncated inside tensor {name!r}")
            yield name, _tensor_from(buf, header[name])
    finally:
        os.close(fd)


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(path))


TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


class SequentialReader:
    """Read a safetensors file front to back, tensor by tensor, hashing every byte on the way.

    One pass over the file gives both the tensors and the checksum that the sidecar promised, so validating a
    delta costs no second read. Tensors must be requested in file order (`names_in_order`). `like`: the stored
    checksum the result will be compared with (its algorithm is used; train/core/digest.py).
    """

    def __init__(self, path: str | os.PathLike, hash_bytes: bool = True, like: str | None = None):
        self.path = Path(path)
        self._fd = sharedfs.open_fd(self.path, os.O_RDONLY)
        try:
            self.header, n, size = _header_of(self.path, self._fd)
            self._hash = digest.Hasher(like) if hash_bytes else None
            if self._hash:  # the header's bytes as stored (the hash covers the whole file)
                self._hash.update(sharedfs.pread(self._fd, 8 + n, 0, self.path))
        except BaseException:
            os.close(self._fd)
            raise
        self.metadata = self.header.pop("__metadata__", {}) or {}
        self._base = 8 + n
        self._size = size
        self._pos = 0
        self._bg = _Background() if hash_bytes else None

    @property
    def names_in_order(self) -> list[str]:
        return sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0])

    def dtype_of(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self.header[name]["dtype"]]

    def read(self, name: str) -> torch.Tensor:
        """The next tensor (its memory is hashed in the background: treat it as read-only)."""
        info = self.header[name]
        start, end = info["data_offsets"]
        if start != self._pos:
            if self._hash is not None:  # the hash needs every byte in order
                raise ValueError(f"{self.path}: tensor {name!r} is not next in file order")
        if end < start or self._base + end > self._size:
            raise ValueError(f"{self.path}: truncated inside tensor {name!r}")
        buf = bytearray(end - start)
        if sharedfs.preadinto(self._fd, buf, self._base + start, self.path) != len(buf):
            raise ValueError(f"{self.path}: truncated inside tensor {name!r}")
        if self._bg is not None:
            self._bg.submit(lambda b=buf: self._hash.update(b))  # hashed while the caller computes
        self._pos = end
        return _tensor_from(buf, info)

    def finish(self) -> str | None:
        """Hash whatever follows the last tensor; return the file's checksum (None if not hashing)."""
        off = self._base + self._pos
        while self._bg is not None and (chunk := sharedfs.pread(self._fd, 1 << 22, off, self.path)):
            off += len(chunk)
            self._bg.submit(lambda b=chunk: self._hash.update(b))
        self._close_fd()
        if self._bg is None:
            return None
        bg, self._bg = self._bg, None
        bg.drain()
        return self._hash.text()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close_fd()
        if self._bg is not None:
            bg, self._bg = self._bg, None
            bg.drain()


class PipelinedReader:
    """Read a safetensors file front to back on a background thread, hashing every byte as it is read, and hand its
    tensors over in groups (a model tensor's codes and scales) through a bounded queue: the caller works on group k
    while group k + 1 is read and hashed (preadv and the hashers release the GIL). One pass gives the tensors and the
    file's checksum; at most `depth` + 2 groups are in memory at once. `like`: the stored checksum the result will
    be compared with (its algorithm is used; train/core/digest.py).

        rd = PipelinedReader(path, [("w", ["w", "w::scale"]), ...])
        for key, tensors in rd:
            ...
        got = rd.finish()   # the whole file's checksum, trailing bytes included

    `groups` names every tensor the caller wants, each once. When they are not one contiguous run of the file's
    order (a file written by another writer), the file is read whole, in its own order, before the first group is
    handed over: the same result, without the overlap. Close it (`close`) when the loop stops early.

    A file of at most INLINE bytes is read whole in the caller's thread, in one read, as it iterates: the same
    tensors and checksum, without the thread and without a read per tensor (for a small delta the hand-offs and the
    one-request-per-tensor reads cost more than the overlap saves: 256 small deltas a round, bench/scale.py)."""

    PIECE = 8 << 20  # bytes per read (and hash update) inside a tensor
    INLINE = 4 << 20  # files up to this size are read without the background thread

    def __init__(self, path: str | os.PathLike, groups: list[tuple[object, list[str]]], depth: int = 2,
                 phases=None, like: str | None = None):
        import queue
        import threading

        from train.core.phases import NO_PHASES

        self.path = Path(path)
        self.groups = groups
        self.phases = phases or NO_PHASES
        self.nbytes = 0  # read so far
        self._q: "queue.Queue" = queue.Queue(maxsize=depth)
        self._hash = digest.Hasher(like)
        self._stop = False
        self._fd = sharedfs.open_fd(self.path, os.O_RDONLY)
        try:
            self.header, n, self.size = _header_of(self.path, self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self.metadata = self.header.pop("__metadata__", {}) or {}
        self._base = 8 + n
        wanted = [name for _, names in groups for name in names]
        order = sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0])
        self.in_order = wanted == order[:len(wanted)]
        self._t = None
        self._flat_read = False
        if self.size > self.INLINE:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()

    _END = object()

    def _put(self, item) -> None:
        import queue

        while not self._stop:
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _span(self, name: str) -> tuple[dict, int, int]:
        """(header entry, start, end) of tensor `name`, its bounds checked against the file."""
        info = self.header.get(name)
        if info is None:
            raise ValueError(f"{self.path}: no tensor {name!r}")
        start, end = info["data_offsets"]
        if end < start or self._base + end > self.size:
            raise ValueError(f"{self.path}: truncated inside tensor {name!r}")
        return info, start, end

    def _read(self, name: str, pos: int) -> tuple[torch.Tensor, int]:
        info, start, end = self._span(name)
        if start != pos:
            raise ValueError(f"{self.path}: tensor {name!r} is not next in file order")
        buf = bytearray(end - start)
        view = memoryview(buf)
        for o in range(0, len(buf), self.PIECE):
            piece = view[o:o + self.PIECE]
            with self.phases("read"):
                got = sharedfs.preadinto(self._fd, piece, self._base + start + o, self.path)
            if got != len(piece):
                raise ValueError(f"{self.path}: truncated inside tensor {name!r}")
            self.nbytes += got
            with self.phases("checksum"):
                self._hash.update(piece)
        return _tensor_from(buf, info), end

    def _read_whole(self) -> bytearray:
        """Every byte of the file in one read and one hash update."""
        data = bytearray(self.size)
        with self.phases("read"):
            got = sharedfs.preadinto(self._fd, data, 0, self.path)
        if got != self.size:
            raise ValueError(f"{self.path}: truncated (read {got} of {self.size} bytes)")
        self.nbytes += got
        with self.phases("checksum"):
            self._hash.update(data)
        return data

    def _items_whole(self):
        """A small file: every byte in one read and one hash update, then the groups from memory."""
        data = self._read_whole()
        view = memoryview(data)
        for key, names in self.groups:
            out = {}
            for name in names:
                info, start, end = self._span(name)
                out[name] = _tensor_from(bytearray(view[self._base + start:self._base + end]), info)
            yield key, out

    def flat(self, names: list[str]) -> torch.Tensor | None:
        """A small file (read whole, see INLINE) whose tensors are exactly `names`, in that order, back to back, of
        one dtype: all their values as ONE flat tensor (read and hashed here; then finish() for the checksum, and no
        iteration). None otherwise (iterate as usual). One tensor for the whole file spares its reader the per-tensor
        work: a delta of a small model (20 tensors of 38K values in all) took 1.9 ms to add tensor by tensor, most of
        it per-tensor overhead (bench/scale.py adds 256 of them at the end of a round)."""
        if self._t is not None or not names or set(names) != set(self.header):
            return None
        dtypes = {self.header[n]["dtype"] for n in names}
        pos = 0
        for n in names:
            start, end = self.header[n]["data_offsets"]
            if start != pos:
                return None
            pos = end
        if len(dtypes) != 1 or self._base + pos != self.size:
            return None
        data = self._read_whole()
        self._flat_read = True  # every byte is read and hashed: iterating gives nothing
        if pos == 0:
            return torch.empty(0, dtype=TORCH_DTYPES[dtypes.pop()])
        return torch.frombuffer(data, dtype=TORCH_DTYPES[dtypes.pop()], offset=self._base)

    def _items(self):
        """The groups, read and hashed in file order; the bytes after the last wanted tensor hashed at the end."""
        with self.phases("read"):
            head = sharedfs.pread(self._fd, self._base, 0, self.path)
        self.nbytes += len(head)
        self._hash.update(head)
        pos = 0
        if self.in_order:
            for key, names in self.groups:
                out = {}
                for name in names:
                    out[name], pos = self._read(name, pos)
                yield key, out
                if self._stop:
                    return
        else:  # the whole file in its own order, then the groups from memory
            every = {}
            for name in sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0]):
                every[name], pos = self._read(name, pos)
            for key, names in self.groups:
                missing = [x for x in names if x not in every]
                if missing:
                    raise ValueError(f"{self.path}: no tensor {missing[0]!r}")
                yield key, {x: every[x] for x in names}
        if self.in_order:  # the tensors nobody asked for, hashed
            for name in sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0]):
                if self.header[name]["data_offsets"][0] >= pos:
                    _, pos = self._read(name, pos)
        off = self._base + pos
        while chunk := sharedfs.pread(self._fd, self.PIECE, off, self.path):
            off += len(chunk)
            self.nbytes += len(chunk)
            self._hash.update(chunk)

    def _run(self) -> None:
        try:
            for item in self._items():
                self._put(item)
                if self._stop:
                    return
            self._put(self._END)
        except BaseException as e:  # raised in the caller's thread
            self._put(e)

    def __iter__(self):
        if self._flat_read:
            return
        if self._t is None:
            yield from self._items_whole()
            return
        while True:
            item = self._q.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def finish(self) -> str:
        """After the loop: the file's checksum (every byte, in order)."""
        self.close()
        return self._hash.text()

    def close(self) -> None:
        import queue

        self._stop = True
        while self._t is not None and self._t.is_alive():
            try:
                self._q.get(timeout=0.05)
            except queue.Empty:
                pass
        if self._t is not None:
            self._t.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
