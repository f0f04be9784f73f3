"""`python -m train.merge CONFIG.yml OUT_DIR`: mergekit-yaml's command on mergekit's YAML (docs/merge.md)."""
from __future__ import annotations

import argparse
from pathlib import Path

from train.core.errors import MergeError, run_main

IGNORED_FLAGS = ("--lazy-unpickle", "--low-cpu-memory", "--trust-remote-code", "--write-model-card", "--quiet",
                 "--verbose", "--safe-serialization", "--async-write", "--read-to-gpu")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m train.merge", description="Merge models by a mergekit YAML config.")
    ap.add_argument("config", type=Path, help="mergekit YAML (models / slices, merge_method, parameters, ...)")
    ap.add_argument("out_dir", type=Path, help="the output HF model directory (written atomically)")
    ap.add_argument("--cuda", action="store_true", help="run the merge math on cuda (same as --device cuda)")
    ap.add_argument("--device", default=None, help="torch device for the merge math (default cpu)")
    ap.add_argument("--copy-tokenizer", dest="copy_tokenizer", action="store_true", default=True,
                    help="copy the donor's tokenizer files (default)")
    ap.add_argument("--no-copy-tokenizer", dest="copy_tokenizer", action="store_false")
    ap.add_argument("--allow-crimes", action="store_true", help="merge models of different architectures")
    ap.add_argument("--random-seed", type=int, default=0,
                    help="seed of the random methods (dare_*, della*): with each tensor's name, one stream per tensor")
    for flag in IGNORED_FLAGS:  # mergekit-yaml flags that change nothing here (memory / I/O / logging)
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = args.device or ("cuda" if args.cuda else "cpu")

    def body():
        import torch
        import yaml
        from train.merge.yaml_merge import run_yaml_merge
        from train.merge.yaml_plan import Plan
        if device != "cpu" and not torch.device(device).type == "cpu":
            if torch.device(device).type == "cuda" and not torch.cuda.is_available():
                raise MergeError(f"--device {device}: no CUDA device here")
        if not args.config.is_file():
            raise MergeError(f"{args.config}: no such file")
        try:
            cfg = yaml.safe_load(args.config.read_text())
        except yaml.YAMLError as e:
            raise MergeError(f"{args.config}: not valid YAML ({str(e).splitlines()[0]})") from None
        plan = Plan(cfg, args.config.resolve().parent, allow_crimes=args.allow_crimes)
        info = run_yaml_merge(plan, args.out_dir, seed=args.random_seed, device=device,
                              copy_tokenizer=args.copy_tokenizer, progress=True)
        print(f"merged {info['tensors']} tensors ({info['layers']} layers) into {args.out_dir} "
              f"in {info['seconds']:.1f} s")
        if not info["finite"]:
            print("warning: the merged weights contain NaN or inf")
    run_main(body, "merge", cli=True)


if __name__ == "__main__":
    main()
