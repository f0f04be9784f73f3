"""The BASE_DIR protocol: where every file lives, atomic writes, manifests, commit markers and polling.

Layout of one run (all under BASE_DIR/<project_name>/):

    run.json                       protocol version, run identity (refused if it changes), creation time
    config.json                    the effective configuration of the latest start
    metrics.jsonl                  one JSON line per round (coordinator)
    loss.png                       train / eval loss against tokens (written at the end)
    logs/coordinator.log, logs/worker-000.log, ...
    data/<key>/tokens.bin + meta.json      token cache shared by every worker (memory-mapped)
    rounds/r000003/global/         HF model directory of the global model θ_3 (+ MANIFEST.json)
    rounds/r000003/outer_state.safetensors  outer momentum (+ the coordinator's residual) after the step to θ_3
    rounds/r000003/update.safetensors       compressed runs: the update θ_3 − θ_2 every copy of θ applies; the
                                   global/ directory and outer_state then exist every outer.checkpoint_every rounds
    rounds/r000003/deltas/w000.safetensors + w000.json   pseudo-gradients computed from θ_3
    rounds/r000003/COMMITTED       atomic marker: θ_3 is complete; readers trust nothing without it
    workers/w000/state.json + opt-r000003.safetensors     inner optimizer state and data position
    workers/w000/progress.json     heartbeat: inner step, loss, pid (for progress bars and `status`)
    final/                         the final model + tokenizer (from_pretrained-loadable)

Invariants: files another process reads appear atomically (temp name in the same folder, fsync, os.replace);
a directory is complete only with its MANIFEST.json; a round is committed only by its COMMITTED marker.
Only safetensors and JSON are read from the shared disk; nothing is unpickled.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from train.core import objstore, sharedfs
from train.core.journal import append_jsonl, read_jsonl  # noqa: F401  (the protocol's journals, re-exported)
from train.core.errors import ProtocolError  # noqa: F401  (raised here)

PROTOCOL_VERSION = 1

log = logging.getLogger("store")


def exclusive_lock(path: str | os.PathLike, what: str, lease: str | os.PathLike | None = None,
                   watch_s: float = 2.5):
    """Hold an exclusive flock on `path` (NFSv4 maps it to a byte-range lock) until the returned RoleLock is
    released or the process exits: one live process per role (`what`, e.g. "worker 3", "the coordinator"). The
    holder's pid and host are written into the file for the error message of the next one.

    Where the disk has no locks (NFSv3 without lockd: flock fails with ENOLCK; mounted `nolock`, locks are local to
    each client and say nothing about other machines), the role's lease decides: `lease` is the heartbeat file of
    the role (train/core/heartbeat.py); if its `beat` changes within `watch_s` seconds, another process holds the
    role and this one stops. The lease is checked too when the lock was granted but the disk is known to grant
    locks per client only (EDT_LOCKS=local), so single-holder enforcement never silently rests on the lock."""
    import fcntl
    import socket

    path = Path(path)
    sharedfs.makedirs(path.parent)
    local = sharedfs.locks_are_local(path)  # an object store: the lock file is the mirror's, this machine's only
    f = sharedfs.retry("open", path, lambda: open(path, "a+"))

    def lock() -> bool | None:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return None  # held by another process (EAGAIN here is not the disk's: never retried)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return False  # no locks on this disk (NFSv3 mounted nolock, or without lockd)
            raise

    locked = sharedfs.retry("lock", path, lock)
    if locked is None:
        holder = (path.read_text() if local else sharedfs.read_text(path)).strip() or "pid ?"
        f.close()
        raise ProtocolError(f"{what} is already running ({holder}, lock {path}); stop it first") from None
    if not locked:
        # NFSv3 without lockd, or a filesystem without locks: the lease (heartbeat) check still stops a second
        # live process; say that the lock itself protects nothing here (docs/protocol.md "On NFS").
        log.warning("%s: file locks are not supported on this disk: one %s at a time is enforced by its lease "
                    "only", path, what)
    if local and lease is None:
        log.warning("%s: on an object store a lock holds on this machine only and %s has no lease: start one %s "
                    "at a time (docs/object-store.md)", objstore.url_of(path), what, what)
    if (not locked or local or os.environ.get("EDT_LOCKS") == "local") and lease is not None:
        holder = live_lease(Path(lease), watch_s)
        if holder:
            f.close()
            raise ProtocolError(f"{what} is already running ({holder}: its lease {lease} is beating); stop it first")
    me = f"pid {os.getpid()} on {socket.gethostname()}".encode()
    sharedfs.retry("write", path, lambda: (os.ftruncate(f.fileno(), 0), os.pwrite(f.fileno(), me, 0)))
    return RoleLock(f)


class RoleLock:
    """A held `exclusive_lock`; `release()` (idempotent) gives it back. NO_LOCK: the null object before one is
    taken, so `close()` methods call `release()` without asking."""

    def __init__(self, f=None):
        self._f = f

    def release(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            f.close()

    close = release


NO_LOCK = RoleLock()


def live_lease(lease: Path, watch_s: float) -> str | None:
    """'pid P on host H' if the heartbeat file `lease` (beat counter; train/core/heartbeat.py) is written by a live
    process other than this one: its `beat` changes within `watch_s` seconds; else None."""
    def beat() -> dict | None:
        try:
            return read_json(lease) if sharedfs.exists(lease) else None
        except (OSError, ValueError):
            return None
    first = beat()
    if not first or first.get("status") in ("exited", "left") or first.get("pid") == os.getpid():
        return None
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = beat()
        if now and now.get("beat") != first.get("beat") and now.get("status") not in ("exited", "left"):
            return f"pid {now.get('pid')} on {now.get('host')}"
    return None


# -- atomic files ---------------------------------------------------------------------------------------------------
def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


fsync_dir = sharedfs.fsync_dir


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Create `path` atomically: a temp file in the same folder (every byte at its offset, fsync), then a rename.
    The shared disk's retry policy covers each step (train/core/sharedfs.py); a failed attempt leaves no temp.
    `durable=False` (a record rewritten every second, whose loss in a server crash only makes it look older: the
    heartbeat's lease ticks): no fsync of the file or the folder, and the folder is not made again (it must exist):
    a rename is still atomic, and close() sends the bytes to an NFS server before it returns (close-to-open)."""
    path = Path(path)
    if durable:
        sharedfs.makedirs(path.parent)
    tmp = tmp_name(path)
    try:
        sharedfs.write_file(tmp, data, durable=durable)
        sharedfs.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Create `path` atomically from what `write(fileobj)` writes (collected in memory, then atomic_write_bytes)."""
    import io

    buf = io.BytesIO() if "b" in mode else io.StringIO()
    write(buf)
    data = buf.getvalue()
    atomic_write_bytes(path, data if isinstance(data, bytes) else data.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), durable=durable)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(sharedfs.read_bytes(path))


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    """A file's sha256 in hex (the launcher's fingerprints of configs and code; the protocol's checksums are
    train/core/digest.py's)."""
    from train.core.digest import feed_file

    return feed_file(hashlib.sha256(), path, bufsize).hexdigest()


# -- manifests ------------------------------------------------------------------------------------------------------
MANIFEST = "MANIFEST.json"


def write_manifest(folder: str | os.PathLike, hashes: dict[str, str] | None = None) -> dict:
    """Write MANIFEST.json listing every file of `folder` with size and checksum (last: it marks completeness).
    The checksums (train/core/digest.py) sit under the key `sha256` for the manifests of earlier runs."""
    from train.core import digest

    folder = Path(folder)
    files = {}
    for rel in sharedfs.walk_files(folder):
        if rel != MANIFEST:
            p = folder / rel
            files[rel] = {"bytes": sharedfs.stat(p).st_size,
                          "sha256": (hashes or {}).get(rel) or digest.of_file(p)}
    manifest = {"protocol": PROTOCOL_VERSION, "files": files}
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def verify_manifest(folder: str | os.PathLike, check_hashes: bool = True) -> dict:
    """Raise ProtocolError unless `folder` has a manifest whose files all exist with the recorded size/hash."""
    from train.core import digest
    folder = Path(folder)
    mpath = folder / MANIFEST
    if not sharedfs.exists(mpath):
        raise ProtocolError(f"{folder}: incomplete (no {MANIFEST})")
    manifest = read_json(mpath)
    for rel, info in manifest["files"].items():
        p = folder / rel
        if not sharedfs.exists(p) or sharedfs.stat(p).st_size != info["bytes"]:
            raise ProtocolError(f"{p}: missing or wrong size (manifest says {info['bytes']} bytes)")
        if check_hashes and digest.of_file(p, like=info["sha256"]) != info["sha256"]:
            raise ProtocolError(f"{p}: checksum differs from the manifest (corrupt or modified)")
    return manifest


def atomic_publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written temp directory into place. A stale `final_dir` (never committed) is replaced."""
    fsync_dir(tmp_dir)
    if sharedfs.exists(final_dir):
        trash = final_dir.with_name(f".{final_dir.name}.old-{uuid.uuid4().hex[:8]}")
        sharedfs.replace(final_dir, trash)
        shutil.rmtree(trash, ignore_errors=True)
    sharedfs.replace(tmp_dir, final_dir)
    sharedfs.remember_dir(final_dir)
    fsync_dir(final_dir.parent)


def new_tmp_dir(final_dir: Path) -> Path:
    sharedfs.makedirs(final_dir.parent)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    sharedfs.retry("mkdir", tmp, tmp.mkdir)
    return tmp


def publish_dir(final_dir: Path, fill: Callable[[Path], Any]) -> Any:
    """Write a folder atomically: `fill(tmp)` writes its files into a fresh temp folder beside `final_dir`, a
    MANIFEST.json is added, and the folder is moved into place (atomic_publish_dir); returns what `fill` returned.
    A transient shared-disk error anywhere in `fill` (which may call libraries such as `save_pretrained`) starts
    the whole folder again in a new temp folder, so `fill` must only read its inputs. Nothing half-written stays."""
    def once() -> Any:
        tmp = new_tmp_dir(final_dir)
        try:
            out = fill(tmp)
            write_manifest(tmp, hashes=out if isinstance(out, dict) and out and all(
                isinstance(v, str) for v in out.values()) else None)
            atomic_publish_dir(tmp, final_dir)
            return out
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return sharedfs.retry("write folder", final_dir, once, transient=sharedfs.is_transient_any, watch=False)


# -- the run's paths ------------------------------------------------------------------------------------------------
def base_path(base_dir: str | os.PathLike) -> Path:
    """The folder the protocol works in for `base_dir`: the path itself, or an s3:// URL's local mirror (its store
    attached: train/core/objstore.py)."""
    if objstore.is_url(base_dir):
        return objstore.attach(os.fspath(base_dir), check=False)
    return Path(os.path.expanduser(os.fspath(base_dir)))


def prepare_run_dir(run_dir: str | os.PathLike, source: str = "the config") -> Path:
    """Create BASE_DIR/<project>; a base_dir that is a file, lies under a file or cannot be written is a ConfigError."""
    from train.core.errors import ConfigError

    run_dir = Path(run_dir)
    store = objstore.store_for(run_dir)
    if store is not None:  # an object store: the bucket answers, takes these credentials and conditional writes
        store.check()
        sharedfs.makedirs(run_dir)
        return run_dir
    for p in [run_dir, *run_dir.parents]:
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{source}: base_dir: {p} is a file, not a folder; set base_dir (or --base-dir) to a "
                                  f"folder on the shared disk (it is created if missing)")
            break
    def probe() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        p = run_dir / f".write-test-{os.getpid()}"
        p.touch()
        p.unlink()

    try:  # a full disk or an EIO burst is the storage's passing state, not a bad base_dir: waited out, retried
        sharedfs.retry("write", run_dir, probe)  # (a worker restarted during a full disk stopped here for good)
    except (sharedfs.SharedDiskError, sharedfs.DiskFull):
        raise
    except OSError as e:
        raise ConfigError(f"{source}: base_dir: cannot write in {run_dir} ({e.strerror or e}); set base_dir to a "
                          f"writable folder on the shared disk") from None
    sharedfs.remember_dir(run_dir)
    return run_dir


class RunPaths:
    """The paths every run has under BASE_DIR/<project> (run.json, config.json, metrics, logs, data, workers/),
    whatever its strategy. Each strategy's own layout extends it: DiLoCoPaths (train/exchange/store.py: rounds,
    deltas, the global model) and EDTPaths (train/edt/store.py: generations, jobs, members)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir)

    run_json = property(lambda self: self.root / "run.json")
    config_json = property(lambda self: self.root / "config.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    plot = property(lambda self: self.root / "loss.png")
    logs = property(lambda self: self.root / "logs")
    data = property(lambda self: self.root / "data")
    final = property(lambda self: self.root / "final")

    def worker_dir(self, w: int) -> Path:
        return self.root / "workers" / f"w{w:03d}"

    def worker_state(self, w: int) -> Path:
        return self.worker_dir(w) / "state.json"

    def progress(self, w: int) -> Path:
        return self.worker_dir(w) / "progress.json"

    def worker_log(self, w: int) -> Path:
        return self.logs / f"worker-{w:03d}.log"


# -- run identity ---------------------------------------------------------------------------------------------------
def ensure_run_manifest(paths: RunPaths, identity: dict) -> dict:
    """Create run.json, or check that an existing run has our protocol version and the same identity."""
    if sharedfs.exists(paths.run_json):
        run = read_json(paths.run_json)
        if run.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{paths.run_json}: this run was written with BASE_DIR protocol version {run.get('protocol')}, "
                f"this code speaks version {PROTOCOL_VERSION}. Use the matching code version, or start a new run "
                f"(another project_name).")
        old = run.get("identity", {})
        changed = {k: (old.get(k), v) for k, v in identity.items() if k in old and old.get(k) != v}
        if changed:
            lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise ProtocolError(
                f"{paths.root}: an existing run with a different setup ({lines}). Resuming it with these changes "
                f"would mix incompatible state: restore the old values, or use another project_name.")
        return run
    run = {"protocol": PROTOCOL_VERSION, "identity": identity, "created": time.time()}
    atomic_write_json(paths.run_json, run)
    return run


# -- polling --------------------------------------------------------------------------------------------------------
def wait_for(predicate: Callable[[], Any], timeout: float | None, poll: float,
             on_poll: Callable[[], None] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy (returned) or `timeout` seconds pass (returns None)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if on_poll:
            on_poll()
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(poll)
