"""The shared disk as it really is: every process on its own NFS-like mount (FUSE, tests/helpers/fusefs.py) of one
folder.

- a 10 s lookup cache (names and "no such file" remembered per mount, as NFS's lookupcache=all on separate
  machines): the run gives the plain-disk model bit for bit, and no round waits for a cached "no such file";
- 0.2% of reads, writes and fsyncs failing with EIO (a soft mount): every process retries, exits 0, the same model;
- both simulators started from a user's own folder with a relative --config.

Skipped with the reason where FUSE cannot mount (no /dev/fuse, libfuse2, fusermount or fusepy).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TEST_THREADS, tiny_config
from tests.helpers.fusefs import fuse_skip_reason, nfs_mount
from tests.helpers.proc import kill_all
from train.core.store import RunPaths, read_jsonl
from train.core.tensorio import load_tensors

# one xdist worker: the module's shared runs; a test also pays for the fixture runs it is the first to use
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("nfs"), pytest.mark.timeout(600)]

WORKERS, ROUNDS, H = 3, 5, 6


def _config(path: Path) -> Path:
    cfg = tiny_config(path.parent / "unused", outer={"rounds": ROUNDS, "local_steps": H, "num_workers": WORKERS,
                                                      "min_workers": WORKERS})
    cfg.pop("base_dir", None)
    cfg.pop("BASE_DIR", None)
    path.write_text(json.dumps(cfg))
    return path


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(TEST_THREADS))
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)


def _run(tmp: Path, cfg: Path, name: str, mount_kw: dict | None, timeout: float = 300) -> tuple[Path, dict]:
    """Coordinator + WORKERS workers, the cluster's command lines, each process on its own mount of one backing
    folder (`mount_kw` for nfs_mount; None: all on the plain folder). Returns (run dir, {label: log text})."""
    backing = tmp / name / "backing"
    logs = tmp / name / "logs"
    backing.mkdir(parents=True)
    logs.mkdir(parents=True)
    labels = ["coordinator"] + [f"worker-{w}" for w in range(WORKERS)]
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        base = {label: backing if mount_kw is None else stack.enter_context(
            nfs_mount(backing, tmp / name / f"mnt-{label}", seed=i, error_log=logs / f"errors-{label}.txt",
                      **mount_kw)) for i, label in enumerate(labels)}
        sets = lambda label: ["--set", f"base_dir={base[label]}", "--set", "project_name=nfs"]  # noqa: E731
        try:
            procs.append(_start([str(REPO / "diloco.py"), "--config", str(cfg), "--no-progress", *sets("coordinator")],
                                logs / "coordinator.log"))
            for w in range(WORKERS):
                procs.append(_start(["-m", "train.diloco.worker", "--config", str(cfg), "--worker", str(w),
                                     "--threads", str(TEST_THREADS), *sets(f"worker-{w}")], logs / f"worker-{w}.log"))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            kill_all(procs)
    texts = {label: (logs / f"{label}.log").read_text(errors="replace") for label in labels}
    rcs = {label: p.returncode for label, p in zip(labels, procs)}
    assert all(rc == 0 for rc in rcs.values()), f"exit codes {rcs}; logs:\n" + "\n".join(
        f"--- {k}\n{v[-3000:]}" for k, v in texts.items())
    for label in labels:
        f = logs / f"errors-{label}.txt"
        texts[f"errors-{label}"] = f.read_text() if f.exists() else ""
    return backing / "nfs", texts


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_tensors(run_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def fuse_ok():
    why = fuse_skip_reason()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nfs-plain")
    cfg = _config(tmp / "evolution.json")
    run_dir, _ = _run(tmp, cfg, "plain", None)
    return cfg, run_dir, _weights(run_dir)


def _same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_lookup_cache_ttl_10s_gives_the_plain_disk_model(fuse_ok, plain_run, tmp_path):
    cfg, plain_dir, plain = plain_run
    run_dir, logs = _run(tmp_path, cfg, "ttl10", {"lookup_ttl": 10})
    _same_model(_weights(run_dir), plain)
    recs = [r for r in read_jsonl(RunPaths(run_dir).metrics) if r.get("round", 0) > 0]
    assert [r["round"] for r in recs] == list(range(1, ROUNDS + 1))  # every round once, every worker in it
    assert all(r.get("workers", WORKERS) == WORKERS or len(r.get("workers", [])) == WORKERS for r in recs)


def test_eio_on_0_2_percent_of_calls_every_process_exits_0_with_the_same_model(fuse_ok, plain_run, tmp_path):
    cfg, _, plain = plain_run
    run_dir, logs = _run(tmp_path, cfg, "eio", {"error_rate": 0.002})
    injected = sum(len(v.splitlines()) for k, v in logs.items() if k.startswith("errors-"))
    assert injected > 0, "the mounts injected no error: the test tested nothing"
    retried = sum(v.count("; retrying for up to") for k, v in logs.items() if not k.startswith("errors-"))
    assert retried > 0, "errors were injected but no process logged a retry"
    _same_model(_weights(run_dir), plain)
    print(f"EIO: {injected} errors injected, {retried} retry episodes logged, every process exited 0, "
          f"the same model")


# edt_sim.py in the long tier (CI runs it): the same resolution of a relative config, the other simulator
@pytest.mark.parametrize("sim,project", [("diloco_sim.py", "mine-diloco"),
                                         pytest.param("edt_sim.py", "mine-edt", marks=pytest.mark.long)])
def test_simulators_run_from_a_users_folder_with_a_relative_config(sim, project, tmp_path):
    """`cd myexp && python /path/to/<sim> --config my.json`: every process reads myexp/my.json (its own project),
    relative paths in it resolve next to it."""
    myexp = tmp_path / "myexp"
    myexp.mkdir()
    cfg = tiny_config(tmp_path / "ignored", outer={"rounds": 1, "local_steps": 2},
                      edt={"max_generations": 1, "mutation_steps": 2})
    cfg["base_dir"] = "runs"  # relative: next to my.json
    cfg["project_name"] = project
    cfg["data"] = {**cfg.get("data", {}), "fake_data": True}
    (myexp / "my.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, str(REPO / sim), "--config", "my.json", "--threads", str(TEST_THREADS)],
                         cwd=myexp, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (myexp / "runs" / project / "final").is_dir()
    assert not (REPO / "runs" / project).exists()
