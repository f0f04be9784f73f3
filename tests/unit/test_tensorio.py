"""train/core/tensorio.py: the streaming safetensors writer and the hashing sequential reader."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from train.core import digest
from train.core.tensorio import (SequentialReader, StreamingWriter, iter_tensors, load_tensors, read_header,
                                 save_streaming)


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 3, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "i64": torch.tensor([-(2 ** 40), 0, 1, 2 ** 62], dtype=torch.int64),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty2d": torch.empty(3, 0, dtype=torch.bfloat16),
        "odd": torch.arange(3, dtype=torch.float16),  # 6 bytes: the following tensor starts unaligned
        "last": torch.randn(1, 1, generator=g),
    }


def _sha(path: Path) -> str:
    return digest.of_bytes(path.read_bytes())


def _open_fds_under(folder: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


def _assert_equal_dicts(got: dict, want: dict) -> None:
    assert list(got) == list(want) or set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert tuple(got[k].shape) == tuple(v.shape), k
        assert torch.equal(got[k], v), k


def test_streaming_writer_output_loads_with_safetensors(tmp_path):
    tensors = _sample()
    path = tmp_path / "out" / "delta.safetensors"
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    with StreamingWriter(path, specs, metadata={"round": 3, "worker": "w001"}) as w:
        for k, v in tensors.items():
            w.write(k, v)
    _assert_equal_dicts(load_file(str(path)), tensors)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"round": "3", "worker": "w001"}
    assert w.nbytes == path.stat().st_size
    assert w.digest == digest.of_bytes(path.read_bytes()) and w.digest.startswith("xxh3-128:")
    assert os.listdir(path.parent) == ["delta.safetensors"]  # no temp file left behind
    # the header is 8-byte aligned, as the format asks
    (n,) = __import__("struct").unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0


def test_save_streaming_matches_safetensors_and_hash(tmp_path):
    tensors = _sample()
    sha = save_streaming(tmp_path / "a.safetensors", tensors, metadata={"format": "pt"})
    assert sha == _sha(tmp_path / "a.safetensors")
    _assert_equal_dicts(load_tensors(tmp_path / "a.safetensors"), tensors)
    # our own readers read a file written by the reference implementation, too
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    _assert_equal_dicts(dict(iter_tensors(tmp_path / "ref.safetensors")), tensors)


def test_non_contiguous_input_is_written_as_its_values(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {"t": base.t(), "s": base[:, ::2]}
    save_streaming(tmp_path / "nc.safetensors", tensors)
    got = load_file(str(tmp_path / "nc.safetensors"))
    assert torch.equal(got["t"], base.t().contiguous()) and torch.equal(got["s"], base[:, ::2].contiguous())


def test_scalar_tensors_round_trip(tmp_path):
    tensors = {"s": torch.tensor(3.5), "b": torch.tensor(-1.25, dtype=torch.bfloat16), "i": torch.tensor(7)}
    sha = save_streaming(tmp_path / "s.safetensors", tensors)
    assert sha == _sha(tmp_path / "s.safetensors")
    _assert_equal_dicts(load_file(str(tmp_path / "s.safetensors")), tensors)
    r = SequentialReader(tmp_path / "s.safetensors")
    got = {n: r.read(n) for n in r.names_in_order}
    assert r.finish() == sha
    _assert_equal_dicts(got, tensors)


SPECS = {"a": (torch.float32, (2, 2)), "b": (torch.bfloat16, (3,))}


@pytest.mark.parametrize("case", ["out_of_order", "unknown_name", "wrong_shape", "wrong_dtype", "too_many",
                                  "too_few", "caller_raises"])
def test_bad_writes_raise_and_leave_no_file(tmp_path, case):
    path = tmp_path / "x.safetensors"
    old = None
    if case in ("wrong_shape", "too_few"):  # an existing file at the path must survive a failed rewrite
        save_streaming(path, {"old": torch.ones(1)})
        old = path.read_bytes()
    a, b = torch.zeros(2, 2), torch.zeros(3, dtype=torch.bfloat16)
    expected = {
        "out_of_order": (ValueError, "expected tensor 'a' next, got 'b'"),
        "unknown_name": (ValueError, "expected tensor 'a' next, got 'c'"),
        "wrong_shape": (ValueError, r"a: got torch.float32\(2, 3\), declared torch.float32\(2, 2\)"),
        "wrong_dtype": (ValueError, "a: got torch.float64"),
        "too_many": (ValueError, "expected tensor None next, got 'a'"),
        "too_few": (ValueError, "only 1/2 tensors written"),
        "caller_raises": (KeyboardInterrupt, None),
    }[case]
    with pytest.raises(expected[0], match=expected[1]):
        with StreamingWriter(path, SPECS) as w:
            if case == "out_of_order":
                w.write("b", b)
            elif case == "unknown_name":
                w.write("c", a)
            elif case == "wrong_shape":
                w.write("a", torch.zeros(2, 3))
            elif case == "wrong_dtype":
                w.write("a", a.double())
            elif case == "too_many":
                w.write("a", a)
                w.write("b", b)
                w.write("a", a)
            elif case == "too_few":
                w.write("a", a)
            elif case == "caller_raises":
                w.write("a", a)
                raise KeyboardInterrupt
    if old is None:
        assert os.listdir(tmp_path) == []
    else:
        assert os.listdir(tmp_path) == ["x.safetensors"] and path.read_bytes() == old
    assert _open_fds_under(tmp_path) == []  # the temp file's handle is closed, not leaked


def test_sequential_reader_reads_back_and_hashes(tmp_path):
    tensors = _sample()
    path = tmp_path / "d.safetensors"
    sha = save_streaming(path, tensors, metadata={"round": "2"})
    r = SequentialReader(path)
    assert r.metadata == {"round": "2"}
    assert r.names_in_order == list(tensors)  # the writer keeps the given order
    got = {}
    for n in r.names_in_order:
        assert r.dtype_of(n) == tensors[n].dtype
        got[n] = r.read(n).clone()
    assert r.finish() == sha == _sha(path)
    _assert_equal_dicts(got, tensors)


def test_sequential_reader_hash_covers_the_whole_file(tmp_path):
    path = tmp_path / "d.safetensors"
    save_streaming(path, {"a": torch.ones(4), "b": torch.zeros(2)})
    with open(path, "ab") as f:
        f.write(b"trailing")
    r = SequentialReader(path)
    r.read("a"), r.read("b")
    assert r.finish() == _sha(path)


def test_sequential_reader_of_a_file_from_safetensors(tmp_path):
    tensors = {"x": torch.randn(3, 3), "y": torch.arange(5)}
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    r = SequentialReader(tmp_path / "ref.safetensors")
    got = {n: r.read(n).clone() for n in r.names_in_order}
    assert r.finish() == _sha(tmp_path / "ref.safetensors")
    _assert_equal_dicts(got, tensors)


def test_sequential_reader_refuses_out_of_order_reads_when_hashing(tmp_path):
    path = tmp_path / "d.safetensors"
    save_streaming(path, {"a": torch.ones(4), "b": torch.zeros(2)})
    r = SequentialReader(path)
    with pytest.raises(ValueError, match="'b' is not next in file order"):
        r.read("b")
    r.close()
    r = SequentialReader(path, hash_bytes=False)  # without hashing, random access is allowed
    assert torch.equal(r.read("b"), torch.zeros(2)) and torch.equal(r.read("a"), torch.ones(4))
    assert r.finish() is None


def test_truncated_files_raise(tmp_path):
    path = tmp_path / "d.safetensors"
    save_streaming(path, {"a": torch.ones(64), "b": torch.ones(64)})
    full = path.read_bytes()
    # cut inside the data section: the header is intact, the last tensor is not
    path.write_bytes(full[:-10])
    r = SequentialReader(path)
    r.read("a")
    with pytest.raises(ValueError, match="truncated inside tensor 'b'"):
        r.read("b")
    r.close()
    # cut inside the header
    path.write_bytes(full[:20])
    with pytest.raises(ValueError, match="header length .* exceeds the file"):
        SequentialReader(path)
    with pytest.raises(ValueError, match="exceeds the file"):
        read_header(path)
    # shorter than the length prefix
    path.write_bytes(full[:5])
    with pytest.raises(ValueError, match="too short"):
        read_header(path)


def test_iter_tensors_reads_every_byte_now_not_through_the_memory_map(tmp_path):
    """A tensor read from the shared disk must not alias the file: the prefetch thread reads the bytes (not the
    training step that first touches them), and a file deleted or rewritten later (a pruned round, on NFS by another
    host) cannot change it or fault."""
    f = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(1024), "b": torch.arange(8.0)}, str(f))
    got = dict(iter_tensors(f))
    with open(f, "r+b") as g:  # rewrite the last bytes of the data in place
        g.seek(-16, 2)
        g.write(torch.full((4,), 7.0).numpy().tobytes())
    f.unlink()
    assert torch.equal(got["a"], torch.zeros(1024)) and torch.equal(got["b"], torch.arange(8.0))


@pytest.mark.parametrize("threaded", [False, True])
def test_pipelined_reader_inline_and_threaded_give_the_same_groups_and_checksum(tmp_path, monkeypatch, threaded):
    """Files up to PipelinedReader.INLINE are read in the caller's thread, larger ones on a background thread: the
    same groups, the same checksum of every byte, in file order or not, and the same errors."""
    from train.core.tensorio import PipelinedReader

    if threaded:
        monkeypatch.setattr(PipelinedReader, "INLINE", 0)
    tensors = _sample()
    path = tmp_path / "d.safetensors"
    sha = save_streaming(path, tensors)
    names = list(tensors)
    for groups in ([(n, [n]) for n in names[:3]], [("all", list(reversed(names)))]):
        rd = PipelinedReader(path, groups)
        assert (rd._t is not None) == threaded
        got = {k: v for _, out in rd for k, v in out.items()}
        assert rd.finish() == sha
        _assert_equal_dicts(got, {n: tensors[n] for _, ns in groups for n in ns})
    assert _open_fds_under(tmp_path) == []
    path.write_bytes(path.read_bytes()[:-5])  # truncated inside the last tensor
    rd = PipelinedReader(path, [("all", names)])
    with pytest.raises(ValueError, match="truncated"):
        list(rd)
    rd.close()
    assert _open_fds_under(tmp_path) == []


def test_pipelined_reader_flat_gives_every_value_in_order_or_none(tmp_path, monkeypatch):
    """flat(names): a small file whose tensors are exactly `names`, back to back in that order and of one dtype, as
    one tensor (the same checksum; iterating after it gives nothing); None for another order, a missing or extra
    tensor, mixed dtypes, or a file read on the background thread."""
    from train.core.tensorio import PipelinedReader

    t = {"a": torch.randn(3, 4), "b": torch.randn(5), "c": torch.randn(2, 2)}
    path = tmp_path / "d.safetensors"
    sha = save_streaming(path, t)
    rd = PipelinedReader(path, [(n, [n]) for n in t])
    flat = rd.flat(list(t))
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in t.values()])) and list(rd) == []
    assert rd.finish() == sha
    for names in (["b", "a", "c"], ["a", "b"], ["a", "b", "c", "d"]):
        rd = PipelinedReader(path, [("x", list(t))])
        assert rd.flat(names) is None
        rd.close()
    save_streaming(path, {**t, "b": t["b"].to(torch.bfloat16)})
    rd = PipelinedReader(path, [("x", list(t))])
    assert rd.flat(list(t)) is None
    rd.close()
    monkeypatch.setattr(PipelinedReader, "INLINE", 0)
    save_streaming(path, t)
    rd = PipelinedReader(path, [("x", list(t))])
    assert rd.flat(list(t)) is None
    rd.close()
    assert _open_fds_under(tmp_path) == []


def _direct_case(n_values: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(len(n_values))
    return {f"t{i}": torch.randn(k, generator=g) for i, k in enumerate(n_values)}


@pytest.mark.parametrize("sizes", [[1], [3, 5, 1024], [(16 << 20) // 4 - 30, 7, 1 << 20], [1 << 22]],
                         ids=["tiny", "small", "across-the-stage", "exactly-the-stage"])
def test_direct_writer_writes_the_same_bytes_as_the_page_cache_writer(tmp_path, sizes):
    """O_DIRECT through the aligned stage: the same file byte for byte (the last block's padding cut off, the
    stage's boundaries anywhere in a tensor), the same checksum, no temp file; where the filesystem refuses O_DIRECT
    the page cache is used and the file is the same too."""
    tensors = _direct_case(sizes)
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    out = {}
    for direct in (False, True):
        path = tmp_path / f"d{int(direct)}" / "x.safetensors"
        with StreamingWriter(path, specs, {"round": "1"}, direct=direct) as w:
            for k, v in tensors.items():
                w.write(k, v)
        out[direct] = (path.read_bytes(), w.digest, w.nbytes)
        assert os.listdir(path.parent) == ["x.safetensors"]
    assert out[True] == out[False]
    assert len(out[True][0]) == out[True][2]
    _assert_equal_dicts(load_file(str(tmp_path / "d1" / "x.safetensors")), tensors)


def test_direct_writer_falls_back_to_the_page_cache_when_a_write_is_refused(tmp_path, monkeypatch):
    """A filesystem that takes the O_DIRECT flag but refuses the aligned write (EINVAL) gets that stage and the
    rest of the file through the page cache: the same bytes, O_DIRECT off for the descriptor."""
    import errno
    import fcntl

    from train.core import sharedfs

    tensors = _direct_case([(16 << 20) // 4 + 100, 300])
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    real, refused, flags_after = sharedfs.pwrite, [], []

    def pwrite(fd, data, offset, path):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if refused:
                flags_after.append("still direct")
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset, path)
    monkeypatch.setattr(sharedfs, "pwrite", pwrite)
    path = tmp_path / "x.safetensors"
    with StreamingWriter(path, specs, direct=True) as w:
        for k, v in tensors.items():
            w.write(k, v)
    ref = tmp_path / "ref.safetensors"
    monkeypatch.setattr(sharedfs, "pwrite", real)
    save_streaming(ref, tensors)
    assert path.read_bytes() == ref.read_bytes() and w.digest == digest.of_bytes(ref.read_bytes())
    if refused:  # (on a filesystem without O_DIRECT at all the flag was never set)
        assert refused == [0] and flags_after == []


def test_direct_writer_errors_leave_no_file_and_no_handle(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="only 1/2 tensors written"):
        with StreamingWriter(path, SPECS, direct=True) as w:
            w.write("a", torch.zeros(2, 2))
    assert os.listdir(tmp_path) == [] and _open_fds_under(tmp_path) == []
