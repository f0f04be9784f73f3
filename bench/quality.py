"""Quality at equal inner steps per worker on the embedded corpus: 1 worker, 1 worker with 4x batch, DiLoCo(4).

    python bench/quality.py                                   # the default comparison (~10 min on 2 cores)
    python bench/quality.py --outer-lr 0.7 1.0 --outer-momentum 0.9 0 --H 25 50 --steps 300

Every run is a real `diloco_sim.py` run (worker processes, BASE_DIR protocol) in a temp folder, on the same held-out
windows. Prints the final eval loss of each, its ratio to the 1-worker baseline, and the bytes communicated
(DiLoCo: deltas up + global model down per worker and round; the 4x-batch row is what synchronous data-parallel
training would all-reduce: 2 x model bytes per step per worker, for scale). Writes bench/results/quality.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, save_result, table


def run(base: Path, name: str, sets: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"),
           "--base-dir", str(base), "--project", name, "--no-progress", *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    recs = {}
    for line in (base / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[r["round"]] = r
    last = recs[max(recs)]
    model_bytes = (base / name / "final" / "model.safetensors").stat().st_size
    comm = sum(r.get("bytes_deltas", 0) + len(r.get("workers_used", [])) * model_bytes
               for k, r in recs.items() if k > 0)
    return {"eval_loss": last["eval_loss"], "tokens": last["tokens"], "comm_bytes": comm,
            "model_bytes": model_bytes, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/bench-llama.json")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per worker (equal for every run)")
    ap.add_argument("--batch", type=int, default=16, help="windows per step per worker")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--H", type=int, nargs="+", default=[50], help="local steps between outer steps")
    ap.add_argument("--outer-lr", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--outer-momentum", type=float, nargs="+", default=[0.9, 0.0])
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    common = [f"model.name={args.model}", f"data.seq_length={args.seq}", f"inner.lr={args.lr}",
              f"inner.per_device_batch_size={args.batch}", "inner.warmup_steps=20", "eval.batches=16",
              f"inner.total_steps={args.steps}", "outer.keep_rounds=1", "logging.plot=false"]
    base = Path(tempfile.mkdtemp(prefix="edt-quality-"))
    rows, results = [], {}
    try:
        if not args.no_baselines:
            one = ["outer.num_workers=1", f"outer.local_steps={args.steps}", "outer.rounds=1", "outer.lr=1.0",
                   "outer.momentum=0", f"inner.total_batch_size={args.batch}"]
            results["1 worker"] = run(base, "one", common + one, args.timeout)
            big = list(one)
            big[-1] = f"inner.total_batch_size={args.batch * args.workers}"
            big.append(f"inner.per_device_batch_size={args.batch * args.workers}")
            results[f"1 worker, {args.workers}x batch"] = r = run(base, "big", common + big, args.timeout)
            r["comm_bytes"] = 2 * r["model_bytes"] * args.steps * args.workers  # DDP all-reduce equivalent
        for H, lr, mu in itertools.product(args.H, args.outer_lr, args.outer_momentum):
            if args.steps % H:
                raise SystemExit(f"--steps {args.steps} must be a multiple of H={H}")
            name = f"DiLoCo({args.workers}) H={H} lr={lr} mom={mu}"
            sets = [f"outer.num_workers={args.workers}", f"outer.local_steps={H}", f"outer.rounds={args.steps // H}",
                    f"outer.lr={lr}", f"outer.momentum={mu}", f"outer.nesterov={'true' if mu > 0 else 'false'}",
                    f"inner.total_batch_size={args.batch}"]
            results[name] = run(base, f"d{H}_{lr}_{mu}", common + sets, args.timeout)
            print(f"  {name}: eval loss {results[name]['eval_loss']:.4f} "
                  f"({results[name]['seconds']:.0f}s)", flush=True)
        ref = results.get("1 worker", {}).get("eval_loss")
        for name, r in results.items():
            rows.append([name, f"{r['tokens'] / 1e6:.2f}M", f"{r['eval_loss']:.4f}",
                         f"{(r['eval_loss'] / ref - 1) * 100:+.1f}%" if ref else "-",
                         f"{r['comm_bytes'] / 1e6:.1f} MB"])
        print(f"\n{args.steps} inner steps per worker, batch {args.batch} x {args.seq} tokens, model {args.model}")
        print(table(rows, ["run", "tokens", "eval loss", "vs 1 worker", "bytes communicated"]))
        save_result("quality", {"args": vars(args), "results": results})
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
