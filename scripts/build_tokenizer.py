"""Train the embedded byte-level BPE tokenizer from the shipped corpus and save it in Hugging Face format.

    python scripts/build_tokenizer.py                 # -> data/tokenizer/
    python scripts/build_tokenizer.py --vocab-size 4096 --out /tmp/tok

The result is deterministic for a given corpus and vocab size, so the committed `data/tokenizer/` can be rebuilt
and diffed. `AutoTokenizer.from_pretrained("data/tokenizer")` loads it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build(corpus_dir: Path, out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from train.core.errors import NotFound

    files = sorted(str(p) for p in corpus_dir.glob("*.txt"))
    if not files:
        raise NotFound(f"--corpus {corpus_dir}: no *.txt files in this folder (the plain-text corpus to train on)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token=None, pad_token="<|pad|>", model_max_length=1 << 20)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # The chat template (train/evomerge/sft.py: plain-text <|user|>/<|assistant|> markers, no new tokens, so the
    # vocabulary and
    # every token cache stay as they are) goes into tokenizer_config.json, where every transformers version reads it.
    from train.evomerge.sft import DEFAULT_CHAT_TEMPLATE
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = DEFAULT_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    print(f"tokenizer with {fast.vocab_size} tokens from {len(files)} files -> {out_dir}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    ap.add_argument("--out", type=Path, default=REPO / "data" / "tokenizer")
    ap.add_argument("--vocab-size", type=int, default=2048)
    args = ap.parse_args()
    build(args.corpus, args.out, args.vocab_size)
    return 0


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "build_tokenizer", cli=True)
