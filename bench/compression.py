"""Bytes per round and loss of the compressed exchange (outer.compression), against the fp32 protocol.

    python bench/compression.py                 # bytes table (107M shape) + quality runs (~15 min on 2 cores)
    python bench/compression.py --bytes-only    # the exact bytes tables only (seconds)
    python bench/compression.py --seeds 0 1 --codecs none int8 int4

1. Bytes: every tensor file a round moves through BASE_DIR, per process, from the file format itself (the
   safetensors header + data of each file the protocol writes or reads, as tensorio.StreamingWriter sizes them), for
   the SmolLM2-135M shape with vocab 2048 (107M parameters) and 4 workers — exact on any machine, no GPU needed. The
   same arithmetic applied to the quality runs below is checked against what their processes recorded in
   metrics.jsonl (bytes_total), so the model of the protocol is the protocol. JSON files (sidecars, markers,
   heartbeats: a few KB per round) are not counted, on either side.
   "fp32 (protocol 1)" is the exchange as the issue measured it: each worker writes its fp32 delta and AdamW state
   and reads the fp32 global; the coordinator reads the global, the momentum and every delta and writes the global
   and the momentum.
2. Quality: real `diloco_sim.py` runs at the bench/quality.py setting (bench-llama, 4 workers, equal tokens) for
   each codec; eval loss on the same held-out windows, Δ against the fp32 run of the same seed.
Writes bench/results/compression.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import REPO, fold_steps, fold_summary, overlap_sets, save_result, smollm_config, table

import torch

sys.path.insert(0, str(REPO))


def file_bytes(specs: dict, metadata: dict | None = None) -> int:
    """The exact size of a safetensors file with these tensors, as the protocol writes it."""
    from train.core.tensorio import StreamingWriter
    return StreamingWriter(Path("/nonexistent/x.safetensors"), specs, metadata).nbytes


def model_shapes(config) -> dict[str, tuple]:
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


def round_bytes(shapes: dict[str, tuple], workers: int, codec: str, block: int = 128, state: str = "base",
                checkpoint_every: int = 20, old_protocol: bool = False) -> dict:
    """Bytes through BASE_DIR in one round, steady state, checkpoints amortised: {'workers': w+r of all workers,
    'coordinator': ..., 'total': ...}. state: base (inner state on BASE_DIR every round) or local (host-local)."""
    from train.exchange.codec import get_codec

    f32 = {n: (torch.float32, s) for n, s in shapes.items()}
    weights = file_bytes(f32, {"format": "pt"})
    momentum = file_bytes(f32, {"round": "1"})
    adam = {}
    for n, s in shapes.items():
        adam.update({f"{n}::exp_avg": (torch.float32, s), f"{n}::exp_avg_sq": (torch.float32, s),
                     f"{n}::step": (torch.float32, (1,))})
    compressed = codec not in ("none", "float32")
    c = get_codec(codec, block)
    specs = {}
    for n, s in shapes.items():
        specs.update(c.specs(n, s))
    delta = file_bytes(specs, {"round": "1", "worker": "0", **c.metadata()})
    residual = {f"residual::{n}": (torch.float32, s) for n, s in shapes.items()} if compressed else {}
    opt = file_bytes({**adam, **residual}) if state == "base" else 0
    if not compressed:
        w_read, w_write = weights, delta + opt
        c_read, c_write = workers * delta, weights + momentum
        if old_protocol:
            c_read += weights + momentum
    else:
        update = file_bytes(specs, {"round": "1", **c.metadata()})
        ckpt = weights + file_bytes({**f32, **{f"residual::{n}": (torch.float32, s) for n, s in shapes.items()}},
                                    {"round": "1"})
        w_read, w_write = update, delta + opt
        c_read, c_write = workers * delta, update + ckpt / checkpoint_every
    out = {"workers": workers * (w_read + w_write), "coordinator": c_read + c_write}
    out["total"] = out["workers"] + out["coordinator"]
    return out


def sparse_round_bytes(shapes: dict[str, tuple], workers: int, codec, state: str = "local",
                       checkpoint_every: int = 20, way: str = "all-read", union: float = 1.0) -> dict:
    """Bytes of one topk round (train/exchange/sparse.py), steady state, checkpoints amortised. way:
    all-read (what is built: every worker reads the N sparse deltas of the round and sums them itself; the
    coordinator reads them to check them and writes only its checkpoints) or the alternative, a coordinator update:
    update-fp32 (the N selections' union, `union` x one worker's count, with fp32 values and 12-bit offsets plus a
    uint16 count per chunk: lossless, the paper's aggregate) or update-2bit (that union at 2 bits, one scale per
    chunk, plus a coordinator residual: a second lossy stage), which every worker reads."""
    f32 = {n: (torch.float32, s) for n, s in shapes.items()}
    weights = file_bytes(f32, {"format": "pt"})
    specs = {}
    for n, s in shapes.items():
        specs.update(codec.specs(n, s))
    delta = file_bytes(specs, {"round": "1", "worker": "0", **codec.metadata()})
    adam = {}
    for n, s in shapes.items():
        adam.update({f"{n}::exp_avg": (torch.float32, s), f"{n}::exp_avg_sq": (torch.float32, s),
                     f"{n}::step": (torch.float32, (1,)), f"residual::{n}": (torch.float32, s)})
    opt = file_bytes(adam) if state == "base" else 0
    if way == "all-read":
        w_read, c_read, c_write = workers * delta, workers * delta, weights / checkpoint_every
    else:
        u_specs = {}
        for n, s in shapes.items():
            K, chunks = codec.count(torch.Size(s).numel())
            k = int(round(K * union))
            vbits = 32 if way == "update-fp32" else codec.vbits
            u_specs.update({n + "::count": (torch.int16, (chunks,)),
                            n + "::idx": (torch.uint8, (-(-k * codec.ibits // 8),)),
                            n + "::val": (torch.uint8, (-(-k * vbits // 8),))})
            if way == "update-2bit":
                u_specs[n + "::scale"] = (torch.float32, (chunks,))
        update = file_bytes(u_specs, {"round": "1", **codec.metadata()})
        ckpt = weights + (file_bytes({f"residual::{n}": (torch.float32, s) for n, s in shapes.items()})
                          if way == "update-2bit" else 0)
        w_read, c_read, c_write = update, workers * delta, update + ckpt / checkpoint_every
    out = {"workers": workers * (w_read + delta + opt), "coordinator": c_read + c_write, "delta": delta}
    out["total"] = out["workers"] + out["coordinator"]
    return out


def sparse_ways_table(shapes: dict[str, tuple], codec, base: float, unions: dict[int, float]) -> tuple[list, dict]:
    """Item 2 of #27: how θ reaches every copy, bytes both ways for N = 2..16 (host-local state). For each N: the
    built way (every worker reads the N deltas), a coordinator update at the measured union (when measured), and the
    union below which that update would be the cheaper (the break-even)."""
    rows, out = [], {}
    for N in (2, 4, 8, 16):
        b = sparse_round_bytes(shapes, N, codec, way="all-read")["total"]
        ref = round_bytes(shapes, N, "none", old_protocol=True)["total"]
        row = {"all-read": b, "fp32 protocol 1": ref}
        even = {}
        for way in ("update-fp32", "update-2bit"):
            lo, hi = 0.0, float(N)
            for _ in range(40):  # bisect the union at which the update costs what all-read costs
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if sparse_round_bytes(shapes, N, codec, way=way, union=mid)["total"] < b else \
                    (lo, mid)
            even[way] = lo
            if N in unions:
                row[way] = sparse_round_bytes(shapes, N, codec, way=way, union=unions[N])["total"]
        row["break_even_union"] = even
        out[N] = row
        u = unions.get(N)
        rows.append([N, f"{b / 1e9:.3f} GB ({b / ref * 100:.2f}%)",
                     f"{u:.2f}" if u else "-",
                     f"{row['update-fp32'] / 1e9:.3f} GB" if u else "-",
                     f"{row['update-2bit'] / 1e9:.3f} GB" if u else "-",
                     f"{even['update-fp32']:.2f} / {even['update-2bit']:.2f}"])
    return rows, out


def bytes_table(args) -> tuple[list, dict]:
    shapes = model_shapes(smollm_config(False).__class__(**{**smollm_config(False).to_dict(), "vocab_size": 2048}))
    nparams = sum(torch.Size(s).numel() for s in shapes.values())
    base = round_bytes(shapes, args.workers, "none", old_protocol=True)["total"]
    rows, out = [], {"parameters": nparams, "workers": args.workers}
    cases = [("fp32 (protocol 1)", "none", "base", True), ("fp32 (now: θ and m kept in memory)", "none", "base", False)]
    for codec in ("bfloat16", "int8", "int4"):
        cases += [(f"{codec}, state on BASE_DIR", codec, "base", False), (f"{codec}, state host-local", codec,
                                                                           "local", False)]
    for name, codec, state, old in cases:
        b = round_bytes(shapes, args.workers, codec, args.block, state, args.checkpoint_every, old)
        out[name] = b
        rows.append([name, f"{b['workers'] / 1e9:.3f} GB", f"{b['coordinator'] / 1e9:.3f} GB",
                     f"{b['total'] / 1e9:.3f} GB", f"{b['total'] / base * 100:.1f}%"])
    from train.exchange.sparse import SparseCodec
    for d in args.densities:
        for values in ("2bit", "int4", "int8") if d == 64 / 4096 else ("2bit",):
            codec = SparseCodec(density=d, chunk=args.chunk, values=values)
            for state in ("base", "local"):
                b = sparse_round_bytes(shapes, args.workers, codec, state, args.checkpoint_every)
                name = f"topk {d * 100:.2f}% {values}, state {'on BASE_DIR' if state == 'base' else 'host-local'}"
                out[name] = b
                rows.append([name, f"{b['workers'] / 1e9:.3f} GB", f"{b['coordinator'] / 1e9:.3f} GB",
                             f"{b['total'] / 1e9:.3f} GB", f"{b['total'] / base * 100:.2f}%"])
    print(f"\nBytes through BASE_DIR per round: {nparams / 1e6:.1f}M parameters (SmolLM2-135M shape, vocab 2048), "
          f"{args.workers} workers, block {args.block}, checkpoint every {args.checkpoint_every} rounds (amortised); "
          f"topk: chunk {args.chunk}")
    print(table(rows, ["exchange", "workers (r+w)", "coordinator (r+w)", "total", "vs protocol 1"]))
    unions = {}
    if args.unions and Path(args.unions).is_file():  # measured by bench/sparse_sim.py --union (16 workers)
        for line in Path(args.unions).read_text().splitlines():
            rec = json.loads(line)
            if rec.get("union") and abs(rec.get("density", 0) - 64 / 4096) < 1e-9:
                unions = {n + 1: u for n, u in enumerate(rec["union"])}
    wrows, ways = sparse_ways_table(shapes, SparseCodec(chunk=args.chunk), base, unions)
    out["ways"] = ways
    print("\nHow θ reaches every copy (topk 1.56% 2bit, host-local state): every worker reads the N sparse deltas "
          "(built) vs a coordinator update carrying the union of the N selections (u = union / one worker's count, "
          "measured on real pseudo-gradients when --unions names bench/sparse_sim.py --union output)")
    print(table(wrows, ["N", "all-read (vs protocol 1 at N)", "measured u", "update fp32", "update 2bit",
                        "break-even u (fp32 / 2bit)"]))
    return rows, out


def block_errors(steps: int = 25, rounds: int = 3) -> tuple[list, dict]:
    """Relative L2 error ||Δ − decode(encode(Δ))|| / ||Δ|| of real pseudo-gradients (bench-llama, `rounds` x
    `steps` AdamW steps on the shipped corpus) for int8 / int4 against the block size ('tensor': one scale each)."""
    from train.config import build_config
    from train.core.data import ShardSampler, TokenData, prepare_data
    from train.core.inner import InnerTrainer
    from train.core.model import build_model, load_tokenizer
    from train.exchange.codec import get_codec

    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="edt-blocks-"))
    try:
        cfg = build_config({"base_dir": str(tmp), "project_name": "blocks",
                            "model": {"name": str(REPO / "configs" / "bench-llama.json")},
                            "data": {"seq_length": 64, "max_tokens": 400_000},
                            "inner": {"lr": 3e-3, "warmup_steps": 20, "per_device_batch_size": 16,
                                      "total_batch_size": 16, "device": "cpu"}})
        tok, model = load_tokenizer(cfg), build_model(cfg)
        data = TokenData.open(prepare_data(cfg, tok, model.config.vocab_size, progress=False), 64, 0.02)
        sampler = ShardSampler(data, 0, 1, 0, 0)
        trainer = InnerTrainer(cfg, model, torch.device("cpu"))
        blocks = [32, 64, 128, 256, 1024, "tensor"]
        errs: dict = {}
        theta = {n: p.detach().clone() for n, p in model.named_parameters()}
        for _ in range(rounds):
            trainer.train_steps(sampler.next_batch, steps)
            delta = {n: theta[n] - p.detach() for n, p in model.named_parameters()}
            theta = {n: p.detach().clone() for n, p in model.named_parameters()}
            for codec in ("int8", "int4"):
                for b in blocks:
                    num = den = 0.0
                    for n, x in delta.items():
                        c = get_codec(codec, x.numel() + x.numel() % 2 if b == "tensor" else b)
                        y = c.decode(n, c.encode(n, x), tuple(x.shape))
                        num += float(((x - y) ** 2).sum())
                        den += float((x ** 2).sum())
                    errs.setdefault(codec, {}).setdefault(str(b), []).append((num / den) ** 0.5)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [[codec] + [f"{statistics.mean(v[str(b)]) * 100:.2f}%" for b in blocks] for codec, v in errs.items()]
    print(f"\nRelative error of real pseudo-gradients (bench-llama, {rounds} rounds of {steps} steps) by block size")
    print(table(rows, ["codec"] + [str(b) for b in blocks]))
    return rows, errs


def quality(args) -> dict:
    from quality import run

    common = ["model.name=configs/bench-llama.json", f"data.seq_length={args.seq}", f"inner.lr={args.lr}",
              f"inner.per_device_batch_size={args.batch}", f"inner.total_batch_size={args.batch}",
              "inner.warmup_steps=20", "eval.batches=16", f"inner.total_steps={args.steps}", "outer.keep_rounds=1",
              "logging.plot=false", f"outer.num_workers={args.workers}", f"outer.local_steps={args.H}",
              f"outer.rounds={args.steps // args.H}", f"outer.lr={args.outer_lr}",
              f"outer.momentum={args.outer_momentum}", f"outer.block_size={args.block}",
              f"outer.checkpoint_every={args.checkpoint_every}", f"outer.chunk_size={args.chunk}"]
    base = Path(tempfile.mkdtemp(prefix="edt-compression-"))
    results: dict = {}
    try:
        for seed in args.seeds:
            for codec in args.codecs:
                name = f"{codec} seed {seed}"
                comp, _, overlap = codec.partition("+")  # e.g. int8+delayed@5: overlap delayed, fold after 5 steps
                sets = [f"outer.compression={comp}", *overlap_sets(overlap, args.H), f"seed={seed}"]
                r = run(base, f"c_{codec}_{seed}", common + sets, args.timeout)
                text = (base / f"c_{codec}_{seed}" / "metrics.jsonl").read_text()
                recs = [json.loads(x) for x in text.splitlines()]
                recs = [x for x in recs if x["round"] > 0]
                r["bytes_per_round"] = statistics.mean(x["bytes_total"] for x in recs)
                shapes = model_shapes(_bench_config())
                state_file = "base"
                # the model's steady state vs the recorded mean (round 1 also reads θ_0: compare rounds >= 2)
                steady = [x["bytes_total"] for x in recs if x["round"] >= 2 and not x.get("checkpoint")]
                if comp == "topk":
                    from train.exchange.sparse import SparseCodec
                    r["model_bytes_per_round"] = sparse_round_bytes(shapes, args.workers, SparseCodec(chunk=args.chunk),
                                                                    state_file, 10 ** 9)["total"]
                else:
                    model = round_bytes(shapes, args.workers, comp, args.block, state_file, args.checkpoint_every)
                    r["model_bytes_per_round"] = round_bytes(shapes, args.workers, comp, args.block, state_file,
                                                             10 ** 9)["total"] if comp != "none" else model["total"]
                r["recorded_steady"] = statistics.mean(steady) if steady else None
                r["fold_steps"] = fold_steps(base / f"c_{codec}_{seed}")
                results[name] = r
                print(f"  {name}: eval loss {r['eval_loss']:.4f}, {r['bytes_per_round'] / 1e6:.2f} MB/round "
                      f"({r['seconds']:.0f}s)", flush=True)
                shutil.rmtree(base / f"c_{codec}_{seed}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def _bench_config():
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(REPO / "configs" / "bench-llama.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--bytes-only", action="store_true")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.005, 64 / 4096, 0.03, 0.05, 0.1, 0.25],
                    help="topk densities of the bytes table")
    ap.add_argument("--chunk", type=int, default=4096, help="topk chunk size")
    ap.add_argument("--no-block-errors", action="store_true", help="skip the int8/int4 error-by-block table")
    ap.add_argument("--unions", default=str(REPO / "bench" / "results" / "sparse_union.jsonl"),
                    help="bench/sparse_sim.py --union output (the measured union of N workers' selections)")
    ap.add_argument("--codecs", nargs="+", default=["none", "int8", "int4", "none+delayed@end", "none+delayed",
                                                        "int8+delayed"],
                    help="outer.compression values; +delayed / +eager also set outer.overlap, and @TAU "
                         "outer.overlap_steps (e.g. int8+delayed@5; @end: fold at the segment's end)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=25)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    rows, bytes_out = bytes_table(args)
    record = {"args": vars(args), "bytes_107M": bytes_out}
    if not args.bytes_only and not args.no_block_errors:
        record["block_errors"] = block_errors()[1]
    if not args.bytes_only:
        res = quality(args)
        record["quality"] = res
        shapes = model_shapes(_bench_config())
        base = round_bytes(shapes, args.workers, "none", old_protocol=True)["total"]
        qrows = []
        for seed in args.seeds:
            ref = res.get(f"none seed {seed}")
            for codec in args.codecs:
                r = res[f"{codec} seed {seed}"]
                d = f"{(r['eval_loss'] / ref['eval_loss'] - 1) * 100:+.2f}%" if ref else "-"
                check = (f"{r['recorded_steady'] / r['model_bytes_per_round']:.4f}"
                         if r.get("recorded_steady") else "-")
                qrows.append([codec, seed, f"{r['bytes_per_round'] / 1e6:.3f} MB",
                              f"{r['bytes_per_round'] / base * 100:.1f}%", f"{r['eval_loss']:.4f}", d, check,
                              fold_summary(r.get("fold_steps", []), args.H)])
        print(f"\nQuality at equal tokens: bench-llama, {args.workers} workers x {args.steps} steps, H={args.H}, "
              f"outer lr {args.outer_lr} momentum {args.outer_momentum}; state on BASE_DIR; bytes are the mean "
              f"recorded per round (all processes, checkpoints included)")
        print(table(qrows, ["exchange", "seed", "bytes/round", "vs protocol 1", "eval loss", "Δ vs fp32",
                            "recorded/model (steady rounds)", "θ folded in (overlap)"]))
    save_result("compression", record)


if __name__ == "__main__":
    main()
