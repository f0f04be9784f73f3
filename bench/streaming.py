"""Streaming DiLoCo (docs/streaming.md) against DiLoCo (P = 1): the bytes, the quality and the utilisation.

    python bench/streaming.py                       # all three parts (~45 min on 2 idle CPU cores)
    python bench/streaming.py --part bytes          # or quality, utilisation (several: --part bytes utilisation)
    python bench/streaming.py --quick               # ~12 min: 1 seed, P = 1 and 4, shorter quality runs

Every row is a real `diloco_sim.py` run (worker processes, the BASE_DIR protocol).

bytes        4 workers, the default 4-block Llama, H = --H, 3 cycles (3·P rounds: equal tokens), P = 1, 2, 4, BASE_DIR
             on the FUSE layer (bench/throttlefs.py, uncapped, counting the bytes written per second by folder).
             From metrics.jsonl: the largest single sync (the deltas a round averages, `bytes_deltas`), against
             P = 1's (target <= 1.1 / P); the delta bytes per H steps (target: unchanged); the bytes a commit
             writes (the global model or the fragment's update; the periodic fp32 checkpoint apart). From the FUSE
             layer: the peak write rate over 1-second windows while the run trains, of the exchange (deltas,
             updates, global models) and of everything (with the workers' state snapshots).
quality      the shipped corpus in bench/scaling.py's regime (configs/scaling-llama.json, 4 blocks; global batch of
             8 windows x 64 tokens; AdamW 0.9/0.99, warmup + cosine, weight decay 1/T), M = 2 workers, H = 32, T =
             --steps inner steps, the paper's outer step (Nesterov 0.9, outer lr 0.4: bench/scaling.py's best at
             M = 2, with its inner lr 0.006): P = 1 against P = 2 and 4, with τ = 0 (α = 0) and the overlapped
             τ = --tau with α = 0.5, fp32 and int4 values, on --seeds, and an ablation that tells τ from α (the
             mix alone at P = 1, the overlap alone at the largest P); the change of the final eval loss against
             P = 1 of the same seed and codec (the paper reports equal quality).
utilisation  4 workers, BASE_DIR capped at --mbps (one shared link), P = 1 against P = 4 with τ = 0 and τ = --tau:
             busy / wall per worker from its sidecars (bench/utilisation.py's measure).

Needs /dev/fuse, libfuse2 and fusepy for bytes and utilisation (`apt-get install fuse libfuse2`, `pip install -e
'.[bench]'`). Writes bench/results/streaming.json and prints the tables docs/streaming.md shows.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, save_result, table
from utilisation import measure, mount, unmount

QUALITY_BASE = ["model.name=configs/scaling-llama.json", "data.seq_length=64", "data.eval_fraction=0.05",
                "inner.lr=0.006", "inner.beta1=0.9", "inner.beta2=0.99", "inner.min_lr_ratio=0.05",
                "inner.weight_decay_mode=inverse_steps", "inner.grad_clip=1.0", "inner.per_device_batch_size=4",
                "inner.total_batch_size=4", "outer.num_workers=2", "outer.lr=0.4", "outer.momentum=0.9",
                "outer.nesterov=true", "eval.batch_size=32", "eval.batches=24", "logging.plot=false"]


def sim(base: Path, project: str, sets: list[str], timeout: float) -> Path:
    cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"), "--base-dir",
           str(base), "--project", project, "--no-progress", "--threads", "1", *[a for s in sets for a in ("--set", s)]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{project} failed:\n{out.stderr[-3000:]}")
    return base / project


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def streaming_sets(P: int, tau: int, alpha: float) -> list[str]:
    return [f"outer.fragments={P}", f"outer.fragment_delay={tau}", f"outer.fragment_mix={alpha}"]


# -- bytes ------------------------------------------------------------------------------------------------------------
def peak_rate(counts: dict, kinds: tuple[str, ...], t0: float, t1: float) -> float:
    """The largest bytes written in one wall-clock second between t0 and t1, of the folders `kinds`."""
    per: dict[int, int] = {}
    for k in kinds:
        for sec, b in (counts.get("written_per_s") or {}).get(k, {}).items():
            if t0 <= int(sec) <= t1:
                per[int(sec)] = per.get(int(sec), 0) + int(b)
    return max(per.values(), default=0) / 1e6


def bytes_part(args) -> dict:
    out = {}
    for P in args.P:
        tmp = Path(tempfile.mkdtemp(prefix="edt-stream-bytes-"))
        backing, mnt, counts_f = tmp / "backing", tmp / "mnt", tmp / "counts.json"
        backing.mkdir()
        mnt.mkdir()
        fs = mount(backing, mnt, 0.0, ["--count-file", str(counts_f)])
        try:
            t = time.perf_counter()
            run = sim(mnt, f"bytes-p{P}", [f"outer.num_workers={args.workers}", f"outer.local_steps={args.H}",
                                           f"outer.rounds={args.cycles * P}", "eval.every=1000",
                                           "logging.plot=false", f"outer.keep_rounds={args.cycles * P + 2}",
                                           *streaming_sets(P, 0, 0.0)], args.timeout)
            recs = records(run)
            wall = time.perf_counter() - t
        finally:
            unmount(mnt, fs)
        counts = json.loads(counts_f.read_text())
        syncs = [r for r in recs if r["round"] >= 1]
        # from round 0's commit to the commit before the last: the last one writes the fp32 checkpoint and the
        # outer state (every P; with P = 1 every commit does)
        t0, t1 = recs[0]["time"], syncs[-2]["time"]
        commit = [r["bytes_written"] for r in syncs if P == 1 or not r.get("checkpoint")]
        out[P] = {"rounds": len(syncs), "largest_sync": max(r["bytes_deltas"] for r in syncs),
                  "deltas_per_H": sum(r["bytes_deltas"] for r in syncs) / args.cycles,
                  "commit_bytes": statistics.median(commit),
                  "checkpoint_bytes": max((r["bytes_written"] for r in syncs if r.get("checkpoint")), default=0),
                  "peak_exchange_MBps": peak_rate(counts, ("exchange",), t0, t1),
                  "peak_all_MBps": peak_rate(counts, ("exchange", "state", "other"), t0, t1),
                  "sync_every_s": statistics.median(b["time"] - a["time"] for a, b in zip(syncs, syncs[1:])),
                  "seconds": wall}
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"  bytes P={P}: {out[P]}", flush=True)
    base = out[args.P[0]]
    rows = [[P, m["rounds"], f"{m['largest_sync'] / 1e6:.2f} MB", f"{m['largest_sync'] / base['largest_sync']:.3f}",
             f"{1.1 / P:.3f}", f"{m['deltas_per_H'] / base['deltas_per_H']:.3f}", f"{m['commit_bytes'] / 1e6:.2f} MB",
             f"{m['peak_exchange_MBps']:.1f} ({m['peak_exchange_MBps'] / base['peak_exchange_MBps']:.2f}x)",
             f"{m['peak_all_MBps']:.1f} ({m['peak_all_MBps'] / base['peak_all_MBps']:.2f}x)",
             f"{m['sync_every_s']:.1f} s"] for P, m in out.items()]
    print(f"\nbytes: {args.workers} workers, configs/tiny-llama.json, H = {args.H}, {args.cycles} cycles (3·P rounds)")
    print(table(rows, ["P", "rounds", "largest sync (deltas)", "vs P=1", "target <=", "delta bytes per H vs P=1",
                       "commit per sync", "peak exchange write MB/s (1 s)", "peak write MB/s, all (1 s)",
                       "a sync every"]))
    return out


# -- quality ----------------------------------------------------------------------------------------------------------
def quality_rows(args) -> list[dict]:
    """The main rows (P = 1; each P at τ = 0 and at τ > 0 with the paper's α = 0.5) and the ablation that tells τ
    from α: the mix alone (P = 1, τ = 0, α = 0.5) and the overlap alone (largest P, τ > 0, α = 0)."""
    def row(P: int, tau: int, alpha: float, codec: str) -> dict:
        name = f"P={P}" + (f" τ={tau}" if P > 1 or tau else "") + (f" α={alpha:g}" if alpha else "") + f" {codec}"
        return {"name": name, "P": P, "tau": tau, "alpha": alpha, "codec": codec}

    rows = []
    for codec in args.codecs:
        rows.append(row(1, 0, 0.0, codec))
        if args.rows in ("main", "all"):
            for P in [p for p in args.P if p > 1]:
                rows += [row(P, 0, 0.0, codec), row(P, args.tau, 0.5, codec)]
        if args.rows in ("ablation", "all"):
            rows += [row(1, 0, 0.5, codec), row(max(args.P), args.tau, 0.0, codec)]
    return rows


def quality_part(args) -> dict:
    T, H = args.steps, 32
    if T % H:
        raise SystemExit(f"--steps {T} must be a multiple of H = {H}")
    res: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="edt-stream-quality-"))
    try:
        for row in quality_rows(args):
            for seed in args.seeds:
                t = time.perf_counter()
                sets = [*QUALITY_BASE, f"seed={seed}", f"inner.warmup_steps={max(1, T // 20)}",
                        f"inner.total_steps={T}", f"outer.local_steps={H}", f"outer.rounds={T // H * row['P']}",
                        f"outer.compression={row['codec']}", "outer.block_size=32", f"eval.every={10 ** 6}",
                        *streaming_sets(row["P"], row["tau"], row["alpha"])]
                run = sim(tmp, f"q{seed}", sets, args.timeout)
                last = records(run)[-1]
                shutil.rmtree(run, ignore_errors=True)
                res.setdefault(row["name"], {**row, "loss": {}})["loss"][seed] = last["eval_loss"]
                print(f"  quality {row['name']} seed {seed}: eval loss {last['eval_loss']:.4f} "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for name, r in res.items():
        ref = res[f"P=1 {r['codec']}"]["loss"]
        d = [100 * (r["loss"][s] / ref[s] - 1) for s in args.seeds]
        r["delta_pct"] = d
        rows.append([name, " ".join(f"{r['loss'][s]:.4f}" for s in args.seeds),
                     " ".join(f"{x:+.2f}%" for x in d), f"{statistics.mean(d):+.2f}%"])
    print(f"\nquality: M = 2, H = 32, T = {T} inner steps ({T // H} cycles), seeds {args.seeds}")
    print(table(rows, ["row", "eval loss per seed", "vs P=1 (same seed, codec)", "mean"]))
    return res


# -- utilisation ------------------------------------------------------------------------------------------------------
def utilisation_part(args) -> dict:
    out = {}
    specs = [(1, 0, 0.0)] + [(P, t, a) for P in args.P if P > 1 for t, a in ((0, 0.0), (args.tau_util, 0.5))]
    if args.quick:
        specs = [s for s in specs if s[0] in (1, max(args.P))]
    for P, tau, alpha in specs:
        tmp = Path(tempfile.mkdtemp(prefix="edt-stream-util-"))
        backing, mnt = tmp / "backing", tmp / "mnt"
        backing.mkdir()
        mnt.mkdir()
        fs = mount(backing, mnt, args.mbps)
        name = f"P={P} τ={tau}" + (" α=0.5" if alpha else "")
        try:
            t = time.perf_counter()
            rounds = args.cycles * P
            run = sim(mnt, "util", [f"outer.num_workers={args.workers}", f"outer.local_steps={args.H}",
                                    f"outer.rounds={rounds}", "data.seq_length=64", "eval.every=1000",
                                    f"outer.keep_rounds={rounds + 2}", *streaming_sets(P, tau, alpha)], args.timeout)
            m = measure(run, args.workers, rounds)
            m["seconds"] = time.perf_counter() - t
        finally:
            unmount(mnt, fs)
            shutil.rmtree(tmp, ignore_errors=True)
        out[name] = m
        print(f"  utilisation {name}: {m['utilisation'] * 100:.1f}% ({m['seconds']:.0f} s)", flush=True)
    def wall(m: dict) -> float:  # a worker's first inner step to the end of its last, mean over the workers
        return statistics.mean(w["wall_s"] for w in m["workers"].values())

    base = next(iter(out.values()))
    rows = [[n, f"{m['utilisation'] * 100:.1f}%", f"{m['busy_per_round_s']:.2f} s", f"{m['idle_per_round_s']:.2f} s",
             f"{wall(m):.1f} s", f"{wall(m) / wall(base):.2f}"] for n, m in out.items()]
    print(f"\nutilisation: {args.workers} workers, configs/tiny-llama.json, H = {args.H}, {args.cycles} cycles, "
          f"BASE_DIR capped at {args.mbps:g} MB/s")
    print(table(rows, ["row", "utilisation (busy / wall)", "compute per round", "idle per round",
                       "training wall (per worker)", "vs P=1"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", choices=["bytes", "quality", "utilisation"],
                    default=["bytes", "quality", "utilisation"])
    ap.add_argument("--quick", action="store_true", help="1 seed, P = 1 and 4, --steps 640")
    ap.add_argument("--P", type=int, nargs="+", default=[1, 2, 4], help="fragment counts (the first is the baseline)")
    ap.add_argument("--workers", type=int, default=4, help="workers of the bytes and utilisation runs")
    ap.add_argument("--H", type=int, default=32, help="H of the bytes and utilisation runs")
    ap.add_argument("--cycles", type=int, default=3, help="cycles of H steps in the bytes and utilisation runs")
    ap.add_argument("--steps", type=int, default=1344, help="T of the quality runs (a multiple of 32)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--codecs", nargs="+", default=["none", "int4"], help="outer.compression of the quality rows")
    ap.add_argument("--tau", type=int, default=2, help="τ of the overlapped quality rows (< 32 / P)")
    ap.add_argument("--rows", choices=["main", "ablation", "all"], default="all",
                    help="quality rows: main (P at τ = 0 and at τ > 0 with α = 0.5), ablation (the mix alone at "
                         "P = 1, the overlap alone at the largest P), all")
    ap.add_argument("--out", default="streaming", help="results name under bench/results/")
    ap.add_argument("--tau-util", type=int, default=4, help="τ of the overlapped utilisation row (< H / P)")
    ap.add_argument("--mbps", type=float, default=10.0, help="the utilisation part's link, MB/s")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.P[0] != 1:
        raise SystemExit("--P: the first value is the baseline and must be 1")
    if args.cycles < 2:
        raise SystemExit("--cycles must be >= 2 (P = 1's utilisation is measured between rounds)")
    if args.quick:
        args.P, args.seeds, args.steps, args.rows = [1, max(args.P)], args.seeds[:1], 640, "main"
    t = time.perf_counter()
    res = {"args": vars(args)}
    for part in args.part:
        res[part] = {"bytes": bytes_part, "quality": quality_part, "utilisation": utilisation_part}[part](args)
    res["seconds"] = time.perf_counter() - t
    save_result(args.out + ("-quick" if args.quick else ""), res)
    print(f"\n{len(args.part)} part(s) in {res['seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
