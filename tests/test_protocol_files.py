"""BASE_DIR building blocks: atomic files, manifests, run identity, commit markers, streaming safetensors."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from train.store import (PROTOCOL_VERSION, ProtocolError, RunPaths, atomic_write, atomic_write_json,
                         ensure_run_manifest, read_jsonl, verify_manifest, write_manifest)
from train.tensorio import SequentialReader, StreamingWriter, save_streaming


def test_atomic_write_leaves_no_temp_and_keeps_old_file_on_error(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"v": 1})
    with pytest.raises(RuntimeError):
        def boom(f):
            f.write(b"partial")
            raise RuntimeError("crash mid-write")
        atomic_write(p, boom)
    assert json.loads(p.read_text()) == {"v": 1}
    assert [x.name for x in tmp_path.iterdir()] == ["a.json"]


def test_manifest_detects_missing_wrong_size_and_modified_byte(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "a.bin").write_bytes(b"x" * 100)
    (d / "sub").mkdir()
    (d / "sub" / "b.txt").write_text("hello")
    write_manifest(d)
    verify_manifest(d)
    (d / "a.bin").write_bytes(b"x" * 99 + b"y")  # same size, one byte changed
    with pytest.raises(ProtocolError, match="sha256 differs"):
        verify_manifest(d)
    (d / "a.bin").write_bytes(b"x" * 10)
    with pytest.raises(ProtocolError, match="wrong size"):
        verify_manifest(d)
    (d / "a.bin").unlink()
    with pytest.raises(ProtocolError, match="missing"):
        verify_manifest(d)
    with pytest.raises(ProtocolError, match="incomplete"):
        verify_manifest(tmp_path)


def test_run_manifest_refuses_other_protocol_and_changed_identity(tmp_path):
    paths = RunPaths(tmp_path / "run")
    ensure_run_manifest(paths, {"model": "a", "num_workers": 2})
    ensure_run_manifest(paths, {"model": "a", "num_workers": 2})  # same: fine
    with pytest.raises(ProtocolError, match="num_workers: 2 -> 4"):
        ensure_run_manifest(paths, {"model": "a", "num_workers": 4})
    run = json.loads(paths.run_json.read_text())
    run["protocol"] = PROTOCOL_VERSION + 1
    paths.run_json.write_text(json.dumps(run))
    with pytest.raises(ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        ensure_run_manifest(paths, {"model": "a", "num_workers": 2})


def test_only_rounds_with_a_marker_count(tmp_path):
    paths = RunPaths(tmp_path)
    for r in (0, 1, 2):
        paths.global_dir(r).mkdir(parents=True)
    atomic_write_json(paths.committed(0), {})
    atomic_write_json(paths.committed(1), {})
    assert paths.committed_rounds() == [0, 1] and paths.latest_committed() == 1


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert read_jsonl(p) == [{"round": 1}, {"round": 2}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_streaming_writer_roundtrip_and_hash(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"b": (torch.randn(3, 5, generator=g) * 10).to(dtype), "a": torch.randn(7, generator=g).to(dtype),
               "empty": torch.zeros(0, 4, dtype=dtype)}
    p = tmp_path / "t.safetensors"
    sha = save_streaming(p, tensors, {"k": "v"})
    loaded = load_file(str(p))
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v)
    assert sha == hashlib.sha256(p.read_bytes()).hexdigest()
    rd = SequentialReader(p)
    got = {n: rd.read(n).clone() for n in rd.names_in_order}
    assert rd.finish() == sha and rd.metadata == {"k": "v"}
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_streaming_writer_rejects_misuse_and_leaves_nothing(tmp_path):
    p = tmp_path / "t.safetensors"
    specs = {"a": (torch.float32, (2,)), "b": (torch.float32, (3,))}
    with pytest.raises(ValueError, match="expected tensor 'a' next"):
        with StreamingWriter(p, specs) as w:
            w.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="declared"):
        with StreamingWriter(p, specs) as w:
            w.write("a", torch.zeros(5))
    with pytest.raises(ValueError, match="only 1/2 tensors"):
        with StreamingWriter(p, specs) as w:
            w.write("a", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_sequential_reader_detects_truncation_and_order(tmp_path):
    p = tmp_path / "t.safetensors"
    save_streaming(p, {"a": torch.ones(100), "b": torch.ones(100)})
    rd = SequentialReader(p)
    with pytest.raises(ValueError, match="not next in file order"):
        rd.read("b")
    rd.close()
    p.write_bytes(p.read_bytes()[:-50])
    rd = SequentialReader(p)
    rd.read("a")
    with pytest.raises(ValueError, match="truncated"):
        rd.read("b")
    rd.close()
