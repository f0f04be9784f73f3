"""Every call on BASE_DIR goes through here: one retry policy for a shared disk that fails now and then, and
visibility that does not depend on an NFS client's lookup cache.

**Retries.** A soft NFS mount (and a hard one on ESTALE) fails a call with EIO, ESTALE, ETIMEDOUT, EAGAIN or ENOLCK
when the server or the link hiccups. `retry(op, path, fn)` runs `fn` again with backoff (50 ms doubling to 2 s) for
up to `outer.io_retry_s` seconds (`configure`), logs one warning when an episode starts and one line when it ends,
and after that raises `SharedDiskError`: one line naming the path and the call, exit 2 (the worker's supervisor
restarts it: train/launch/procs.py).

**A full disk** (ENOSPC, EDQUOT: the filesystem or the user's quota) is not a hiccup and has its own policy, apart
from the EIO budget: the call waits for space, polling every `DISK_FULL_POLL_S`, for up to `outer.disk_full_wait_s`
seconds (`configure`; default one hour) per episode of this process. One line when the episode starts ("BASE_DIR is
full (...): waiting for space, up to N s"), one a minute while it lasts, one when space is back; every thread of the
process shares the episode (one set of lines). Past the wait: `DiskFull`, one line, exit 2, and no restart (a
supervisor would only fill the disk again): the same command resumes once there is space. A write that hits a full
disk frees what it had written before it waits (`write_file` truncates its file, `reserve` its reservation), so
processes waiting side by side never hold the space that would let one of them finish.

Every helper below is safe to run twice: writes go to a temp name and are
published by rename (a retried rename that already happened on the server is recognised), reads and writes of a
file use explicit offsets (pread / pwrite), an append checks whether its line already landed.

**Visibility.** Each machine is its own NFS client: a lookup of a name that does not exist yet is remembered
("negative" dentry, lookupcache=all) for up to acdirmax (60 s by default), so polling `path.is_file()` for a file
another machine is about to publish sees "no such file" long after it appeared. A directory *read* revalidates the
directory on NFS (and is never cached by FUSE), and a name that exists is re-checked on open (close-to-open). So
`exists(path)` never looks a name up before a listing of its folder shows it: it lists the parent (and, the first
time, the folders above it, up to one known to exist) and answers from the listing. Use it for everything another
process creates; a plain `Path.is_file()` is only for files this process made itself.

Nothing here is specific to DiLoCo or EDT: train/core/store.py (atomic files, manifests, the run's paths),
train/core/tensorio.py (safetensors streaming) and train/core/data.py (the token cache) build on it.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from train.core import objstore
from train.core.errors import UserError

log = logging.getLogger("sharedfs")

T = TypeVar("T")

# Errors a flaky shared disk returns and a later call may not: retried. (EINTR is retried by Python itself.)
TRANSIENT = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.ENOLCK})
RETRY_S = 120.0  # outer.io_retry_s: how long one call keeps retrying before the process gives up (exit 2)
BACKOFF_S, BACKOFF_CAP_S = 0.05, 2.0
RETRY_SAY_EVERY_S = 30.0  # while one call keeps failing: a line this often (start and end have theirs)
_retry_s = RETRY_S
_episodes = 0  # retry episodes so far in this process (recovered or not): for logs, metrics and tests

# A full filesystem or quota: waited out (for up to outer.disk_full_wait_s), never counted against io_retry_s.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
DISK_FULL_WAIT_S = 3600.0  # outer.disk_full_wait_s
DISK_FULL_POLL_S = 1.0     # how often a waiting call tries again
DISK_FULL_SAY_EVERY_S = 60.0  # a line this often while the disk stays full
_disk_full_wait_s = DISK_FULL_WAIT_S
_full_lock = threading.Lock()
_full_since: float | None = None  # monotonic start of this process's current disk-full episode (None: none)
_full_said = 0.0                   # when the last line about it was logged
_full_episodes = 0                 # disk-full episodes so far in this process (for logs, metrics and tests)


class SharedDiskError(UserError, OSError):
    """A call on the shared disk kept failing for outer.io_retry_s seconds (exit 2; a supervisor restarts)."""

    retryable = True  # run_main tells the supervisor: restart (train/core/errors.py note_retryable_exit)


class DiskFull(UserError, OSError):
    """BASE_DIR stayed full for outer.disk_full_wait_s seconds (exit 2, not restarted: rerun the same command once
    there is space; the run resumes from its last saved state)."""


def configure(retry_s: float, disk_full_wait_s: float | None = None) -> None:
    """Set this process's retry budget per call (outer.io_retry_s) and how long it waits for space on a full
    BASE_DIR (outer.disk_full_wait_s; None keeps the current value)."""
    global _retry_s, _disk_full_wait_s
    _retry_s = float(retry_s)
    if disk_full_wait_s is not None:
        _disk_full_wait_s = float(disk_full_wait_s)


def configure_from(outer: Any) -> None:
    """`configure` from a config's `outer` section (io_retry_s, disk_full_wait_s): every process of a run calls it
    once it has its config (workers: train/core/entry.py; coordinators; the simulators and launchers)."""
    configure(outer.io_retry_s, getattr(outer, "disk_full_wait_s", None))


def episodes() -> int:
    return _episodes


def disk_full_episodes() -> int:
    return _full_episodes


def is_disk_full(e: BaseException | None) -> bool:
    """An OSError ENOSPC / EDQUOT, or a library's wrapper of one (safetensors' `Os { code: 28`, a `raise ... from`),
    but not our own DiskFull (the wait is over: it goes up, it is not waited for again)."""
    import re

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (DiskFull, SharedDiskError)):
            return False
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        m = re.search(r"Os \{ code: (\d+)", str(e)) if not isinstance(e, OSError) else None
        if m and int(m.group(1)) in DISK_FULL:
            return True
        e = e.__cause__ or e.__context__
    return False


def _disk_full_wait(op: str, path: str | os.PathLike, e: BaseException) -> None:
    """One poll of the disk-full wait of this process (see the module docstring): says the start of an episode and
    a line a minute, sleeps DISK_FULL_POLL_S, raises DiskFull once the episode is older than disk_full_wait_s."""
    global _full_since, _full_said, _full_episodes
    with _full_lock:
        now = time.monotonic()
        if _full_since is None:
            _full_since = _full_said = now
            _full_episodes += 1
            log.warning("BASE_DIR is full (%s %s: %s): waiting for space, up to %.0f s (outer.disk_full_wait_s)",
                        op, path, _why(e), _disk_full_wait_s)
        waited = now - _full_since
        if waited >= _disk_full_wait_s:
            raise DiskFull(
                errno.ENOSPC,
                f"{path}: BASE_DIR stayed full for {waited:.0f} s ({op}: {_why(e)}; outer.disk_full_wait_s = "
                f"{_disk_full_wait_s:g}): free space on the shared disk (old runs, outer.keep_rounds), then run the "
                f"same command again: the run resumes from its last saved state") from None
        if now - _full_said >= DISK_FULL_SAY_EVERY_S:
            _full_said = now
            log.warning("BASE_DIR is still full (%s %s): waited %.0f s of %.0f s", op, path, waited,
                        _disk_full_wait_s)
    time.sleep(DISK_FULL_POLL_S)


def _disk_full_over(op: str, path: str | os.PathLike) -> None:
    """A call that waited for space succeeded: the episode is over (one line, once, whichever thread sees it)."""
    global _full_since
    with _full_lock:
        if _full_since is None:
            return
        waited, _full_since = time.monotonic() - _full_since, None
    log.warning("BASE_DIR has space again (%s %s succeeded): going on after %.0f s of waiting", op, path, waited)


def is_transient(e: BaseException) -> bool:
    return isinstance(e, OSError) and not isinstance(e, SharedDiskError) and e.errno in TRANSIENT


def is_transient_any(e: BaseException) -> bool:
    """`is_transient`, or a library's wrapper of such an OSError (safetensors reports `IoError(Os { code: 5 ...`
    as a SafetensorError): for retrying a whole step that calls into libraries (e.g. `save_pretrained`)."""
    import re

    seen = set()
    while e is not None and id(e) not in seen:  # a library may wrap the OSError (raise ... from e)
        seen.add(id(e))
        if is_transient(e):
            return True
        m = re.search(r"Os \{ code: (\d+)", str(e))
        if m and int(m.group(1)) in TRANSIENT:
            return True
        if isinstance(e, SharedDiskError):
            return False
        e = e.__cause__ or e.__context__
    return False


def retry(op: str, path: str | os.PathLike, fn: Callable[[], T], *, budget: float | None = None,
          transient: Callable[[BaseException], bool] = is_transient, watch: bool = True) -> T:
    """`fn()`, again after a transient error (see TRANSIENT) with backoff, for up to `budget` seconds
    (outer.io_retry_s); then SharedDiskError naming `op` and `path`. A full disk (DISK_FULL, also wrapped by a
    library) is waited out apart from that budget, for up to outer.disk_full_wait_s (module docstring); then
    DiskFull. Other errors pass through at once. A call that hangs is said while it hangs (`_watched`; `watch`
    False for a `fn` that also computes, whose time is not the storage's)."""
    global _episodes
    budget = _retry_s if budget is None else budget
    start, delay, tries, full, said = None, BACKOFF_S, 0, False, 0.0
    while True:
        try:
            out = _watched(op, path, fn) if watch else fn()  # watch=False: fn computes too (a model, a cache)
        except Exception as e:
            if is_disk_full(e):
                full = True
                _disk_full_wait(op, path, e)
                continue
            if not transient(e):
                raise
            tries += 1
            now = time.monotonic()
            if start is None:
                start = said = now
                _episodes += 1
                log.warning("shared disk: %s %s failed (%s); retrying for up to %.0f s", op, path, _why(e), budget)
            elif now - said >= RETRY_SAY_EVERY_S:  # a long outage (a hung mount, a stopped server): a line a while
                said = now
                log.warning("shared disk: %s %s still failing after %.0f s (%s); retrying for up to %.0f s", op, path,
                            now - start, _why(e), budget)
            if now - start >= budget:
                raise SharedDiskError(
                    getattr(e, "errno", None) or errno.EIO,
                    f"{path}: {op} kept failing for {budget:.0f} s ({_why(e)}; outer.io_retry_s): "
                             f"check that the shared disk is mounted and its server reachable; a supervised process "
                             f"is restarted and resumes from its saved state") from None
            time.sleep(min(delay, max(0.0, start + budget - now)))
            delay = min(delay * 2, BACKOFF_CAP_S)
            continue
        if start is not None:
            log.info("shared disk: %s %s succeeded after %d retries (%.1f s)", op, path, tries,
                     time.monotonic() - start)
        if full:
            _disk_full_over(op, path)
        return out


# -- calls that hang: a hard NFS mount whose server is gone, a FUSE daemon stopped, an S3 request with no answer --
HUNG_SAY_AFTER_S = 30.0  # a call in flight this long gets a line (again each HUNG_SAY_AFTER_S), one when it returns
_inflight: dict[int, list] = {}  # id -> [op, path, start, said]
_inflight_lock = threading.Lock()
_watchdog: list[int] = []  # the pid whose watchdog thread runs


def _watched(op: str, path, fn: Callable[[], T]) -> T:
    """`fn()`, watched by a daemon thread that logs it while it hangs (see HUNG_SAY_AFTER_S)."""
    token = object()
    entry = [op, path, time.monotonic(), 0.0]
    with _inflight_lock:
        _inflight[id(token)] = entry
        if _watchdog != [os.getpid()]:  # none yet, or a forked child's (threads do not cross a fork)
            _watchdog[:] = [os.getpid()]
            threading.Thread(target=_watch, name="sharedfs-watchdog", daemon=True).start()
    try:
        return fn()
    finally:
        with _inflight_lock:
            _inflight.pop(id(token), None)
        if entry[3]:
            log.warning("shared disk: %s %s returned after %.0f s", op, path, time.monotonic() - entry[2])


def _watch() -> None:
    while True:
        time.sleep(min(1.0, HUNG_SAY_AFTER_S / 2))
        now = time.monotonic()
        with _inflight_lock:
            late = [e for e in _inflight.values()
                    if now - e[2] >= HUNG_SAY_AFTER_S and now - e[3] >= HUNG_SAY_AFTER_S]
            for e in late:
                e[3] = now
        for op, path, start, _ in late:
            log.warning("shared disk: %s %s has been in progress %.0f s (a large transfer on a slow link, or a "
                        "hung mount or a server that does not answer); still waiting", op, path, now - start)


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno:
        return e.strerror or errno.errorcode.get(e.errno, str(e.errno))
    return str(e).split("\n")[0][:200]


# -- visibility: listings, never lookups of names that may not exist yet ------------------------------------------
_known_dirs: set[str] = set()   # folders this process has seen exist (listed or made); forgotten when they vanish
_known_lock = threading.Lock()


def listdir(folder: str | os.PathLike) -> list[str]:
    """The names in `folder` ([] if it does not exist). Only call it on a folder known to exist (see `exists`)."""
    store = objstore.store_for(folder)
    try:
        names = retry("list", folder, (lambda: store.listdir(folder)) if store else (lambda: os.listdir(folder)))
    except (FileNotFoundError, NotADirectoryError):
        with _known_lock:
            _known_dirs.discard(os.fspath(folder))
        return []
    with _known_lock:
        _known_dirs.add(os.fspath(folder))
    return names


def _dir_known(folder: Path) -> bool:
    with _known_lock:
        return os.fspath(folder) in _known_dirs


def exists(path: str | os.PathLike) -> bool:
    """Whether `path` exists, answered from a listing of its folder (see the module docstring): its name is looked
    up only once a listing has shown it. The folders above are checked the same way until one is known."""
    path = Path(path)
    parent = path.parent
    if parent == path:  # the root
        return True
    if not _dir_known(parent) and not exists(parent):
        return False
    return path.name in listdir(parent)


def is_file(path: str | os.PathLike) -> bool:
    """`exists(path)` and a regular file (the stat comes after a listing showed the name). A file removed between
    the listing and the stat (a round pruned by the coordinator while a worker looks for the latest commit) is not
    a file: False, not FileNotFoundError."""
    import stat as stat_

    if not exists(path):
        return False
    try:
        return stat_.S_ISREG(stat(path).st_mode)
    except FileNotFoundError:
        return False


def remember_dir(folder: str | os.PathLike) -> None:
    """Record that `folder` exists (this process made it, or was handed it as the run folder)."""
    with _known_lock:
        _known_dirs.add(os.fspath(folder))


def names(folder: str | os.PathLike) -> list[str]:
    """`listdir` for a folder that may not exist yet (checked by listing its parents first)."""
    folder = Path(folder)
    if not _dir_known(folder) and not exists(folder):
        return []
    return listdir(folder)


# -- calls that touch one file -------------------------------------------------------------------------------------
def stat(path: str | os.PathLike) -> os.stat_result:
    if (store := objstore.store_for(path)) is not None:
        return retry("stat", path, lambda: store.stat(path))
    return retry("stat", path, lambda: os.stat(path))


def read_bytes(path: str | os.PathLike) -> bytes:
    """The whole file (read again from the start after a transient error), in as few requests to the file server
    as a read can take: open, one stat, the bytes it gave, close. Python's own `open(path, "rb").read()` adds a
    tty check (an ioctl), a second stat and a read past the end (a stat again: a client without attributes cached
    asks the server when a read goes past the size it knows): 9 calls of a FUSE mount per small JSON file instead
    of 5 (bench/scale.py reads N sidecars and N leases a round). Files here are replaced whole, never rewritten in
    place, so the size at the open is the file's; an append-only file is read up to the size it had then. A file
    without a size (st_size 0: /proc, a pipe) is read to its end. On an object store: one GET."""
    if (store := objstore.store_for(path)) is not None:
        return retry("read", path, lambda: store.read_bytes(path))
    def once() -> bytes:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                return b"".join(chunks)
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:
                    break  # shorter than its stat said (replaced between the two? not by this code): what it has
                got += n
            return bytes(buf) if got == size else bytes(buf[:got])
        finally:
            os.close(fd)
    return retry("read", path, once)


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode()


def pread(fd: int, n: int, offset: int, path: str | os.PathLike) -> bytes:
    """`n` bytes at `offset` (fewer only at the end of the file), retried."""
    def once() -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = os.pread(fd, n - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    return retry("read", path, once)


def preadinto(fd: int, buf: bytearray | memoryview, offset: int, path: str | os.PathLike) -> int:
    """Fill `buf` from `offset` (returns the bytes read: fewer only at the end of the file), retried."""
    view = memoryview(buf).cast("B")

    def once() -> int:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got
    return retry("read", path, once)


def pwrite(fd: int, data, offset: int, path: str | os.PathLike) -> None:
    """Write all of `data` at `offset` (a retry writes the same bytes to the same place)."""
    view = memoryview(data).cast("B")

    def once() -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    retry("write", path, once)


def fsync(fd: int, path: str | os.PathLike) -> None:
    retry("fsync", path, lambda: os.fsync(fd))


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait


def start_writeback(fd: int, offset: int, nbytes: int, path: str | os.PathLike) -> None:
    """Start writing bytes offset..offset+nbytes of `fd` to disk without waiting (Linux's sync_file_range with
    SYNC_FILE_RANGE_WRITE), so the disk works while the writer goes on and the final fsync has little left to wait
    for. It makes nothing durable by itself: the fsync that follows does. Where that call is missing or fails
    (another OS, an error), an fdatasync of the file, retried as every fsync is, does the same job the blocking way,
    so an error is never swallowed here (the fsync after a failed writeback must not be the first to hear of it)."""
    libc = _libc()
    fn = getattr(libc, "sync_file_range", None) if libc is not None else None
    if fn is not None and fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
        return
    retry("fsync", path, lambda: os.fdatasync(fd))


def open_fd(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """os.open, retried. On an object store: for reading, a descriptor of the mirror's copy (downloaded unless
    current); for writing, the mirror file (local: published by `replace`, or uploaded by `upload_written`)."""
    if (store := objstore.store_for(path)) is not None:
        if flags & os.O_EXCL:
            raise ValueError(f"{path}: O_EXCL on an object store: use sharedfs.create_new")
        if not flags & (os.O_WRONLY | os.O_RDWR):
            return retry("open", path, lambda: store.open_read(path))
        os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
    return retry("open", path, lambda: os.open(path, flags, mode))


def upload_written(path: str | os.PathLike) -> None:
    """A file written in place under its final name (not published by `replace`): on an object store, upload it
    now (whole). Nothing on a plain disk."""
    if (store := objstore.store_for(path)) is not None:
        retry("write", path, lambda: store.note_local(Path(path), store.upload(path, path)))


def create_new(path: str | os.PathLike, data: bytes) -> bool:
    """Create `path` holding `data` only if no file has that name: True if this call created it, False if it
    existed. A plain disk: O_CREAT | O_EXCL, written and fsynced (a reader of such a file waits for its content);
    an object store: a PUT with If-None-Match: *."""
    if (store := objstore.store_for(path)) is not None:
        def put() -> bool:
            try:
                store.put_bytes(path, data, if_absent=True)
                return True
            except FileExistsError:
                return False
        return retry("create", path, put)

    def once() -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            _pwrite_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    return retry("create", path, once)


def locks_are_local(path: str | os.PathLike) -> bool:
    """True where a lock taken on `path` says nothing to other machines (an object store's mirror)."""
    return objstore.store_for(path) is not None


def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """os.replace, retried. A retry that finds `src` gone and `dst` present is the first attempt having happened
    on the server while its reply was lost (NFS's non-idempotent rename): success."""
    first = [True]
    store, from_store = objstore.store_for(dst), objstore.store_for(src)

    def once() -> None:
        try:
            if store is not None and from_store is not None:
                store.move(src, dst)  # an object renamed (server-side copy, then delete)
            elif store is not None:
                store.publish(src, dst)  # a local temp published
            elif from_store is not None:  # an object moved to a temp name: taken out of the store (then removed)
                import stat as stat_
                _take_out(from_store, src, dst, tree=stat_.S_ISDIR(from_store.stat(src).st_mode))
            else:
                os.replace(src, dst)
        except FileNotFoundError:
            if first[0] or not os.path.lexists(dst):
                raise
        finally:
            first[0] = False
    retry("rename", dst, once)


def _take_out(store, src, dst, tree: bool) -> None:
    """`replace(object, temp name)`: the mirror copy moves to the temp name, the object (or folder) is deleted."""
    try:
        os.replace(src, dst)
    except OSError:
        pass
    store.delete_tree(src) if tree else store.delete(src)


def rmtree(folder: str | os.PathLike) -> None:
    """Remove a folder and everything in it, for good, whoever made it (old rounds, uncommitted state). A plain
    disk: renamed to a temp name first (a reader never sees half a folder under its name), then removed; an
    object store: its objects deleted, markers first. Nothing if it does not exist."""
    import shutil

    folder = Path(folder)
    if (store := objstore.store_for(folder)) is not None:
        retry("remove", folder, lambda: store.delete_tree(folder))
        return
    if folder.name.startswith("."):
        shutil.rmtree(folder, ignore_errors=True)  # a temp folder of this process: nobody else reads it
        return
    trash = folder.with_name(f".{folder.name}.deleting-{os.getpid()}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


def walk_files(folder: str | os.PathLike) -> list[str]:
    """Every file under `folder`, relative to it ('/'-separated, sorted; temp names left out)."""
    if (store := objstore.store_for(folder)) is not None:
        return sorted(n for n in retry("list", folder, lambda: store.walk(folder))
                      if not any(part.startswith(".") for part in n.split("/")))
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def local_copy(path: str | os.PathLike) -> Path:
    """A path a library can open by name (transformers' from_pretrained, safetensors' safe_open, shutil): the path
    itself on a plain disk; on an object store, its mirror copy, downloaded (a folder: every file in it)."""
    if (store := objstore.store_for(path)) is not None:
        return retry("read", path, lambda: store.local_copy(path))
    return Path(path)


def publish_once(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> bool:
    """Publish the temp folder `tmp_dir` as `final_dir` only if no folder has that name yet (create-once: the first
    attempt wins). True if this call published it. A plain disk: one rename (ENOTEMPTY / EEXIST: lost; a retry
    that finds tmp gone and final there is ours); an object store: the files, then MANIFEST.json created only if
    absent."""
    if (store := objstore.store_for(final_dir)) is not None:
        return retry("publish", final_dir, lambda: store.publish(tmp_dir, final_dir, once=True))
    first = [True]

    def once() -> bool:
        try:
            os.rename(tmp_dir, final_dir)
            return True
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            if isinstance(e, FileNotFoundError) and not first[0] and os.path.isdir(final_dir):
                return True
            raise
        finally:
            first[0] = False
    return retry("rename", final_dir, once)


def server_now(folder: str | os.PathLike) -> float | None:
    """The storage's clock (for leases judged by modification times), on an object store; None on a plain disk
    (the caller touches a file there)."""
    if (store := objstore.store_for(folder)) is not None:
        return retry("clock", folder, store.server_time)
    return None


def touch(path: str | os.PathLike) -> None:
    """Set a file's modification time to now (a lease renewed). An object store: the object written again with
    the same bytes (its LastModified is the lease)."""
    if (store := objstore.store_for(path)) is not None:
        retry("touch", path, lambda: store.put_bytes(path, store.read_bytes(path)))
        return
    retry("touch", path, lambda: os.utime(path))


def unlink(path: str | os.PathLike, missing_ok: bool = True) -> None:
    if (store := objstore.store_for(path)) is not None:
        def gone() -> None:
            if not missing_ok:
                store.stat(path)  # FileNotFoundError if there is none
            store.delete(path)
        retry("unlink", path, gone)
        return

    def once() -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
    retry("unlink", path, once)


def makedirs(folder: str | os.PathLike) -> None:
    if (store := objstore.store_for(folder)) is not None:
        retry("mkdir", folder, lambda: store.make_folder(folder))
    else:
        retry("mkdir", folder, lambda: os.makedirs(folder, exist_ok=True))
    remember_dir(folder)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in `path` durable (best effort: some filesystems refuse fsync on a folder). Nothing on an
    object store (a PUT is durable when it returns)."""
    if objstore.store_for(path) is not None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        retry("fsync", path, lambda: os.fsync(fd), budget=min(_retry_s, 10.0))
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike, data: bytes | Any, *, durable: bool = True) -> None:
    """Write `data` to a new file `path` (truncating), every byte at its offset, then fsync; retried as a whole.
    On a full disk the file is truncated before the wait (its partial bytes would hold the space it waits for).
    On an object store: a temp name (a dot name, published by `replace`) is a mirror file; any other, one PUT."""
    store = objstore.store_for(path)
    if store is not None and not Path(path).name.startswith("."):
        retry("write", path, lambda: store.put_bytes(path, data))
        return
    if store is not None:
        os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
    def once() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, data)
            if durable:
                os.fsync(fd)
        except OSError as e:
            if is_disk_full(e):
                _truncate(fd)
            raise
        finally:
            os.close(fd)
    retry("write", path, once)


def _pwrite_all(fd: int, data) -> None:
    """All of `data` from offset 0 of the new file `fd` (a short write goes on where it stopped)."""
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def _truncate(fd: int, size: int = 0) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass


_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV})


def reserve(fd: int, nbytes: int, path: str | os.PathLike) -> bool:
    """Allocate `nbytes` for the new file `fd` up front (fallocate(2): the file's size becomes `nbytes`), so that
    writing it never meets a full disk halfway; on a full disk the reservation is released and the call waits
    (retry). False where the filesystem cannot allocate (NFS before 4.2, FUSE): its writes then wait for space
    where they stand, keeping what they wrote. glibc's posix_fallocate is not used: where the filesystem lacks it,
    it writes every block, which on NFS costs a second write of the whole file."""
    import ctypes

    if nbytes <= 0:
        return True
    libc = _libc()
    if libc is None:
        return False

    def once() -> bool:
        if libc.fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(nbytes)) == 0:
            return True
        err = ctypes.get_errno()
        if err in _NO_FALLOCATE:
            return False
        if err in DISK_FULL:
            _truncate(fd)
        raise OSError(err, os.strerror(err), os.fspath(path))
    return retry("reserve space for", path, once)


_libc_cache: list = []


def _libc():
    import ctypes
    import ctypes.util

    if not _libc_cache:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            lib.fallocate.restype = ctypes.c_int
            if hasattr(lib, "sync_file_range"):  # Linux only
                lib.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                lib.sync_file_range.restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _libc_cache.append(lib)
    return _libc_cache[0]


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a (small) file's bytes into a new file, both ends retried."""
    write_file(dst, read_bytes(src))


class SequentialFile:
    """A new file written front to back, each `write` a retried pwrite at the running offset (the data cache, whose
    writer produces its bytes as it goes). `close()` fsyncs; use as a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self.fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.offset = 0

    def write(self, data) -> int:
        pwrite(self.fd, data, self.offset, self.path)
        n = memoryview(data).nbytes
        self.offset += n
        return n

    def close(self, durable: bool = True) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if durable:
                fsync(fd, self.path)
        finally:
            os.close(fd)
        if durable and not Path(self.path).name.startswith("."):
            upload_written(self.path)  # an object store: the file goes up whole now

    def __enter__(self) -> "SequentialFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(durable=exc_type is None)


class PreadArray:
    """A read-only 1-d numpy view of a file that reads each slice with a retried pread (instead of np.memmap, whose
    page faults turn a soft mount's EIO into SIGBUS). Supports len() and [a:b] slices."""

    def __init__(self, path: str | os.PathLike, dtype, length: int):
        import numpy as np

        self.path, self.dtype, self.length = path, np.dtype(dtype), int(length)
        self.fd = open_fd(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        import numpy as np

        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("PreadArray supports contiguous slices only")
        a, b, _ = key.indices(self.length)
        n = max(0, b - a)
        raw = pread(self.fd, n * self.dtype.itemsize, a * self.dtype.itemsize, self.path)
        if len(raw) != n * self.dtype.itemsize:
            raise ValueError(f"{self.path}: file is shorter than its meta.json says ({self.length} tokens)")
        return np.frombuffer(raw, dtype=self.dtype)

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __getattr__(self, name: str):
        """Any other numpy attribute (max, tolist, ...) on the whole array, read once (notebooks, tests)."""
        if name.startswith("_") or name in ("path", "dtype", "length", "fd"):
            raise AttributeError(name)
        return getattr(self[:], name)

    def __del__(self) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
