"""Worker inner-loop throughput against a bare PyTorch loop on the same model and batch; the memory-lean loss.

    python bench/inner_overhead.py [--model configs/tiny-llama.json] [--steps 30] [--repeats 5] [--device cpu]
    python bench/inner_overhead.py --torchrun 2     # the same for a worker of 2 processes (gloo on CPU)

ours: train.core.inner.InnerTrainer.train_steps fed by train.core.data.ShardSampler from the memory-mapped token
cache (lr schedule, grad clipping, loss bookkeeping with a read-back every inner.log_every steps, heartbeat
callback), with the device's defaults (`auto`: on CPU fp32, eager, foreach AdamW; on CUDA bf16 autocast, compile,
fused AdamW). bare: the same forward / cross-entropy / backward / clip / AdamW step on batches preloaded in memory,
with torch.optim.AdamW's defaults, in ours' precision (and compiled when ours is: it measures the loop, not the
settings). Interleaved repetitions, median tokens/s (`--clock cpu`: per CPU second of this process, which other
processes on a loaded box disturb far less); target ratio >= 1.0. Then the memory-lean loss
(inner.loss_chunk): our loop with the loss in one piece against `--loss-chunk` tokens at a time (tokens/s), and the
bytes one training forward keeps for the backward pass, in fp32 and under bf16 autocast.
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
from contextlib import nullcontext
from pathlib import Path

from common import REPO, median, save_result, table

import torch
import torch.nn.functional as F


def bare_steps(model, opt, batches, autocast=nullcontext) -> None:
    """The baseline: a bare PyTorch training loop (forward, loss, backward, clip, AdamW step) over `batches`."""
    for batch in batches:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast():
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


def saved_for_backward_mib(model, batch, precision: str, chunk: int, device) -> float:
    """MiB of activations one training forward (model + loss) keeps for the backward pass: the distinct storages
    autograd saves, parameters excluded."""
    from train.core.inner import autocast_for, lm_loss
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_for(precision, device):
        loss = lm_loss(model, batch.to(device), chunk)
    del loss
    return sum(seen.values()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/tiny-llama.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU seconds instead of wall seconds (steadier on a loaded CPU box; CPU "
                         "device only)")
    ap.add_argument("--loss-chunk", type=int, default=512, help="tokens per chunk in the lean-loss comparison; "
                                                                "0 skips it")
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

    from train.config import build_config
    from train.core.data import ShardSampler, TokenData, prepare_data
    from train.core.heartbeat import Heartbeat
    from train.core.inner import InnerTrainer, autocast_for, resolve_compile
    from train.core.model import build_model, load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="edt-inner-"))

    def config(**inner):
        return build_config({"base_dir": str(tmp), "model": {"name": str(REPO / args.model)},
                             "data": {"seq_length": args.seq, "max_tokens": 400_000},
                             "inner": {"per_device_batch_size": args.batch, "total_batch_size": args.batch,
                                       "device": args.device, **inner},
                             "outer": {"num_workers": 1, "rounds": 1, "local_steps": args.steps}})

    cfg = config()
    data = TokenData.open(prepare_data(cfg, load_tokenizer(cfg), 2048, progress=False), args.seq, 0.02)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.clock == "cpu" and device.type != "cpu":
        sys.exit("--clock cpu measures CPU seconds: only with --device cpu")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tokens = args.steps * args.batch * args.seq
    hb = Heartbeat(tmp / "progress.json", 0)

    def ours_fn(trainer):
        sampler = ShardSampler(data, 0, 1, cfg.seed)

        def run() -> float:
            sync()
            t0 = clock()
            trainer.train_steps(sampler.next_batch, args.steps,
                                lambda i, loss: hb.beat(status="training", round=0, step=i + 1, loss=loss))
            sync()
            return tokens / (clock() - t0)
        return run

    trainer = InnerTrainer(cfg, build_model(cfg), device)
    bare_model = build_model(cfg).to(device)
    bare_model.train()
    bare_fwd = torch.compile(bare_model) if resolve_compile(cfg.inner.compile, device) else bare_model
    opt = torch.optim.AdamW(bare_model.parameters(), lr=cfg.inner.lr, betas=(0.9, 0.95), weight_decay=0.1)
    pre = [ShardSampler(data, 0, 1, 1).next_batch(args.batch).to(device) for _ in range(args.steps)]

    def bare() -> float:
        sync()
        t0 = clock()
        bare_steps(bare_fwd, opt, pre, lambda: autocast_for(trainer.precision, device))
        sync()
        return tokens / (clock() - t0)

    setting = f"{trainer.precision}, compile {'on' if bare_fwd is not bare_model else 'off'}, {args.clock} clock"
    b, o, ratio = interleaved(bare, ours_fn(trainer), args.repeats, "bare", "ours", verbose=True)
    print(table([["bare PyTorch loop", f"{median(b):.0f}"], ["our inner loop", f"{median(o):.0f}"],
                 ["ratio (target >= 1.0)", f"{ratio:.3f}"]],
                [f"{args.model}, batch {args.batch}x{args.seq}, {device.type} ({setting})", "tokens/s (median)"]))
    record = {"args": vars(args), "device": device.type, "precision": trainer.precision, "bare_tok_s": b,
              "ours_tok_s": o, "ratio": ratio}

    if args.loss_chunk:
        # The lean loss: speed of our loop with it (same precision), and what a forward keeps for the backward.
        plain, lean = (InnerTrainer(config(loss_chunk=c), build_model(cfg), device) for c in (0, args.loss_chunk))
        p_tok, l_tok, loss_ratio = interleaved(ours_fn(plain), ours_fn(lean), args.repeats, "one piece",
                                               f"chunks of {args.loss_chunk}", verbose=True)
        batch = pre[0]
        mem = {prec: [saved_for_backward_mib(plain.model, batch, prec, c, device) for c in (0, args.loss_chunk)]
               for prec in ("fp32", "bf16-mixed")}
        print(table([["loss in one piece", f"{median(p_tok):.0f}", f"{mem['fp32'][0]:.1f}",
                      f"{mem['bf16-mixed'][0]:.1f}"],
                     [f"loss in chunks of {args.loss_chunk}", f"{median(l_tok):.0f}", f"{mem['fp32'][1]:.1f}",
                      f"{mem['bf16-mixed'][1]:.1f}"],
                     ["ratio chunked / one piece", f"{loss_ratio:.3f}", f"{mem['fp32'][1] / mem['fp32'][0]:.3f}",
                      f"{mem['bf16-mixed'][1] / mem['bf16-mixed'][0]:.3f}"]],
                    [f"lean loss, {device.type}, {plain.precision}", "tokens/s (median)",
                     "saved for backward, fp32 (MiB)", "... bf16 autocast (MiB)"]))
        record.update(loss_one_piece_tok_s=p_tok, loss_chunked_tok_s=l_tok, loss_ratio=loss_ratio,
                      saved_mib={k: {"one_piece": v[0], "chunked": v[1]} for k, v in mem.items()})
    save_result("inner_overhead", record)


def group_bench(args) -> None:
    """Inside torchrun: our worker group against bare DDP processes, same model, same per-rank batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from train.config import build_config
    from train.core.data import ShardSampler, TokenData, prepare_data
    from train.core.dist import RankBatches, broadcast_json, close_group, init_group
    from train.core.inner import InnerTrainer
    from train.core.model import build_model, load_tokenizer
    from train.core.heartbeat import Heartbeat

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
                     ["ratio (target >= 1.0)", f"{ratio:.3f}"]],
                    [f"{args.model}, batch {args.batch}x{args.seq} over {n} gloo ranks", "tokens/s (median)"]))
        save_result("inner_overhead_torchrun", {"args": vars(args), "bare_tok_s": b, "ours_tok_s": o,
                                                "ratio": ratio})
    close_group()


if __name__ == "__main__":
    main()
