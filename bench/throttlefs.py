"""A passthrough FUSE filesystem with a bandwidth cap: a slow shared disk on a CPU box, for bench/utilisation.py.

    python bench/throttlefs.py BACKING_DIR MOUNTPOINT --mbps 40      # foreground; `fusermount -u MOUNTPOINT` ends it

Every read and write of a file under MOUNTPOINT goes through the kernel's FUSE layer to this process, which forwards
it to BACKING_DIR after taking its bytes from a token bucket (reads and writes share one budget, like one NFS link):
what the protocol reads and writes is slowed, metadata operations are not. Writes are not cached by the kernel (the
default for FUSE without writeback caching) and reads of data another process just wrote are served through this
process, so the cap is what the processes see. Needs /dev/fuse, libfuse2 and `pip install fusepy` (root, or
fusermount for a user); bench-only, nothing in train/ uses it.
"""
from __future__ import annotations

import argparse
import errno
import os
import threading
import time


class Bucket:
    """A token bucket: `take(n)` sleeps until n bytes fit into `rate` bytes per second (burst of 1/10 s)."""

    def __init__(self, rate: float):
        self.rate, self.burst = rate, rate / 10
        self.tokens, self.t = self.burst, time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def make_ops(root: str, bucket: Bucket):
    from fuse import FuseOSError, Operations

    class Passthrough(Operations):
        def _p(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def __call__(self, op, *args):
            try:
                return super().__call__(op, *args)
            except OSError as e:
                raise FuseOSError(e.errno or errno.EIO) from None

        def access(self, path, mode):
            if not os.access(self._p(path), mode):
                raise FuseOSError(errno.EACCES)

        def getattr(self, path, fh=None):
            st = os.lstat(self._p(path))
            return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                                                 "st_size", "st_uid")}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._p(path))

        def statfs(self, path):
            sv = os.statvfs(self._p(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                 "f_files", "f_flag", "f_frsize", "f_namemax")}

        chmod = lambda self, path, mode: os.chmod(self._p(path), mode)  # noqa: E731
        chown = lambda self, path, uid, gid: os.chown(self._p(path), uid, gid)  # noqa: E731
        mkdir = lambda self, path, mode: os.mkdir(self._p(path), mode)  # noqa: E731
        rmdir = lambda self, path: os.rmdir(self._p(path))  # noqa: E731
        unlink = lambda self, path: os.unlink(self._p(path))  # noqa: E731
        rename = lambda self, old, new: os.rename(self._p(old), self._p(new))  # noqa: E731
        utimens = lambda self, path, times=None: os.utime(self._p(path), times)  # noqa: E731
        readlink = lambda self, path: os.readlink(self._p(path))  # noqa: E731
        symlink = lambda self, name, target: os.symlink(target, self._p(name))  # noqa: E731
        link = lambda self, target, name: os.link(self._p(name), self._p(target))  # noqa: E731

        def open(self, path, flags):
            return os.open(self._p(path), flags)

        def create(self, path, mode, fi=None):
            return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, size, offset, fh):
            data = os.pread(fh, size, offset)
            bucket.take(len(data))
            return data

        def write(self, path, data, offset, fh):
            bucket.take(len(data))
            return os.pwrite(fh, data, offset)

        def truncate(self, path, length, fh=None):
            with open(self._p(path), "r+") as f:
                f.truncate(length)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, fdatasync, fh):
            os.fsync(fh)
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

    return Passthrough()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backing")
    ap.add_argument("mountpoint")
    ap.add_argument("--mbps", type=float, default=40.0, help="bandwidth cap, MB/s (reads + writes)")
    args = ap.parse_args()
    from fuse import FUSE
    FUSE(make_ops(os.path.abspath(args.backing), Bucket(args.mbps * 1e6)), args.mountpoint, foreground=True,
         nothreads=False, big_writes=True, max_read=1 << 20, max_write=1 << 20)


if __name__ == "__main__":
    main()
