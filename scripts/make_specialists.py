"""Fine-tune the offline EvoMerge demo's parents: a base and one specialist per synthetic task
(train/evomerge/specialists.py).

    python scripts/make_specialists.py                          # -> runs/evomerge-models/{base,addition,reverse,sort}
    python scripts/make_specialists.py --out /tmp/m --fast      # a few steps: a smoke test, not good models

About 5.5 CPU-minutes; measured 5m35s wall on a heavily shared 2-core box with the default --jobs 2.
Rerunning skips finished models (resume) and rewrites accuracy.json / accuracy.md: exact-match accuracy of every
model on every task's fixed held-out items.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    from train.evomerge.tasks import TASKS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "evomerge-models")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=sorted(TASKS))
    ap.add_argument("--base-steps", type=int, default=400, help="SFT steps of the base on the mix of all tasks")
    ap.add_argument("--steps", type=int, default=250, help="SFT steps of each specialist on its own task")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--specialist-lr", type=float, default=1e-3, help="peak lr of the specialists")
    ap.add_argument("--min-lr-ratio", type=float, default=0.3, help="cosine decay to lr * this")
    ap.add_argument("--jobs", type=int, default=2, help="specialists trained at once (processes, 1 thread each)")
    ap.add_argument("--eval-items", type=int, default=100, help="held-out items per task for the accuracy table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-config", type=Path, default=REPO / "configs" / "tiny-llama.json",
                    help="HF config JSON of the base model (random init)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch's default; 1 is fastest for this tiny model on a busy CPU)")
    ap.add_argument("--fast", action="store_true", help="10 base + 20 specialist steps, <= 16 eval items (tests)")
    args = ap.parse_args()
    if args.fast:
        args.base_steps, args.steps, args.eval_items = 10, 20, min(args.eval_items, 16)

    import torch

    from train.core.model import quiet_transformers
    from train.evomerge.specialists import make_specialists, markdown_table
    from train.core.store import read_json

    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    make_specialists(args.out, tuple(args.tasks), base_steps=args.base_steps, steps=args.steps,
                     batch_size=args.batch_size, lr=args.lr, specialist_lr=args.specialist_lr,
                     min_lr_ratio=args.min_lr_ratio, jobs=args.jobs, eval_items=args.eval_items, seed=args.seed,
                     model_config=args.model_config)
    print(markdown_table(read_json(args.out / "accuracy.json")))
    print(f"models and accuracy.json / accuracy.md in {args.out}")
    return 0


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "make_specialists", cli=True)
