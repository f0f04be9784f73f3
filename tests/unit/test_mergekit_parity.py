"""`python -m train.merge CONFIG.yml` equals mergekit on every method: pinned mergekit outputs (scripts/
mergekit_reference.py) on tiny models, and, where mergekit is installed (the `mergekit` extra), a live run too."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import REPO
from train.core.tensorio import load_tensors
from train.merge.yaml_merge import run_yaml_merge
from train.merge.yaml_plan import Plan

ROOT = REPO / "tests" / "data" / "mergekit"
CONFIGS = sorted((ROOT / "configs").glob("*.yml"))
TOL = 1e-6


def ours(config: Path, out: Path, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.chdir(ROOT)  # configs name models relative to tests/data/mergekit, resolved as mergekit does
    plan = Plan(yaml.safe_load(config.read_text()), config.parent)
    run_yaml_merge(plan, out)
    return load_tensors(out / "model.safetensors")


def by_token(got: dict, want: dict, out: Path, want_vocab: dict, what: str) -> dict:
    """Our output's vocabulary-indexed rows put in mergekit's token order (mergekit's union order is not fixed)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out))
    ours_v = tok.get_vocab()
    assert set(ours_v) == set(want_vocab["vocab"]), f"{what}: output vocabularies differ"
    assert sorted(t.content for t in tok.added_tokens_decoder.values() if t.special) == want_vocab["special"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == want_vocab["vocab_size"]
    n = want_vocab["vocab_size"]  # rows past the tokens: pad_to_multiple_of's, in place
    order = torch.tensor([ours_v[t] for t, _ in sorted(want_vocab["vocab"].items(), key=lambda kv: kv[1])] +
                         list(range(len(ours_v), n)))
    return {k: v[order] if v.dim() and v.shape[0] == n and want[k].shape == v.shape else v for k, v in got.items()}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: tensor names differ"
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k} shape"
        err = float((got[k].float() - want[k].float()).abs().max()) if want[k].numel() else 0.0
        assert err <= TOL, f"{what}: {k} differs by {err:.3g}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_equals_pinned_mergekit_output(config, tmp_path, monkeypatch):
    want = load_tensors(ROOT / "expected" / f"{config.stem}.safetensors")
    got = ours(config, tmp_path / "out", monkeypatch)
    vocab = ROOT / "expected" / f"{config.stem}.vocab.json"
    if vocab.is_file():
        got = by_token(got, want, tmp_path / "out", json.loads(vocab.read_text()), config.stem)
    assert_same(got, want, config.stem)


def test_every_method_is_pinned():
    from train.merge.yaml_plan import METHODS
    pinned = {yaml.safe_load(c.read_text())["merge_method"] for c in CONFIGS}
    assert pinned == set(METHODS)


@pytest.mark.skipif(importlib.util.find_spec("mergekit") is None, reason="mergekit not installed (extra: mergekit)")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_equals_live_mergekit(config, tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "scripts"))
    from mergekit_reference import out_vocab, run_mergekit, yaml_has_tokenizer
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_mergekit(config, tmp_path / "mk")
    want = load_tensors(tmp_path / "mk" / "model.safetensors")
    got = ours(config, tmp_path / "ours", monkeypatch)
    if yaml_has_tokenizer(config):
        got = by_token(got, want, tmp_path / "ours", out_vocab(tmp_path / "mk"), config.stem)
    assert_same(got, want, config.stem)
