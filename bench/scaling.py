"""DiLoCo against data-parallel at equal tokens, following Charles et al. 2025 ("Scaling Laws for DiLoCo",
arXiv 2503.09799) at a size 2 CPU cores train.

    python bench/scaling.py                   # the paper's regime: 2700 steps, H = 30 is 90 outer steps, staged
                                              # tuning, M 1 2 4, H 10 30 100, 3 seeds (bench/scaling_regime.py)
    python bench/scaling.py --quick           # the same regime, fewer rows: M 1 4, H 30, 2 seeds
    python bench/scaling.py --report          # the table again from the recorded runs, without running any
    python bench/scaling.py --device cuda     # the same study on a GPU (inner.device; auto picks CUDA anyway)
    python bench/scaling.py --short           # the 10-outer-step study below (T = 300): a cheap smoke version
    python bench/scaling.py --short --H 30 --lrs 0.012 0.016 0.02 --only averaging   # DP and the averaging rows,
                                              # each at its best inner lr of the three

The default study and what it runs: bench/scaling_regime.py (its time: docs/benchmarks.md). What follows is the
--short study (and --flat, its plan at other sizes).

Time (--short): 70 min wall for the whole plan on 2 CPU cores that another job kept at load 9-15 (2-5 runs at a
time); one run of DP alone trains at ~30k tokens/s on the 2 idle cores (~50 s with start-up and evaluation).

Protocol. Model: configs/scaling-llama.json, a Llama of 116,000 parameters of which 65,536 are the tied 2048 x 32
embedding and 50,464 the rest (4 layers, hidden 32, MLP 88, 2 heads). Data: the shipped corpus (27 Shakespeare
plays, 1.167M tokens with the shipped 2048-token BPE); the last 5% (`data.eval_fraction`, 58k tokens) is held out
and every run is evaluated at its end on the same 384 held-out windows of 144 tokens (55k tokens). Budget: T = 300
steps of a fixed global batch of 24 windows x 144 tokens = 1.04M training tokens = 20.5 tokens per non-embedding
parameter (8.9 per parameter with the embedding), 0.94 epochs of the training split, so no window is seen twice.
Rows, every one a real `diloco_sim.py` run (worker processes, BASE_DIR protocol) in a temp folder:
  DP        one worker with the global batch for T steps (outer lr 1, momentum 0: a plain AdamW run);
  DiLoCo    M workers, each with batch 24/M, T steps each (equal tokens, equal steps), an outer step every H,
            M in {1, 2, 4} x H in {10, 30, 100};
the paper's recipe for both: AdamW (0.9, 0.99), linear warmup over 5% of T then cosine to 5% of the peak, weight
decay 1/T (inner.weight_decay_mode = inverse_steps), gradient clipping 1, inner state kept across rounds, Nesterov
outer momentum 0.9 with a constant outer lr of 0.4 for M = 1 and 0.6 for M = 2, 4 (0.8 for M = 8). Beyond the
paper, at H = 30: MuLoCo (inner.optimizer = muon) for the smallest and largest M and a DP Muon row, the
overlapped outer step (outer.overlap = delayed and eager) at the largest M, and the project's default outer step
(lr 1, momentum 0: parameter averaging) for every M > 1 and H, with Muon inner at H = 30, and overlapped at the
largest M; an H schedule (outer.local_steps_schedule: H = 10 for the first 60 steps, then 30) at the largest M
with both outer steps (--outer LR,MOM ... adds rows with other outer steps at H = 30 for every M).
The inner peak lr was tuned for DP on seed 0: AdamW 1.6e-2 (of 6e-3, 9e-3, 1.2e-2, 1.6e-2, 2.4e-2), Muon 0.05 (of
0.02, 0.05, 0.1). --lrs runs every AdamW row (DP included) at each given inner lr and reports each row at the lr
with its lowest mean loss over the seeds, compared with DP at its own best lr; --only REGEX keeps the rows whose
name matches (and DP).

Each row: mean eval loss over the seeds, the per-seed values, the change against DP of the same seed (mean over
seeds) and the paper's figure at 35M parameters on C4 (H = 30) for that M. The paper's targets (M = 1 <= DP, M = 2
<= +0.7%, M = 4 <= +2.0%) are judged from the per-seed changes: met or not met when their 95% t-interval lies on
one side of the target, else "not resolved by these seeds". Writes bench/results/scaling.json,
scaling.md (the table) and scaling.png (eval loss against M per H, DP as a line). Each finished run is appended to
bench/results/scaling-runs.jsonl, keyed by its overrides and the fingerprint of the training code, model configs,
tokenizer and corpus (bench/common.code_fingerprint); a rerun reuses those of the same code (--fresh: run everything
again), so a table never mixes runs of different code.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import REPO, RESULTS, code_fingerprint, save_result, table

PAPER = {1: -0.1, 2: 0.7, 4: 2.0, 8: 3.9}  # DiLoCo vs DP at 35M parameters, C4, H = 30, % of eval loss
OUTER_LR = {1: 0.4, 2: 0.6, 4: 0.6, 8: 0.8}  # the paper's best constant outer lr per M


def params(model: str) -> tuple[int, int]:
    """(all parameters, the embedding's) of a config JSON; a tied output head is counted once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / model))
    return sum(p.numel() for p in m.parameters()), m.get_input_embeddings().weight.numel()


def run(base: Path, name: str, sets: list[str], threads: int, timeout: float) -> dict:
    """One real diloco_sim.py run in base/name; its final eval loss, tokens and the corpus size, then delete it."""
    cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"), "--base-dir",
           str(base), "--project", name, "--no-progress", "--threads", str(threads),
           *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    recs = [json.loads(line) for line in (base / name / "metrics.jsonl").read_text().splitlines()]
    last = recs[-1]
    meta = json.loads(next((base / name / "data").glob("*/meta.json")).read_text())
    shutil.rmtree(base / name, ignore_errors=True)
    # the delta screen (outer.screen) must reject nothing in these healthy runs: counted, shown by --report
    screened = sum(len(r.get("screen") or {}) for r in recs)
    rejected = sum(1 for r in recs for why in (r.get("rejected") or {}).values() if str(why).startswith("screen"))
    return {"eval_loss": last["eval_loss"], "tokens": last["tokens"], "corpus_tokens": meta["tokens"],
            "seconds": time.perf_counter() - t0, "screened": screened, "screen_rejected": rejected}


def rows(args) -> list[dict]:
    """Every run of the study: name, M, H, outer lr / momentum, extra overrides, the paper's figure. The rows beyond
    the paper (--core-only drops them) are run at H = 30 where they need one H, and --only applies to every row."""
    out = [{"name": "DP", "M": 0, "H": args.steps, "lr": 1.0, "mom": 0.0, "sets": [], "paper": None}]
    for H in args.H:
        out += [{"name": f"DiLoCo M={M} H={H}", "M": M, "H": H, "lr": OUTER_LR[M], "mom": 0.9, "sets": [],
                 "paper": PAPER[M] if H == 30 else None} for M in args.M]
    if not args.core_only:
        out += extra_rows(args)
    if args.only:  # DP stays: every row is compared with it
        out = [out[0]] + [r for r in out[1:] if re.search(args.only, r["name"])]
    # every AdamW row at every inner lr of --lrs (the paper tunes the inner lr of each configuration); Muon rows
    # keep --muon-lr
    return [dict(r, inner_lr=lr) for r in out
            for lr in ([args.lr] if "inner.optimizer=muon" in r["sets"] else args.lrs)]


def extra_rows(args) -> list[dict]:
    """Beyond the paper: the project's default outer step (averaging) at every M > 1 and H; at H = 30 (when --H has
    it) MuLoCo, the overlapped outer step, an H schedule and the --outer rows."""
    big = max(args.M)
    avg = [{"name": f"DiLoCo M={M} H={H}, averaging (lr 1, mom 0: project default)", "M": M, "H": H, "lr": 1.0,
            "mom": 0.0, "sets": [], "paper": None} for H in args.H for M in args.M if M > 1]  # M = 1: it is DP
    if 30 not in args.H:
        return avg
    out = [{"name": "DP, Muon", "M": 0, "H": args.steps, "lr": 1.0, "mom": 0.0, "sets": ["inner.optimizer=muon"],
            "paper": None}]
    out += [{"name": f"MuLoCo M={M} H=30", "M": M, "H": 30, "lr": OUTER_LR[M], "mom": 0.9,
             "sets": ["inner.optimizer=muon"], "paper": None} for M in sorted({min(args.M), big})]
    # the overlapped outer step (docs/overlap.md) with the paper's outer step: folded in at the segment's end (one
    # round late; delayed and eager rules) and after 6 of the 30 steps (outer.overlap_steps = 6)
    for rule in ("delayed", "eager"):
        out.append({"name": f"DiLoCo M={big} H=30, {rule} outer step", "M": big, "H": 30, "lr": OUTER_LR[big],
                    "mom": 0.9, "sets": [f"outer.overlap={rule}", "outer.overlap_steps=30"], "paper": None})
    out.append({"name": f"DiLoCo M={big} H=30, delayed, fold after 6", "M": big, "H": 30, "lr": OUTER_LR[big],
                "mom": 0.9, "sets": ["outer.overlap=delayed", "outer.overlap_steps=6"], "paper": None})
    out += avg
    out += [{"name": f"MuLoCo M={M} H=30, averaging", "M": M, "H": 30, "lr": 1.0, "mom": 0.0,
             "sets": ["inner.optimizer=muon"], "paper": None} for M in args.M if M > 1]
    if big > 1:  # ... and with averaging, AdamW and Muon inner
        out += [{"name": f"DiLoCo M={big} H=30, averaging, {rule}", "M": big, "H": 30, "lr": 1.0, "mom": 0.0,
                 "sets": [f"outer.overlap={rule}", "outer.overlap_steps=30"], "paper": None}
                for rule in ("delayed", "eager")]
        out.append({"name": f"DiLoCo M={big} H=30, averaging, delayed, fold after 6", "M": big, "H": 30, "lr": 1.0,
                    "mom": 0.0, "sets": ["outer.overlap=delayed", "outer.overlap_steps=6"], "paper": None})
        out.append({"name": f"MuLoCo M={big} H=30, averaging, eager", "M": big, "H": 30, "lr": 1.0, "mom": 0.0,
                    "sets": ["inner.optimizer=muon", "outer.overlap=eager", "outer.overlap_steps=30"],
                    "paper": None})
    if big > 1 and args.steps % 30 == 0 and args.steps > 60:  # an H schedule: H = 10 for the first 60 steps, then 30
        n = 6 + (args.steps - 60) // 30
        for lr, mom, what in ((1.0, 0.0, "averaging"), (OUTER_LR[big], 0.9, "paper's outer step")):
            out.append({"name": f"DiLoCo M={big} H=10 then 30 (schedule), {what}", "M": big, "H": 30, "rounds": n,
                        "lr": lr, "mom": mom, "sets": ["outer.local_steps_schedule=[[0,10],[6,30]]"], "paper": None})
    for lr, mom in (map(float, o.split(",")) for o in args.outer):
        out += [{"name": f"DiLoCo M={M} H=30, outer lr {lr} mom {mom}", "M": M, "H": 30, "lr": lr, "mom": mom,
                 "sets": [], "paper": None} for M in args.M if (lr, mom) != (1.0, 0.0)]
    return out


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student t, two-sided 95%


def verdict(per_seed: list[float], limit: float) -> str:
    """A target `change vs DP <= limit` judged from the per-seed changes (paired with DP's seeds): met or not met
    when the 95% interval of the mean lies on one side of the limit, else not resolved by these seeds."""
    mean = statistics.mean(per_seed)
    if len(per_seed) < 2:
        return f"{'met' if mean <= limit else 'not met'} (one seed: no interval)"
    half = T95.get(len(per_seed) - 1, 2.0) * statistics.stdev(per_seed) / len(per_seed) ** 0.5
    lo, hi = mean - half, mean + half
    span = f"95% interval {lo:+.2f}% .. {hi:+.2f}% over {len(per_seed)} seeds"
    if hi <= limit:
        return f"met ({span})"
    if lo > limit:
        return f"not met ({span})"
    return f"not resolved by these seeds ({span})"


def run_key(sets: list[str], code: str) -> str:
    """A run's key in the cache: its overrides and the fingerprint of the code that trained it."""
    return " ".join(sets) + f" code={code}"


def tuned(plan: list[dict]) -> list[dict]:
    """Of the rows run at several inner lrs, the one with the lowest mean eval loss per name (first-seen order)."""
    best: dict[str, dict] = {}
    for r in plan:
        if r["name"] not in best or r["mean"] < best[r["name"]]["mean"]:
            best[r["name"]] = r
    return list(best.values())


def overrides(args, row: dict, seed: int) -> list[str]:
    M, T = max(row["M"], 1), args.steps
    rounds = row.get("rounds", T // row["H"])  # given: an H schedule (outer.local_steps_schedule) adding up to T
    if ("rounds" not in row and T % row["H"]) or args.batch % M:
        raise SystemExit(f"{row['name']}: --steps {T} must be a multiple of H and --batch {args.batch} of M")
    b = args.batch // M
    sets = [f"seed={seed}", f"model.name={args.model}", f"data.seq_length={args.seq}", "data.eval_fraction=0.05",
            f"inner.lr={row.get('inner_lr', args.lr)}", f"inner.muon_lr={args.muon_lr}", "inner.beta1=0.9",
            "inner.beta2=0.99",
            f"inner.warmup_steps={max(1, T // 20)}", f"inner.total_steps={T}", "inner.min_lr_ratio=0.05",
            "inner.weight_decay_mode=inverse_steps", "inner.grad_clip=1.0", "inner.reset_state=false",
            f"inner.per_device_batch_size={b}", f"inner.total_batch_size={b}",
            f"outer.num_workers={M}", f"outer.local_steps={row['H']}", f"outer.rounds={rounds}",
            f"outer.lr={row['lr']}", f"outer.momentum={row['mom']}",
            f"outer.nesterov={str(row.get('nesterov', True)).lower()}", "outer.keep_rounds=1",
            "eval.batch_size=32", f"eval.batches={args.eval_batches}", f"eval.every={T}", "logging.plot=false"]
    if args.device:
        sets.append(f"inner.device={args.device}")
    return sets + row["sets"] + args.set


def plot(res: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dp = next(r for r in res if r["name"] == "DP")
    ax.axhline(dp["mean"], color="k", ls="--", label=f"DP ({dp['mean']:.3f})")
    for r in res:
        if r["name"] == "DP, Muon":
            ax.axhline(r["mean"], color="gray", ls=":", label=f"DP, Muon ({r['mean']:.3f})")
    series: dict[str, list[dict]] = {}
    for r in res:
        if r["name"].startswith("DiLoCo") and "," not in r["name"]:
            series.setdefault(f"DiLoCo H={r['H']}", []).append(r)
        elif r["name"].startswith("MuLoCo") and "averaging" in r["name"]:
            series.setdefault("MuLoCo H=30, averaging", []).append(r)
        elif r["name"].startswith("MuLoCo"):
            series.setdefault("MuLoCo H=30", []).append(r)
        elif "averaging (lr 1" in r["name"]:
            series.setdefault(f"DiLoCo H={r['H']}, averaging (project default)", []).append(r)
    for label, rs in series.items():
        xs, ys = [r["M"] for r in rs], [r["mean"] for r in rs]
        err = [[r["mean"] - min(r["losses"]) for r in rs], [max(r["losses"]) - r["mean"] for r in rs]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    single = [r for r in res if r["name"].startswith("DiLoCo") and "," in r["name"] and "averaging" not in r["name"]]
    for r, marker in zip(single, "xsD^v<>p*h"):
        ax.plot([r["M"]], [r["mean"]], marker, ms=8, label=r["name"].split(", ", 1)[1] + f", M={r['M']}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["M"] for r in res if r["M"]}), [str(m) for m in sorted({r["M"] for r in res if r["M"]})])
    ax.set_xlabel("DiLoCo workers M (global batch fixed)")
    ax.set_ylabel("held-out eval loss (mean over seeds; bars: min-max)")
    ax.set_title("DiLoCo vs DP at equal tokens, 116k-param Llama, Shakespeare")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true",
                    help="the 10-outer-step smoke study (T = 300 steps of 24 x 144 tokens, H 10 30 100, seeds 0 1, "
                         "every row of the plan at --lr): cheap, but outside the paper's regime")
    ap.add_argument("--flat", action="store_true", help="the flat plan (--lrs, --outer, --only) at the sizes given")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--short, --quick: 0 1)")
    ap.add_argument("--M", type=int, nargs="+", default=None, choices=sorted(OUTER_LR), help="default 1 2 4")
    ap.add_argument("--H", type=int, nargs="+", default=[10, 30, 100], help="H = 30 is the study's; the others at "
                                                                             "equal tokens")
    ap.add_argument("--steps", type=int, default=None, help="T: steps of every run (each worker's, for DiLoCo); "
                                                            "default 2700 (--short 300)")
    ap.add_argument("--batch", type=int, default=None, help="global batch in windows (DiLoCo: batch / M per worker); "
                                                            "default 8 (--short 24)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per window; default 64 (--short 144)")
    ap.add_argument("--lr", type=float, default=None, help="inner AdamW peak lr of the flat plan (--short 1.6e-2)")
    ap.add_argument("--lrs", type=float, nargs="+", metavar="LR",
                    help="the inner peak lrs: the staged study tunes each row over them (default 0.006 0.012 "
                         "0.024); the flat plan runs every AdamW row at each and reports each row at its best")
    ap.add_argument("--only", metavar="REGEX", help="flat plan: only the rows whose name matches (DP is always run)")
    ap.add_argument("--muon-lr", type=float, default=0.05)
    ap.add_argument("--eval-batches", type=int, default=None, help="held-out batches of 32 windows (default 24; "
                                                                    "--short 12)")
    ap.add_argument("--model", default="configs/scaling-llama.json")
    ap.add_argument("--device", default="", help="inner.device of every run (default: the config's, auto)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override of every run")
    ap.add_argument("--outer", nargs="*", default=[], metavar="LR,MOM",
                    help="flat plan: extra rows at H=30 for every M: outer lr and Nesterov momentum, e.g. 1.0,0")
    ap.add_argument("--core-only", action="store_true", help="only the paper's rows (DP, DiLoCo M x H)")
    ap.add_argument("--quick", action="store_true",
                    help="the paper's regime, fewer rows: seeds 0 1, M 1 4, H 30, inner lrs 0.006 0.012, Nesterov "
                         "lr 0.6 and 1.0 and averaging, the rows beyond the paper on seed 0 (about 35 min); with "
                         "--short: 60 steps, seed 0, M 1 4, H 10 30")
    ap.add_argument("--beyond-seeds", type=int, default=2,
                    help="the staged study's rows beyond the paper (overlap, MuLoCo, topk) run on this many of the "
                         "seeds (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (threads per process: cores / jobs / M)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--report", action="store_true", help="no new runs: the table of the rows already recorded")
    ap.add_argument("--fresh", action="store_true", help="ignore the runs recorded by an earlier invocation")
    ap.add_argument("--out", default=None, help="results name under bench/results/ (default scaling-paper; --short "
                                                "scaling)")
    args = ap.parse_args()
    short = args.short
    args.M = args.M or [1, 2, 4]
    args.steps = args.steps or (300 if short else 2700)
    args.batch = args.batch or (24 if short else 8)
    args.seq = args.seq or (144 if short else 64)
    args.eval_batches = args.eval_batches or (12 if short else 24)
    args.out = args.out or ("scaling" if short else "scaling-paper")
    if not (short or args.flat):  # the staged study in the paper's regime (bench/scaling_regime.py)
        import scaling_regime
        args.seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
        args.lrs = args.lrs or ([0.006, 0.012] if args.quick else [0.006, 0.012, 0.024])
        if args.quick:
            args.M, args.H, args.out, args.beyond_seeds = [1, 4], [30], args.out + "-quick", 1
        if args.steps % 30 or any(args.steps % h for h in args.H) or any(args.batch % m for m in args.M):
            raise SystemExit(f"--steps {args.steps} must be a multiple of 30 and of every --H, and --batch "
                             f"{args.batch} of every --M")
        scaling_regime.study(args, sys.modules[__name__])
        return
    args.seeds = args.seeds or [0, 1]
    args.lr = args.lr or 1.6e-2
    if args.quick:
        args.steps, args.seeds, args.M, args.H, args.out = 60, [0], [1, 4], [10, 30], args.out + "-quick"
    args.lrs = args.lrs or [args.lr]

    total, emb = params(args.model)
    plan = rows(args)
    base = Path(tempfile.mkdtemp(prefix="edt-scaling-"))
    t0 = time.perf_counter()

    cache_path, lock, code = RESULTS / f"{args.out}-runs.jsonl", threading.Lock(), code_fingerprint()
    cache = {} if args.fresh or not cache_path.exists() else \
        {(e := json.loads(line))["key"]: e["result"] for line in cache_path.read_text().splitlines()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    before = set(cache)

    def one(job: tuple[int, int]) -> None:
        i, seed = job
        row = plan[i]
        sets = overrides(args, row, seed)
        key = run_key(sets, code)
        if key not in cache and args.report:
            return
        if key not in cache:
            threads = max(1, (os.cpu_count() or 1) // (args.jobs * max(row["M"], 1)))
            cache[key] = run(base, f"r{i}s{seed}", sets, threads, args.timeout)
            with lock, cache_path.open("a") as f:
                f.write(json.dumps({"key": key, "result": cache[key]}) + "\n")
        r = row["runs"][seed] = cache[key]
        print(f"  {row['name']} seed {seed}: eval loss {r['eval_loss']:.4f} ({r['seconds']:.0f}s)", flush=True)

    for row in plan:
        row["runs"] = {}
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            first = sorted(range(len(plan)), key=lambda i: plan[i]["H"] not in (30, args.steps))  # H=30 rows first
            list(pool.map(one, [(i, s) for i in first for s in args.seeds]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t0
    missing = [row for row in plan if len(row["runs"]) < len(args.seeds)]
    plan = [row for row in plan if row not in missing]
    if not any(row["name"] == "DP" for row in plan):  # only --report skips runs (a failed run stops the bench)
        raise SystemExit(f"{cache_path}: no run of DP by this code (fingerprint {code}) for seeds {args.seeds}; "
                         f"the rows are compared with DP, so run without --report to record it")
    reused = sum(1 for row in plan for seed in args.seeds if run_key(overrides(args, row, seed), code) in before)
    run_s = sum(r["seconds"] for row in plan for r in row["runs"].values())

    for row in plan:
        row["losses"] = [row["runs"][s]["eval_loss"] for s in args.seeds]
        row["mean"] = statistics.mean(row["losses"])
    best = tuned(plan)
    dp_row = best[0]  # DP at its best inner lr: the baseline of every row
    dp = {s: v["eval_loss"] for s, v in dp_row["runs"].items()}
    for row in plan:
        row["vs_dp"] = [(row["runs"][s]["eval_loss"] / dp[s] - 1) * 100 for s in args.seeds]
        row["vs_dp_mean"] = statistics.mean(row["vs_dp"])
    tokens = dp_row["runs"][args.seeds[0]]["tokens"]
    corpus = dp_row["runs"][args.seeds[0]]["corpus_tokens"]
    n_eval = int(corpus * 0.05)
    n_train = corpus - n_eval
    sweep = len(args.lrs) > 1
    header = ["run", "M", "H", "outer lr / mom", *(["inner lr"] if sweep else []), "eval loss", "per seed",
              "vs DP (per seed)", "vs DP", "paper"]

    def line(r: dict) -> list:
        muon = "inner.optimizer=muon" in r["sets"]
        lr = [f"muon {args.muon_lr:g}" if muon else f"{r['inner_lr']:g}"] if sweep else []
        return [r["name"], r["M"] or "-", r["H"] if r["M"] else "-", f"{r['lr']} / {r['mom']}", *lr,
                f"{r['mean']:.4f}", " ".join(f"{x:.4f}" for x in r["losses"]),
                " ".join(f"{x:+.2f}%" for x in r["vs_dp"]), f"{r['vs_dp_mean']:+.2f}%" if r is not dp_row else "—",
                f"{r['paper']:+.1f}%" if r["paper"] is not None else ""]

    body = [line(r) for r in best]
    every = [line(r) for r in plan] if sweep else []
    checks = []
    adamw = [r for r in best if r["M"] and r["H"] == 30 and "inner.optimizer=muon" not in r["sets"]]
    for M, limit in ((1, 0.0), (2, 0.7), (4, 2.0)):
        for r in [r for r in adamw if r["name"] == f"DiLoCo M={M} H=30"] + \
                 sorted((r for r in adamw if r["M"] == M and r["name"] != f"DiLoCo M={M} H=30"),
                        key=lambda r: r["mean"])[:1]:
            checks.append(f"{r['name']} vs DP {r['vs_dp_mean']:+.2f}% (target <= {limit:+.1f}%): "
                          f"{verdict(r['vs_dp'], limit)}")
    better = [f"{r['name']} {r['vs_dp_mean']:+.2f}% against the paper's {PAPER[r['M']]:+.1f}%: "
              f"{verdict(r['vs_dp'], PAPER[r['M']])}" for r in best
              if r["M"] in PAPER and r["vs_dp_mean"] < PAPER[r["M"]]]  # 'met': resolved below the paper's figure
    checks.append("better than the paper's figure for its M: " + (", ".join(better) or "none"))
    if missing:
        checks.append("not run (--report): " + ", ".join(sorted({r["name"] for r in missing})))
    summary = (f"{args.model}: {total:,} parameters ({total - emb:,} without the embedding); T = {args.steps} steps "
               f"x {args.batch} x {args.seq} tokens = {tokens / 1e6:.3f}M tokens = {tokens / (total - emb):.1f} "
               f"per non-embedding parameter ({tokens / total:.1f} per parameter), {tokens / n_train:.2f} epochs of "
               f"{n_train / 1e6:.3f}M training tokens; eval on {args.eval_batches * 32} held-out windows; "
               f"seeds {' '.join(map(str, args.seeds))}; the runs took {run_s / 60:.0f} min summed; "
               f"this invocation {wall / 60:.1f} min wall ({reused} runs reused from {cache_path.name}); code {code}")
    def md_table(b: list[list]) -> list[str]:
        return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                *["| " + " | ".join(str(c) for c in x) + " |" for x in b]]

    title = "each row at its best inner lr (of " + ", ".join(f"{x:g}" for x in args.lrs) + "):" if sweep else ""
    md = "\n".join([summary, "", *([title, ""] if sweep else []), *md_table(body),
                     *(["", "every run:", "", *md_table(every)] if sweep else []), "", *[f"- {c}" for c in checks]])
    print("\n" + summary + "\n" + (title + "\n" if sweep else "") + table(body, header)
          + ("\n\nevery run:\n" + table(every, header) if sweep else "") + "\n\n" + "\n".join(checks))
    (RESULTS / f"{args.out}.md").write_text(md + "\n")
    plot(best, RESULTS / f"{args.out}.png")
    save_result(args.out, {"args": vars(args), "params": total, "embedding_params": emb, "tokens": tokens,
                           "train_tokens": n_train, "eval_tokens": n_eval, "wall_s": wall, "run_s": run_s,
                           "reused": reused, "code": code, "checks": checks, "rows": plan,
                           "best": [r["name"] + f" @ {r['inner_lr']:g}" for r in best]})


if __name__ == "__main__":
    main()
