"""A full BASE_DIR (ENOSPC / EDQUOT) is waited out by train/core/sharedfs.py's own policy, apart from the EIO retry
budget: one line when it starts, one when space is back, and past outer.disk_full_wait_s one line and exit 2
(no traceback, not marked for a restart). Real full disks: /dev/full (every write ENOSPC) and a small tmpfs."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.helpers import REPO
from tests.helpers.tmpfs import fill, free_bytes, small_fs
from train.core import sharedfs
from train.core.store import append_jsonl, atomic_write_bytes, read_jsonl


@pytest.fixture
def quick_policy():
    """A short wait for this test; the process's policy restored after it."""
    old = (sharedfs._retry_s, sharedfs._disk_full_wait_s, sharedfs.DISK_FULL_POLL_S)
    sharedfs.DISK_FULL_POLL_S = 0.05
    yield
    sharedfs._retry_s, sharedfs._disk_full_wait_s, sharedfs.DISK_FULL_POLL_S = old
    sharedfs._full_since = None


def test_is_disk_full_sees_wrapped_errors_but_not_its_own_verdict():
    import errno

    assert sharedfs.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert sharedfs.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not sharedfs.is_disk_full(OSError(errno.EIO, "Input/output error"))
    assert sharedfs.is_disk_full(RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space" })'))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise ValueError("a library's wrapper") from e
    except ValueError as wrapped:
        assert sharedfs.is_disk_full(wrapped)
    assert not sharedfs.is_disk_full(sharedfs.DiskFull(errno.ENOSPC, "gave up"))
    assert not sharedfs.is_transient(OSError(errno.ENOSPC, "No space left on device"))  # not the EIO budget


def test_the_wait_gives_up_after_disk_full_wait_s_with_one_line_and_exit_2(tmp_path):
    """A process whose every write finds the disk full (/dev/full) waits disk_full_wait_s (small here, however
    large io_retry_s is), then stops through run_main: one line, exit 2, no traceback, no 'retryable' note for a
    supervisor (a restart would only meet the same full disk)."""
    note = tmp_path / "exit-note"
    note.write_text("")
    script = textwrap.dedent("""
        import time
        from train.core import sharedfs
        from train.core.errors import run_main

        def main():
            sharedfs.configure(0.0, 2.0)   # no EIO budget at all: the disk-full wait is a policy of its own
            sharedfs.DISK_FULL_POLL_S = 0.1
            t0 = time.monotonic()
            try:
                sharedfs.write_file("/dev/full", b"x" * 100)
            finally:
                print(f"waited {time.monotonic() - t0:.2f}", flush=True)
        run_main(main, "diskfull-test")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "EDT_EXIT_NOTE": str(note)})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    start = [ln for ln in lines if "BASE_DIR is full" in ln]
    assert len(start) == 1 and "waiting for space, up to 2 s" in start[0] and "/dev/full" in start[0], lines
    errors = [ln for ln in lines if " ERROR " in ln]
    assert len(errors) == 1 and "stayed full" in errors[0] and "outer.disk_full_wait_s" in errors[0] \
        and "run the same command again" in errors[0], lines
    assert len(lines) == 2, lines  # nothing else: no minute lines in 2 s, no "space again"
    assert float(r.stdout.split()[-1]) >= 2.0
    assert note.read_text() == "", "a disk that stayed full is not worth a restart"


def test_a_process_started_while_the_disk_is_full_waits_at_its_base_dir_check(tmp_path, quick_policy, monkeypatch):
    """The soak on SeaweedFS (bench/soak.py --storage seaweedfs, ENOSPC switched on in every mount) found a worker
    restarted during a full disk stop for good at its start-up write test of base_dir (a ConfigError: 'cannot
    write in'); the test now waits for space like every other call, and a folder that truly cannot be written is
    still a ConfigError."""
    import errno
    from pathlib import Path

    from train.core.errors import ConfigError
    from train.core.store import prepare_run_dir

    real, full = Path.touch, {"n": 3}

    def touch(self, *a, **k):
        if full["n"] > 0:
            full["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "touch", touch)
    assert prepare_run_dir(tmp_path / "runs" / "p") == tmp_path / "runs" / "p"
    assert full["n"] == 0 and not list((tmp_path / "runs" / "p").iterdir())  # waited, then the probe went
    monkeypatch.setattr(Path, "touch", lambda self, *a, **k: (_ for _ in ()).throw(
        OSError(errno.EACCES, "Permission denied", str(self))))
    with pytest.raises(ConfigError, match="cannot write in"):
        prepare_run_dir(tmp_path / "runs" / "q")


def test_a_full_tmpfs_is_waited_out_and_the_partial_file_freed(tmp_path, quick_policy, caplog):
    """On a real small filesystem: a write that meets a full disk frees its own partial bytes, waits, and succeeds
    once the filler goes; one start line and one end line; the EIO budget (0 here) is not what it waits on."""
    sharedfs.configure(0.0, 60.0)
    with small_fs(tmp_path / "fs", "4m") as mnt:
        filler = fill(mnt)
        os.truncate(filler, filler.stat().st_size - (512 << 10))  # room for half of the file: a partial write
        assert (400 << 10) < free_bytes(mnt) < (600 << 10)
        before_episodes = sharedfs.disk_full_episodes()
        data = os.urandom(1 << 20)
        done = threading.Event()
        errors: list = []

        def write():
            try:
                atomic_write_bytes(mnt / "run" / "big.bin", data)
                append_jsonl(mnt / "run" / "metrics.jsonl", {"round": 1})
            except BaseException as e:  # noqa: BLE001  (reported by the assertion below)
                errors.append(e)
            done.set()

        with caplog.at_level(logging.INFO, logger="sharedfs"):
            sharedfs.makedirs(mnt / "run")
            t = threading.Thread(target=write)
            t.start()
            deadline = time.monotonic() + 30
            while sharedfs._full_since is None and time.monotonic() < deadline:  # the event: it is waiting now
                time.sleep(0.02)
            assert sharedfs._full_since is not None, "the write never met the full disk"
            # while it waits, its temp file holds no space (it truncated what it had written)
            temps = [p for p in (mnt / "run").iterdir() if p.name.startswith(".big.bin.tmp")]
            assert all(p.stat().st_size == 0 for p in temps), [(p, p.stat().st_size) for p in temps]
            assert free_bytes(mnt) > (400 << 10)
            assert not done.is_set()
            filler.unlink()
            assert done.wait(30), "the write did not go on once there was space"
            t.join()
        assert not errors, errors
        assert (mnt / "run" / "big.bin").read_bytes() == data
        assert read_jsonl(mnt / "run" / "metrics.jsonl") == [{"round": 1}]
        assert not [p for p in (mnt / "run").iterdir() if p.name.startswith(".")]
        msgs = [r.getMessage() for r in caplog.records if r.name == "sharedfs"]
        assert sum("BASE_DIR is full" in m for m in msgs) == 1, msgs
        assert sum("BASE_DIR has space again" in m for m in msgs) == 1, msgs
        assert sharedfs.disk_full_episodes() == before_episodes + 1


def test_a_streaming_write_reserves_its_space_first(tmp_path, quick_policy):
    """A safetensors file written tensor by tensor reserves its whole size up front (fallocate): on a full disk it
    waits before writing any byte and holds nothing while it waits."""
    import torch

    from train.core.tensorio import load_tensors, save_streaming

    sharedfs.configure(0.0, 60.0)
    with small_fs(tmp_path / "fs", "4m") as mnt:
        filler = fill(mnt)
        os.truncate(filler, filler.stat().st_size - (512 << 10))  # room for half of the file
        t = {"a": torch.arange(200_000, dtype=torch.float32)}  # 800 kB
        done, errors = threading.Event(), []

        def write():
            try:
                save_streaming(mnt / "d.safetensors", t)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            done.set()

        th = threading.Thread(target=write)
        th.start()
        deadline = time.monotonic() + 30
        while sharedfs._full_since is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sharedfs._full_since is not None
        temps = [p for p in mnt.iterdir() if p.name.startswith(".d.safetensors.tmp")]
        assert all(p.stat().st_blocks == 0 for p in temps), [(p, p.stat().st_blocks) for p in temps]
        assert free_bytes(mnt) > (400 << 10)  # nothing of ours holds the space while we wait
        filler.unlink()
        assert done.wait(30)
        th.join()
        assert not errors, errors
        assert torch.equal(load_tensors(mnt / "d.safetensors")["a"], t["a"])


def test_log_lines_written_while_the_log_disk_is_full_arrive_later_whole(tmp_path):
    """A process's log is on BASE_DIR: the lines it logs while that disk is full are kept and written, in order and
    untorn, once there is space (train/core/errors.py's stderr handler)."""
    with small_fs(tmp_path / "fs", "1m") as mnt:
        log_path = mnt / "worker.log"
        script = textwrap.dedent(f"""
            import logging, os, sys
            from train.core.errors import setup_logging
            log = setup_logging("t")
            log.info("before")
            from tests.helpers.tmpfs import fill
            filler = fill(__import__("pathlib").Path({str(mnt)!r}))
            for i in range(200):
                log.info("during %03d %s", i, "y" * 100)
            os.unlink(filler)
            log.info("after")
        """)
        with open(log_path, "wb") as err:
            r = subprocess.run([sys.executable, "-c", script], cwd=REPO, stderr=err, timeout=120)
        assert r.returncode == 0
        lines = log_path.read_text().splitlines()
        body = [ln.split(" t INFO ", 1)[1] for ln in lines]
        assert body == ["before", *[f"during {i:03d} {'y' * 100}" for i in range(200)], "after"], lines[:5]
