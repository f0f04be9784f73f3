"""train/core/digest.py: checksums name their algorithm; records written with sha256 before still check."""
from __future__ import annotations

import hashlib

import pytest
import xxhash

from train.core import digest


def test_written_checksums_are_xxh3_128_and_name_it(tmp_path):
    data = b"delta bytes" * 1000
    text = digest.of_bytes(data)
    assert text == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()
    assert digest.algorithm_of(text) == "xxh3-128"
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    assert digest.of_file(f, bufsize=7) == text  # pieces or whole: the same checksum


def test_a_sha256_record_is_checked_with_sha256(tmp_path):
    data = b"a file of an earlier run" * 100
    old = hashlib.sha256(data).hexdigest()
    assert digest.algorithm_of(old) == "sha256"
    assert digest.of_bytes(data, like=old) == old
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    assert digest.of_file(f, like=old) == old
    assert digest.of_bytes(data[:-1], like=old) != old  # and a change is still caught


def test_incremental_updates_equal_one_update():
    h = digest.Hasher()
    for piece in (b"ab", memoryview(b"cdef"), bytearray(b"g")):
        h.update(piece)
    assert h.text() == digest.of_bytes(b"abcdefg")


@pytest.mark.parametrize("bad", ["", "xxh3-128:abc", "md5:" + "0" * 32, "0" * 63, "G" * 64, 12])
def test_an_unknown_checksum_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="not a checksum this version knows"):
        digest.Hasher(like=bad)
