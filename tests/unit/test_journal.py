"""train/core/journal.py's reading of a journal's parts on a bucket (which objects, each record once), and a
journal on a disk. The bucket itself: tests/e2e/test_s3.py (long tier, a real S3 gateway)."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from train.core import journal


def _name(a: int, b: int) -> str:
    return f"{a:08d}-{b:08d}.jsonl"


def _data(a: int, b: int) -> bytes:
    return "".join(json.dumps({"i": i}) + "\n" for i in range(a, b + 1)).encode()


def test_a_chunk_wins_over_the_singles_it_covers_and_strangers_are_ignored():
    names = [_name(5, 5), _name(0, 3), _name(2, 2), _name(4, 4), "", "notes.txt", _name(9, 1), "00000001.jsonl"]
    assert [n for _, _, n in journal.covering(names)] == [_name(0, 3), _name(4, 4), _name(5, 5)]
    got = journal.read_parts(names, lambda n: _data(*map(int, n[:-6].split("-"))))
    assert got == [{"i": i} for i in range(6)]


def test_a_line_that_is_not_json_is_skipped_and_the_rest_read():
    parts = [(0, 1, b'{"i": 0}\nnot json\n'), (2, 2, b'{"i": 2}\n')]
    assert journal.combine(parts) == [{"i": 0}, {"i": 2}]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), chunk=st.integers(1, 8), left=st.sets(st.integers(0, 39)),
       late=st.sets(st.integers(0, 39)))
def test_every_record_once_in_order_whatever_singles_survive_beside_their_chunks(n, chunk, left, late):
    """The bucket after n appends with chunks of `chunk` records: chunks for every full one, the singles after
    them; plus singles a crash left beside their chunk and late copies of PUTs that landed after the deletes."""
    full = n - n % chunk
    names = {_name(a, a + chunk - 1) for a in range(0, full, chunk)} | {_name(i, i) for i in range(full, n)}
    names |= {_name(i, i) for i in (left | late) if i < n}
    got = journal.read_parts(sorted(names), lambda nm: _data(*map(int, nm[:-6].split("-"))))
    assert got == [{"i": i} for i in range(n)]


def test_on_a_disk_one_file_and_a_torn_line_skipped(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    assert journal.read_jsonl(path) == []
    journal.append_jsonl(path, {"round": 1})
    with open(path, "ab") as f:
        f.write(b'{"round": 2, "tor')  # a crash mid-append
    journal.append_jsonl(path, {"round": 3})
    assert journal.read_jsonl(path) == [{"round": 1}, {"round": 3}]
    assert not journal.parts_folder(path).exists()
