"""A real small filesystem for tests of a full disk: a tmpfs of a given size mounted on a fresh folder (root only).

    with small_fs(tmp_path / "fs", "8m") as mnt:   # pytest.skip with the reason where mount is not permitted
        ...
        fill(mnt)      # a filler file that takes every free byte (returns its path); unlink it to free the space
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs(folder: Path, size: str):
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full-disk test needs a real small filesystem: `mount -t tmpfs` is not permitted here "
                    f"({(r.stderr or r.stdout).strip()[:200]})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(mnt: Path, name: str = "filler.bin") -> Path:
    """Write a file that takes every free byte of `mnt` (its write ends in ENOSPC); returns its path."""
    path = mnt / name
    chunk = b"\0" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError:
                break
        while True:  # the last pages: smaller writes until nothing fits
            try:
                if os.write(fd, b"\0" * 512) == 0:
                    break
            except OSError:
                break
    finally:
        os.close(fd)
    return path


def free_bytes(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return st.f_bavail * st.f_frsize
