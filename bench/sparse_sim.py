"""An in-process simulation of DiLoCo(N) for the sparse exchange's density–loss curve (bench/compression.py --sparse).

Faithful to the process run where it matters: the same model (bench-llama), the same corpus, tokenizer and held-out
windows as `diloco_sim.py` at bench/quality.py's setting, one InnerTrainer per worker whose AdamW state lives across
rounds, the data layout's disjoint slices (worker w of round r reads stream windows [(r·N + w)·H·B, +H·B), what
Layout.single gives), and the exchange's own code: train/exchange/sparse.py's codec and Residual (error feedback with
β) on the way out, its fixed-order sum and sparse_step (θ − α · mean) on the way back; fp32 DiLoCo through
train/exchange/outer.py's outer_step_tensor. What it leaves out is the file protocol (no bytes, no processes): the
process runs that confirm two points are in bench/compression.py's quality().
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from common import REPO


def _setup(seed: int, steps: int, batch: int, seq: int, lr: float):
    from train.config import load_config
    from train.core.data import TokenData, prepare_data
    from train.core.model import build_model, check_model_fits, load_tokenizer

    tmp = Path(tempfile.gettempdir()) / "edt-sparse-sim"  # kept: the tokenized corpus is reused run to run
    cfg = load_config(REPO / "evolution.json", [
        f"base_dir={tmp}", "project_name=sim", f"model.name={REPO / 'configs' / 'bench-llama.json'}",
        f"data.seq_length={seq}", f"inner.lr={lr}", f"inner.per_device_batch_size={batch}",
        f"inner.total_batch_size={batch}", "inner.warmup_steps=20", "eval.batches=16", f"inner.total_steps={steps}",
        f"seed={seed}", "inner.device=cpu"])
    tok = load_tokenizer(cfg)
    torch.manual_seed(seed)
    model = build_model(cfg)
    vocab = check_model_fits(cfg, model, tok)
    data = TokenData.open(prepare_data(cfg, tok, vocab, progress=False), seq, cfg.data.eval_fraction)
    return tmp, cfg, model, data


def simulate(*, workers: int = 4, steps: int = 300, H: int = 25, batch: int = 16, seq: int = 64, lr: float = 3e-3,
             seed: int = 0, exchange: str = "fp32", density: float = 64 / 4096, chunk: int = 4096,
             values: str = "2bit", beta: float = 0.95, outer_lr: float = 1.0, momentum: float = 0.0,
             union_stats: bool = False) -> dict:
    """One run; returns {eval_loss, ...}; with union_stats, the mean size of the union of the first n workers'
    selections relative to one worker's, n = 1..workers (what a coordinator update would have to carry)."""
    from train.core.data import StreamSampler
    from train.core.inner import InnerTrainer, evaluate
    from train.exchange.outer import outer_step_tensor
    from train.exchange.codec import Residual
    from train.exchange.sparse import SparseCodec, sparse_step

    tmp, cfg, model0, data = _setup(seed, steps, batch, seq, lr)
    names = [n for n, _ in model0.named_parameters()]
    theta = {n: p.detach().clone().float() for n, p in model0.named_parameters()}
    codec = SparseCodec(density=density, chunk=chunk, values=values, ef_decay=beta)
    ws = []
    for w in range(workers):
        torch.manual_seed(seed * 1000 + w)
        m = type(model0)(model0.config)
        trainer = InnerTrainer(cfg, m, torch.device("cpu"))
        ws.append((trainer, StreamSampler(data, seed), Residual(codec)))
    mom: dict = {}
    unions: list[list[float]] = []
    for r in range(steps // H):
        sent = []
        for w, (trainer, sampler, res) in enumerate(ws):
            params = dict(trainer.model.named_parameters())
            with torch.no_grad():
                for n in names:
                    params[n].copy_(theta[n])
            sampler.begin((r * workers + w) * H * batch, H * batch)
            trainer.train_steps(sampler.next_batch, H)
            delta = {n: theta[n] - params[n].detach().float() for n in names}
            if exchange == "fp32":
                sent.append(delta)
            else:
                sent.append({n: res.send(n, delta[n])[1] for n in names})
        if union_stats and exchange != "fp32":
            row = []
            for k in range(1, workers + 1):
                u = sum(int((torch.stack([s[n] != 0 for s in sent[:k]]).any(0)).sum()) for n in names)
                one = sum(int((sent[0][n] != 0).sum()) for n in names)
                row.append(u / one)
            unions.append(row)
        for n in names:
            mean = torch.stack([s[n] for s in sent]).to(torch.float64).mean(0).to(torch.float32)
            if exchange == "fp32":
                theta[n], mom[n] = outer_step_tensor(theta[n], mean, mom.get(n), outer_lr, momentum,
                                                     momentum > 0)
            else:
                theta[n] = sparse_step(theta[n], mean, outer_lr)
    with torch.no_grad():
        p0 = dict(model0.named_parameters())
        for n in names:
            p0[n].copy_(theta[n])
    windows = torch.from_numpy(data.eval_windows(cfg.eval.batches * cfg.eval.batch_size))
    loss = evaluate(model0, windows, cfg.eval.batch_size, torch.device("cpu"))
    out = {"eval_loss": loss}
    if unions:
        out["union"] = [sum(c) / len(c) for c in zip(*unions)]
    return out


def main() -> None:
    """The curve: every combination of the options, appended to --out (JSON lines) as each run ends."""
    import argparse
    import itertools
    import json
    import time

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--fp32", action="store_true", help="also the fp32 DiLoCo run (averaging: lr 1, momentum 0)")
    ap.add_argument("--fp32-nesterov", action="store_true", help="also fp32 DiLoCo with lr 0.7, Nesterov 0.9")
    ap.add_argument("--densities", type=float, nargs="*", default=[])
    ap.add_argument("--values", nargs="+", default=["2bit"])
    ap.add_argument("--beta", type=float, nargs="+", default=[0.95])
    ap.add_argument("--outer-lr", type=float, nargs="+", default=[1.0])
    ap.add_argument("--chunk", type=int, nargs="+", default=[4096])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--union", action="store_true", help="record the union of the workers' selections")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sparse_curve.jsonl"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    for seed in args.seeds:
        if args.fp32:
            runs.append({"exchange": "fp32", "seed": seed, "outer_lr": 1.0, "momentum": 0.0})
        if args.fp32_nesterov:
            runs.append({"exchange": "fp32", "seed": seed, "outer_lr": 0.7, "momentum": 0.9})
        for d, v, b, a, c in itertools.product(args.densities, args.values, args.beta, args.outer_lr, args.chunk):
            runs.append({"exchange": "topk", "seed": seed, "density": d, "values": v, "beta": b, "outer_lr": a,
                         "chunk": c, "union_stats": args.union})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for spec in runs:
        t = time.perf_counter()
        res = simulate(workers=args.workers, steps=args.steps, H=args.H, **spec)
        rec = {**spec, "workers": args.workers, "steps": args.steps, "H": args.H, **res,
               "seconds": round(time.perf_counter() - t, 1)}
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
