"""NFS-client emulation for tests and benches: one FUSE passthrough mount (bench/throttlefs.py) per process.

    from tests.helpers.fusefs import fuse_skip_reason, nfs_mount

    if (why := fuse_skip_reason()):
        pytest.skip(why)
    with nfs_mount(backing, tmp_path / "m0", lookup_ttl=10) as m0, nfs_mount(backing, tmp_path / "m1") as m1:
        ...   # m0 and m1 are two machines' views of one NFS export (backing)

Each mount is its own kernel FUSE superblock, so it has its own dentry cache: a name cached as absent in one mount
stays absent there for `lookup_ttl` seconds while another mount already sees it, as NFS's lookupcache=all does on
separate machines. `error_rate` makes reads, writes and fsyncs fail with EIO (a soft mount). What the emulation does
and does not show: bench/throttlefs.py's docstring.

The mount's process is killed and the mount removed when the block ends, also when it raises (a lazy unmount when
something still has files open under it). Self-contained (no conftest import), so bench/nfs.py uses it too.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
THROTTLEFS = REPO / "bench" / "throttlefs.py"


def _unescape(field: str) -> str:
    """A path from /proc/self/mounts (space, tab, newline and backslash are octal escapes there)."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def is_mounted(mountpoint: Path | str) -> bool:
    """Whether a filesystem is mounted at `mountpoint` (from /proc/self/mounts: unlike os.path.ismount this touches
    nothing under the mount, so it works when the mount's process hangs or fails its getattr)."""
    target = os.path.realpath(mountpoint)
    try:
        with open("/proc/self/mounts") as f:
            return any(_unescape(line.split()[1]) == target for line in f if len(line.split()) > 1)
    except OSError:
        return os.path.ismount(target)


def unmount(mountpoint: Path | str, lazy: bool = True) -> bool:
    """Unmount a FUSE mount (fusermount -u, fusermount3 -u, umount), then, if it is busy and `lazy`, detach it
    lazily (-uz / umount -l: gone from the tree now, freed when the last file under it closes). True when nothing is
    mounted there any more."""
    mnt = os.path.realpath(mountpoint)
    tools = [t for t in (shutil.which("fusermount"), shutil.which("fusermount3")) if t]
    attempts = [[t, "-u", mnt] for t in tools] + [["umount", mnt]]
    if lazy:
        attempts += [[t, "-uz", mnt] for t in tools] + [["umount", "-l", mnt]]
    for cmd in attempts:
        if not is_mounted(mnt):
            return True
        if shutil.which(cmd[0]) is None:
            continue
        try:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return not is_mounted(mnt)


@functools.lru_cache(maxsize=1)
def fuse_skip_reason() -> str | None:
    """None when this machine can run nfs_mount; otherwise why not, in one line (for pytest.skip). The first call
    mounts and unmounts a scratch directory (about half a second); the answer is cached."""
    if not sys.platform.startswith("linux"):
        return f"FUSE mounts need Linux (this is {sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (a container needs --device /dev/fuse, or the fuse kernel module)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    try:
        import fuse  # noqa: F401  (fusepy; loads libfuse.so.2 through ctypes)
    except ImportError:
        return "fusepy is not installed (pip install -e '.[dev]', or pip install fusepy)"
    except OSError as e:  # fusepy raises it when ctypes finds no libfuse.so.2
        return f"libfuse2 is not installed (apt-get install fuse libfuse2): {e}"
    if os.geteuid() != 0 and not (shutil.which("fusermount") or shutil.which("fusermount3")):
        return "no fusermount (apt-get install fuse) and not root: cannot mount FUSE filesystems"
    tmp = Path(tempfile.mkdtemp(prefix="edt-fuse-probe-"))
    try:
        (tmp / "b").mkdir()
        (tmp / "b" / "probe").write_text("ok")
        with nfs_mount(tmp / "b", tmp / "m", timeout=10) as m:
            if (m / "probe").read_text() != "ok":
                return "a FUSE passthrough mount works but reads back wrong data"
    except Exception as e:  # any failure means: cannot mount here; say why
        return f"cannot mount a FUSE filesystem here: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None


@contextlib.contextmanager
def nfs_mount(backing: Path, mountpoint: Path, lookup_ttl: float = 0, error_rate: float = 0.0, seed: int = 0,
              error_log: Path | None = None, mbps: float = 0, *, attr_ttl: float = 0,
              error_ops: tuple[str, ...] | None = None, timeout: float = 15, control: Path | None = None,
              count_file: Path | None = None):
    """Mount `backing` at `mountpoint` through bench/throttlefs.py (one NFS client) and yield `mountpoint` (a Path).

    lookup_ttl: seconds the kernel caches names found and names not found (entry + negative timeout).
    error_rate, seed, error_log, error_ops: EIO injection (default ops read, write, fsync), one line `op<TAB>path`
    per injected error appended to error_log. mbps: bandwidth cap in MB/s, 0 = none. attr_ttl: attribute cache.
    control: a JSON file of faults switched while the mount runs (error_rate, hang, enospc: bench/throttlefs.py).
    count_file: the mount writes its per-operation call counts there (JSON, bench/throttlefs.py --count-file).
    The mountpoint is created if missing. Raises RuntimeError with the process's stderr when the mount does not come
    up within `timeout` seconds. On exit: unmount (fusermount -u, fusermount3 -u, umount; lazily if busy), then stop
    the process (SIGTERM, then SIGKILL)."""
    backing, mountpoint = Path(backing), Path(mountpoint)
    if not backing.is_dir():
        raise FileNotFoundError(f"backing directory {backing} does not exist")
    mountpoint.mkdir(parents=True, exist_ok=True)
    if is_mounted(mountpoint):
        raise RuntimeError(f"{mountpoint} is already a mount point")
    cmd = [sys.executable, str(THROTTLEFS), str(backing), str(mountpoint), "--mbps", str(mbps),
           "--lookup-ttl", str(lookup_ttl), "--attr-ttl", str(attr_ttl)]
    if error_rate > 0:
        cmd += ["--error-rate", str(error_rate), "--seed", str(seed)]
        if error_ops:
            cmd += ["--error-ops", ",".join(error_ops)]
        if error_log is not None:
            cmd += ["--error-log", str(error_log)]
    if control is not None:
        cmd += ["--control", str(control)]
    if count_file is not None:
        cmd += ["--count-file", str(count_file)]
    # stderr to a file, not a pipe: nobody reads it while the mount runs, and a full pipe would hang the filesystem
    errf = tempfile.TemporaryFile(prefix="edt-throttlefs-")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=errf, stderr=subprocess.STDOUT,
                            start_new_session=True)  # a Ctrl-C of the test run reaches us, who unmount first

    def output() -> str:
        errf.seek(0)
        return errf.read().decode(errors="replace")[-3000:].strip()

    try:
        deadline = time.monotonic() + timeout
        while not is_mounted(mountpoint):
            if proc.poll() is not None:
                raise RuntimeError(f"throttlefs exited with code {proc.returncode} before mounting {mountpoint}: "
                                   f"{output() or '(no output)'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"throttlefs did not mount {mountpoint} within {timeout:g} s: "
                                   f"{output() or '(no output)'}")
            time.sleep(0.02)
        yield mountpoint
    finally:
        # a clean unmount ends the process; a busy mount (a file still open under it) cannot be unmounted cleanly:
        # stop the process, then detach the mount lazily (its open files then fail with ENOTCONN)
        clean = unmount(mountpoint, lazy=False)
        try:
            proc.wait(5 if clean else 0)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, sig)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
        if not clean:
            unmount(mountpoint)
        errf.close()
