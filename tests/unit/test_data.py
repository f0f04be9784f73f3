"""train/core/data.py (token cache, shards, eval windows, resumable sampler) and train/core/inner.py (schedule,
state)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import REPO, pin_threads, tiny_config
from train.config import build_config
from train.core.data import ShardSampler, TokenData, prepare_data
from train.core.inner import InnerTrainer, lr_at
from train.core.model import build_model, load_tokenizer


# -- fixtures --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The embedded corpus, tokenized (capped by data.max_tokens to stay fast)."""
    base = tmp_path_factory.mktemp("corpus")
    cfg = build_config(tiny_config(base / "runs", data={"max_tokens": 20_000, "cache_dir": ""}))  # tokenized here
    tok = load_tokenizer(cfg)
    out = prepare_data(cfg, tok, 2048, progress=False)
    return cfg, tok, out


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    base = tmp_path_factory.mktemp("fake")
    cfg = build_config(tiny_config(base / "runs", data={"fake_data": True, "fake_tokens": 5000, "seq_length": 16,
                                                        "eval_fraction": 0.05}))
    out = prepare_data(cfg, None, 2048, progress=False)
    return cfg, TokenData.open(out, 16, 0.05)


def _arange_data(n_tokens: int, seq_length: int, eval_fraction: float) -> TokenData:
    """Token i has value i: a window's content tells where it came from."""
    return TokenData(np.arange(n_tokens, dtype=np.int64), seq_length, eval_fraction)


def _window_index(data: TokenData, row) -> int:
    start = int(row[0])
    assert start % data.seq_length == 0
    assert np.array_equal(np.asarray(row), np.arange(start, start + data.seq_length + 1))
    return start // data.seq_length


# -- token cache -----------------------------------------------------------------------------------------------------
def test_corpus_cache_holds_the_tokenized_corpus(corpus):
    cfg, tok, out = corpus
    meta = json.loads((out / "meta.json").read_text())
    assert meta == {"tokens": 20_000, "dtype": "uint16", "vocab_size": 2048, "dataset": cfg.data.dataset,
                    "fake": False}
    assert (out / "tokens.bin").stat().st_size == 20_000 * 2
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens.bin"]  # no temp files left
    data = TokenData.open(out, 32, 0.02)
    first = sorted((REPO / "data" / "corpus").glob("*.txt"))[0].read_text()
    want = tok(first, add_special_tokens=False)["input_ids"][:1000]
    assert data.tokens[:1000].tolist() == want  # the first file, in order, exactly as the tokenizer says
    # cached: the same spec reuses the folder without rebuilding it
    mtime = (out / "tokens.bin").stat().st_mtime_ns
    assert prepare_data(cfg, tok, 2048, progress=False) == out
    assert (out / "tokens.bin").stat().st_mtime_ns == mtime


def test_documents_are_joined_with_eos(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("To be, or not to be, that is the question.")
    (docs / "b.txt").write_text("Now is the winter of our discontent.")
    cfg = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(docs), "max_tokens": 0, "cache_dir": ""}))
    tok = load_tokenizer(cfg)
    out = prepare_data(cfg, tok, 2048, progress=False)
    data = TokenData.open(out, 4, 0.1)
    eos = tok.eos_token_id
    want = []
    for name in ("a.txt", "b.txt"):
        want += tok((docs / name).read_text(), add_special_tokens=False)["input_ids"] + [eos]
    assert data.tokens.tolist() == want
    # another max_tokens is another cache (never a stale one)
    cfg2 = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(docs), "max_tokens": 5, "cache_dir": ""}))
    out2 = prepare_data(cfg2, tok, 2048, progress=False)
    assert out2 != out and TokenData.open(out2, 4, 0.1).tokens.tolist() == want[:5]


def test_a_shared_cache_dir_tokenizes_once_and_every_run_gets_its_own_copy(tmp_path, monkeypatch):
    """data.cache_dir: the first run tokenizes and leaves the cache there; a second run with the same data copies it
    (no tokenizing: build_token_cache would fail) into its own data/ folder, byte for byte; other data is another
    key; a cache_dir that cannot be written costs a warning, not the run."""
    from train.core import data as data_mod

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("To be, or not to be, that is the question. " * 20)
    shared = tmp_path / "shared"

    def cfg_for(run: str, **extra):
        return build_config(tiny_config(tmp_path / run, data={"dataset": str(docs), "max_tokens": 0,
                                                              "cache_dir": str(shared), **extra}))

    cfg = cfg_for("one")
    tok = load_tokenizer(cfg)
    first = prepare_data(cfg, tok, 2048, progress=False)
    kept = shared / first.name
    assert sorted(p.name for p in kept.iterdir()) == ["meta.json", "tokens.bin"]  # no temp files left
    assert (kept / "tokens.bin").read_bytes() == (first / "tokens.bin").read_bytes()

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again although data.cache_dir holds the cache")

    monkeypatch.setattr(data_mod, "build_token_cache", no_tokenizing)
    second = prepare_data(cfg_for("two"), tok, 2048, progress=False)
    assert second.parent == tmp_path / "two" / "t" / "data" and second.name == first.name
    assert (second / "tokens.bin").read_bytes() == (first / "tokens.bin").read_bytes()
    assert json.loads((second / "meta.json").read_text()) == json.loads((first / "meta.json").read_text())
    with pytest.raises(AssertionError, match="tokenized again"):  # other max_tokens: another key, tokenized
        prepare_data(cfg_for("three", max_tokens=7), tok, 2048, progress=False)
    monkeypatch.undo()
    # a cache_dir that cannot be written (under a file: so also for root)
    cfg4 = build_config(tiny_config(tmp_path / "four", data={"dataset": str(docs), "max_tokens": 9,
                                                             "cache_dir": str(docs / "a.txt")}))
    out = prepare_data(cfg4, tok, 2048, progress=False)
    assert TokenData.open(out, 4, 0.1).tokens.tolist() == tok((docs / "a.txt").read_text(),
                                                              add_special_tokens=False)["input_ids"][:9]


def test_fake_data_is_seeded_and_in_vocab(tmp_path, fake):
    cfg, data = fake
    assert len(data.tokens) == 5000 and int(data.tokens.max()) < 2048
    again = prepare_data(build_config(tiny_config(tmp_path / "a", data={"fake_data": True, "fake_tokens": 5000})),
                         None, 2048, progress=False)
    assert np.array_equal(np.fromfile(again / "tokens.bin", dtype=np.uint16), np.asarray(data.tokens))
    other = prepare_data(build_config(tiny_config(tmp_path / "b", seed=1, data={"fake_data": True,
                                                                                 "fake_tokens": 5000})),
                         None, 2048, progress=False)
    assert not np.array_equal(np.fromfile(other / "tokens.bin", dtype=np.uint16), np.asarray(data.tokens))


# -- shards and eval windows -----------------------------------------------------------------------------------------
def _check_shards_and_eval(data: TokenData, num_workers: int) -> None:
    n = data.n_train_windows
    eval_start = len(data.tokens) - data.n_eval_tokens
    spans = [data.shard(w, num_workers) for w in range(num_workers)]
    covered = [i for lo, hi in spans for i in range(lo, hi)]
    assert covered == list(range(n))  # disjoint, in order, and together exactly the training windows
    assert all(hi > lo for lo, hi in spans)
    sizes = [hi - lo for lo, hi in spans]
    assert max(sizes) - min(sizes) <= 1  # balanced
    # no training window reads a held-out token
    last = data.window((n - 1) * data.seq_length)
    assert len(last) == data.seq_length + 1
    assert (n - 1) * data.seq_length + data.seq_length < eval_start
    # and no more training windows would fit before the tail (nothing usable is wasted)
    assert n * data.seq_length + data.seq_length >= eval_start


def test_corpus_shards_are_disjoint_cover_training_and_avoid_eval(corpus):
    _, _, out = corpus
    data = TokenData.open(out, 32, 0.02)
    assert data.n_train_windows == (20_000 - 400 - 1) // 32
    for n in (1, 2, 3, 5, 8):
        _check_shards_and_eval(data, n)
    with pytest.raises(ValueError, match="too few for"):
        data.shard(0, data.n_train_windows + 1)


def test_corpus_eval_windows_are_fixed_and_held_out(corpus):
    cfg, _, out = corpus
    a = TokenData.open(out, 32, 0.02)
    b = TokenData.open(out, 32, 0.02)
    e1, e2, e3 = a.eval_windows(8), a.eval_windows(8), b.eval_windows(8)
    assert e1.shape == (8, 33) and e1.dtype == np.int64
    assert np.array_equal(e1, e2) and np.array_equal(e1, e3)
    eval_start = 20_000 - a.n_eval_tokens
    tail = np.asarray(a.tokens[eval_start:], dtype=np.int64)
    for i, row in enumerate(e1):
        assert np.array_equal(row, tail[i * 32: i * 32 + 33])
    # asking for more windows than the tail holds gives all of them, never a window past the end
    many = a.eval_windows(10_000)
    assert len(many) == (a.n_eval_tokens - 1) // 32


@settings(max_examples=40, deadline=None)
@given(n_tokens=st.integers(200, 5000), seq_length=st.integers(2, 40), eval_fraction=st.floats(0.01, 0.5),
       num_workers=st.integers(1, 6))
def test_shard_and_eval_arithmetic(n_tokens, seq_length, eval_fraction, num_workers):
    data = _arange_data(n_tokens, seq_length, eval_fraction)
    if data.n_train_windows < num_workers:
        with pytest.raises(ValueError, match="too few for"):
            data.shard(0, num_workers)  # the first shard is the empty one
        return
    _check_shards_and_eval(data, num_workers)
    eval_start = n_tokens - data.n_eval_tokens
    if (data.n_eval_tokens - 1) // seq_length < 1:
        with pytest.raises(ValueError, match="holds no window"):
            data.eval_windows(4)
        return
    ev = data.eval_windows(1000)
    assert ev.shape[1] == seq_length + 1
    assert ev.min() >= eval_start and ev.max() < n_tokens  # only held-out tokens
    assert np.array_equal(ev, data.eval_windows(1000))


# -- the sampler -----------------------------------------------------------------------------------------------------
def test_sampler_is_deterministic_per_seed_and_stays_in_its_shard(fake):
    _, data = fake
    a = [ShardSampler(data, 1, 2, seed=3).next_batch(8) for _ in range(2)]
    assert torch.equal(a[0], a[1]) and a[0].shape == (8, 17) and a[0].dtype == torch.int64
    assert not torch.equal(ShardSampler(data, 1, 2, seed=4).next_batch(8), a[0])
    assert not torch.equal(ShardSampler(data, 0, 2, seed=3).next_batch(8), a[0])
    # every row is a training window of worker 1's shard
    lo, hi = data.shard(1, 2)
    starts = {tuple(data.window(i * 16)): i for i in range(data.n_train_windows)}
    s = ShardSampler(data, 1, 2, seed=3)
    for row in s.next_batch(3 * (hi - lo)):
        assert lo <= starts[tuple(row.tolist())] < hi


def test_every_epoch_visits_each_window_once_in_a_new_order():
    data = _arange_data(2000, 10, 0.05)
    lo, hi = data.shard(2, 3)
    n = hi - lo
    s = ShardSampler(data, 2, 3, seed=11)
    epochs = [[_window_index(data, r) for r in s.next_batch(n)] for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(lo, hi))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled per epoch
    assert s.position == 3 * n


@pytest.mark.parametrize("batch", [1, 5, 7, 16])
def test_resume_at_saved_position_neither_replays_nor_skips(fake, batch):
    _, data = fake
    lo, hi = data.shard(0, 2)
    n_batches = 3 * (hi - lo) // batch + 2  # crosses at least two epoch boundaries
    straight = ShardSampler(data, 0, 2, seed=7)
    ref = [straight.next_batch(batch) for _ in range(n_batches)]
    for cut in range(0, n_batches, max(1, n_batches // 12)):
        first = ShardSampler(data, 0, 2, seed=7)
        got = [first.next_batch(batch) for _ in range(cut)]
        saved = json.loads(json.dumps({"position": first.position}))  # what the worker writes to state.json
        assert saved["position"] == cut * batch
        resumed = ShardSampler(data, 0, 2, seed=7, position=saved["position"])
        got += [resumed.next_batch(batch) for _ in range(n_batches - cut)]
        for i, (x, y) in enumerate(zip(got, ref)):
            assert torch.equal(x, y), (cut, i)


def test_resume_mid_epoch_with_another_batch_size_gives_the_same_window_stream():
    data = _arange_data(3000, 8, 0.02)
    lo, hi = data.shard(0, 1)
    total = 2 * (hi - lo) + 13
    ref = [_window_index(data, r) for r in ShardSampler(data, 0, 1, seed=0).next_batch(total)]
    s = ShardSampler(data, 0, 1, seed=0)
    got = [_window_index(data, r) for r in s.next_batch(hi - lo - 3)]  # stop 3 windows before the epoch ends
    resumed = ShardSampler(data, 0, 1, seed=0, position=s.position)
    while len(got) < total:
        got += [_window_index(data, r) for r in resumed.next_batch(min(5, total - len(got)))]
    assert got == ref


# -- inner schedule --------------------------------------------------------------------------------------------------
def test_lr_schedule_warmup_and_cosine_floor():
    peak, warmup, total, floor = 1e-3, 10, 110, 0.1
    lrs = [lr_at(s, peak, warmup, total, floor) for s in range(150)]
    # linear warmup reaching the peak at the last warmup step
    assert lrs[:warmup] == pytest.approx([peak * (s + 1) / warmup for s in range(warmup)])
    assert lrs[0] == pytest.approx(peak / warmup)
    assert lrs[warmup - 1] == pytest.approx(peak)
    # cosine: peak right after warmup, the midpoint halfway, the floor at `total` and after it
    assert lrs[warmup] == pytest.approx(peak)
    assert lrs[60] == pytest.approx(peak * (floor + (1 - floor) * 0.5))
    assert lrs[35] == pytest.approx(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.25))))
    assert lrs[total] == pytest.approx(peak * floor)
    assert all(x == pytest.approx(peak * floor) for x in lrs[total:])
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))  # never increases after warmup
    assert min(lrs) >= peak * floor - 1e-15


def test_lr_schedule_edge_cases():
    assert lr_at(0, 2.0, 0, 100, 0.0) == pytest.approx(2.0)  # no warmup: starts at the peak
    assert lr_at(100, 2.0, 0, 100, 0.0) == pytest.approx(0.0)
    assert lr_at(5, 2.0, 0, 100, 1.0) == pytest.approx(2.0)  # floor 1 = constant
    assert lr_at(3, 1.0, 10, 5, 0.2) == pytest.approx(0.4)  # warmup longer than the schedule: still warming up
    assert lr_at(10, 1.0, 10, 5, 0.2) == pytest.approx(1.0)
    assert lr_at(11, 1.0, 10, 5, 0.2) == pytest.approx(0.2)


def test_trainer_lr_follows_the_config(tmp_path):
    pin_threads()
    cfg = build_config(tiny_config(tmp_path, inner={"warmup_steps": 2, "min_lr_ratio": 0.1}))
    tr = InnerTrainer(cfg, build_model(cfg), torch.device("cpu"))
    assert cfg.total_inner_steps == 15
    for step in range(20):
        tr.step = step
        assert tr.lr() == pytest.approx(lr_at(step, 3e-3, 2, 15, 0.1))


# -- inner optimizer state round trip --------------------------------------------------------------------------------
def test_inner_state_round_trips_adamw_exactly(tmp_path):
    pin_threads()
    cfg = build_config(tiny_config(tmp_path, model={"name": str(REPO / "configs" / "micro-llama.json")}))
    gen = torch.Generator().manual_seed(123)
    batches = [torch.randint(0, 2048, (8, cfg.data.seq_length + 1), generator=gen) for _ in range(4)]

    def feeder(bs):
        it = iter(bs)
        return lambda n: next(it)

    dev = torch.device("cpu")
    a = InnerTrainer(cfg, build_model(cfg), dev)
    init = {k: v.detach().clone() for k, v in a.model.named_parameters()}
    a.train_steps(feeder(batches[:3]), 3)
    extra = a.save_state(tmp_path / "opt.safetensors")
    assert json.loads(json.dumps(extra)) == extra and extra["step"] == 3  # JSON-able, nothing pickled
    assert any(not torch.equal(v, init[k]) for k, v in a.model.named_parameters())

    def fresh_with_a_weights() -> InnerTrainer:
        t = InnerTrainer(cfg, build_model(cfg), dev)
        with torch.no_grad():
            for k, p in t.model.named_parameters():
                p.copy_(dict(a.model.named_parameters())[k])
        return t

    b = fresh_with_a_weights()
    b.load_state(tmp_path / "opt.safetensors", extra)
    assert b.step == 3 and b.lr() == a.lr()
    for name, pa in a.params.items():
        sa, sb = a.opt.state[pa], b.opt.state[b.params[name]]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 3.0

    control = fresh_with_a_weights()  # same weights, no optimizer state: must end up elsewhere
    control.step = 3
    for t in (a, b, control):
        t.train_steps(feeder(batches[3:]), 1)
    pa, pb, pc = (dict(t.model.named_parameters()) for t in (a, b, control))
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)
    assert a.step == b.step == 4
