"""The protocol on a real distributed filesystem: SeaweedFS (master, volume server, filer on loopback,
tests/helpers/seaweed.py), the coordinator and every worker on its own `weed mount` of one filer, as on separate
machines: a file created on one mount reaches the others a moment later, through the filer's metadata events.

- DiLoCo (codec none and int8) and EDT: the final model bit for bit the plain-disk run's;
- a worker SIGKILLed mid-round and started again: the same model;
- the whole storage server (master, volume server, filer) frozen for 20 s mid-run (SIGSTOP, then SIGCONT): every
  process waits, the same model, no traceback;
- the filer, and separately the volume server, killed (SIGKILL) mid-run and started again: the same.

The long tier (`python -m pytest -m long -k seaweed`; CI runs it). The default tier's tests of the same
capabilities on our own FUSE emulation of NFS clients: tests/e2e/test_nfs.py (lookup cache, EIO), test_kill.py,
test_edt_e2e.py. Skipped with the reason where FUSE or the `weed` binary (the `storage` extra) is missing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TEST_THREADS
from tests.helpers.cluster import ROUNDS, WORKERS, cluster_argv, cluster_config
from tests.helpers.proc import held, in_round_with_state, kill_all, wait_until
from tests.helpers.seaweed import SeaweedFS, seaweed_skip_reason, seaweedfs
from train.core.store import read_jsonl
from train.core.tensorio import load_tensors
from train.exchange.store import DiLoCoPaths

# one xdist worker: the plain-disk runs are module fixtures; each test starts its own SeaweedFS
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.xdist_group("seaweed"), pytest.mark.timeout(300)]

PROJECT = "sw"
STARTED = "training windows of"  # a DiLoCo worker's start line, after it restored its state (train/diloco/worker.py)


def _config(path: Path, strategy: str, codec: str = "none", **outer) -> Path:
    return cluster_config(path, codec, **outer)


def _argv(strategy: str, cfg: Path, base: Path, worker: int | None) -> list[str]:
    return cluster_argv(strategy, cfg, base, PROJECT, worker)


class Run:
    """The coordinator and WORKERS workers, the cluster's command lines, each on its own BASE_DIR path (its own
    mount); their output in local log files (never on the filesystem under test)."""

    def __init__(self, tmp: Path, cfg: Path, strategy: str, bases: dict[str, Path]):
        self.cfg, self.strategy, self.bases = cfg, strategy, bases
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True)
        self.labels = ["coordinator"] + [f"worker-{w}" for w in range(WORKERS)]
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, label: str) -> subprocess.Popen:
        worker = None if label == "coordinator" else int(label.split("-")[1])
        env = dict(os.environ, OMP_NUM_THREADS=str(TEST_THREADS))
        with open(self.logs / f"{label}.log", "ab") as f:
            self.procs[label] = subprocess.Popen(
                [sys.executable, *_argv(self.strategy, self.cfg, self.bases[label], worker)], stdout=f,
                stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        return self.procs[label]

    def log(self, label: str) -> str:
        return (self.logs / f"{label}.log").read_text(errors="replace")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)

    def check(self, sw: SeaweedFS | None = None) -> None:
        """Every process exited 0 and no log holds a traceback."""
        rcs = {label: p.returncode for label, p in self.procs.items()}
        texts = {label: self.log(label) for label in self.labels}
        why = "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in texts.items()) + ("\n" + sw.logs() if sw else "")
        assert all(rc == 0 for rc in rcs.values()), f"exit codes {rcs}; logs:\n{why}"
        assert not any("Traceback" in t for t in texts.values()), f"a traceback in a log:\n{why}"


def _run(tmp: Path, cfg: Path, strategy: str, sw: SeaweedFS | None, during=None, timeout: float = 240):
    """One run; `sw` None: every process on one plain folder. `during(run, observer)` is called once every process
    started (observer: the run's folder as the test's own mount sees it). Returns (run, the run's folder)."""
    labels = ["coordinator"] + [f"worker-{w}" for w in range(WORKERS)]
    if sw is None:
        plain = tmp / "plain"
        plain.mkdir()
        bases = {label: plain for label in labels}
        observer = plain
    else:
        bases = {label: sw.mount(label) for label in labels}
        observer = sw.mount("observer")
    run = Run(tmp, cfg, strategy, bases)
    try:
        for label in labels:
            run.start(label)
        if during is not None:
            during(run, observer / PROJECT)
        run.wait(timeout)
    finally:
        kill_all(list(run.procs.values()))
    run.check(sw)
    return run, observer / PROJECT


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_tensors(run_dir / "final" / "model.safetensors")


def _same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the plain-disk run's"


@pytest.fixture(scope="module")
def seaweed_ok():
    why = seaweed_skip_reason()
    if why:
        pytest.skip(why)


_PLAIN: dict[tuple[str, str], dict] = {}


@pytest.fixture
def plain(tmp_path_factory):
    """The plain-disk run of a (strategy, codec): its final model, run once per module."""
    def get(strategy: str, codec: str = "none") -> tuple[Path, dict]:
        tmp = tmp_path_factory.mktemp(f"plain-{strategy}-{codec}")
        cfg = _config(tmp / "evolution.json", strategy, codec)
        if (strategy, codec) not in _PLAIN:
            _, run_dir = _run(tmp, cfg, strategy, None)
            _PLAIN[(strategy, codec)] = _final(run_dir)
        return cfg, _PLAIN[(strategy, codec)]
    return get


@pytest.fixture
def sw(seaweed_ok, tmp_path):
    with seaweedfs(tmp_path / "seaweed") as s:
        yield s


def _committed(run_dir: Path, r: int) -> bool:
    return (run_dir / "rounds" / f"r{r:06d}" / "COMMITTED").is_file()


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_seaweed_diloco_gives_the_plain_disk_model(seaweed_ok, plain, sw, tmp_path, codec):
    cfg, want = plain("diloco", codec)
    _, run_dir = _run(tmp_path, cfg, "diloco", sw)
    _same_model(_final(run_dir), want)


def test_seaweed_edt_gives_the_plain_disk_model(seaweed_ok, plain, sw, tmp_path):
    cfg, want = plain("edt")
    _, run_dir = _run(tmp_path, cfg, "edt", sw)
    _same_model(_final(run_dir), want)


def test_seaweed_worker_sigkilled_mid_round_then_restarted_gives_the_plain_disk_model(seaweed_ok, plain, sw,
                                                                                      tmp_path):
    """Worker 1 killed while it trains round 2 (its round-1 state saved), started again by the test (its
    supervisor's part); the coordinator held meanwhile, so that the round waits for the restart (the event), not
    for how fast the restart is."""
    cfg, want = plain("diloco")

    def kill_worker_1(run: Run, run_dir: Path) -> None:
        paths = DiLoCoPaths(run_dir)
        wait_until(lambda: in_round_with_state(paths, 1, 2), 180, "worker 1 in round 2 with its state saved",
                   run.procs["coordinator"])
        with held(run.procs["coordinator"].pid):
            os.killpg(run.procs["worker-1"].pid, signal.SIGKILL)
            run.procs["worker-1"].wait(30)
            before = run.log("worker-1").count(STARTED)
            run.start("worker-1")
            wait_until(lambda: run.log("worker-1").count(STARTED) > before, 120, "worker 1 restarted",
                       run.procs["worker-1"])

    run, run_dir = _run(tmp_path, cfg, "diloco", sw, during=kill_worker_1)
    assert "resumed worker state" in run.log("worker-1")
    _same_model(_final(run_dir), want)


def _fault_config(tmp: Path) -> Path:
    """The plain run's config, but min_workers at its default (1): the coordinator may go on without a worker it
    judges dead, so a worker whose lease looked silent while the storage was away would change the model (the
    plain run's rounds have every worker's delta: the model does not depend on min_workers there)."""
    return _config(tmp / "evolution.json", "diloco", min_workers=1)


def _every_worker_in_every_round(run_dir: Path) -> None:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("round", 0) > 0]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert not [(r["round"], r.get("missing")) for r in rows if r.get("missing")], "a round went on without a worker"


def test_seaweed_storage_server_frozen_20s_mid_run_is_waited_out(seaweed_ok, plain, sw, tmp_path):
    """Master, volume server and filer SIGSTOPped for 20 s once round 2 is committed (the run not over): every call
    a process makes that needs the server waits, no worker is judged dead; then the run goes on to the same model,
    with no traceback."""
    _, want = plain("diloco")

    def freeze(run: Run, run_dir: Path) -> None:
        wait_until(lambda: _committed(run_dir, 2), 180, "round 2 committed", run.procs["coordinator"])
        assert not _committed(run_dir, ROUNDS), "the run ended before the freeze"
        with sw.frozen():
            time.sleep(20)  # the fault's length, not a wait for an event

    _, run_dir = _run(tmp_path, _fault_config(tmp_path), "diloco", sw, during=freeze)
    _every_worker_in_every_round(run_dir)
    _same_model(_final(run_dir), want)


@pytest.mark.parametrize("server", ["filer", "volume"])
def test_seaweed_server_killed_and_restarted_mid_run_is_ridden_out(seaweed_ok, plain, sw, tmp_path, server):
    """The filer (or the volume server) SIGKILLed once round 2 is committed, down until a process says a call
    failed (the mounts answer EIO once their own retries give up) or 15 s passed, then started again on its ports
    with its data: every process retries (sharedfs), no worker is judged dead, the same model, no traceback."""
    _, want = plain("diloco")
    retried = []

    def crash(run: Run, run_dir: Path) -> None:
        wait_until(lambda: _committed(run_dir, 2), 180, "round 2 committed", run.procs["coordinator"])
        assert not _committed(run_dir, ROUNDS), "the run ended before the crash"
        sw.stop_server(server)
        with contextlib.suppress(AssertionError):  # a process noticed, or the outage lasted 15 s: either will do
            wait_until(lambda: any("retrying for up to" in run.log(x) for x in run.labels), 15,
                       "a process retrying a call")
        sw.start_server(server)

    run, run_dir = _run(tmp_path, _fault_config(tmp_path), "diloco", sw, during=crash)
    retried += [x for x in run.labels if "retrying for up to" in run.log(x)]
    print(f"{server} killed and restarted: processes that retried a call: {retried or 'none'}")
    _every_worker_in_every_round(run_dir)
    _same_model(_final(run_dir), want)
