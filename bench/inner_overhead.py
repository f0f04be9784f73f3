"""Worker inner-loop throughput against a bare PyTorch loop on the same model and batch.

    python bench/inner_overhead.py [--model configs/tiny-llama.json] [--steps 30] [--repeats 5]
    python bench/inner_overhead.py --torchrun 2     # the same for a worker of 2 processes (gloo on CPU)

ours: train.core.inner.InnerTrainer.train_steps fed by train.core.data.ShardSampler from the memory-mapped token
cache (lr
schedule, grad clipping, loss bookkeeping, heartbeat callback). bare: the same forward / cross-entropy / backward /
clip / AdamW step on batches preloaded in memory. Interleaved repetitions, median tokens/s; target ratio >= 0.97.
Writes bench/results/inner_overhead.json.

--torchrun N: ours is a torchrun worker group (train/core/dist.py: DDP, each rank a slice of every step's batch via
RankBatches, group-mean loss); bare is N plain DDP processes on preloaded batches of the same per-rank size. Both
run inside one `torchrun --nproc_per_node N` launch. Writes bench/results/inner_overhead_torchrun.json.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, median, save_result, table

import torch
import torch.nn.functional as F


def bare_steps(model, opt, batches) -> None:
    """The baseline: a bare PyTorch training loop (forward, loss, backward, clip, AdamW step) over `batches`."""
    for batch in batches:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def interleaved(bare, ours, repeats: int, bare_name: str, ours_name: str, verbose: bool):
    """One warm-up each, then `repeats` alternating measurements (tokens/s); the median per-pair ratio ours/bare
    (pairs taken close in time cancel most of a noisy machine's drift)."""
    bare(), ours()
    b, o = [], []
    for i in range(repeats):
        b.append(bare())
        o.append(ours())
        if verbose:
            print(f"  repeat {i + 1}: {bare_name} {b[-1]:.0f} tok/s, {ours_name} {o[-1]:.0f} tok/s", flush=True)
    return b, o, median([x / y for x, y in zip(o, b)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/tiny-llama.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--torchrun", type=int, default=0, metavar="N", help="compare a worker of N processes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.torchrun and "RANK" not in os.environ:  # relaunch ourselves as the group
        argv = sys.argv[1:]
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                  str(args.torchrun), __file__, *argv], cwd=REPO))
    if args.torchrun:
        return group_bench(args)

    from train.core.config import build_config
    from train.core.data import ShardSampler, TokenData, prepare_data
    from train.core.inner import InnerTrainer
    from train.core.model import build_model, load_tokenizer
    from train.diloco.worker import Heartbeat

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
        bare_steps(bare_model, opt, pre)
        return args.steps * args.batch * args.seq / (time.perf_counter() - t0)

    def ours() -> float:
        t0 = time.perf_counter()
        trainer.train_steps(sampler.next_batch, args.steps,
                            lambda i, loss: hb.beat(status="training", round=0, step=i + 1, loss=loss))
        return args.steps * args.batch * args.seq / (time.perf_counter() - t0)

    b, o, ratio = interleaved(bare, ours, args.repeats, "bare", "ours", verbose=True)
    print(table([["bare PyTorch loop", f"{median(b):.0f}"], ["our inner loop", f"{median(o):.0f}"],
                 ["ratio (target >= 0.97)", f"{ratio:.3f}"]],
                [f"{args.model}, batch {args.batch}x{args.seq}", "tokens/s (median)"]))
    save_result("inner_overhead", {"args": vars(args), "bare_tok_s": b, "ours_tok_s": o, "ratio": ratio})


def group_bench(args) -> None:
    """Inside torchrun: our worker group against bare DDP processes, same model, same per-rank batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from train.core.config import build_config
    from train.core.data import ShardSampler, TokenData, prepare_data
    from train.core.dist import RankBatches, broadcast_json, close_group, init_group
    from train.core.inner import InnerTrainer
    from train.core.model import build_model, load_tokenizer
    from train.diloco.worker import Heartbeat

    n = args.torchrun
    tmp = Path(tempfile.gettempdir()) / f"edt-inner-dist-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}"
    cfg = build_config({"base_dir": str(tmp), "model": {"name": str(REPO / args.model)},
                        "data": {"seq_length": args.seq, "max_tokens": 400_000},
                        "inner": {"per_device_batch_size": args.batch // n, "total_batch_size": args.batch,
                                  "device": "cpu", "nproc_per_node": n},
                        "outer": {"num_workers": 1, "rounds": 1, "local_steps": args.steps}})
    info, device = init_group(cfg)
    # rank 0 builds the token cache (as the coordinator would) and tells the others where it is
    cache = str(prepare_data(cfg, load_tokenizer(cfg), 2048, progress=False)) if info.main else None
    data = TokenData.open(Path(broadcast_json(cache, info, device)), args.seq, 0.02)
    trainer = InnerTrainer(cfg, build_model(cfg), device, info)
    batches = RankBatches(ShardSampler(data, 0, 1, cfg.seed), info, args.batch)
    hb = Heartbeat(tmp / f"progress-{info.rank}.json", 0)

    bare_model = DDP(build_model(cfg).to(device))
    opt = torch.optim.AdamW(bare_model.parameters(), lr=cfg.inner.lr, betas=(0.9, 0.95), weight_decay=0.1)
    pre_sampler = RankBatches(ShardSampler(data, 0, 1, 1), info, args.batch)
    pre = [pre_sampler.next_batch(args.batch // n) for _ in range(args.steps)]

    def bare() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        bare_steps(bare_model, opt, pre)
        dist.barrier()
        return args.steps * args.batch * args.seq / (time.perf_counter() - t0)  # the whole group's tokens

    def ours() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_steps(batches.next_batch, args.steps,
                            lambda i, loss: info.main and hb.beat(status="training", round=0, step=i + 1, loss=loss))
        dist.barrier()
        return args.steps * args.batch * args.seq / (time.perf_counter() - t0)

    b, o, ratio = interleaved(bare, ours, args.repeats, "bare DDP", "our worker group", verbose=info.main)
    if info.main:
        print(table([[f"{n} bare DDP processes", f"{median(b):.0f}"], [f"our {n}-process worker", f"{median(o):.0f}"],
                     ["ratio (target >= 0.97)", f"{ratio:.3f}"]],
                    [f"{args.model}, batch {args.batch}x{args.seq} over {n} gloo ranks", "tokens/s (median)"]))
        save_result("inner_overhead_torchrun", {"args": vars(args), "bare_tok_s": b, "ours_tok_s": o,
                                                "ratio": ratio})
    close_group()


if __name__ == "__main__":
    main()
