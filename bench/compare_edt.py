"""EDT against DiLoCo and a single worker at equal tokens on the embedded corpus: eval loss and bytes moved.

    python bench/compare_edt.py                         # defaults below (~10-20 min on 2 busy cores)
    python bench/compare_edt.py --seeds 0 1 2 --skip 1xbatch      # repeat the docs/edt.md comparison over 3 seeds
    python bench/compare_edt.py --steps 200 --H 50 --workers 4 --extra-edt edt.crossover=slerp

Every run is a real simulator run (worker processes, BASE_DIR protocol) in a temp folder:
  1 worker, Nx steps     one worker, N x steps at batch B         (the same tokens, sequential)
  1 worker, Nx batch     one worker, `steps` steps at batch N x B (what synchronous data-parallel training does)
  DiLoCo(N)              N workers, H inner steps per round, outer SGD with --diloco-outer-lr / -momentum (default
                         1.0 / 0: parameter averaging, the best of bench/quality.py's sweep at this scale)
  EDT(N)                 population N on N workers, generations = steps / H, mutation = H steps (edt defaults:
                         outer_sgd crossover, tournament 3, elitism 1, the default genes)
  EDT(N), no genes       the same with edt.genes = {} (every member on the configured hyperparameters)
Every run sees steps x N x B x seq tokens. "eval" is the loss of the run's final model on the run's own held-out
windows (for EDT: the best member, *selected* on those windows, so it is optimistic); "test" is the loss on held-out
windows no run ever evaluated on: the honest number. Bytes moved are the tensor bytes written to and read from
BASE_DIR by all processes: workers (model down, delta / mutated model up, EDT's inherited optimizer state, DiLoCo's
per-round optimizer-state save) and coordinator (reads and writes of the reduce / crossover). Writes
bench/results/compare_edt.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, save_result, table


def share_token_cache(base: Path, name: str) -> None:
    """Hard-link a finished run's token cache into the next run's folder: tokenize the corpus once, not per run."""
    for cur in base.glob("*/data/current.json"):
        key = json.loads(cur.read_text())["key"]
        src, dst = cur.parent / key, base / name / "data" / key
        if not dst.exists():
            dst.mkdir(parents=True)
            for f in ("tokens.bin", "meta.json"):
                os.link(src / f, dst / f)
        return


def sim(script: str, base: Path, name: str, sets: list[str], timeout: float) -> Path:
    share_token_cache(base, name)
    cmd = [sys.executable, str(REPO / script), "--config", str(REPO / "evolution.json"), "--base-dir", str(base),
           "--project", name, "--no-progress", *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    print(f"  {name}: {time.perf_counter() - t0:.0f}s", flush=True)
    return base / name


def records(run: Path, key: str) -> list[dict]:
    recs = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[r[key]] = r
    return [recs[k] for k in sorted(recs)]


def diloco_result(run: Path, workers: int) -> dict:
    recs = [r for r in records(run, "round") if r["round"] > 0]
    model_bytes = (run / "final" / "model.safetensors").stat().st_size
    opt = sorted((run / "workers" / "w000").glob("opt-r*.safetensors"))
    opt_bytes = opt[-1].stat().st_size if opt else 0
    w = sum(len(r["workers_used"]) * (model_bytes + opt_bytes) + r["bytes_deltas"] for r in recs)
    c = sum(r["bytes_read"] + r["bytes_written"] for r in recs)
    return {"eval_loss": recs[-1]["eval_loss"], "tokens": recs[-1]["tokens"], "bytes_workers": w,
            "bytes_coordinator": c, "model_bytes": model_bytes}


def edt_result(run: Path) -> dict:
    recs = records(run, "generation")
    return {"eval_loss": recs[-1]["best_eval_loss"], "mean_eval_loss": recs[-1]["avg_eval_loss"],
            "tokens": recs[-1]["tokens"], "bytes_workers": sum(r["bytes_workers"] for r in recs),
            "bytes_coordinator": sum(r["bytes_coordinator"] for r in recs),
            "model_bytes": (run / "final" / "model.safetensors").stat().st_size,
            "best_per_generation": [r["best_eval_loss"] for r in recs]}


def test_loss(run: Path, seq: int, fit_windows: int, batch: int) -> tuple[float, int]:
    """Loss of run/final on the held-out windows after the first `fit_windows` (never used by any run)."""
    import torch
    from transformers import AutoModelForCausalLM

    from train.core.data import TokenData
    from train.core.inner import evaluate
    from train.core.model import quiet_transformers

    quiet_transformers()

    key = json.loads((run / "data" / "current.json").read_text())["key"]
    data = TokenData.open(run / "data" / key, seq, 0.02)
    windows = torch.from_numpy(data.eval_windows(10**9))[fit_windows:]
    if len(windows) < 16:
        raise SystemExit(f"only {len(windows)} unseen held-out windows: lower --eval-batches")
    model = AutoModelForCausalLM.from_pretrained(str(run / "final"), dtype=torch.float32)
    return evaluate(model, windows, batch, torch.device("cpu")), len(windows)


def plan(args) -> dict[str, tuple[str, str, list[str], str]]:
    """name -> (script, project, overrides, kind) of every contender."""
    N, B = args.workers, args.batch
    one = ["outer.num_workers=1", "outer.rounds=1", "outer.lr=1.0", "outer.momentum=0"]
    runs = {
        f"1 worker, {N}x steps": ("diloco_sim.py", "one_steps", one + [
            f"outer.local_steps={N * args.steps}", f"inner.per_device_batch_size={B}", f"inner.total_batch_size={B}"],
            "1xsteps"),
        f"1 worker, {N}x batch": ("diloco_sim.py", "one_batch", one + [
            f"outer.local_steps={args.steps}", f"inner.per_device_batch_size={N * B}",
            f"inner.total_batch_size={N * B}"], "1xbatch"),
        f"DiLoCo({N})": ("diloco_sim.py", "diloco", [
            f"outer.num_workers={N}", f"outer.local_steps={args.H}", f"outer.rounds={args.steps // args.H}",
            f"outer.lr={args.diloco_outer_lr}", f"outer.momentum={args.diloco_outer_momentum}",
            f"inner.per_device_batch_size={B}", f"inner.total_batch_size={B}"], "diloco"),
    }
    # outer.lr / outer.momentum: what EDT's outer_sgd uses when the DNA carries no outer genes (the no-genes row)
    edt = [f"outer.num_workers={N}", f"edt.population_size={N}", f"edt.max_generations={args.steps // args.H}",
           f"edt.mutation_steps={args.H}", f"inner.per_device_batch_size={B}", f"inner.total_batch_size={B}",
           f"inner.total_steps={args.steps}", f"outer.lr={args.diloco_outer_lr}",
           f"outer.momentum={args.diloco_outer_momentum}", *args.extra_edt]
    runs[f"EDT({N})"] = ("edt_sim.py", "edt", edt, "edt")
    runs[f"EDT({N}), no genes"] = ("edt_sim.py", "edt_nogenes", edt + ["edt.genes={}"], "edt-nogenes")
    return {k: v for k, v in runs.items() if v[3] not in args.skip}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/bench-llama.json")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per worker / member (equal for all)")
    ap.add_argument("--H", type=int, default=50, help="inner steps per DiLoCo round = EDT mutation steps")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="windows per step per worker")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches every run evaluates on")
    ap.add_argument("--diloco-outer-lr", type=float, default=1.0)
    ap.add_argument("--diloco-outer-momentum", type=float, default=0.0)
    ap.add_argument("--extra-edt", nargs="*", default=[], help="more KEY=VALUE for the EDT runs")
    ap.add_argument("--skip", nargs="*", default=[], help="rows to skip: 1xsteps 1xbatch diloco edt edt-nogenes")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="seeds (model init, data order, DNA); several: a table per seed and mean +- std")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders (printed) for inspection")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.steps % args.H:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --H {args.H}")
    B = args.batch
    common = [f"model.name={args.model}", f"data.seq_length={args.seq}", f"inner.lr={args.lr}",
              "inner.warmup_steps=20", f"eval.batches={args.eval_batches}", f"eval.batch_size={B}",
              "logging.plot=false", "outer.keep_rounds=1", "inner.threads=1"]
    base = Path(tempfile.mkdtemp(prefix="edt-compare-"))
    per_seed: dict[int, dict] = {}
    try:
        for seed in args.seeds:
            results = per_seed[seed] = {}
            for name, (script, project, sets, _) in plan(args).items():
                run = sim(script, base, f"{project}_s{seed}", common + sets + [f"seed={seed}"], args.timeout)
                r = edt_result(run) if script == "edt_sim.py" else diloco_result(run, args.workers)
                r["test_loss"], r["test_windows"] = test_loss(run, args.seq, args.eval_batches * B, B)
                results[name] = r
            print_table(args, seed, results)
        if len(args.seeds) > 1:
            print_summary(per_seed)
        save_result("compare_edt", {"args": vars(args), "results": per_seed})
    finally:
        if args.keep:
            print(f"runs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def print_table(args, seed: int, results: dict) -> None:
    first = next(iter(results.values()))
    ref_name, ref = next(iter(results)), first["test_loss"]
    rows = []
    for name, r in results.items():
        total = r["bytes_workers"] + r["bytes_coordinator"]
        rows.append([name, f"{r['tokens'] / 1e6:.2f}M", f"{r['eval_loss']:.4f}", f"{r['test_loss']:.4f}",
                     f"{(r['test_loss'] / ref - 1) * 100:+.1f}%", f"{r['bytes_workers'] / 1e6:.1f} MB",
                     f"{total / 1e6:.1f} MB", f"{total / r['model_bytes']:.0f}"])
    print(f"\nseed {seed}: {args.steps} inner steps per worker, batch {args.batch} x {args.seq} tokens, model "
          f"{args.model} ({first['model_bytes'] / 1e6:.2f} MB), H = {args.H}; test = {first['test_windows']} "
          f"unseen held-out windows")
    print(table(rows, ["run", "tokens", "eval loss", "test loss", f"vs {ref_name}", "worker bytes", "all bytes",
                       "models moved"]), flush=True)


def print_summary(per_seed: dict[int, dict]) -> None:
    names = list(next(iter(per_seed.values())))
    ref = names[0]
    rows = []
    for name in names:
        xs = [res[name]["test_loss"] for res in per_seed.values()]
        rel = [res[name]["test_loss"] / res[ref]["test_loss"] - 1 for res in per_seed.values()]
        rows.append([name, f"{statistics.mean(xs):.4f} +- {statistics.stdev(xs):.4f}",
                     f"{statistics.mean(rel) * 100:+.1f}%", " ".join(f"{x:.3f}" for x in xs)])
    print(f"\nover seeds {list(per_seed)}: test loss mean +- std")
    print(table(rows, ["run", "test loss", f"vs {ref}", "per seed"]))


if __name__ == "__main__":
    main()
