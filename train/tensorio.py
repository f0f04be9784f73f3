"""Streaming safetensors I/O: read tensor by tensor (mmap), write tensor by tensor with O(one tensor) memory.

The writer knows every name, dtype and shape up front, so it writes the safetensors header first and then each
tensor's bytes in order; the file appears atomically (temp name + fsync + os.replace) and its sha256 is computed
on the fly, so publishing a 500 MB delta never holds two copies of it and never re-reads it to hash it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from train.store import _tmp_name, fsync_dir

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor without a copy (bf16 viewed as bytes)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class StreamingWriter:
    """Write a safetensors file tensor by tensor, in the order of `specs`.

    with StreamingWriter(path, {"w": (torch.float32, (4, 4))}, metadata={...}) as w:
        w.write("w", tensor)
    """

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
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
        self._hash = hashlib.sha256()

    def __enter__(self) -> "StreamingWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = _tmp_name(self.path)
        self._f = open(self._tmp, "wb")
        self._emit(self._header)
        return self

    def _emit(self, data) -> None:
        self._f.write(data)
        self._hash.update(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise ValueError(f"{self.path.name}: expected tensor {expected!r} next, got {name!r}")
        dtype, shape = self.specs[name]
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.path.name}: {name}: got {t.dtype}{tuple(t.shape)}, declared {dtype}{shape}")
        self._emit(tensor_bytes(t))
        self._next += 1

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self._next != len(self.order):
                    raise ValueError(f"{self.path.name}: only {self._next}/{len(self.order)} tensors written")
                self._f.flush()
                os.fsync(self._f.fileno())
            self._f.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
                fsync_dir(self.path.parent)
        finally:
            if self._tmp.exists():
                self._tmp.unlink()


def save_streaming(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                   metadata: dict[str, str] | None = None) -> str:
    """Atomically save a dict of tensors; returns the file's sha256."""
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    with StreamingWriter(path, specs, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)
    return w.sha256


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str]]:
    """(tensors {name: {dtype, shape, data_offsets}}, metadata) from a safetensors header, validating its bounds."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short to be safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: header length {n} exceeds the file")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    return header, meta


def iter_tensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time from a safetensors file (memory-mapped)."""
    with safe_open(str(path), framework="pt") as f:
        for name in (names if names is not None else f.keys()):
            yield name, f.get_tensor(name)


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(path))


_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


class SequentialReader:
    """Read a safetensors file front to back, tensor by tensor, hashing every byte on the way.

    One pass over the file gives both the tensors and the sha256 that the sidecar promised, so validating a
    delta costs no second read. Tensors must be requested in file order (`names_in_order`).
    """

    def __init__(self, path: str | os.PathLike, hash_bytes: bool = True):
        self.path = Path(path)
        self.header, self.metadata = read_header(self.path)
        self._f = open(self.path, "rb")
        self._hash = hashlib.sha256() if hash_bytes else None
        head = self._f.read(8)
        (n,) = struct.unpack("<Q", head)
        raw = self._f.read(n)
        if self._hash:
            self._hash.update(head)
            self._hash.update(raw)
        self._base = 8 + n
        self._pos = 0

    @property
    def names_in_order(self) -> list[str]:
        return sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0])

    def dtype_of(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[self.header[name]["dtype"]]

    def read(self, name: str) -> torch.Tensor:
        info = self.header[name]
        start, end = info["data_offsets"]
        if start != self._pos:
            raise ValueError(f"{self.path}: tensor {name!r} is not next in file order")
        buf = bytearray(end - start)
        got = self._f.readinto(buf)
        if got != len(buf):
            raise ValueError(f"{self.path}: truncated inside tensor {name!r}")
        if self._hash:
            self._hash.update(buf)
        self._pos = end
        dtype = _TORCH_DTYPES[info["dtype"]]
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def finish(self) -> str | None:
        """Hash whatever follows the last tensor; return the file's sha256 (None if not hashing)."""
        while chunk := self._f.read(1 << 22):
            if self._hash:
                self._hash.update(chunk)
        self._f.close()
        return self._hash.hexdigest() if self._hash else None

    def close(self) -> None:
        self._f.close()
