"""Soak: the whole DiLoCo system for many rounds with every fault at once, its invariants checked while it runs.

    python bench/soak.py --quick                 # 4 workers, 80 rounds, 16 faults of all 11 kinds, about 5 min
    python bench/soak.py                         # 8 workers x 1000 rounds (hours; not in CI)
    python bench/soak.py --quick --seed 3 --out /tmp/soak --faults kill_worker disk_full bad_delta
    python bench/soak.py --quick --storage seaweedfs   # each process on its own `weed mount` of a real SeaweedFS
    python bench/soak.py --quick --storage s3          # BASE_DIR an s3:// bucket (SeaweedFS's S3 gateway)

What runs: the real programs, as on a cluster (README "multi-machine"): the coordinator `python diloco.py` and every
worker (`bench/soak_worker.py`: `python -m train.diloco.worker` that may publish a bad delta when told to) each under
its supervisor (`python -m train.launch.supervise`), the supervisors kept by this script as the simulator keeps them
(train/launch/procs.py LocalProcess: a killed supervisor is restarted). Every process has its own NFS-client mount
(bench/throttlefs.py via tests/helpers/fusefs.py: lookup cache 10 s, faults switched through a control file) of one
backing folder, which lies on a real small filesystem (a tmpfs of --disk-mb, when this user may mount one).

With --storage seaweedfs the shared disk is a real distributed filesystem instead (tests/helpers/seaweed.py: a
private SeaweedFS, master, volume server and filer on loopback, the `storage` extra): every process has its own
`weed mount` of one filer, under its own throttlefs mount (no lookup cache: only the fault switches), so every
fault above works there too (a full disk as ENOSPC switched on in every mount), and two more hit the storage server
itself: freeze_storage (master, volume server and filer SIGSTOPped for --freeze-s, 20 s) and restart_storage (the
filer or the volume server SIGKILLed, started again on its ports with its data after --down-s, 10 s). The checker
reads the run through a weed mount of its own.

With --storage s3 BASE_DIR is a bucket: the same private SeaweedFS with its S3 gateway (`weed s3`), every process
run with base_dir=s3://edt-runs/soak-runs, the standard AWS variables of the gateway and its own mirror folder
(EDT_S3_CACHE=DIR/machines/<name>: its own machine, sharing nothing but the bucket; train/core/objstore.py). No FUSE
is involved, so the kinds that act on a process's mount (eio_burst, hang_mount, disk_full) are left out (and refused
if asked for); freeze_storage stops the gateway too, and restart_storage picks the filer, the volume server or the
gateway. The checker reads the run from the bucket through a mirror of its own (every read through
train/core/sharedfs.py), and the disk curve is the bucket's size under the run's prefix (a LIST) with every
machine's mirror folder beside it; at the end no mirror may hold copies of more than keep_rounds + 2 pruned rounds
(a listing drops the copies of objects the bucket no longer holds).

The fault schedule (seeded by --seed) starts a fault every --gap seconds, or once --every-rounds rounds were committed
since the last one if that comes first (so a fast machine gets as many faults as a slow one), each kind once in a
shuffled order first, then at random; faults overlap (a hang lasts 60 s, a full disk 30 s). Kinds (--faults):
    kill_worker        SIGKILL of a worker (its supervisor restarts it)
    kill_supervisor    SIGKILL of a worker's supervisor (this script restarts it, as the simulator does)
    kill_coordinator   SIGKILL of the coordinator (its supervisor restarts it)
    stop_worker        SIGSTOP of a worker for dead_after_s + 5 s, then SIGCONT (a frozen GPU process)
    eio_burst          10 s of EIO on 5% of the reads, writes and fsyncs of one worker's mount (a soft mount)
    hang_mount         every call on one worker's mount blocks for 60 s (a hard mount whose server is away)
    disk_full          the backing filesystem filled for 30 s (ENOSPC on every mount), then freed
    bad_delta          a worker publishes a well-formed but bad delta: x100, sign-flipped or noise of its norm
    join               one more worker (the next free id) joins the live run
    leave              a worker leaves (SIGTERM)
    move_coordinator   the coordinator is killed and started again on another machine's mount

Invariants, checked live (every committed round as it appears, from the backing folder or the bucket) and at the end:
    - every round committed exactly once (one COMMITTED marker, never rewritten; one metrics row per round);
    - θ of every committed round equals the replay of its committed deltas (the outer step is averaging, outer.lr 1
      and momentum 0, so the replay is exact: Σ tokens·Δ in float64 in the coordinator's way; rounds pruned before
      the checker saw them are counted, not failed);
    - no data window read twice (the metrics rows' data slices);
    - every rejected or missing delta has a reason in metrics; the screen does what it says with every bad delta
      (x100 is always rejected in a round of >= 3 on-time deltas; a flipped or noise delta when its cosine with the
      others' mean is under outer.screen_min_cosine, or, with the loss screen (outer.screen_loss), in any round
      whose other deltas gained at least LOSS_PROMISE on the held-out windows; a noise delta wherever the screen's
      noise floor applied (the others' or the recent pairs' cosine over CLEAR x the floor); what became of each is
      listed);
    - a frozen worker (SIGSTOP) or one whose mount hung catches up by itself, without a restart;
    - no traceback in any log;
    - RSS of the coordinator and of each worker grows at most 10% from round 100 (--quick: a quarter of the rounds)
      to the end, open file descriptors flat, BASE_DIR's size bounded (measured on the process alive at the end,
      from the reference round or 20 rounds after it started: worker 0 is never killed, and the coordinator is
      killed or moved only in the first half of the rounds, so both are measured over the run's second half);
    - the final model loads with transformers.

Writes DIR/soak.md (the faults: when, what, what the system did; the invariants; RSS, fd and disk curves in
soak.png), DIR/soak.json, the run's timeline.png, and the logs in DIR/logs. The last line printed is
`soak: R rounds, F faults of K kinds, V invariant violations (report: DIR/soak.md)`; exit 0 when V = 0, else 1.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO

from tests.helpers.fusefs import fuse_skip_reason, nfs_mount  # one FUSE mount per process (common put REPO on path)
from tests.helpers.seaweed import seaweed_skip_reason, seaweedfs, weed_binary
from train.exchange.screen import CLEAR

KINDS = ("kill_worker", "kill_supervisor", "kill_coordinator", "stop_worker", "eio_burst", "hang_mount",
         "disk_full", "bad_delta", "join", "leave", "move_coordinator")
STORAGE_KINDS = ("freeze_storage", "restart_storage")  # --storage seaweedfs / s3: the storage server itself fails
MOUNT_KINDS = ("eio_burst", "hang_mount", "disk_full")  # act on a process's FUSE mount: none with --storage s3
BUCKET, S3_PREFIX = "edt-runs", "soak-runs"            # --storage s3: BASE_DIR = s3://BUCKET/S3_PREFIX
SAMPLE_KEYS = ("t", "round", "disk_mb", "mirror_mb")   # a sample's keys that are not a process's
BAD_KINDS = ("scale", "flip", "noise")
# the loss screen's promise (docs/protocol.md): a bad delta (its gain <= 0) is rejected wherever the others' median
# gain is over outer.screen_loss_margin / 0.25; checked with twice that (0.24 nats at the default margin of 0.03)
LOSS_PROMISE = 2 / 0.25
PROJECT = "soak"
MIN_GAP_S = 3.0  # two faults start at least this far apart, whatever --every-rounds says


# -- the run's config ------------------------------------------------------------------------------------------------
def soak_config(workers: int, rounds: int, H: int, dead_after: float, codec: str = "none") -> dict:
    """The micro Llama on the shipped corpus, a round of about a second; averaging (the exact replay); `codec`:
    outer.compression (int8, topk: θ is followed the workers' way instead, see Checker)."""
    return {
        "project_name": PROJECT, "seed": 0,
        "model": {"name": str(REPO / "configs" / "micro-llama.json"), "tokenizer": str(REPO / "data" / "tokenizer")},
        "data": {"dataset": str(REPO / "data" / "corpus"), "seq_length": 32, "eval_fraction": 0.02},
        "inner": {"lr": 3e-3, "warmup_steps": 2, "per_device_batch_size": 8, "total_batch_size": 8, "threads": 1,
                  "device": "cpu"},
        "outer": {"num_workers": workers, "min_workers": max(1, workers // 2), "rounds": rounds, "local_steps": H,
                  "lr": 1.0, "momentum": 0.0, "poll_interval_s": 0.1, "round_timeout_s": 300,
                  "dead_after_s": dead_after, "startup_grace_s": 60, "keep_rounds": 4, "max_restarts": 1000,
                  "compression": codec, "checkpoint_every": 10},
        "eval": {"batch_size": 8, "batches": 2, "every": 10},
        "logging": {"progress": False, "plot": True},
    }


# -- processes -------------------------------------------------------------------------------------------------------
def children(pid: int | None) -> list[int]:
    if pid is None:
        return []
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def proc_stats(pid: int) -> tuple[float, int] | None:
    """(RSS in MB, open fds) of a live process, None when it is gone."""
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:")) / 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


@dataclass
class Role:
    """A worker or the coordinator: its mount, control file and current LocalProcess."""
    name: str
    mount: Path | None  # None with --storage s3 (no mount: its machine's mirror is DIR/machines/<name>)
    control: Path
    proc: object = None
    busy_until: float = 0.0  # stopped / hung: not a target of another fault until then
    gone: bool = False       # left (SIGTERM) or replaced (the coordinator moved)

    def child(self) -> int | None:
        kids = children(self.proc.pid) if self.proc is not None else []
        return kids[0] if kids else None


def signal_pid(pid: int, sig: int) -> bool:
    """Send `sig`; False when the process is gone already (it ended between our look and the signal)."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def set_control(path: Path, **state) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


@dataclass
class Fault:
    t: float
    kind: str
    target: str
    detail: str = ""
    until: float | None = None
    round_at_start: int = 0
    round_at_end: int | None = None
    observed: list[str] = field(default_factory=list)
    wall: float = field(default_factory=time.time)


# -- the live checker ------------------------------------------------------------------------------------------------
class Checker:
    """Reads the backing folder (the server's view, no client cache) and checks every committed round once. Every
    read goes through train/core/sharedfs.py (and store / tensorio, built on it): on a plain folder the call itself,
    with --storage s3 a request to the bucket (`run` is then a path in the checker's own mirror, which holds only
    what those calls downloaded).

    Without a codec θ_r is replayed from θ_{r−1} and the round's deltas. With one (int8, topk) the coordinator
    writes θ only at checkpoints: the checker keeps its own copy of θ the way a worker does (train/exchange/theta.py
    GlobalTheta: θ_{r−1} + the decoded update, or the fixed-order sum of the sparse deltas, from the newest
    checkpoint when it fell behind) and checks it against each round's θ checksum in the commit record — the
    coordinator's in-place step checked by the receivers' code, on the files as they are on the server."""

    def __init__(self, run: Path, codec: str = "none", config: Path | None = None):
        self.run, self.codec, self.config = run, codec, config
        self.theta = None  # the codec runs' copy of θ (GlobalTheta), made at the first committed round
        self.seen: dict[int, str] = {}     # round -> sha256 of its COMMITTED file
        self.checked: list[int] = []
        self.unchecked: list[int] = []     # pruned before the checker saw both θ's and the deltas
        self.gone: set[int] = set()        # pruned: no marker, and older than a committed round (not read again)
        self.violations: list[str] = []
        self.tokens: dict[int, dict] = {}

    def latest(self) -> int:
        return max(self.seen) if self.seen else 0

    def poll(self) -> None:
        from train.core import sharedfs

        rounds = self.run / "rounds"
        try:
            names = sorted(sharedfs.names(rounds))
        except OSError:
            return
        for name in names:
            if not (name.startswith("r") and name[1:].isdigit()):
                continue
            r = int(name[1:])
            if r in self.gone:
                continue
            marker = rounds / name / "COMMITTED"
            try:
                data = sharedfs.read_bytes(marker)
            except FileNotFoundError:
                # a listed round without its marker, older than one committed: pruned (rounds commit in order;
                # the object store of --storage s3 may go on listing a pruned round's empty folders, and one GET
                # per such round and poll would grow with the run)
                if r < self.latest():
                    self.gone.add(r)
                continue
            except OSError:
                continue
            sha = hashlib.sha256(data).hexdigest()
            if r in self.seen:
                if self.seen[r] != sha:
                    self.violations.append(f"round {r}: its COMMITTED marker was rewritten (committed twice)")
                    self.seen[r] = sha
                continue
            self.seen[r] = sha
            if r > 0:
                try:
                    self.replay(r, json.loads(data))
                except FileNotFoundError:
                    self.unchecked.append(r)

    def replay(self, r: int, rec: dict) -> None:
        """θ_r = θ_{r-1} − mean of round r−1's accepted deltas (and late ones), bit for bit."""
        if self.codec != "none":
            return self.follow(r)
        import torch

        from train.core.store import read_json
        from train.core.tensorio import load_tensors
        from train.exchange.outer import outer_step_tensor

        prev, cur = self.run / "rounds" / f"r{r - 1:06d}", self.run / "rounds" / f"r{r:06d}"
        theta0 = load_tensors(prev / "global" / "model.safetensors")
        theta1 = load_tensors(cur / "global" / "model.safetensors")
        parts = [(prev / "deltas", w, 1.0) for w in rec["workers"]]
        for key, late in (rec.get("late") or {}).items():
            parts.append((self.run / "rounds" / f"r{late['round']:06d}" / "deltas", int(key[1:]), late["weight"]))
        acc: dict[str, torch.Tensor] = {}
        total = 0.0
        for folder, w, weight in parts:
            meta = read_json(folder / f"w{w:03d}.json")
            d = load_tensors(folder / f"w{w:03d}.safetensors")
            a = float(meta["tokens"]) * weight
            for n, t in d.items():
                t = t.to(torch.float64)
                acc[n] = t.mul_(a) if n not in acc else acc[n].add_(t, alpha=a)
            total += a
        for n, t in theta0.items():
            want, _ = outer_step_tensor(t, (acc[n] / total).to(torch.float32), None, 1.0, 0.0, True)
            if not torch.equal(want, theta1[n]):
                self.violations.append(f"round {r}: θ differs from the replay of its committed deltas ({n})")
                break
        self.checked.append(r)

    def follow(self, r: int) -> None:
        """A codec run: our copy of θ brought to round r and its checksum held against round r's commit record."""
        from train.config import load_config
        from train.core.errors import ProtocolError
        from train.exchange.master import exchange_codecs
        from train.exchange.store import DiLoCoPaths
        from train.exchange.theta import GlobalTheta

        if self.theta is None:
            cfg = load_config(str(self.config))
            self.theta = GlobalTheta(DiLoCoPaths(self.run), exchange_codecs(cfg.outer)[1], cfg.outer.fragments)
        try:
            if self.theta.round is not None and self.theta.round > r:
                self.theta.round = None  # (a round seen late: start again from its checkpoint)
            if not self.theta.buildable(r):
                self.unchecked.append(r)
                return
            self.theta.advance_to(r)
            self.theta.verify(r)
        except FileNotFoundError:
            self.unchecked.append(r)  # pruned while we read it
            self.theta.round = None
            return
        except ProtocolError as e:
            self.violations.append(f"round {r}: θ followed the workers' way differs from the coordinator's ({e})")
            self.theta.round = None
            return
        self.checked.append(r)


# -- the soak ----------------------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = Path(a.out).resolve()
        self.rng = random.Random(a.seed)
        self.t0 = time.monotonic()
        self.faults: list[Fault] = []
        self.samples: list[dict] = []      # {t, round, disk_mb, <role>: [rss, fds, pid]}
        self.bad: list[tuple[int, int, str]] = []  # (worker, round, kind)
        self.lines: list[str] = []
        self.stack = contextlib.ExitStack()
        self.fill_path: Path | None = None
        self.tmpfs = False
        self.bad_outcomes: list[str] = []
        self.healthy_rejected: list[str] = []
        self.sw = None  # --storage seaweedfs / s3: the running SeaweedFS (tests/helpers/seaweed.py)
        self.s3 = a.storage == "s3"
        self.url = f"s3://{BUCKET}/{S3_PREFIX}"  # --storage s3: every process's base_dir
        self.lister = None  # --storage s3: a client of short timeouts for the bucket's size (sample)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        line = f"[{self.now():7.1f} s] {text}"
        print(line, flush=True)
        self.lines.append(line)

    # -- set-up ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        from train.launch.procs import child_env

        if self.out.exists():
            shutil.rmtree(self.out)
        (self.out / "logs").mkdir(parents=True)
        (self.out / "control").mkdir()
        (self.out / "bad").mkdir()
        disk = self.out / "disk"
        disk.mkdir()
        if self.a.storage == "seaweedfs":
            # the run on SeaweedFS; the checker reads it through a weed mount of its own (the server's view, a
            # moment later); a full disk is ENOSPC switched on in every process's throttlefs mount
            self.sw = self.stack.enter_context(seaweedfs(self.out / "seaweed"))
            self.backing = self.sw.mount("checker")
        elif self.s3:
            # the run in a bucket of SeaweedFS's S3 gateway; the checker is one more machine: the AWS variables
            # and a mirror of its own in this process's environment, the store attached (and checked: the bucket
            # answers, conditional writes hold), every read of the run through sharedfs
            from train.core import objstore, sharedfs

            self.sw = self.stack.enter_context(seaweedfs(self.out / "seaweed", s3=True))
            self.sw.make_bucket(BUCKET)
            os.environ.update(self.sw.s3_env(), EDT_S3_CACHE=str(self.out / "machines" / "checker"))
            sharedfs.configure(600.0)  # a frozen or restarted server is waited out, never a crash of the checker
            self.backing = objstore.attach(self.url)
        elif os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.a.disk_mb}m", "tmpfs",
                                                 str(disk)], capture_output=True).returncode == 0:
            self.tmpfs = True
            self.stack.callback(lambda: subprocess.run(["umount", "-l", str(disk)], capture_output=True))
        else:
            self.say("note: cannot mount a tmpfs here (not root?): disk_full switches ENOSPC on in every mount instead")
        if self.sw is None:  # (on SeaweedFS the backing folder is the checker's weed mount or its bucket mirror)
            self.backing = disk / "export"
            self.backing.mkdir()
        self.run = self.backing / PROJECT
        cfg = soak_config(self.a.workers, self.a.rounds, self.a.local_steps, self.a.dead_after, self.a.codec)
        self.cfg_path = self.out / "evolution.json"
        self.cfg_path.write_text(json.dumps(cfg, indent=1))
        self.env = dict(child_env(1), SOAK_BAD_DELTAS=str(self.out / "bad"), OMP_NUM_THREADS="1")
        names = ["coordinator", "coordinator-b"] + [f"worker-{w}" for w in range(self.a.workers + self.a.max_joins)]
        self.roles: dict[str, Role] = {}
        for i, name in enumerate(names):
            control = self.out / "control" / f"{name}.json"
            set_control(control)
            if self.s3:
                mount = None  # its own machine: the bucket through the mirror DIR/machines/<name>
            elif self.sw is None:
                mount = self.stack.enter_context(nfs_mount(self.backing, self.out / "mnt" / name, lookup_ttl=10,
                                                           seed=i, control=control))
            else:  # its own weed mount; over it a throttlefs mount without a cache, for the fault switches only
                mount = self.stack.enter_context(nfs_mount(self.sw.mount(name), self.out / "mnt" / name,
                                                           lookup_ttl=0, seed=i, control=control))
            self.roles[name] = Role(name, mount, control)
        self.coordinator = "coordinator"
        self.next_worker = self.a.workers

    def start(self, role: Role, worker: int | None) -> None:
        from train.launch.procs import LocalProcess

        sets = ["--set", f"base_dir={self.url if self.s3 else role.mount}"]
        env = dict(self.env, EDT_S3_CACHE=str(self.machine(role.name))) if self.s3 else self.env
        if worker is None:
            argv = [sys.executable, str(REPO / "diloco.py"), "--config", str(self.cfg_path), "--no-progress", *sets]
        else:
            argv = [sys.executable, str(REPO / "bench" / "soak_worker.py"), "--config", str(self.cfg_path),
                    "--worker", str(worker), "--threads", "1", *sets]
        role.proc = LocalProcess(role.name.replace("-", " "), argv, self.out / "logs" / f"{role.name}.log", env,
                                 max_restarts=1000)
        role.proc.start()

    def machine(self, name: str) -> Path:
        """--storage s3: the machine folder of a role (its EDT_S3_CACHE: the mirror lies under it)."""
        return self.out / "machines" / name

    def workers(self, live_only: bool = True) -> list[Role]:
        now = time.monotonic()
        return [r for n, r in self.roles.items() if n.startswith("worker") and r.proc is not None and not r.gone
                and (not live_only or r.busy_until <= now)]

    # -- faults ----------------------------------------------------------------------------------------------------
    def inject(self, kind: str) -> Fault | None:
        now = time.monotonic()
        live = self.workers()
        coord = self.roles[self.coordinator]
        r = self.checker.latest()
        f = Fault(self.now(), kind, "", round_at_start=r)
        enough = len(self.workers(live_only=False)) > self.a.workers // 2 + 1  # room to lose one more
        if kind in ("kill_worker", "kill_supervisor", "stop_worker", "eio_burst", "hang_mount", "bad_delta", "leave"):
            if kind in ("kill_worker", "kill_supervisor", "leave"):  # worker 0 lives the whole run (its RSS and fds
                live = [x for x in live if x.name != "worker-0"]     # are the leak check's)
            if not live or (kind in ("stop_worker", "hang_mount", "leave") and not enough):
                return None
            role = self.rng.choice(live)
            f.target = role.name
        if kind in ("kill_coordinator", "move_coordinator") and r >= self.a.rounds // 2:
            return None  # the coordinator's second half is its leak check
        if kind == "kill_worker":
            pid = role.child()
            if pid is None:
                return None
            if not signal_pid(pid, signal.SIGKILL):
                return None
            f.detail = f"SIGKILL pid {pid}"
        elif kind == "kill_supervisor":
            pid = role.proc.pid
            if pid is None or not signal_pid(pid, signal.SIGKILL):
                return None
            f.detail = f"SIGKILL supervisor pid {pid}"
        elif kind == "kill_coordinator":
            pid = coord.child()
            if pid is None:
                return None
            if not signal_pid(pid, signal.SIGKILL):
                return None
            f.target, f.detail = coord.name, f"SIGKILL pid {pid}"
        elif kind == "stop_worker":
            pid = role.child()
            if pid is None:
                return None
            hold = self.a.dead_after + 5
            if not signal_pid(pid, signal.SIGSTOP):
                return None
            role.busy_until = now + hold + 2
            f.detail, f.until = f"SIGSTOP pid {pid} for {hold:g} s", self.now() + hold
            threading.Timer(hold, lambda: signal_pid(pid, signal.SIGCONT)).start()
        elif kind == "eio_burst":
            set_control(role.control, error_rate=0.05)
            f.detail, f.until = "EIO on 5% of reads, writes, fsyncs for 10 s", self.now() + 10
            role.busy_until = now + 10
            threading.Timer(10, lambda: set_control(role.control)).start()
        elif kind == "hang_mount":
            set_control(role.control, hang=True)
            f.detail, f.until = f"every call on its mount blocks for {self.a.hang_s:g} s", self.now() + self.a.hang_s
            role.busy_until = now + self.a.hang_s + 5
            threading.Timer(self.a.hang_s, lambda: set_control(role.control)).start()
        elif kind == "disk_full":
            if any(x.kind == "disk_full" and x.until and x.until > self.now() for x in self.faults):
                return None
            f.target = "every mount"
            f.detail, f.until = f"filesystem full for {self.a.full_s:g} s", self.now() + self.a.full_s
            f.detail += " (" + self.fill_disk() + ")"
            threading.Timer(self.a.full_s, self.free_disk).start()
        elif kind == "bad_delta":
            w = int(role.name.split("-")[1])
            rr = r + 2  # a round it has not started yet
            bad = self.rng.choice(self.a.bad_kinds)
            (self.out / "bad" / f"w{w:03d}-r{rr:06d}.json").write_text(json.dumps({"kind": bad}))
            self.bad.append((w, rr, bad))
            f.detail = f"its delta of round {rr}: {bad}"
        elif kind == "join":
            if self.next_worker >= self.a.workers + self.a.max_joins:
                return None
            role = self.roles[f"worker-{self.next_worker}"]
            self.start(role, self.next_worker)
            f.target, f.detail = role.name, f"worker {self.next_worker} joins"
            self.next_worker += 1
        elif kind == "leave":
            role.proc.signal_group(signal.SIGTERM)
            role.gone = True
            f.detail = "SIGTERM (leaves)"
        elif kind in STORAGE_KINDS:
            if any(x.kind in STORAGE_KINDS and x.until and x.until > self.now() - 5 for x in self.faults):
                return None  # one storage fault at a time
            f.target = "the storage server"
            if kind == "freeze_storage":
                self.sw.freeze()
                what = "master, volume server, filer and S3 gateway" if self.s3 else "master, volume server and filer"
                f.detail, f.until = f"{what} SIGSTOPped for {self.a.freeze_s:g} s", self.now() + self.a.freeze_s
                threading.Timer(self.a.freeze_s, self.storage_back, args=("thawed (SIGCONT)",)).start()
            else:
                server = self.rng.choice(("filer", "volume", "s3") if self.s3 else ("filer", "volume"))
                self.sw.stop_server(server)
                name = "S3 gateway" if server == "s3" else server
                f.target = f"the {name}"
                f.detail, f.until = f"SIGKILL, started again after {self.a.down_s:g} s", self.now() + self.a.down_s
                threading.Timer(self.a.down_s, self.storage_back, args=(f"{name} started again", server)).start()
        elif kind == "move_coordinator":
            other = "coordinator-b" if self.coordinator == "coordinator" else "coordinator"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(coord.proc.pid, signal.SIGKILL)
            coord.gone = True
            self.coordinator = other
            self.roles[other].gone = False
            self.start(self.roles[other], None)
            f.target, f.detail = other, (f"killed on {coord.name}'s machine, started on {other}'s (its own mirror)"
                                         if self.s3 else f"killed on {coord.name}'s mount, started on {other}'s")
        self.faults.append(f)
        self.say(f"fault {len(self.faults)}: {kind} {f.target}: {f.detail}")
        return f

    def fill_disk(self) -> str:
        if not self.tmpfs:
            for role in self.roles.values():
                set_control(role.control, enospc=True)
            return "ENOSPC switched on in every mount"
        self.fill_path = self.backing.parent / "filler"
        n = 0
        with open(self.fill_path, "wb") as fh:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    fh.write(chunk)
                    n += 1
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        return f"a {n} MB file fills the tmpfs"

    def free_disk(self) -> None:
        if not self.tmpfs:
            for role in self.roles.values():
                set_control(role.control)
        elif self.fill_path is not None:
            self.fill_path.unlink(missing_ok=True)
        self.say("disk_full: space is back")

    def storage_back(self, what: str, server: str | None = None) -> None:
        """The end of a storage fault (a timer's thread): thaw the servers, or start the killed one again."""
        try:
            if server is None:
                self.sw.thaw()
            else:
                self.sw.start_server(server)
            self.say(f"storage: {what}")
        except Exception as e:  # noqa: BLE001  (said, and the run's invariants will show what it cost)
            self.say(f"storage: could not bring it back ({what}): {e}")

    # -- the loop --------------------------------------------------------------------------------------------------
    def sample(self) -> None:
        if self.s3:  # the bucket's objects under the run's prefix; every machine's mirror folder beside them
            size = self.bucket_bytes()
            row = {"t": round(self.now(), 2), "round": self.checker.latest(),
                   "disk_mb": None if size is None else round(size / 1e6, 3),
                   "mirror_mb": {p.name: round(du(p) / 1e6, 3) for p in sorted((self.out / "machines").iterdir())
                                 if p.is_dir()}}
        else:
            row = {"t": round(self.now(), 2), "round": self.checker.latest(), "disk_mb": round(du(self.run) / 1e6, 3)}
        for name, role in self.roles.items():
            if role.proc is None or role.gone:
                continue
            pid = role.child()
            st = proc_stats(pid) if pid else None
            if st:
                row[name] = [round(st[0], 1), st[1], pid]
        self.samples.append(row)

    def bucket_bytes(self) -> int | None:
        """--storage s3: the size of every object under the run's prefix (a LIST; None when the server does not
        answer within a few seconds: a storage fault, no sample of it then). A measurement, not a read of the run
        (the checker's reads go through sharedfs): its own client, short timeouts, no retries."""
        if self.lister is None:
            import boto3
            from botocore.config import Config

            env = self.sw.s3_env()
            self.lister = boto3.client(
                "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"],
                config=Config(connect_timeout=2, read_timeout=3, retries={"max_attempts": 1}))
        total = 0
        try:
            for page in self.lister.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                               Prefix=f"{S3_PREFIX}/{PROJECT}/"):
                total += sum(int(o.get("Size", 0)) for o in page.get("Contents") or [])
        except Exception:  # noqa: BLE001  (the server is frozen or down: this sample has no size)
            return None
        return total

    def main(self) -> int:
        if self.s3:
            if (why := s3_skip_reason()):
                print(f"soak: --storage s3: {why}", file=sys.stderr)
                return 2
        elif (why := fuse_skip_reason()):
            print(f"soak: needs FUSE: {why}", file=sys.stderr)
            return 2
        if self.a.storage == "seaweedfs" and (why := seaweed_skip_reason()):
            print(f"soak: --storage seaweedfs: {why}", file=sys.stderr)
            return 2
        try:
            self.setup()
            self.checker = Checker(self.run, self.a.codec, self.cfg_path)
            self.start(self.roles["coordinator"], None)
            for w in range(self.a.workers):
                self.start(self.roles[f"worker-{w}"], w)
            kinds = list(self.a.faults)
            order = self.rng.sample(kinds, len(kinds))
            deadline = self.t0 + self.a.timeout
            next_fault = self.t0 + self.a.first_fault
            next_fault_round = 1 + self.a.every_rounds
            last_sample = 0.0
            tries: dict[str, int] = {}
            while time.monotonic() < deadline:
                self.checker.poll()
                for role in self.roles.values():
                    if role.proc is not None and not role.gone:
                        role.proc.poll()
                coord = self.roles[self.coordinator].proc
                if coord.rc is not None:
                    self.say(f"the coordinator ended: {coord.ending()}")
                    break
                if time.monotonic() - last_sample >= self.a.sample_s:
                    self.sample()
                    last_sample = time.monotonic()
                latest = self.checker.latest()
                stop_at = self.a.rounds - max(3, self.a.rounds // 10)  # the last rounds run without new faults
                due = time.monotonic() >= next_fault or (
                    latest >= next_fault_round and time.monotonic() >= next_fault - self.a.gap + MIN_GAP_S)
                if kinds and due and latest >= 1 and latest < stop_at and len(self.faults) < self.a.max_faults:
                    kind = order[0] if order else self.rng.choice(kinds)
                    done = self.inject(kind) is not None
                    if order:  # each kind once first; one that has no target now goes to the back of the line
                        order.pop(0)
                        if not done and tries.get(kind, 0) < 3:
                            tries[kind] = tries.get(kind, 0) + 1
                            order.append(kind)
                    next_fault = time.monotonic() + self.a.gap
                    next_fault_round = latest + self.a.every_rounds
                time.sleep(0.25)
            else:
                self.say(f"timeout: {self.a.timeout:g} s passed before the run finished")
            self.finish_procs()
            self.checker.poll()
            return self.report()
        finally:
            self.stack.close()

    def finish_procs(self) -> None:
        """The coordinator has ended: give the workers a moment to see DONE, then stop what is left."""
        end = time.monotonic() + 60
        for role in self.roles.values():
            if role.proc is None or role.gone:
                continue
            while role.proc.poll() is None and time.monotonic() < end:
                time.sleep(0.2)
            if role.proc.poll() is None:
                role.proc.signal_group(signal.SIGTERM)
        time.sleep(1)
        for role in self.roles.values():
            if role.proc is not None:
                role.proc.signal_group(signal.SIGKILL)

    # -- the report ------------------------------------------------------------------------------------------------
    def report(self) -> int:
        from train.core.store import read_jsonl

        from train.core import sharedfs

        violations = list(self.checker.violations)
        rows = [r for r in read_jsonl(self.run / "metrics.jsonl") if r.get("round", 0) > 0]  # ([] without one)
        rounds = [r["round"] for r in rows]
        dup = sorted({k for k in rounds if rounds.count(k) > 1})
        if dup:
            violations.append(f"rounds with more than one metrics row: {dup}")
        want = list(range(1, self.a.rounds + 1))
        if sorted(set(rounds)) != want:
            violations.append(f"committed rounds {len(set(rounds))} of {self.a.rounds} "
                              f"(missing: {sorted(set(want) - set(rounds))[:10]})")
        # no data window read twice
        seen: dict[int, str] = {}
        twice = 0
        for row in rows:
            for who, (off, n) in (row.get("data") or {}).items():
                for i in range(off, off + n):
                    if i in seen:
                        twice += 1
                    seen[i] = f"{who}@{row['round']}"
        if twice:
            violations.append(f"{twice} data windows were trained twice")
        # every rejected or missing delta has a reason
        for row in rows:
            why = row.get("missing_why") or {}
            for w in row.get("missing", []):
                if not (why.get(f"w{w:03d}") or why.get(str(w))):
                    violations.append(f"round {row['round']}: worker {w} missing without a reason")
            for w, reason in (row.get("rejected") or {}).items():
                if not reason:
                    violations.append(f"round {row['round']}: {w} rejected without a reason")
        # bad deltas: the screen must do what it says (docs/protocol.md): x100 is rejected by the norm rule
        # wherever a round has >= 3 on-time deltas; a flipped or noise delta only when its cosine with the others'
        # mean was under outer.screen_min_cosine (with nearly orthogonal healthy deltas, late in training, a flip
        # looks like any other: reported, not a violation)
        by_round = {row["round"]: row for row in rows}
        oc = json.loads(self.cfg_path.read_text()).get("outer", {})
        ratio, min_cos = float(oc.get("screen_norm_ratio", 5.0)), float(oc.get("screen_min_cosine", -0.5))
        self.bad_outcomes = []
        for w, rr, bad in self.bad:
            row = by_round.get(rr + 1)
            if row is None:
                continue
            key = f"w{w:03d}"
            seen = (row.get("screen") or {}).get(key) or {}
            late = key + f"@{rr}" in (row.get("data") or {}) or key + f"@{rr}" in ((by_round.get(rr + 2) or {})
                                                                                   .get("data") or {})
            if key in (row.get("rejected") or {}):
                self.bad_outcomes.append(f"round {rr}, worker {w}, {bad}: rejected ({row['rejected'][key]})")
                continue
            if w not in row.get("workers_used", []) and not late:
                self.bad_outcomes.append(f"round {rr}, worker {w}, {bad}: not in the round ({key} missing)")
                continue
            said = "".join(p.read_text(errors="replace") for p in (self.out / "logs").glob(f"worker-{w}*.log"))
            if f"soak: round {rr}: publishing a bad delta on purpose" not in said:  # the fault came too late
                self.bad_outcomes.append(f"round {rr}, worker {w}, {bad}: not published (the worker had written "
                                         f"its delta of round {rr} before the fault)")
                continue
            screened = len(row.get("screen") or {}) >= 3 and not late
            catchable = screened and (float(seen.get("norm_ratio", 1.0)) > ratio or 1 / max(
                float(seen.get("norm_ratio", 1.0)), 1e-12) > ratio or float(seen.get("cos", 1.0)) < min_cos)
            others = sorted(float(v["loss_gain"]) for k, v in (row.get("screen") or {}).items()
                            if k != key and "loss_gain" in v)
            ref = (others[(len(others) - 1) // 2] + others[len(others) // 2]) / 2 if others else None
            catchable = catchable or (not late and "loss_gain" in seen and ref is not None
                                      and ref >= LOSS_PROMISE * float(oc.get("screen_loss_margin", 0.03)))
            # the noise floor (train/exchange/screen.py): noise is rejected wherever the others' cosine (a round
            # of >= 3) or the recent rounds' pair cosine (a round of 2) was over CLEAR x the floor; a round of 2 may
            # say that neither delta was clearly the bad one (`pair`), which is reported, not a violation
            floor = float(seen.get("cos_floor", "inf"))
            catchable = catchable or (bad == "noise" and not late and "pair" not in seen
                                      and float(seen.get("cos_ref", 0.0)) >= CLEAR * floor)
            what = (f"averaged in{' (late: not screened)' if late else ''}: the screen saw norm ratio "
                    f"{seen.get('norm_ratio', '-')}, cosine {seen.get('cos', '-')}, loss gain "
                    f"{seen.get('loss_gain', '-')} (the others' median {'-' if ref is None else round(ref, 4)}), "
                    f"cosine floor {seen.get('cos_floor', '-')} against {seen.get('cos_ref', '-')}"
                    f"{'; ' + seen['pair'] if 'pair' in seen else ''}")
            self.bad_outcomes.append(f"round {rr}, worker {w}, {bad}: {what}")
            if catchable or (bad == "scale" and screened):
                violations.append(f"round {rr}: worker {w}'s bad delta ({bad}) was averaged in although the screen "
                                  f"saw norm ratio {seen.get('norm_ratio')}, cosine {seen.get('cos')} and loss gain "
                                  f"{seen.get('loss_gain')} (the others' median {ref})")
        # healthy deltas: the screen rejects none (docs/protocol.md: 0 in the fault-free soaks)
        bad_at = {(w, rr) for w, rr, _ in self.bad}
        self.healthy_rejected = [f"round {row['round'] - 1}, {k}: {why}" for row in rows
                                 for k, why in (row.get("rejected") or {}).items()
                                 if str(why).startswith("screen:") and (int(k.lstrip("w")), row["round"] - 1)
                                 not in bad_at]
        violations += [f"a healthy delta was screened out: {h}" for h in self.healthy_rejected]
        # tracebacks
        logs = sorted((self.out / "logs").glob("*.log"))
        if self.s3:  # logs/ of the run stays on each machine (docs/object-store.md): every machine's mirror
            logs += sorted(p for p in (self.out / "machines").rglob("*.log") if p.parent.name == "logs")
        else:
            logs += sorted((self.run / "logs").glob("*.log"))
        tb = [p.name for p in logs if "Traceback (most recent call last)" in p.read_text(errors="replace")]
        if tb:
            violations.append(f"a traceback in {', '.join(tb)}")
        # resources
        res_lines, res_violations = self.resources()
        violations += res_violations
        # the final model
        final = self.run / "final"
        shown = f"{self.url}/{PROJECT}/final" if self.s3 else final
        try:
            from transformers import AutoModelForCausalLM

            from train.core.model import quiet_transformers
            quiet_transformers()
            AutoModelForCausalLM.from_pretrained(str(sharedfs.local_copy(final)))  # (s3: downloaded to our mirror)
            final_ok = f"{shown} loads with transformers"
        except Exception as e:  # noqa: BLE001  (any failure to load is the finding)
            final_ok = f"{shown} does not load: {type(e).__name__}: {e}"
            violations.append(final_ok)
        for f in self.faults:
            self.observe(f, rows)
            if (why := self.caught_up(f)):
                violations.append(why)
        with contextlib.suppress(OSError):  # the screen's figures of every round, the run's picture
            (self.out / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n"
                                                            for r in read_jsonl(self.run / "metrics.jsonl")))
            if sharedfs.exists(self.run / "timeline.png"):
                (self.out / "timeline.png").write_bytes(sharedfs.read_bytes(self.run / "timeline.png"))
        self.plot()
        kinds = sorted({f.kind for f in self.faults})
        committed = len(set(rounds))
        md = self.markdown(committed, kinds, violations, res_lines, final_ok, rows)
        (self.out / "soak.md").write_text(md)
        (self.out / "soak.json").write_text(json.dumps({
            "rounds": committed, "faults": [f.__dict__ for f in self.faults], "violations": violations,
            "checked": len(self.checker.checked), "unchecked": len(self.checker.unchecked), "wall_s": self.now(),
            "samples": self.samples, "args": vars(self.a)}, indent=1, default=str))
        for v in violations:
            print(f"VIOLATION: {v}")
        print(f"soak: {committed} rounds, {len(self.faults)} faults of {len(kinds)} kinds, {len(violations)} "
              f"invariant violations (report: {self.out / 'soak.md'})")
        return 0 if not violations else 1

    def storage_words(self) -> str:
        if self.s3:
            return (f"BASE_DIR {self.url} on SeaweedFS's S3 gateway, each process its own mirror (EDT_S3_CACHE); "
                    f"no mounts, so no disk_full")
        return (f"{'SeaweedFS, one weed mount per process' if self.sw else 'throttlefs NFS-client mounts'}. Disk: "
                f"{'a tmpfs of %d MB' % self.a.disk_mb if self.tmpfs else 'ENOSPC switched in the mounts'}")

    def observe(self, f: Fault, rows: list[dict]) -> None:
        """What the system did: the rounds committed during the fault, the target's part in them, log lines."""
        end = f.until if f.until is not None else f.t + self.a.gap
        in_window = [s["round"] for s in self.samples if f.t <= s["t"] <= end + 5]
        f.round_at_end = max(in_window) if in_window else f.round_at_start
        f.observed.append(f"rounds {f.round_at_start} -> {f.round_at_end} committed meanwhile")
        if f.target.startswith("worker"):
            w = int(f.target.split("-")[1])
            key = f"w{w:03d}"
            missing = [(row["round"], (row.get("missing_why") or {}).get(key, "")) for row in rows
                       if f.round_at_start < row["round"] <= f.round_at_end + 2 and w in row.get("missing", [])]
            rejected = [(row["round"], row["rejected"][key]) for row in rows
                        if f.round_at_start < row["round"] <= f.round_at_end + 3 and key in (row.get("rejected") or {})]
            if missing:
                f.observed.append(f"missing from rounds {[m[0] for m in missing]} ({missing[0][1] or 'no reason'})")
            if rejected:
                f.observed.append(f"rejected in round {rejected[0][0]}: {rejected[0][1]}")
        log = self.out / "logs" / f"{f.target}.log"
        if log.exists():
            words = {"kill_worker": "restart", "kill_supervisor": "supervisor", "kill_coordinator": "restart",
                     "disk_full": "full", "leave": "leav", "join": "join"}
            word = words.get(f.kind)
            if word:
                after = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.wall - 1))
                hits = [line.strip() for line in log.read_text(errors="replace").splitlines()
                        if word in line and line[:19] >= after]  # the log's lines start with the wall time
                if hits:
                    f.observed.append(f"log: {hits[0][20:][-170:]}")

    def caught_up(self, f: Fault) -> str | None:
        """A frozen worker or one whose mount hung goes on by itself when it comes back: its next published delta
        comes before any restart (unless another fault hit it meanwhile)."""
        if f.kind not in ("stop_worker", "hang_mount") or f.until is None:
            return None
        log = self.out / "logs" / f"{f.target}.log"
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.wall))
        back = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.wall + f.until - f.t))
        for line in log.read_text(errors="replace").splitlines():
            if line[:19] < start:
                continue
            if line[:19] < back and "restart" not in line:
                continue  # (a restart while it was frozen counts; what it wrote before the fault took hold not)
            if "published delta" in line or "the run is complete" in line:
                f.observed.append(f"caught up without a restart: {line[20:][:90]}")
                return None
            if "restart" in line and ("supervise" in line or "simulator" in line):
                later = [g for g in self.faults if g is not f and g.target == f.target and g.t > f.t]
                if later and later[0].wall <= time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + 1:
                    return None  # another fault killed it first
                return f"{f.target}: restarted after {f.kind} instead of catching up ({line[20:][:120]})"
        return f"{f.target}: never published again after {f.kind}"

    def resources(self) -> tuple[list[str], list[str]]:
        lines, bad = [], []
        ref_round = 100 if self.a.rounds >= 200 else max(1, self.a.rounds // 4)
        roles = sorted({k for s in self.samples for k in s if k not in SAMPLE_KEYS})
        for name in roles:
            pts = [(s["round"], *s[name]) for s in self.samples if name in s]
            # the incarnation (one pid) alive at the end, from the reference round or 20 rounds after its start
            by_pid: dict[int, list] = {}
            for rr, rss, fds, pid in pts:
                by_pid.setdefault(pid, []).append((rr, rss, fds))
            life = by_pid[pts[-1][3]]
            start = max(ref_round, life[0][0] + 20)
            if life[-1][0] - start < 20:
                lines.append(f"| {name} | - | - | rounds {life[0][0]}-{life[-1][0]} | its last process lived too "
                             f"few rounds after round {start} to judge |")
                continue
            ref = next(p for p in life if p[0] >= start)
            last = life[-1]
            growth = last[1] / ref[1] - 1
            fd_growth = last[2] - ref[2]
            verdict = "ok"
            if growth > 0.10:
                bad.append(f"{name}: RSS grew {growth:+.0%} from round {ref[0]} to {last[0]}")
                verdict = "RSS grows"
            if fd_growth > 4:
                bad.append(f"{name}: open fds {ref[2]} -> {last[2]} from round {ref[0]} to {last[0]}")
                verdict = "fds grow"
            lines.append(f"| {name} | {ref[1]:.0f} -> {last[1]:.0f} MB ({growth:+.1%}) | {ref[2]} -> {last[2]} | "
                         f"rounds {ref[0]}-{last[0]} | {verdict} |")
        disk = [(s["round"], s["disk_mb"]) for s in self.samples if s["disk_mb"] is not None]
        if disk:
            half = [d for rr, d in disk if rr <= self.a.rounds // 2] or [0.0]
            rest = [d for rr, d in disk if rr > self.a.rounds // 2] or [0.0]
            where = f"BASE_DIR ({self.url}/{PROJECT}, the bucket's objects)" if self.s3 else "BASE_DIR"
            lines.append(f"\n{where}: at most {max(half):.1f} MB in the first half of the rounds, {max(rest):.1f} MB "
                         f"in the second")
            if max(rest) > 1.5 * max(half) + 1:
                bad.append(f"BASE_DIR grows: {max(half):.1f} MB -> {max(rest):.1f} MB")
        # --storage s3: each machine's mirror (EDT_S3_CACHE) holds copies of what it read, and a listing of a folder
        # drops the copies of objects the bucket no longer holds (docs/object-store.md), so at the end a mirror may
        # hold copies of at most keep_rounds + 2 pruned rounds (what a process had when it was killed or left, or
        # what was pruned after its last listing). Its size over the halves of the run is shown, not judged (a
        # worker that joined late starts small)
        machines = sorted({m for s in self.samples for m in s.get("mirror_mb") or {}})
        stale = self.stale_copies() if machines else {}
        keep = int(json.loads(self.cfg_path.read_text()).get("outer", {}).get("keep_rounds", 4))
        for m in machines:
            pts = [(s["round"], s["mirror_mb"][m]) for s in self.samples if m in (s.get("mirror_mb") or {})]
            half = [d for rr, d in pts if rr <= self.a.rounds // 2]
            rest = [d for rr, d in pts if rr > self.a.rounds // 2]
            n, mb = stale.get(m, (0, 0.0))
            lines.append(f"{'' if m != machines[0] else chr(10)}- mirror of {m}: at most "
                         f"{max(half) if half else 0:.1f} MB in the first half, {max(rest) if rest else 0:.1f} MB "
                         f"in the second; at the end it holds copies from {n} rounds the bucket no longer has "
                         f"({mb:.1f} MB)")
            if n > keep + 2:
                bad.append(f"the mirror of {m} holds copies from {n} pruned rounds ({mb:.1f} MB; at most "
                           f"keep_rounds + 2 = {keep + 2} expected: a listing drops them)")
        return lines, bad

    def stale_copies(self) -> dict[str, tuple[int, float]]:
        """--storage s3, at the end: per machine, the rounds whose files its mirror still holds (downloaded copies)
        although the bucket holds no object of that round any more (pruned), and their size in MB."""
        try:
            live: set[str] = set()
            for page in self.lister.get_paginator("list_objects_v2").paginate(
                    Bucket=BUCKET, Prefix=f"{S3_PREFIX}/{PROJECT}/rounds/"):
                live |= {o["Key"].split("/")[3] for o in page.get("Contents") or []}
        except Exception:  # noqa: BLE001  (no answer: nothing to say)
            return {}
        out = {}
        for machine in sorted((self.out / "machines").iterdir()):
            n, size = 0, 0
            for rounds in machine.glob(f"*/{BUCKET}/{S3_PREFIX}/{PROJECT}/rounds"):
                for folder in rounds.iterdir():
                    if folder.name in live or not folder.is_dir():
                        continue
                    files = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")]
                    if files:
                        n += 1
                        size += sum(p.stat().st_size for p in files)
            out[machine.name] = (n, size / 1e6)
        return out

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
        roles = sorted({k for s in self.samples for k in s if k not in SAMPLE_KEYS})
        for name in roles:
            t = [s["t"] for s in self.samples if name in s]
            axes[0].plot(t, [s[name][0] for s in self.samples if name in s], label=name, lw=0.8)
            axes[1].plot(t, [s[name][1] for s in self.samples if name in s], label=name, lw=0.8)
        disk = [s for s in self.samples if s["disk_mb"] is not None]
        axes[2].plot([s["t"] for s in disk], [s["disk_mb"] for s in disk], color="k", lw=0.8,
                     label="the bucket" if self.s3 else "BASE_DIR")
        for m in sorted({m for s in self.samples for m in s.get("mirror_mb") or {}}):  # --storage s3
            pts = [(s["t"], s["mirror_mb"][m]) for s in self.samples if m in (s.get("mirror_mb") or {})]
            axes[2].plot([t for t, _ in pts], [d for _, d in pts], lw=0.6, label=f"mirror of {m}")
        if self.s3:
            axes[2].legend(fontsize=6, ncol=4)
        for ax, label in zip(axes, ("RSS (MB)", "open fds",
                                    "bucket, mirrors (MB)" if self.s3 else "BASE_DIR (MB)")):
            ax.set_ylabel(label)
            for f in self.faults:
                if f.until:
                    ax.axvspan(f.t, f.until, color="tab:red", alpha=0.08)
                else:
                    ax.axvline(f.t, color="tab:red", alpha=0.3, lw=0.6)
        axes[0].legend(fontsize=6, ncol=4)
        axes[2].set_xlabel("seconds (red: faults)")
        fig.tight_layout()
        fig.savefig(self.out / "soak.png", dpi=110)
        plt.close(fig)

    def markdown(self, committed, kinds, violations, res_lines, final_ok, rows) -> str:
        a = self.a
        out = [f"# Soak: {a.workers} workers x {a.rounds} rounds, seed {a.seed}, codec {a.codec}", "",
               f"`python bench/soak.py {' '.join(sys.argv[1:])}` — {self.now():.0f} s wall, {committed} rounds "
               f"committed, {len(self.faults)} faults of {len(kinds)} kinds ({', '.join(kinds)}), "
               f"{len(violations)} invariant violations. Storage: {self.storage_words()}.", "",
               "## Faults", "", "| # | at (s) | kind | target | what | what the system did |",
               "|---|---|---|---|---|---|"]
        for i, f in enumerate(self.faults, 1):
            out.append(f"| {i} | {f.t:.0f} | {f.kind} | {f.target} | {f.detail} | {'; '.join(f.observed)} |")
        rej = sum(len(r.get("rejected") or {}) for r in rows)
        miss = sum(len(r.get("missing") or []) for r in rows)
        out += ["", "## Invariants", "",
                f"- rounds committed once: {committed} of {a.rounds}, each marker read once and never rewritten",
                ("- θ replayed bit for bit from the committed deltas: " if a.codec == "none" else
                 "- θ followed the workers' way (decoded updates / sparse sums) and its checksum equal to the "
                 "commit record's: ") + f"{len(self.checker.checked)} rounds checked, "
                f"{len(self.checker.unchecked)} pruned before the checker saw them",
                f"- deltas rejected: {rej}, missing: {miss} (each with its reason in metrics.jsonl); bad deltas "
                f"injected: {len(self.bad)}, healthy deltas screened out: {len(self.healthy_rejected)}",
                f"- final model: {final_ok}", "",
                "Bad deltas, each with what became of it:", "", *[f"- {b}" for b in self.bad_outcomes], "",
                "| process | RSS from the reference round to the end | open fds | span | verdict |",
                "|---|---|---|---|---|", *res_lines, "",
                "![RSS, fds and BASE_DIR size](soak.png)", "", "The run's timeline: ![timeline](timeline.png)", ""]
        out += ["## Violations", ""] + ([f"- {v}" for v in violations] or ["none"]) + [""]
        return "\n".join(out)


def s3_skip_reason() -> str | None:
    """None when this machine can run --storage s3 (the `weed` binary and boto3: the storage extra; no FUSE)."""
    if weed_binary() is None:
        return "no `weed` binary: install the storage extra (pip install -c requirements/lock.txt -e '.[storage]')"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "no boto3: install the storage extra (pip install -c requirements/lock.txt -e '.[storage]')"
    return None


def du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 workers, 80 rounds, 16 faults, a gap of 9 s")
    ap.add_argument("--workers", type=int, default=None, help="workers at the start (default 8; --quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 1000; --quick 80)")
    ap.add_argument("--local-steps", type=int, default=5, help="H (default %(default)s: a round of about a second)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codec", choices=("none", "int8", "topk"), default="none",
                    help="outer.compression (default none: θ replayed from the deltas; int8 / topk: θ followed the "
                         "workers' way and held against each round's checksum)")
    ap.add_argument("--out", default=None, help="the report's folder (default: a new temp folder)")
    ap.add_argument("--storage", choices=("nfs", "seaweedfs", "s3"), default="nfs",
                    help="the shared disk: nfs (default: our FUSE emulation of NFS clients, bench/throttlefs.py, over "
                         "a tmpfs), seaweedfs (a real SeaweedFS on loopback, one weed mount per process; needs the "
                         "storage extra; adds the fault kinds " + ", ".join(STORAGE_KINDS) + ") or s3 (BASE_DIR a "
                         "bucket of SeaweedFS's S3 gateway, each process its own mirror; the storage extra, no FUSE; "
                         "adds " + ", ".join(STORAGE_KINDS) + ", leaves out " + ", ".join(MOUNT_KINDS) + ")")
    ap.add_argument("--faults", nargs="+", choices=KINDS + STORAGE_KINDS, default=None, metavar="KIND",
                    help=f"fault kinds (default: all of {', '.join(KINDS)}; with --storage seaweedfs also "
                         f"{', '.join(STORAGE_KINDS)}; with --storage s3 those but {', '.join(MOUNT_KINDS)})")
    ap.add_argument("--bad-kinds", nargs="+", choices=BAD_KINDS, default=list(BAD_KINDS), metavar="KIND",
                    help=f"what a bad_delta fault publishes, drawn from these (default: all of {', '.join(BAD_KINDS)})")
    ap.add_argument("--freeze-s", type=float, default=20.0, help="how long freeze_storage lasts (default 20)")
    ap.add_argument("--down-s", type=float, default=10.0, help="how long restart_storage keeps a server down "
                                                                "(default 10)")
    ap.add_argument("--no-faults", action="store_true", help="no faults: the baseline a soak's wall time is held "
                                                               "against (same workers and rounds)")
    ap.add_argument("--gap", type=float, default=None, help="seconds between two faults (default 30; --quick 9)")
    ap.add_argument("--every-rounds", type=int, default=None,
                    help="a fault also starts once this many rounds were committed since the last one, if that "
                         "comes before --gap (default: none; --quick 4, so an idle fast box gets its 16 faults)")
    ap.add_argument("--max-faults", type=int, default=None, help="at most this many faults (default: no limit; "
                                                                  "--quick 16)")
    ap.add_argument("--dead-after", type=float, default=6.0, help="outer.dead_after_s (default %(default)s)")
    ap.add_argument("--hang-s", type=float, default=60.0, help="how long a hung mount blocks (default 60)")
    ap.add_argument("--full-s", type=float, default=30.0, help="how long the disk stays full (default 30)")
    ap.add_argument("--disk-mb", type=int, default=256, help="size of the tmpfs BASE_DIR lies on (default 256)")
    ap.add_argument("--max-joins", type=int, default=2, help="workers that may join (default 2)")
    ap.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default: 4 h; "
                                                                 "--quick 420, 900 on SeaweedFS or s3)")
    ap.add_argument("--sample-s", type=float, default=1.0, help="seconds between RSS / fd / disk samples")
    ap.add_argument("--first-fault", type=float, default=5.0, help="seconds before the first fault")
    a = ap.parse_args(argv)
    q = a.quick
    a.workers = a.workers or (4 if q else 8)
    a.rounds = a.rounds or (80 if q else 1000)
    a.gap = a.gap or (9.0 if q else 30.0)
    a.max_faults = a.max_faults or (16 if q else 10 ** 6)
    a.every_rounds = a.every_rounds or (4 if q else 10 ** 9)
    # (on SeaweedFS every call crosses two FUSE layers and the filesystem's daemons share the cores: more time)
    a.timeout = a.timeout or ((900.0 if a.storage in ("seaweedfs", "s3") else 420.0) if q else 4 * 3600.0)
    if a.faults is None:
        a.faults = [k for k in KINDS if a.storage != "s3" or k not in MOUNT_KINDS] + (
            list(STORAGE_KINDS) if a.storage in ("seaweedfs", "s3") else [])
    elif a.storage == "nfs" and set(a.faults) & set(STORAGE_KINDS):
        ap.error(f"{', '.join(STORAGE_KINDS)} need --storage seaweedfs or s3")
    elif a.storage == "s3" and (mount := [k for k in a.faults if k in MOUNT_KINDS]):
        one = len(mount) == 1  # one line, no usage block
        ap.exit(2, f"soak: --faults {' '.join(mount)}: {'acts' if one else 'act'} on a process's FUSE mount, and with "
                   f"--storage s3 no process has one (each talks to the bucket through its own mirror): leave "
                   f"{'it' if one else 'them'} out\n")
    a.out = a.out or tempfile.mkdtemp(prefix="edt-soak-")
    if a.no_faults:
        a.faults, a.max_faults = [], 0
    if a.workers < 2:
        ap.error("--workers must be >= 2 (the loss screen judges a bad delta against another's)")
    return a


if __name__ == "__main__":
    sys.exit(Soak(parse_args()).main())
