"""Data sources beyond the embedded corpus: local jsonl with a text field, and the errors for bad paths/fields."""
from __future__ import annotations

import json

import pytest

from tests.helpers import tiny_config
from train.config import build_config
from train.core.data import prepare_data
from train.core.errors import DataError
from train.core.model import load_tokenizer


def test_local_jsonl_and_bad_paths(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"line {i} " * 20}) for i in range(50)))
    cfg = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(f), "text_field": "body",
                                                            "max_tokens": 0}))
    out = prepare_data(cfg, load_tokenizer(cfg), 2048, progress=False)
    assert json.loads((out / "meta.json").read_text())["tokens"] > 1000
    bad = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(f), "text_field": "nope"}))
    with pytest.raises(DataError, match="text_field = 'nope'"):
        prepare_data(bad, load_tokenizer(bad), 2048, progress=False)
    missing = build_config(tiny_config(tmp_path / "runs", data={"dataset": str(tmp_path / "none.txt")}))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        prepare_data(missing, load_tokenizer(missing), 2048, progress=False)
