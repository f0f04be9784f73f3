"""Regenerate the pinned mergekit outputs that tests/unit/test_mergekit_parity.py compares `python -m train.merge` to.

    pip install -c requirements/lock.txt -e '.[mergekit]'     # mergekit beside the lock (an optional extra)
    python scripts/mergekit_reference.py                       # rewrites tests/data/mergekit/{models,expected}

Tiny Llama models (hidden 8, 2-3 layers, vocab 32; fp32, ~10 KB each) are made from fixed seeds: `base`, three
fine-tunes `a`, `b`, `c` (base + noise) and a 3-layer `deep`. Every tests/data/mergekit/configs/*.yml is merged by
mergekit's own run_merge into expected/<name>.safetensors. Randomised methods (dare_*, della*) are pinned at
density 1 only: mergekit draws their masks from torch's global stream in its task order, which we do not replay.

Three more (`vbase`, `va`, `vb`) have different vocabularies, each with its own tiny BPE tokenizer, for the
`tokenizer_source` configs (vocab_*.yml): vb lacks y and z, va lacks z and its letters are in another order, va and vb
both add C, va alone adds A, B and a special <|im_start|>, vb alone adds D; va's embeddings have a padding row.
For those, expected/<name>.vocab.json pins mergekit's output vocabulary (token -> id) and vocab_size: mergekit adds
union tokens in an order that changes from run to run, so the test compares each token's row, not each id's.

expected/chat_templates.json pins how each of mergekit's named chat templates renders a few conversations through
transformers' apply_chat_template.
"""
from __future__ import annotations

import argparse
import json
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


LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCABS = {  # model: (tokens in id order after <s> </s>, extra special tokens, config vocab_size)
    "vbase": (list(LETTERS), [], 28),
    "va": (list("mnopqrstuvwxyabcdefghijkl") + ["A", "B", "C"], ["<|im_start|>"], 32),
    "vb": (list(LETTERS[:24]) + ["C", "D"], [], 28),
}


def tiny_tokenizer(tokens: list[str], extra_special: list[str]):
    """A BPE tokenizer whose vocabulary is exactly <s>, </s>, `tokens`, `extra_special` (ids in that order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    allv = ["<s>", "</s>", *tokens, *extra_special]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(allv)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", *extra_special])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_vocab_models(root: Path) -> None:
    """vbase and two fine-tunes of it on other vocabularies: a shared token's rows are vbase's plus noise."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(2)
    base = None
    for i, (name, (tokens, extra, n)) in enumerate(VOCABS.items()):
        m = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "vocab_size": n}), dtype=torch.float32)
        if base is not None:
            g = torch.Generator().manual_seed(200 + i)
            ids = {t: j for j, t in enumerate(["<s>", "</s>", *VOCABS["vbase"][0]])}
            sd = {}
            for k, v in m.state_dict().items():
                b = base[k]
                if v.shape == b.shape:
                    sd[k] = b + 0.02 * torch.randn(v.shape, generator=g)
                    continue
                v = v.clone()
                for j, t in enumerate(["<s>", "</s>", *tokens]):
                    if t in ids:
                        v[j] = b[ids[t]] + 0.02 * torch.randn(b[ids[t]].shape, generator=g)
                sd[k] = v
            m.load_state_dict(sd)
        else:
            base = {k: v.clone() for k, v in m.state_dict().items()}
        m.save_pretrained(root / name)
        tiny_tokenizer(tokens, extra).save_pretrained(root / name)


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello! "},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}],
    [{"role": "system", "content": " Sort. "}, {"role": "user", "content": " Sort these: "},
     {"role": "user_context", "content": "b a\n"}, {"role": "assistant", "content": "a b"}],
]


def render(tok, template: str, conversation: list, generation_prompt: bool) -> str | None:
    """apply_chat_template's text, or None where the template raises (mistral on a role it does not take)."""
    try:
        return tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    except Exception:  # noqa: BLE001 — jinja's TemplateError from raise_exception
        return None


def render_templates() -> dict:
    """{template: [rendering (None: raises) per conversation and add_generation_prompt]} of mergekit's named chat
    templates."""
    import importlib.resources

    from mergekit._data import chat_templates
    tok = tiny_tokenizer(list(LETTERS), [])
    out = {}
    for f in sorted(importlib.resources.files(chat_templates).iterdir(), key=lambda f: f.name):
        if f.name.endswith(".jinja"):
            out[f.name[:-6]] = [render(tok, f.read_text(), c, g) for c in CONVERSATIONS for g in (False, True)]
    return out


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
        make_vocab_models(ROOT / "models")
    (ROOT / "expected").mkdir(exist_ok=True)
    import os
    os.chdir(ROOT)  # the configs name models relative to tests/data/mergekit, as mergekit resolves paths
    for config in sorted((ROOT / "configs").glob("*.yml")):
        with tempfile.TemporaryDirectory() as tmp:
            run_mergekit(config, Path(tmp) / "out")
            shutil.copy(Path(tmp) / "out" / "model.safetensors", ROOT / "expected" / f"{config.stem}.safetensors")
            if yaml_has_tokenizer(config):
                (ROOT / "expected" / f"{config.stem}.vocab.json").write_text(json.dumps(out_vocab(
                    Path(tmp) / "out"), indent=1, sort_keys=True) + "\n")
        print("pinned", config.stem)
    (ROOT / "expected" / "chat_templates.json").write_text(json.dumps(render_templates(), indent=1) + "\n")
    print("pinned chat_templates")


def yaml_has_tokenizer(config: Path) -> bool:
    import yaml
    cfg = yaml.safe_load(config.read_text())
    return "tokenizer_source" in cfg or "tokenizer" in cfg


def out_vocab(out_dir: Path) -> dict:
    """A merged model's vocabulary (token -> id), its special tokens and config.json's vocab_size."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    return {"vocab": tok.get_vocab(), "special": sorted(t.content for t in tok.added_tokens_decoder.values()
                                                        if t.special),
            "vocab_size": json.loads((out_dir / "config.json").read_text())["vocab_size"]}


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "mergekit_reference", cli=True)
