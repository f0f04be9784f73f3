"""Token cache, disjoint shards, fixed eval windows, and a data position that resumes exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, tiny_config
from train.config import build_config
from train.data import ShardSampler, TokenData, prepare_data
from train.model import load_tokenizer


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    cfg = build_config(tiny_config(base, data={"max_tokens": 60_000}))
    tok = load_tokenizer(cfg)
    out = prepare_data(cfg, tok, 2048, progress=False)
    return cfg, tok, out


def test_cache_is_built_once_and_decodes_to_the_corpus(corpus_cache):
    cfg, tok, out = corpus_cache
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokens"] == 60_000 and meta["dtype"] == "uint16"
    mtime = (out / "tokens.bin").stat().st_mtime_ns
    assert prepare_data(cfg, tok, 2048, progress=False) == out  # cached: same key, not rebuilt
    assert (out / "tokens.bin").stat().st_mtime_ns == mtime
    data = TokenData.open(out, 32, 0.02)
    text = tok.decode(np.asarray(data.tokens[:200], dtype=np.int64).tolist())
    first_file = sorted((REPO / "data" / "corpus").glob("*.txt"))[0].read_text()
    assert text[:100] in first_file


def test_shards_are_disjoint_cover_training_and_avoid_eval(corpus_cache):
    _, _, out = corpus_cache
    data = TokenData.open(out, 32, 0.02)
    for n in (1, 3, 4):
        spans = [data.shard(w, n) for w in range(n)]
        assert spans[0][0] == 0 and spans[-1][1] == data.n_train_windows
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    last_train_token = (data.n_train_windows - 1) * 32 + 32  # index of the last token a training window reads
    eval_start = len(data.tokens) - data.n_eval_tokens
    assert last_train_token < eval_start
    e1, e2 = data.eval_windows(16), data.eval_windows(16)
    assert np.array_equal(e1, e2) and e1.shape == (16, 33)
    with pytest.raises(ValueError, match="too few for"):
        data.shard(0, 10_000)


def test_sampler_is_deterministic_and_stays_in_its_shard(corpus_cache):
    _, _, out = corpus_cache
    data = TokenData.open(out, 32, 0.02)
    a = ShardSampler(data, 1, 3, seed=5)
    b = ShardSampler(data, 1, 3, seed=5)
    c = ShardSampler(data, 1, 3, seed=6)
    ba, bb, bc = a.next_batch(8), b.next_batch(8), c.next_batch(8)
    assert (ba == bb).all() and not (ba == bc).all()
    lo, hi = data.shard(1, 3)
    starts = set()
    s = ShardSampler(data, 1, 3, seed=0)
    for _ in range(hi - lo):
        row = s.next_batch(1)[0].numpy()
        for idx in range(lo, hi):
            if np.array_equal(row, data.window(idx * 32)):
                starts.add(idx)
                break
    assert starts == set(range(lo, hi))  # one epoch visits every window of the shard exactly once


def test_resume_at_position_neither_replays_nor_skips(corpus_cache):
    _, _, out = corpus_cache
    data = TokenData.open(out, 32, 0.02)
    lo, hi = data.shard(0, 4)
    n = hi - lo
    straight = ShardSampler(data, 0, 4, seed=1)
    ref = [straight.next_batch(7) for _ in range(2 * n // 7 + 3)]  # crosses epoch boundaries
    for cut in (1, 3, n // 7 + 1):
        first = ShardSampler(data, 0, 4, seed=1)
        got = [first.next_batch(7) for _ in range(cut)]
        resumed = ShardSampler(data, 0, 4, seed=1, position=first.position)
        got += [resumed.next_batch(7) for _ in range(len(ref) - cut)]
        assert all((x == y).all() for x, y in zip(got, ref))


def test_fake_data_needs_no_tokenizer(tmp_path):
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 5000}))
    out = prepare_data(cfg, None, 300, progress=False)
    data = TokenData.open(out, 32, 0.1)
    assert len(data.tokens) == 5000 and int(np.max(data.tokens)) < 300


def test_local_jsonl_and_bad_paths(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"line {i} " * 20}) for i in range(50)))
    cfg = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(f), "text_field": "body",
                                                            "max_tokens": 0}))
    out = prepare_data(cfg, load_tokenizer(cfg), 2048, progress=False)
    assert json.loads((out / "meta.json").read_text())["tokens"] > 1000
    bad = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(f), "text_field": "nope"}))
    with pytest.raises(KeyError, match="text_field = 'nope'"):
        prepare_data(bad, load_tokenizer(bad), 2048, progress=False)
    missing = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(tmp_path / "none.txt")}))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        prepare_data(missing, load_tokenizer(missing), 2048, progress=False)
