"""The NFS-client emulation itself (bench/throttlefs.py through tests/helpers/fusefs.py): real FUSE mounts, one per
"machine".

What the protocol tests and bench/nfs.py rely on: a name looked up before it existed stays invisible to stat() through
that mount for the lookup TTL while a listing shows it at once; without a TTL names show at once; injected EIO hits
reads at the rate asked, reproducibly for a seed, and every injected error is logged. Skipped without FUSE.
"""
from __future__ import annotations

import errno
import os
import time

import pytest

from tests.helpers.fusefs import fuse_skip_reason, is_mounted, nfs_mount


@pytest.fixture(autouse=True)
def needs_fuse():
    """Skip with the reason (no /dev/fuse, fusepy, libfuse2, fusermount, or a mount fails) when FUSE is absent."""
    why = fuse_skip_reason()
    if why:
        pytest.skip(why)


def publish(directory, name: str, text: str) -> None:
    """What the protocol does for every file: write a temp file, then rename it over the name."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / name)


def test_a_failed_lookup_hides_a_new_name_for_the_ttl_but_a_listing_shows_it(tmp_path):
    backing = tmp_path / "export"
    backing.mkdir()
    ttl = 2.0
    with nfs_mount(backing, tmp_path / "reader", lookup_ttl=ttl) as reader, \
            nfs_mount(backing, tmp_path / "writer") as writer:
        assert not (reader / "COMMITTED").exists()        # the reader's kernel now caches "no such name"
        t0 = time.monotonic()
        publish(writer, "COMMITTED", "round 1")           # another machine creates it
        assert (backing / "COMMITTED").exists() and (writer / "COMMITTED").exists()
        assert "COMMITTED" in os.listdir(reader)          # a listing sees it at once (no readdir cache) ...
        assert not (reader / "COMMITTED").exists()        # ... but the cached negative entry still answers stat()
        with pytest.raises(FileNotFoundError):
            (reader / "COMMITTED").read_text()
        time.sleep(ttl / 2)
        seen, looked = (reader / "COMMITTED").exists(), time.monotonic() - t0  # a busy box may oversleep
        assert not seen or looked >= ttl * 0.75, "visible before the negative TTL ran out"
        while not (reader / "COMMITTED").exists():
            assert time.monotonic() - t0 < ttl + 3, "still invisible long after the TTL"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= ttl * 0.75
        assert (reader / "COMMITTED").read_text() == "round 1"
        # a name the reader never looked up is found at once, TTL or not
        publish(writer, "fresh", "x")
        assert (reader / "fresh").read_text() == "x"
        # a cached positive entry, the file replaced by rename through the other mount: open() reads the new file
        publish(writer, "COMMITTED", "round 2, longer")
        assert (reader / "COMMITTED").read_text() == "round 2, longer"
        assert (reader / "COMMITTED").stat().st_size == len("round 2, longer")
        # O_CREAT on a name the reader wrongly caches as absent opens the existing file: no truncation
        assert not (reader / "log").exists()
        publish(writer, "log", "line 1\n")
        with open(reader / "log", "a") as f:
            f.write("line 2\n")
        assert (backing / "log").read_text() == "line 1\nline 2\n"
    assert not is_mounted(tmp_path / "reader") and not is_mounted(tmp_path / "writer")


def test_without_a_ttl_a_new_name_is_seen_at_once(tmp_path):
    backing = tmp_path / "export"
    backing.mkdir()
    with nfs_mount(backing, tmp_path / "a") as a, nfs_mount(backing, tmp_path / "b") as b:
        assert not (a / "x").exists()
        publish(b, "x", "1")
        assert (a / "x").exists() and (a / "x").read_text() == "1"
        publish(b, "x", "22")
        assert (a / "x").read_text() == "22"
        (b / "x").unlink()
        assert not (a / "x").exists()


def read_all(mnt, n: int) -> set[str]:
    """Read files f000..f<n-1> through mnt; the names whose read failed (with EIO, nothing else)."""
    failed = set()
    for i in range(n):
        try:
            assert (mnt / f"f{i:03d}").read_bytes() == b"x" * 100
        except OSError as e:
            assert e.errno == errno.EIO, e
            failed.add(f"f{i:03d}")
    return failed


def test_injected_eio_hits_reads_at_the_rate_reproducibly_and_is_logged(tmp_path):
    backing = tmp_path / "export"
    backing.mkdir()
    n, rate = 200, 0.2
    for i in range(n):
        (backing / f"f{i:03d}").write_bytes(b"x" * 100)  # one page each: one read call per file
    logs, runs = [], []
    for k, seed in enumerate((3, 3, 4)):
        log = tmp_path / f"errors-{k}.log"
        with nfs_mount(backing, tmp_path / f"m{k}", error_rate=rate, seed=seed, error_log=log) as m:
            runs.append(read_all(m, n))
        logs.append(log.read_text().splitlines() if log.exists() else [])
    failed = runs[0]
    assert 0.1 * n < len(failed) < 0.3 * n, f"{len(failed)} of {n} reads failed at P = {rate}"
    # each failed read is one logged error (the kernel's retry of the page is failed too, not drawn again)
    assert sorted(logs[0]) == sorted(f"read\t/{name}" for name in failed)
    assert runs[1] == failed and logs[1] == logs[0], "the same seed gave another error stream"
    assert runs[2] != failed, "another seed gave the same error stream"


def test_injected_eio_hits_writes_and_fsyncs_only_the_chosen_ops(tmp_path):
    backing = tmp_path / "export"
    backing.mkdir()
    (backing / "data").write_bytes(b"x" * 100)
    log = tmp_path / "errors.log"
    with nfs_mount(backing, tmp_path / "m", error_rate=0.5, seed=1, error_log=log,
                   error_ops=("write", "fsync")) as m:
        failures = 0
        for i in range(40):
            fd = os.open(m / f"w{i}", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"y" * 10)
                os.fsync(fd)
            except OSError as e:
                assert e.errno == errno.EIO, e
                failures += 1
            finally:
                os.close(fd)
        for _ in range(20):
            assert (m / "data").read_bytes() == b"x" * 100  # reads are not among the chosen ops
    ops = [line.split("\t")[0] for line in log.read_text().splitlines()]
    assert failures == len(ops) and 10 < failures < 40
    assert set(ops) == {"write", "fsync"}
