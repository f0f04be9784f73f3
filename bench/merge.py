"""Benchmark the streaming merge (train.merge.stream) against the naive in-memory merge, SmolLM2-135M-shaped.

    python bench/merge.py [--repeats 2] [--methods slerp ties] [--threads N] [--small]

Three random-init Llama models of SmolLM2-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 kv
heads, vocab 49152, tied embeddings; 538 MB in float32) are saved with save_pretrained; for each method (ties uses
the third as its base) each variant runs in its own fresh process, interleaved:
  ours   merge_model_dirs: pread chunks of every input, merge chunk by chunk, StreamingWriter, manifest, atomic dir.
  naive  from_pretrained every model, merge_state_dicts on their parameters in memory, load into the first model,
         save_pretrained (the same merge math; what a notebook would do).
Each process reports the merge's wall time (after imports) and its peak RSS (VmHWM, absolute and above the
process's baseline after imports). Targets: ours' peak RSS <= 1.5x one model's size, and ours faster than naive.
Prints ratios, checks both variants wrote the same tensors, writes bench/results/merge.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, median, save_result, smollm_config, table


def make_models(root: Path, small: bool) -> list[Path]:
    import torch
    from transformers import AutoModelForCausalLM
    dirs = []
    for i, name in enumerate(("a", "b", "base")):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(smollm_config(small), dtype=torch.float32)
        model.save_pretrained(str(root / name))
        dirs.append(root / name)
        del model
    return dirs


RECIPES = {"slerp": {"method": "slerp", "t_curves": {"self_attn": [0, 0.5, 0.3, 0.7, 1], "mlp": [1, 0.5, 0.7, 0.3, 0],
                                                     "default": 0.5}},
           "ties": {"method": "ties", "weights": [0.6, 0.4], "density": 0.5}}


# -- one measured merge, in a fresh process ----------------------------------------------------------------------------
def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(variant: str, method: str, root: Path, out: Path, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    from train.merge.methods import Recipe, merge_state_dicts
    from train.merge.stream import merge_model_dirs
    if variant == "naive":
        from transformers import AutoModelForCausalLM
    (torch.randn(1000) * 2).sum()  # torch's thread pool and allocator are up before the baseline
    recipe = Recipe.from_dict(RECIPES[method])
    dirs = [root / "a", root / "b"]
    base = root / "base" if method in Recipe.NEEDS_BASE else None
    baseline = _status("VmRSS")
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: import-time peaks do not count
    except OSError:
        pass
    baseline = max(baseline, _status("VmHWM"))
    t0 = time.perf_counter()
    if variant == "ours":
        merge_model_dirs(recipe, dirs, out, base_model_dir=base)
    else:
        models = [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32) for d in dirs]
        base_model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32) if base else None
        params = [{k: p.detach() for k, p in m.named_parameters()} for m in models]
        bparams = {k: p.detach() for k, p in base_model.named_parameters()} if base_model else None
        merged = merge_state_dicts(recipe, params, bparams)
        with torch.no_grad():
            for k, p in models[0].named_parameters():
                p.copy_(merged[k])
        models[0].save_pretrained(str(out))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak": _status("VmHWM"), "baseline": baseline}


def run_worker(variant: str, method: str, root: Path, threads: int) -> dict:
    out = root / f"out-{variant}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([sys.executable, __file__, "--_worker", variant, "--method", method, "--root", str(root),
                        "--threads", str(threads)], capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"{variant} {method} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> float:
    """Largest absolute difference between the tensors two output directories hold (tied names resolved)."""
    from train.core.tensorio import load_tensors
    ta, tb = load_tensors(a / "model.safetensors"), load_tensors(b / "model.safetensors")
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["slerp", "ties"], choices=sorted(RECIPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in each process")
    ap.add_argument("--small", action="store_true", help="a tiny model, to check the script quickly")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir on /tmp's disk)")
    ap.add_argument("--_worker", choices=["ours", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        root = Path(args.root)
        print(json.dumps(worker(args._worker, args.method, root, root / f"out-{args._worker}-{args.method}",
                                args.threads)))
        return
    root = Path(tempfile.mkdtemp(prefix="edt-bench-merge-", dir=args.dir))
    try:
        print(f"saving 3 {'small' if args.small else 'SmolLM2-135M-shaped'} models in {root} ...", flush=True)
        dirs = make_models(root, args.small)
        model_bytes = (dirs[0] / "model.safetensors").stat().st_size
        record = {"model_bytes": model_bytes, "threads": args.threads, "cpus": os.cpu_count(), "methods": {}}
        rows = []
        for method in args.methods:
            runs = {"ours": [], "naive": []}
            for i in range(args.repeats):  # interleaved, each in a fresh process, page cache warm for both
                for variant in ("ours", "naive"):
                    runs[variant].append(run_worker(variant, method, root, args.threads))
                print(f"  {method} repeat {i + 1}: ours {runs['ours'][-1]['seconds']:.1f}s, "
                      f"naive {runs['naive'][-1]['seconds']:.1f}s", flush=True)
            diff = same_tensors(root / f"out-ours-{method}", root / f"out-naive-{method}")
            t = {v: median([r["seconds"] for r in runs[v]]) for v in runs}
            peak = {v: max(r["peak"] for r in runs[v]) for v in runs}
            grow = {v: max(r["peak"] - r["baseline"] for r in runs[v]) for v in runs}
            record["methods"][method] = {"runs": runs, "seconds": t, "peak_rss": peak, "rss_growth": grow,
                                         "ours_over_naive_time": t["ours"] / t["naive"],
                                         "ours_peak_over_model": peak["ours"] / model_bytes,
                                         "naive_peak_over_model": peak["naive"] / model_bytes,
                                         "max_abs_diff_ours_vs_naive": diff}
            for v in ("ours", "naive"):
                rows.append([method, v, f"{t[v]:.1f} s", f"{peak[v] / 1e6:.0f} MB ({peak[v] / model_bytes:.2f}x)",
                             f"{grow[v] / 1e6:.0f} MB ({grow[v] / model_bytes:.2f}x)"])
            rows.append([method, "ours / naive", f"{t['ours'] / t['naive']:.2f}x",
                         f"{peak['ours'] / peak['naive']:.2f}x", f"max |ours - naive| = {diff:.1e}"])
        print(f"model: {model_bytes / 1e6:.0f} MB float32; {args.threads} torch thread(s) on {os.cpu_count()} CPUs")
        print(table(rows, ["method", "variant", "wall (median)", "peak RSS (x model)", "RSS growth (x model)"]))
        default_threads = args.threads == (os.cpu_count() or 1)
        save_result("merge" + ("_small" if args.small else "") + ("" if default_threads else f"_threads{args.threads}"),
                    record)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
