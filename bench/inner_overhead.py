"""Worker inner-loop throughput against a bare PyTorch loop on the same model and batch.

    python bench/inner_overhead.py [--model configs/tiny-llama.json] [--steps 30] [--repeats 5]

ours: train.inner.InnerTrainer.train_steps fed by train.data.ShardSampler from the memory-mapped token cache (lr
schedule, grad clipping, loss bookkeeping, heartbeat callback). bare: the same forward / cross-entropy / backward /
clip / AdamW step on batches preloaded in memory. Interleaved repetitions, median tokens/s; target ratio >= 0.97.
Writes bench/results/inner_overhead.json.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import REPO, median, save_result, table

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/tiny-llama.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from train.config import build_config
    from train.data import ShardSampler, TokenData, prepare_data
    from train.inner import InnerTrainer
    from train.model import build_model, load_tokenizer
    from train.worker import Heartbeat

    tmp = Path(tempfile.mkdtemp(prefix="edt-inner-"))
    cfg = build_config({"base_dir": str(tmp), "model": {"name": str(REPO / args.model)},
                        "data": {"seq_length": args.seq, "max_tokens": 400_000},
                        "inner": {"per_device_batch_size": args.batch, "total_batch_size": args.batch,
                                  "device": "cpu"},
                        "outer": {"num_workers": 1, "rounds": 1, "local_steps": args.steps}})
    data = TokenData.open(prepare_data(cfg, load_tokenizer(cfg), 2048, progress=False), args.seq, 0.02)
    device = torch.device("cpu")

    ours_model = build_model(cfg)
    trainer = InnerTrainer(cfg, ours_model, device)
    sampler = ShardSampler(data, 0, 1, cfg.seed)
    hb = Heartbeat(tmp / "progress.json", 0)

    bare_model = build_model(cfg).to(device)
    bare_model.train()
    opt = torch.optim.AdamW(bare_model.parameters(), lr=cfg.inner.lr, betas=(0.9, 0.95), weight_decay=0.1)
    pre = [ShardSampler(data, 0, 1, 1).next_batch(args.batch) for _ in range(args.steps)]

    def bare() -> float:
        t0 = time.perf_counter()
        for batch in pre:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            logits = bare_model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return args.steps * args.batch * args.seq / (time.perf_counter() - t0)

    def ours() -> float:
        t0 = time.perf_counter()
        trainer.train_steps(sampler.next_batch, args.steps,
                            lambda i, loss: hb.beat(status="training", round=0, step=i + 1, loss=loss))
        return args.steps * args.batch * args.seq / (time.perf_counter() - t0)

    bare(), ours()  # warm-up
    b, o = [], []
    for i in range(args.repeats):
        b.append(bare())
        o.append(ours())
        print(f"  repeat {i + 1}: bare {b[-1]:.0f} tok/s, ours {o[-1]:.0f} tok/s", flush=True)
    ratio = median([x / y for x, y in zip(o, b)])
    print(table([["bare PyTorch loop", f"{median(b):.0f}"], ["our inner loop", f"{median(o):.0f}"],
                 ["ratio (target >= 0.97)", f"{ratio:.3f}"]],
                [f"{args.model}, batch {args.batch}x{args.seq}", "tokens/s (median)"]))
    save_result("inner_overhead", {"args": vars(args), "bare_tok_s": b, "ours_tok_s": o, "ratio": ratio})


if __name__ == "__main__":
    main()
