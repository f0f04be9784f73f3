"""Regenerate the pinned mergekit outputs that tests/unit/test_mergekit_parity.py compares `python -m train.merge` to.

    pip install -c requirements/lock.txt -e '.[mergekit]'     # mergekit beside the lock (an optional extra)
    python scripts/mergekit_reference.py                       # rewrites tests/data/mergekit/{models,expected}

Tiny Llama models (hidden 8, 2-3 layers, vocab 32; fp32, ~10 KB each) are made from fixed seeds: `base`, three
fine-tunes `a`, `b`, `c` (base + noise) and a 3-layer `deep`. Every tests/data/mergekit/configs/*.yml is merged by
mergekit's own run_merge into expected/<name>.safetensors. Randomised methods (dare_*, della*) are pinned at
density 1 only: mergekit draws their masks from torch's global stream in its task order, which we do not replay.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1] / "tests" / "data" / "mergekit"
TINY = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=32, max_position_embeddings=64, tie_word_embeddings=False)


def make_models(root: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    base.save_pretrained(root / "base")
    for i, name in enumerate("abc"):
        g = torch.Generator().manual_seed(100 + i)
        ft = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
        ft.load_state_dict({k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.state_dict().items()})
        ft.save_pretrained(root / name)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "num_hidden_layers": 3}),
                                     dtype=torch.float32).save_pretrained(root / "deep")


def run_mergekit(config: Path, out: Path) -> None:
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge
    cfg = MergeConfiguration.model_validate(yaml.safe_load(config.read_text()))
    options = MergeOptions(copy_tokenizer=False, quiet=True, random_seed=0, write_model_card=False,
                           out_shard_size=1 << 40)
    run_merge(cfg, str(out), options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep-models", action="store_true", help="reuse tests/data/mergekit/models as they are")
    args = ap.parse_args()
    if not args.keep_models:
        shutil.rmtree(ROOT / "models", ignore_errors=True)
        make_models(ROOT / "models")
    (ROOT / "expected").mkdir(exist_ok=True)
    import os
    os.chdir(ROOT)  # the configs name models relative to tests/data/mergekit, as mergekit resolves paths
    for config in sorted((ROOT / "configs").glob("*.yml")):
        with tempfile.TemporaryDirectory() as tmp:
            run_mergekit(config, Path(tmp) / "out")
            shutil.copy(Path(tmp) / "out" / "model.safetensors", ROOT / "expected" / f"{config.stem}.safetensors")
        print("pinned", config.stem)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "mergekit_reference", cli=True)
