"""The model configs the benchmarks name build the models they claim (on the meta device: no weights, no download)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, params", [("configs/llama-107m.json", 107_383_104),
                                          ("configs/scaling-llama.json", 116_000)])
def test_bench_config_builds_its_model_with_the_shipped_vocab(name, params):
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / name))
    assert sum(p.numel() for p in m.parameters()) == params
    vocab = json.loads((REPO / "data/tokenizer/tokenizer.json").read_text())["model"]["vocab"]
    assert m.config.vocab_size == len(vocab)
