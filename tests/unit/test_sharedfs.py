"""The shared disk's one retry policy and listing-based visibility (train/core/sharedfs.py)."""
from __future__ import annotations

import errno
import logging
import json
import os

import pytest

from train.core import sharedfs
from train.core.sharedfs import read_bytes
from train.core.errors import UserError
from train.core.store import append_jsonl, atomic_write_json, read_json, read_jsonl


class Flaky:
    """A callable that fails with `err` the first `n` times, then returns `value`."""

    def __init__(self, n: int, err: int = errno.EIO, value="ok"):
        self.n, self.err, self.value, self.calls = n, err, value, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.n:
            raise OSError(self.err, os.strerror(self.err))
        return self.value


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(sharedfs, "BACKOFF_S", 0.001)
    monkeypatch.setattr(sharedfs, "BACKOFF_CAP_S", 0.002)
    sharedfs.configure(5.0)
    yield
    sharedfs.configure(sharedfs.RETRY_S)


@pytest.mark.parametrize("err", sorted(sharedfs.TRANSIENT))
def test_transient_errors_are_retried_until_the_call_succeeds(err, caplog):
    f = Flaky(3, err)
    before = sharedfs.episodes()
    assert sharedfs.retry("read", "/x/y", f) == "ok" and f.calls == 4
    assert sharedfs.episodes() == before + 1
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "/x/y" in warnings[0].getMessage()  # one line per episode, not per try


def test_other_errors_pass_through_at_once():
    f = Flaky(1, errno.ENOENT)
    with pytest.raises(FileNotFoundError):
        sharedfs.retry("read", "/x", f)
    assert f.calls == 1


def test_after_the_budget_one_user_error_naming_the_path():
    f = Flaky(10**9)
    with pytest.raises(sharedfs.SharedDiskError) as e:
        sharedfs.retry("fsync", "/shared/run/rounds/r000001/COMMITTED", f, budget=0.05)
    assert isinstance(e.value, UserError) and e.value.retryable
    msg = str(e.value)
    assert "/shared/run/rounds/r000001/COMMITTED" in msg and "fsync" in msg and "io_retry_s" in msg
    assert "\n" not in msg


def test_a_retried_rename_that_already_happened_counts_as_done(tmp_path, monkeypatch):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_text("x")
    real = os.replace
    calls = []

    def lost_reply(a, b):  # the server did it, the client saw an error (NFS retransmission)
        if os.fspath(a) != os.fspath(src):
            return real(a, b)  # another thread's rename (a background writer of an earlier test): not ours
        calls.append(1)
        if len(calls) == 1:
            real(a, b)
            raise OSError(errno.EIO, "Input/output error")
        return real(a, b)
    monkeypatch.setattr(os, "replace", lost_reply)
    sharedfs.replace(src, dst)
    assert dst.read_text() == "x" and not src.exists() and len(calls) == 2


def test_a_retried_append_writes_its_line_once(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"round": 1})
    real = os.fsync
    state = {"failed": False}

    def fsync_fails_once(fd):  # the line is written, then its fsync fails
        if not state["failed"]:
            state["failed"] = True
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync_fails_once)
    append_jsonl(path, {"round": 2})
    assert [r["round"] for r in read_jsonl(path)] == [1, 2]


def test_atomic_write_survives_a_failed_write_and_leaves_no_temp(tmp_path, monkeypatch):
    real = os.pwrite
    state = {"n": 0}

    def pwrite_fails_once(fd, data, off):
        state["n"] += 1
        if state["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, off)
    monkeypatch.setattr(os, "pwrite", pwrite_fails_once)
    atomic_write_json(tmp_path / "c.json", {"a": 1})
    assert read_json(tmp_path / "c.json") == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_exists_answers_from_listings_and_never_looks_up_a_missing_name(tmp_path, monkeypatch):
    (tmp_path / "rounds" / "r000001").mkdir(parents=True)
    (tmp_path / "rounds" / "r000001" / "COMMITTED").write_text("{}")
    looked_up = []
    real_stat, real_lstat = os.stat, os.lstat

    def stat(p, *a, **k):
        looked_up.append(os.fspath(p))
        return real_stat(p, *a, **k)

    def lstat(p, *a, **k):
        looked_up.append(os.fspath(p))
        return real_lstat(p, *a, **k)
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)
    assert sharedfs.exists(tmp_path / "rounds" / "r000001" / "COMMITTED")
    assert not sharedfs.exists(tmp_path / "rounds" / "r000002" / "COMMITTED")
    assert not sharedfs.exists(tmp_path / "rounds" / "r000001" / "deltas" / "w000.json")
    assert not any("r000002" in p or "deltas" in p for p in looked_up), looked_up
    # a name another process creates later is seen at the next call (nothing negative is remembered)
    (tmp_path / "rounds" / "r000002").mkdir()
    (tmp_path / "rounds" / "r000002" / "COMMITTED").write_text("{}")
    assert sharedfs.exists(tmp_path / "rounds" / "r000002" / "COMMITTED")
    assert sharedfs.names(tmp_path / "nowhere") == []


def test_pread_array_reads_slices_like_a_memmap(tmp_path):
    import numpy as np

    arr = np.arange(1000, dtype=np.uint16)
    (tmp_path / "tokens.bin").write_bytes(arr.tobytes())
    pa = sharedfs.PreadArray(tmp_path / "tokens.bin", "uint16", 1000)
    assert len(pa) == 1000 and pa[10:20].tolist() == list(range(10, 20)) and pa[995:2000].tolist() == \
        list(range(995, 1000))
    assert int(pa.max()) == 999
    short = sharedfs.PreadArray(tmp_path / "tokens.bin", "uint16", 2000)
    with pytest.raises(ValueError, match="shorter"):
        short[1500:1600]


def test_json_read_is_retried(tmp_path, monkeypatch):
    (tmp_path / "x.json").write_text(json.dumps({"k": 1}))
    real_open = os.open
    state = {"n": 0}

    def open_fails_once(*a, **k):
        if os.fspath(a[0]).endswith("x.json"):
            state["n"] += 1
            if state["n"] == 1:
                raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(*a, **k)
    monkeypatch.setattr(os, "open", open_fails_once)
    assert read_json(tmp_path / "x.json") == {"k": 1} and state["n"] == 2


def test_read_bytes_gives_the_whole_file_of_any_size(tmp_path):
    """One stat and reads up to its size (no probe past the end): every byte of files of 0, 1, small and several
    MB; a file without a size (/proc) is read to its end."""
    for n in (0, 1, 536, (3 << 20) + 7):
        data = os.urandom(n)
        (tmp_path / "f").write_bytes(data)
        assert read_bytes(tmp_path / "f") == data
    assert read_bytes("/proc/self/status").startswith(b"Name:")


def test_a_process_the_shared_disk_failed_is_restarted_by_its_supervisor(tmp_path):
    """SharedDiskError: one line, exit 2 (run_main), and the supervisor restarts it (an ordinary exit 2 is final)."""
    import subprocess
    import sys

    from tests.helpers import REPO

    flag = tmp_path / "failed-once"
    child = (
        "import pathlib, sys\n"
        "from train.core import sharedfs\n"
        "from train.core.errors import run_main\n"
        f"flag = pathlib.Path({str(flag)!r})\n"
        "def main():\n"
        "    if not flag.exists():\n"
        "        flag.write_text('x')\n"
        "        sharedfs.retry('read', '/shared/run/x.json', lambda: (_ for _ in ()).throw(OSError(5, 'EIO')),"
        " budget=0.01)\n"
        "    return 0\n"
        "run_main(main, 'child')\n")
    out = subprocess.run([sys.executable, "-m", "train.launch.supervise", "--max-restarts", "2", "--name", "worker 7",
                          "--", sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "/shared/run/x.json: read kept failing" in out.stderr
    assert "worker 7 exited with status 2; restart 1/2" in out.stderr and "shared disk kept failing" in out.stderr

    user_error = "from train.core.errors import run_main, ConfigError\n" \
                 "def main():\n    raise ConfigError('evolution.json: outer.lr = -1: must be > 0')\n" \
                 "run_main(main, 'child')\n"
    out = subprocess.run([sys.executable, "-m", "train.launch.supervise", "--max-restarts", "2", "--name", "worker 7",
                          "--", sys.executable, "-c", user_error], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "restart" not in out.stderr, out.stderr


def test_is_file_of_a_file_removed_after_the_listing_is_false(tmp_path, monkeypatch):
    """A worker looking for the latest commit lists rounds/ and a round's folder, then stats its COMMITTED marker: the
    coordinator may prune that round in between (bench/scale.py hit it with 256 workers). Not a file, not an error."""
    f = tmp_path / "COMMITTED"
    monkeypatch.setattr(sharedfs, "exists", lambda path: True)  # the listing showed the name; then it went away
    assert sharedfs.is_file(f) is False


def test_start_writeback_starts_the_disk_or_falls_back_to_fdatasync(tmp_path, monkeypatch):
    """sync_file_range where Linux has it (nothing waits, the bytes stay as written); where the call is missing
    (another OS) or fails (here: a bad descriptor), an fdatasync of the file does the job, so an error reaches the
    caller the way it always did."""
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    synced = []
    monkeypatch.setattr(os, "fdatasync", synced.append)
    try:
        os.pwrite(fd, b"x" * 100_000, 0)
        sharedfs.start_writeback(fd, 0, 100_000, path)
        libc = sharedfs._libc()
        assert synced == ([] if libc is not None and hasattr(libc, "sync_file_range") else [fd])
        synced.clear()
        sharedfs.start_writeback(-1, 0, 10, path)  # EBADF from sync_file_range
        assert synced == [-1]
        monkeypatch.setattr(sharedfs, "_libc", lambda: None)
        sharedfs.start_writeback(fd, 0, 100_000, path)
        assert synced == [-1, fd]
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 100_000


def test_a_call_that_hangs_is_said_while_it_hangs_and_when_it_returns(monkeypatch, caplog):
    """A call blocked in the storage (a hung mount, a server that does not answer) gets a line while it waits, not
    only when it fails: the watchdog thread says it, and the call says when it returned."""
    import threading

    monkeypatch.setattr(sharedfs, "HUNG_SAY_AFTER_S", 0.2)
    release = threading.Event()
    said = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "has been in progress" in record.getMessage():
                said.set()
    seen = Seen()
    logging.getLogger("sharedfs").addHandler(seen)
    caplog.set_level(logging.WARNING, "sharedfs")
    try:
        t = threading.Thread(target=lambda: sharedfs.retry("read", "/nfs/run/x", lambda: release.wait(60)))
        t.start()
        assert said.wait(30), "no line while the call hung"
        release.set()
        t.join(30)
    finally:
        logging.getLogger("sharedfs").removeHandler(seen)
        release.set()
    text = caplog.text
    assert "read /nfs/run/x has been in progress" in text and "read /nfs/run/x returned after" in text


def test_a_call_that_computes_is_not_watched(monkeypatch, caplog):
    monkeypatch.setattr(sharedfs, "HUNG_SAY_AFTER_S", 0.05)
    caplog.set_level(logging.WARNING, "sharedfs")
    import time as time_
    sharedfs.retry("build the token cache in", "/nfs/run/data", lambda: time_.sleep(0.4), watch=False)
    assert "in progress" not in caplog.text and "returned" not in caplog.text
