"""train/core/store.py: atomic writes, manifests, the run manifest, commit markers, jsonl."""
from __future__ import annotations

import json

import pytest

from train.core import digest
from train.core.store import (MANIFEST, PROTOCOL_VERSION, ProtocolError, append_jsonl, atomic_write,
                              atomic_write_bytes, atomic_write_json, ensure_run_manifest, exclusive_lock, read_json,
                              read_jsonl, sha256_file, verify_manifest, write_manifest)
from train.exchange.store import DiLoCoPaths


# -- atomic writes ---------------------------------------------------------------------------------------------------
def test_atomic_writes_leave_no_temp_files(tmp_path):
    atomic_write_bytes(tmp_path / "sub" / "a.bin", b"\x00\x01hello")
    atomic_write_json(tmp_path / "sub" / "b.json", {"x": [1, 2], "y": "z"})
    atomic_write(tmp_path / "sub" / "c.txt", lambda f: f.write("text"), mode="w")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["a.bin", "b.json", "c.txt"]
    assert (tmp_path / "sub" / "a.bin").read_bytes() == b"\x00\x01hello"
    assert read_json(tmp_path / "sub" / "b.json") == {"x": [1, 2], "y": "z"}
    assert (tmp_path / "sub" / "c.txt").read_text() == "text"
    # overwriting replaces the content and still leaves nothing else behind
    atomic_write_json(tmp_path / "sub" / "b.json", {"x": 3})
    assert read_json(tmp_path / "sub" / "b.json") == {"x": 3}
    assert len(list((tmp_path / "sub").iterdir())) == 3


def test_a_write_that_raises_leaves_the_old_file_intact(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_json(target, {"round": 1})
    before = target.read_bytes()

    def half_then_fail(f):
        f.write(b'{"round": 2, "trunc')
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the temp file is gone

    # a failing first write leaves nothing at all
    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "new.bin", half_then_fail)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]

    # an object json cannot encode fails before anything is visible
    with pytest.raises(TypeError):
        atomic_write_json(target, {"bad": object()})
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


# -- manifests -------------------------------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "global"
    (d / "nested").mkdir(parents=True)
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (d / "nested" / "extra.txt").write_text("x" * 10)
    (d / ".model.safetensors.tmp-1-abc").write_bytes(b"junk")  # a temp file is not part of the directory
    return d


def test_manifest_lists_every_file_with_size_and_hash(model_dir):
    m = write_manifest(model_dir)
    assert m["protocol"] == PROTOCOL_VERSION
    assert set(m["files"]) == {"config.json", "model.safetensors", "nested/extra.txt"}
    assert m["files"]["model.safetensors"] == {"bytes": 1024, "sha256": digest.of_file(model_dir / "model.safetensors")}
    assert read_json(model_dir / MANIFEST) == m
    assert verify_manifest(model_dir) == m


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_manifest_uses_precomputed_hashes(model_dir, algorithm):
    # sha256: a manifest written before train/core/digest.py's xxh3-128 still verifies (and still catches a change)
    f = model_dir / "model.safetensors"
    h = digest.of_file(f) if algorithm == "xxh3-128" else sha256_file(f)
    m = write_manifest(model_dir, hashes={"model.safetensors": h})
    assert m["files"]["model.safetensors"]["sha256"] == h
    verify_manifest(model_dir)
    f.write_bytes(b"\x01" + f.read_bytes()[1:])
    with pytest.raises(ProtocolError, match="model.safetensors: checksum differs"):
        verify_manifest(model_dir)


def test_verify_manifest_detects_missing_manifest(model_dir):
    with pytest.raises(ProtocolError, match=f"incomplete \\(no {MANIFEST}\\)"):
        verify_manifest(model_dir)


def test_verify_manifest_detects_a_missing_file(model_dir):
    write_manifest(model_dir)
    (model_dir / "nested" / "extra.txt").unlink()
    with pytest.raises(ProtocolError, match="extra.txt: missing or wrong size"):
        verify_manifest(model_dir)


def test_verify_manifest_detects_a_wrong_size(model_dir):
    write_manifest(model_dir)
    with open(model_dir / "model.safetensors", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(ProtocolError, match=r"model.safetensors: missing or wrong size \(manifest says 1024"):
        verify_manifest(model_dir)
    with pytest.raises(ProtocolError):
        verify_manifest(model_dir, check_hashes=False)  # size is checked even without hashing


def test_verify_manifest_detects_a_modified_byte(model_dir):
    write_manifest(model_dir)
    p = model_dir / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[500] ^= 0x01
    p.write_bytes(bytes(data))
    assert p.stat().st_size == 1024
    with pytest.raises(ProtocolError, match="model.safetensors: checksum differs"):
        verify_manifest(model_dir)
    verify_manifest(model_dir, check_hashes=False)  # the cheap check only looks at sizes


# -- run manifest ----------------------------------------------------------------------------------------------------
def test_run_manifest_is_created_then_accepted(tmp_path):
    paths = DiLoCoPaths(tmp_path / "run")
    ident = {"model": "micro", "num_workers": 2, "seq_length": 32}
    run = ensure_run_manifest(paths, ident)
    assert run["protocol"] == PROTOCOL_VERSION and run["identity"] == ident
    assert read_json(paths.run_json) == run
    again = ensure_run_manifest(paths, dict(ident))
    assert again == run  # the original, unchanged (same creation time)


def test_run_manifest_refuses_another_protocol_version(tmp_path):
    paths = DiLoCoPaths(tmp_path / "run")
    ensure_run_manifest(paths, {"model": "m"})
    run = read_json(paths.run_json)
    run["protocol"] = PROTOCOL_VERSION + 1
    paths.run_json.write_text(json.dumps(run))
    with pytest.raises(ProtocolError) as ei:
        ensure_run_manifest(paths, {"model": "m"})
    msg = str(ei.value)
    assert str(paths.run_json) in msg
    assert f"protocol version {PROTOCOL_VERSION + 1}" in msg and f"speaks version {PROTOCOL_VERSION}" in msg
    assert "project_name" in msg  # says how to get out of it


def test_run_manifest_refuses_a_changed_identity(tmp_path):
    paths = DiLoCoPaths(tmp_path / "run")
    ensure_run_manifest(paths, {"model": "micro", "num_workers": 2, "seq_length": 32})
    with pytest.raises(ProtocolError) as ei:
        ensure_run_manifest(paths, {"model": "micro", "num_workers": 4, "seq_length": 64})
    msg = str(ei.value)
    assert "num_workers: 2 -> 4" in msg and "seq_length: 32 -> 64" in msg
    assert "model" not in msg.split("(")[1].split(")")[0]  # unchanged keys are not listed
    assert "project_name" in msg
    # nothing was overwritten by the refused start
    assert read_json(paths.run_json)["identity"]["num_workers"] == 2


# -- committed rounds ------------------------------------------------------------------------------------------------
def test_committed_rounds_only_counts_rounds_with_a_marker(tmp_path):
    paths = DiLoCoPaths(tmp_path / "run")
    assert paths.committed_rounds() == [] and paths.latest_committed() is None
    for r in (0, 1, 2, 3, 11):
        paths.global_dir(r).mkdir(parents=True)
        (paths.global_dir(r) / "model.safetensors").write_bytes(b"x")
    for r in (0, 2, 11):
        atomic_write_json(paths.committed(r), {"round": r})
    (paths.round_dir(3) / "COMMITTED").mkdir()  # not a file: not a marker
    (paths.rounds / "rtmp").mkdir()
    (paths.rounds / "rtmp" / "COMMITTED").write_text("{}")
    (paths.rounds / ".r000005.tmp-1").mkdir()
    (paths.rounds / ".r000005.tmp-1" / "COMMITTED").write_text("{}")
    assert paths.committed_rounds() == [0, 2, 11]
    assert paths.latest_committed() == 11
    assert paths.round_dir(11).name == "r000011"


def test_latest_committed_from_a_hint_probes_only_later_rounds(tmp_path):
    paths = DiLoCoPaths(tmp_path / "run")
    for r in (3, 4, 5):
        atomic_write_json(paths.committed(r), {"round": r})
    assert paths.latest_committed(3) == 5 and paths.latest_committed(5) == 5
    assert paths.latest_committed(1) == 5  # a pruned (or never committed) hint: every round directory is listed
    atomic_write_json(paths.committed(6), {"round": 6})
    assert paths.latest_committed(5) == 6
    assert DiLoCoPaths(tmp_path / "empty").latest_committed(0) is None


# -- jsonl -----------------------------------------------------------------------------------------------------------
def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, {"round": 0, "loss": 5.0})
    append_jsonl(path, {"round": 1, "loss": 4.5})
    with open(path, "a") as f:
        f.write('{"round": 2, "lo')  # a crash in the middle of an append
    assert read_jsonl(path) == [{"loss": 5.0, "round": 0}, {"loss": 4.5, "round": 1}]
    assert path.read_text().count("\n") == 2


def test_append_after_a_torn_line_keeps_the_new_record(tmp_path):
    # a resumed coordinator appends after the crash: its first record must not be glued onto the fragment
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"round": 0})
    with open(path, "a") as f:
        f.write('{"round": 1, "lo')
    append_jsonl(path, {"round": 1, "loss": 4.0})
    append_jsonl(path, {"round": 2, "loss": 3.0})
    assert read_jsonl(path) == [{"round": 0}, {"loss": 4.0, "round": 1}, {"loss": 3.0, "round": 2}]


def test_exclusive_lock_admits_one_holder_and_names_it(tmp_path):
    from train.core.store import ProtocolError, exclusive_lock

    first = exclusive_lock(tmp_path / "run" / "coordinator.lock", "the coordinator")
    with pytest.raises(ProtocolError, match=r"the coordinator is already running \(pid \d+ on .*run/coordinator.lock"):
        exclusive_lock(tmp_path / "run" / "coordinator.lock", "the coordinator")
    first.close()  # released (as when the process exits): the next one gets it
    exclusive_lock(tmp_path / "run" / "coordinator.lock", "the coordinator").close()


def test_without_file_locks_the_roles_lease_decides(tmp_path, monkeypatch, caplog):
    """NFSv3 without lockd: flock fails with ENOLCK. The lock is then only advisory and the role's heartbeat lease
    decides: a lease that beats refuses a second holder; a silent (dead) one does not."""
    import errno
    import fcntl
    import threading
    import time as time_

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    lease = tmp_path / "run" / "coordinator" / "progress.json"
    atomic_write_json(lease, {"beat": 1, "pid": 999999, "host": "other", "status": "collecting"})
    stop = threading.Event()

    def beat():
        n = 1
        while not stop.wait(0.2):
            n += 1
            atomic_write_json(lease, {"beat": n, "pid": 999999, "host": "other", "status": "collecting"})
    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(ProtocolError, match="already running .*pid 999999 on other.*lease"):
            exclusive_lock(tmp_path / "run" / "coordinator.lock", "the coordinator", lease=lease, watch_s=1.5)
    finally:
        stop.set()
        t.join()
    assert "file locks are not supported" in caplog.text
    time_.sleep(0.1)
    exclusive_lock(tmp_path / "run" / "coordinator.lock", "the coordinator", lease=lease, watch_s=0.6).release()
