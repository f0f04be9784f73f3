"""Benchmark our merges against mergekit's and a naive in-memory merge, SmolLM2-135M-shaped, in one run.

    python bench/merge.py [--repeats 2] [--methods slerp ties] [--variants ...] [--threads N] [--small]
    /tmp/mkvenv/bin/python bench/merge.py --variants yaml mergekit     # an interpreter where mergekit imports

Three random-init Llama models of SmolLM2-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 kv
heads, vocab 49152, tied embeddings; 538 MB in float32) are saved once with save_pretrained; for each method (ties
uses the third as its base) each variant runs in its own fresh process, interleaved:
  ours      merge_model_dirs (EvoMerge's merge of two parents): pread chunks of every input, merge chunk by chunk,
            StreamingWriter, manifest, atomic dir.
  yaml      `python -m train.merge CONFIG.yml OUT` (Plan + run_yaml_merge) on the recipe as mergekit YAML (written by
            train.evomerge.mergekit_io.to_mergekit, as EvoMerge's best_config.yaml).
  mergekit  mergekit's run_merge (what `mergekit-yaml CONFIG.yml OUT` runs, mergekit-yaml's default options, no
            tokenizer to copy) on the same YAML; only where `import mergekit` works in this interpreter.
  naive     from_pretrained every model, merge_state_dicts on their parameters in memory, load into the first model,
            save_pretrained (the same merge math; what a notebook would do).
Each process reports the merge's wall time (after imports: YAML parse, plan, merge, write) and its peak RSS (VmHWM,
absolute and above the process's baseline after imports); the parent adds the whole process's wall time (start-up and
imports included). Targets: yaml <= 1.0x mergekit's time and peak RSS <= 1.5x one model's size; ours faster than
naive. Prints ratios, checks the variants wrote the same tensors, writes bench/results/merge.json.
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
           "ties": {"method": "ties", "weights": [0.6, 0.4], "density": 0.5},
           "linear": {"method": "linear", "weights": [0.6, 0.4]}}
VARIANTS = ("ours", "yaml", "mergekit", "naive")


def write_yaml(root: Path, method: str) -> Path:
    """The recipe as mergekit YAML (EvoMerge's best_config.yaml writer), parents a and b, base `base`."""
    from train.evomerge.mergekit_io import dump_yaml, to_mergekit
    from train.merge.methods import Recipe
    recipe = Recipe.from_dict(RECIPES[method])
    cfg = to_mergekit(recipe.to_dict(), [str(root / "a"), str(root / "b")],
                      str(root / "base") if method in Recipe.NEEDS_BASE else None)
    path = root / f"{method}.yml"
    path.write_text(dump_yaml(cfg))
    return path


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
    if variant in ("yaml", "mergekit"):
        import yaml
        from train.merge.yaml_merge import run_yaml_merge
        from train.merge.yaml_plan import Plan
    if variant == "mergekit":
        from mergekit.config import MergeConfiguration
        from mergekit.merge import MergeOptions, run_merge
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
    elif variant == "yaml":  # the body of `python -m train.merge CONFIG OUT`
        config = root / f"{method}.yml"
        run_yaml_merge(Plan(yaml.safe_load(config.read_text()), config.parent), out)
    elif variant == "mergekit":  # the body of `mergekit-yaml CONFIG OUT` (its default options)
        cfg = MergeConfiguration.model_validate(yaml.safe_load((root / f"{method}.yml").read_text()))
        run_merge(cfg, str(out), options=MergeOptions(copy_tokenizer=False, quiet=True, num_threads=threads))
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
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--_worker", variant, "--method", method, "--root", str(root),
                        "--threads", str(threads)], capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"{variant} {method} failed:\n{p.stderr[-3000:]}")
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "process_seconds": time.perf_counter() - t0}


def mergekit_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("mergekit") is not None


def same_tensors(a: Path, b: Path) -> float:
    """Largest absolute difference between the tensors two output directories hold (tied names resolved)."""
    from train.core.tensorio import load_tensors
    ta, tb = load_tensors(a / "model.safetensors"), load_tensors(b / "model.safetensors")
    return max(float((ta[k] - tb[k]).abs().max()) for k in ta)


def summarise(method: str, runs: dict, root: Path, model_bytes: int) -> tuple[dict, list[list]]:
    """The record and table rows of one method: medians, peaks, ratios, the differences between outputs."""
    t = {v: median([r["seconds"] for r in runs[v]]) for v in runs}
    proc = {v: median([r["process_seconds"] for r in runs[v]]) for v in runs}
    peak = {v: max(r["peak"] for r in runs[v]) for v in runs}
    grow = {v: max(r["peak"] - r["baseline"] for r in runs[v]) for v in runs}
    rec = {"runs": runs, "seconds": t, "process_seconds": proc, "peak_rss": peak, "rss_growth": grow,
           "peak_over_model": {v: peak[v] / model_bytes for v in runs}, "max_abs_diff": {}}
    rows = [[method, v, f"{t[v]:.1f} s", f"{proc[v]:.1f} s", f"{peak[v] / 1e6:.0f} MB ({peak[v] / model_bytes:.2f}x)",
             f"{grow[v] / 1e6:.0f} MB ({grow[v] / model_bytes:.2f}x)"] for v in runs]
    for a, b in (("yaml", "mergekit"), ("ours", "naive"), ("yaml", "ours")):
        if a in runs and b in runs:
            diff = same_tensors(root / f"out-{a}-{method}", root / f"out-{b}-{method}")
            rec["max_abs_diff"][f"{a}_vs_{b}"] = diff
            rec[f"{a}_over_{b}_time"] = t[a] / t[b]
            rows.append([method, f"{a} / {b}", f"{t[a] / t[b]:.2f}x", f"{proc[a] / proc[b]:.2f}x",
                         f"{peak[a] / peak[b]:.2f}x", f"max |{a} - {b}| = {diff:.1e}"])
    return rec, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["slerp", "ties"], choices=sorted(RECIPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="mergekit is left out where it does not import")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of naive and mergekit (ours and yaml merge with 1, their default)")
    ap.add_argument("--small", action="store_true", help="a tiny model, to check the script quickly")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir on /tmp's disk)")
    ap.add_argument("--_worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        root = Path(args.root)
        print(json.dumps(worker(args._worker, args.method, root, root / f"out-{args._worker}-{args.method}",
                                args.threads)))
        return
    variants = [v for v in args.variants if v != "mergekit" or mergekit_importable()]
    if len(variants) < len(args.variants):
        print("mergekit does not import here: run with an interpreter that has it (pip install 'edt[mergekit]')")
    root = Path(tempfile.mkdtemp(prefix="edt-bench-merge-", dir=args.dir))
    try:
        print(f"saving 3 {'small' if args.small else 'SmolLM2-135M-shaped'} models in {root} ...", flush=True)
        dirs = make_models(root, args.small)
        model_bytes = (dirs[0] / "model.safetensors").stat().st_size
        record = {"model_bytes": model_bytes, "threads": args.threads, "cpus": os.cpu_count(), "methods": {},
                  "variants": variants, "date": time.strftime("%Y-%m-%d")}
        rows = []
        for method in args.methods:
            write_yaml(root, method)
            runs: dict[str, list] = {v: [] for v in variants}
            for i in range(args.repeats):  # interleaved, each in a fresh process, page cache warm for all
                for variant in variants:
                    runs[variant].append(run_worker(variant, method, root, args.threads))
                print(f"  {method} repeat {i + 1}: " + ", ".join(f"{v} {runs[v][-1]['seconds']:.1f}s" for v in runs),
                      flush=True)
            record["methods"][method], method_rows = summarise(method, runs, root, model_bytes)
            rows += method_rows
        print(f"model: {model_bytes / 1e6:.0f} MB float32; {args.threads} torch thread(s) for naive / mergekit on "
              f"{os.cpu_count()} CPUs")
        print(table(rows, ["method", "variant", "merge (median)", "process (median)", "peak RSS (x model)",
                           "RSS growth (x model)"]))
        default_threads = args.threads == (os.cpu_count() or 1)
        save_result("merge" + ("_small" if args.small else "") + ("" if default_threads else f"_threads{args.threads}"),
                    record)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
