"""A passthrough FUSE filesystem that behaves like one machine's NFS client: bandwidth cap, lookup cache, EIO.

    python bench/throttlefs.py BACKING_DIR MOUNTPOINT --mbps 40      # foreground; `fusermount -u MOUNTPOINT` ends it
    python bench/throttlefs.py B M --mbps 0 --lookup-ttl 30          # no cap; names cached 30 s, as NFS lookupcache
    python bench/throttlefs.py B M --mbps 0 --error-rate 0.01 --seed 1 --error-log faults.log   # a soft mount

Every read and write of a file under MOUNTPOINT goes through the kernel's FUSE layer to this process, which forwards
it to BACKING_DIR. One mount per process stands for one machine: several mounts of one backing directory are
several NFS clients of one server (bench/nfs.py, tests/helpers/fusefs.py).

Bandwidth (`--mbps`, 0 = no cap): reads and writes take their bytes from one token bucket (one NFS link); metadata
operations are not slowed. Writes are not cached by the kernel (the default for FUSE without writeback caching) and
the page cache of a file is dropped at every open (close-to-open), so the cap is what the processes see.

Lookup cache (`--entry-ttl`, `--negative-ttl`, `--lookup-ttl` for both; `--attr-ttl`; all 0 by default): passed to
the kernel as FUSE's entry_timeout / negative_timeout / attr_timeout. Observed on Linux 6.18 with libfuse 2.9 (the
tests in tests/unit/test_throttlefs.py check the first two):
- A name looked up while it did not exist stays "No such file" for `stat()` / `open()` / `os.path.exists()` through
  this mount for the negative TTL after the failed lookup, although another mount (or the backing directory) has
  created it meanwhile: with --lookup-ttl 10 it appeared 10.0 s after the failed lookup, not before. This is NFS's
  lookupcache=all (a client trusts "no such name" as long as it trusts the directory: acdirmin..acdirmax, 30-60 s by
  default). The protocol must never wait for a path that does not exist yet by polling `stat()`.
- `os.listdir()` of the parent shows the new name at once (FUSE caches no directory listings), and after it the
  cached negative entry is still there: stat() and open() of the listed name keep failing until the TTL ends (FUSE
  expires negative entries by time only; NFS also drops them when it sees the directory change, so this is the
  worse case). A name this mount never looked up is found at once, and a name this mount creates itself replaces
  its negative entry at once. So: discover another machine's files by listing their directory, never by polling a
  path before it exists (a poll that misses the file by a moment hides it for a whole TTL), and retry an open
  that says ENOENT.
- Opening a name that is negatively cached with O_CREAT (without O_EXCL) creates nothing new: the kernel sends a
  create, which opens the existing file without truncating it (this passthrough honours the caller's flags).
- A name whose positive entry is cached and which another mount then replaces by rename (temp + os.replace, the
  protocol's every write): open() through this mount returns the new contents at once, with any entry TTL, because
  this passthrough is path-based (the kernel's cached entry resolves to the path, the path to the new file) and the
  page cache is dropped at open. With --attr-ttl 0 (the default) stat() shows the new size at once too. With
  --attr-ttl > 0 the kernel keeps the old file's attributes until they expire: stat() shows the old size, and a
  read of a longer replacement comes back cut at the old length (observed: "ve" of "version-two-longer", the
  replaced file had 2 bytes); a file another mount deleted still passes os.path.exists() (open() says ENOENT).
  NFS's close-to-open revalidates attributes at open(), so keep --attr-ttl 0 unless stale attributes are the point.
Not emulated: NFS's attribute caching of directories (acdir*), ESTALE for open files whose inode went away on the
server, and cross-machine locking: flock() through one mount does not exclude a flock() of the same file through
another (observed; FUSE handles it in the mount's kernel), where NFS forwards it to the server (NLM / NFSv4 locks).

Errors (`--error-rate P`, `--error-ops`, `--seed`, `--error-log FILE`): each call of the chosen operations (default
read, write, fsync; also open, create, flush, getattr, readdir, rename, unlink, mkdir, rmdir, truncate) fails with
EIO with probability P, as a soft NFS mount fails a call that timed out. The draws come from one
random.Random(seed) per process behind a lock, so one thread making the same calls sees the same failures in every
run. `--error-log` appends one line per injected error: `op<TAB>path` (path inside the mount), so a test can tell
that errors were injected. The kernel retries a failed page read once (readahead, then a synchronous read of the
page): that retry fails too, without a new draw or log line, so a user's read of a page fails with probability P
(measured: 34 of 200 one-page files at P = 0.2, 34 read lines logged). A failed write stays in Python's buffer and
close() writes it again, so a file object's write can draw twice. A page fault of an mmap that gets EIO is SIGBUS,
as on NFS.

Faults switched while it runs (`--control FILE`, bench/soak.py): a JSON file outside the mount, read again when its
mtime changes (looked at most every 0.2 s): `{"error_rate": P}` replaces --error-rate (an EIO burst), `{"hang": true}`
makes every call block until the file says otherwise (a hard mount whose server is away: the callers sit in the
kernel, uninterruptible, as on NFS), `{"enospc": true}` fails every create, write, mkdir and rename with ENOSPC.

Counting (`--count-file FILE`, bench/scale.py): every call the kernel sends is counted by operation name, and each
listing's names and the kernel's READDIR requests it takes (one per 4 KB of FUSE dirents: 24 bytes + the name,
8-aligned, as the kernel asks for them, and as an NFS client reads a big folder in several READDIR RPCs). The counts
go to FILE as JSON ({"ops": {op: n}, "readdir_names": n, "readdir_pages": n, "written_per_s": {folder: {second:
bytes}}, "time": ...}, atomically: temp + rename) every 0.2 s while they change and when the mount ends; the bytes
written are binned by wall-clock second and by what they are: exchange (under rounds/, and a worker's delta-r*
files, written privately and then renamed into rounds/), state (opt-r*: the workers' snapshots), other
(bench/streaming.py's peak write rate). Without it nothing is counted.

Needs /dev/fuse, libfuse2 and `pip install fusepy` (root, or fusermount for a user); bench and tests only, nothing in
train/ uses it.
"""
from __future__ import annotations

import argparse
import errno
import os
import random
import threading
import time

ERROR_OPS = ("read", "write", "fsync", "flush", "open", "create", "getattr", "readdir", "rename", "unlink", "mkdir",
             "rmdir", "truncate")
DEFAULT_ERROR_OPS = ("read", "write", "fsync")


class Bucket:
    """A token bucket: `take(n)` sleeps until n bytes fit into `rate` bytes per second (burst of 1/10 s); rate 0 = no
    cap."""

    def __init__(self, rate: float):
        self.rate, self.burst = rate, rate / 10
        self.tokens, self.t = self.burst, time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class Faults:
    """Injected EIO: each call of an op in `ops` fails with probability `rate`, drawn from one seeded stream."""

    def __init__(self, rate: float, ops: tuple[str, ...] = DEFAULT_ERROR_OPS, seed: int = 0, log: str | None = None):
        self.rate, self.ops = rate, frozenset(ops)
        self.base_rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log else None
        self.injected = 0
        self.failed_reads: set[tuple[int, int]] = set()  # (fh, offset) of reads that failed, until their retry

    def hit(self, op: str, path: str, key: tuple[int, int] | None = None) -> bool:
        """Whether this call fails. `key` (fh, offset) for reads: the kernel retries a failed page read once
        (readahead, then a synchronous read of the same page); the retry fails too, without a draw or a log line,
        so that a user's read fails with probability P, as it does when a soft mount's server is away."""
        if self.rate <= 0 or op not in self.ops:
            return False
        with self.lock:
            if key is not None and key in self.failed_reads:
                self.failed_reads.discard(key)
                return True
            if self.rng.random() >= self.rate:
                return False
            self.injected += 1
            if key is not None:
                self.failed_reads.add(key)
            if self.log_fd is not None:
                os.write(self.log_fd, f"{op}\t{path}\n".encode("utf-8", "surrogateescape"))
        return True

    def released(self, fh: int) -> None:
        """A file handle was closed: its number may come back for another file."""
        if self.failed_reads:
            with self.lock:
                self.failed_reads = {k for k in self.failed_reads if k[0] != fh}


class Control:
    """The faults of `--control FILE`, switched from outside while the mount runs (see the module's docstring)."""

    ENOSPC_OPS = frozenset({"create", "write", "mkdir", "rename", "truncate"})

    def __init__(self, path: str, faults: Faults):
        self.path, self.faults = path, faults
        self.state: dict = {}
        self.mtime = None
        self.checked = 0.0
        self.lock = threading.Lock()

    def _refresh(self) -> dict:
        now = time.monotonic()
        if now - self.checked < 0.2:
            return self.state
        with self.lock:
            self.checked = now
            try:
                mtime = os.stat(self.path).st_mtime_ns
                if mtime != self.mtime:
                    import json
                    with open(self.path) as f:
                        self.state = json.load(f) or {}
                    self.mtime = mtime
                    self.faults.rate = float(self.state.get("error_rate", self.faults.base_rate))
            except (OSError, ValueError):
                pass  # no file yet, or half written by a writer that does not rename: keep the last state
        return self.state

    def before(self, op: str) -> None:
        """Block while the mount hangs; raise ENOSPC while the disk is full."""
        while self._refresh().get("hang"):
            time.sleep(0.1)
        if op in self.ENOSPC_OPS and self.state.get("enospc"):
            from fuse import FuseOSError
            raise FuseOSError(errno.ENOSPC)


class Counts:
    """Per-operation call counts of one mount, written to a JSON file (`--count-file`, module docstring)."""

    PAGE = 4096  # the kernel reads a FUSE directory in page-sized READDIR requests

    def __init__(self, path: str, every: float = 0.2):
        self.path, self.every = path, every
        self.ops: dict[str, int] = {}
        self.names = self.pages = 0
        # bytes written per second of the wall clock, by what they are: exchange (deltas, updates, global models),
        # state (the workers' snapshots) and other (leases, metrics, the data cache): bench/streaming.py
        self.written_per_s: dict[str, dict[int, int]] = {}
        self.lock = threading.Lock()
        self.changed = True
        self.written = threading.Event()
        threading.Thread(target=self._loop, name="counts", daemon=True).start()

    def op(self, op: str) -> None:
        with self.lock:
            self.ops[op] = self.ops.get(op, 0) + 1
            self.changed = True

    def wrote(self, path: str, n: int) -> None:
        parts = path.lstrip("/").split("/")
        name = parts[-1]
        kind = ("exchange" if "rounds" in parts[:3] or "delta-r" in name else  # a worker writes its delta privately
                "state" if "opt-r" in name else "other")                       # first, then renames it into rounds/
        sec = int(time.time())
        with self.lock:
            per = self.written_per_s.setdefault(kind, {})
            per[sec] = per.get(sec, 0) + n
            self.changed = True

    def listing(self, names: list[str]) -> None:
        size = sum((24 + len(n.encode("utf-8", "surrogateescape")) + 7) // 8 * 8 for n in names)
        with self.lock:
            self.names += len(names)
            self.pages += max(1, -(-size // self.PAGE))

    def write(self) -> None:
        import json
        with self.lock:
            if not self.changed:
                return
            rec = {"ops": dict(self.ops), "readdir_names": self.names, "readdir_pages": self.pages,
                   "written_per_s": {k: {str(t): b for t, b in v.items()} for k, v in self.written_per_s.items()},
                   "time": time.time()}
            self.changed = False
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while True:
            time.sleep(self.every)
            try:
                self.write()
            except OSError:
                pass


def make_ops(root: str, bucket: Bucket, faults: Faults | None = None, control: Control | None = None,
             counts: Counts | None = None):
    from fuse import FuseOSError, Operations

    class Passthrough(Operations):
        use_ns = True  # utimens gets nanoseconds, getattr returns them

        def _p(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def __call__(self, op, *args):
            if counts is not None:
                counts.op(op)
            if control is not None:
                control.before(op)
            if faults is not None and args:
                if op == "release":
                    faults.released(args[1])
                elif faults.hit(op, args[0], (args[3], args[2]) if op == "read" else None):
                    raise FuseOSError(errno.EIO)
            try:
                return super().__call__(op, *args)
            except OSError as e:
                raise FuseOSError(e.errno or errno.EIO) from None

        def access(self, path, mode):
            if not os.access(self._p(path), mode):
                raise FuseOSError(errno.EACCES)

        def getattr(self, path, fh=None):
            st = os.fstat(fh) if fh is not None else os.lstat(self._p(path))
            out = {k: getattr(st, k) for k in ("st_gid", "st_mode", "st_nlink", "st_size", "st_uid", "st_blocks")}
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return out

        def readdir(self, path, fh):
            names = [".", ".."] + os.listdir(self._p(path))
            if counts is not None:
                counts.listing(names)
            return names

        def destroy(self, path):
            if counts is not None:
                counts.changed = True
                counts.write()

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
        readlink = lambda self, path: os.readlink(self._p(path))  # noqa: E731
        symlink = lambda self, name, target: os.symlink(target, self._p(name))  # noqa: E731
        link = lambda self, target, name: os.link(self._p(name), self._p(target))  # noqa: E731

        def utimens(self, path, times=None):
            os.utime(self._p(path), ns=times)

        def open(self, path, flags):
            return os.open(self._p(path), flags)

        def create(self, path, mode, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
            # the caller's flags (NFSFuse passes them): O_CREAT on a name the kernel wrongly thinks absent (a cached
            # negative entry) must open the existing file, not truncate it; O_EXCL must still fail
            return os.open(self._p(path), flags | os.O_CREAT, mode)

        def read(self, path, size, offset, fh):
            data = os.pread(fh, size, offset)
            bucket.take(len(data))
            return data

        def write(self, path, data, offset, fh):
            bucket.take(len(data))
            if counts is not None:
                counts.wrote(path, len(data))
            return os.pwrite(fh, data, offset)

        def truncate(self, path, length, fh=None):
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._p(path), length)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, fdatasync, fh):
            os.fsync(fh)
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

    return Passthrough()


def parse_ops(text: str) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in ops if o not in ERROR_OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"unknown operation(s) {', '.join(bad) or '(none)'}; choose from "
                                         f"{','.join(ERROR_OPS)}")
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backing")
    ap.add_argument("mountpoint")
    ap.add_argument("--mbps", type=float, default=40.0, help="bandwidth cap, MB/s (reads + writes); 0 = no cap")
    ap.add_argument("--entry-ttl", type=float, default=None, metavar="S",
                    help="seconds the kernel trusts a name it found (FUSE entry_timeout; default 0)")
    ap.add_argument("--negative-ttl", type=float, default=None, metavar="S",
                    help="seconds the kernel trusts that a name does not exist (FUSE negative_timeout; default 0)")
    ap.add_argument("--lookup-ttl", type=float, default=None, metavar="S",
                    help="both --entry-ttl and --negative-ttl (NFS lookupcache=all with this cache time)")
    ap.add_argument("--attr-ttl", type=float, default=0.0, metavar="S",
                    help="seconds the kernel trusts a file's attributes, size included (FUSE attr_timeout; default 0)")
    ap.add_argument("--error-rate", type=float, default=0.0, metavar="P",
                    help="probability that each call of --error-ops fails with EIO (a soft mount); default 0")
    ap.add_argument("--error-ops", type=parse_ops, default=DEFAULT_ERROR_OPS, metavar="OPS",
                    help=f"comma-separated operations that may fail (default {','.join(DEFAULT_ERROR_OPS)}; "
                         f"any of {','.join(ERROR_OPS)})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the error stream (default 0)")
    ap.add_argument("--error-log", metavar="FILE", help="append `op<TAB>path` for every injected error")
    ap.add_argument("--control", metavar="FILE",
                    help="a JSON file of faults switched while it runs: error_rate, hang, enospc (bench/soak.py)")
    ap.add_argument("--count-file", metavar="FILE",
                    help="write per-operation call counts to FILE (JSON) every 0.2 s and at unmount (bench/scale.py)")
    args = ap.parse_args()
    for name in ("mbps", "entry_ttl", "negative_ttl", "lookup_ttl", "attr_ttl"):
        v = getattr(args, name)
        if v is not None and v < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {v:g}")
    if not 0.0 <= args.error_rate <= 1.0:
        ap.error(f"--error-rate must be in [0, 1], got {args.error_rate:g}")
    lookup = args.lookup_ttl or 0.0
    entry = args.entry_ttl if args.entry_ttl is not None else lookup
    negative = args.negative_ttl if args.negative_ttl is not None else lookup
    if not os.path.isdir(args.backing):
        ap.error(f"backing directory {args.backing} does not exist")
    if not os.path.isdir(args.mountpoint):
        ap.error(f"mountpoint {args.mountpoint} is not a directory")
    try:
        from fuse import FUSE
    except (ImportError, OSError) as e:  # fusepy missing, or libfuse.so.2 missing (OSError from ctypes)
        raise SystemExit(f"throttlefs needs fusepy and libfuse2 (pip install fusepy; apt-get install fuse libfuse2): "
                         f"{e}") from None

    class NFSFuse(FUSE):
        def create(self, path, mode, fip):  # pass the open flags on to Operations.create (fusepy drops them)
            fi = fip.contents
            fi.fh = self.operations("create", path.decode(self.encoding), mode, fi.flags)
            return 0

    faults = (Faults(args.error_rate, args.error_ops, args.seed, args.error_log)
              if args.error_rate > 0 or args.control else None)
    control = Control(args.control, faults) if args.control else None
    counts = Counts(os.path.abspath(args.count_file)) if args.count_file else None
    NFSFuse(make_ops(os.path.abspath(args.backing), Bucket(args.mbps * 1e6), faults, control, counts),
            args.mountpoint,
            foreground=True, nothreads=False, big_writes=True, max_read=1 << 20, max_write=1 << 20,
            entry_timeout=entry, negative_timeout=negative, attr_timeout=args.attr_ttl)


if __name__ == "__main__":
    main()
