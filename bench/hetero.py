"""Mixed machines on one box: rounds by time against a fixed H when some workers are slower.

    python bench/hetero.py --quick          # 4 workers, two at half speed, the micro Llama, the default weighting
                                            # (~5 min on 2 cores)
    python bench/hetero.py --rounds 4 --local-steps 80 --seeds 0   # every weighting (~11 min on 2 cores)
    python bench/hetero.py                  # longer runs, 2 seeds, every weighting

Every row is a real `diloco_sim.py` run (worker processes under their supervisors, the BASE_DIR protocol) of the
micro Llama on the embedded corpus. Workers 2 and 3 are held to half speed by the simulator (`--slow 2=0.5,3=0.5`:
their processes stopped for half of every 0.2 s, as slower machines), except in the homogeneous row:
  homogeneous   no slow workers, H = --local-steps every round: the reference
  fixed H       the slow workers, H for all: every round lasts as long as the slow workers' H steps
  time/tokens   rounds by time (outer.round_time_s = the time the homogeneous run's workers took for H steps), each
  time/equal    worker's H from its speed, capped at 2H; the deltas weighted by tokens, equally, or per step
  time/per_step (outer.weighting)
Every row trains the same token budget on the same inner schedule: inner.total_steps = rounds x H, in the run's
mean-worker steps (train/diloco/pace.py), so the learning rate reaches its floor at the budget in every row; the time
rows run a few rounds past it and their eval loss at the budget is read between the two rounds around it (every round
is evaluated). Printed per row:
  * the fast workers' utilisation: their training seconds over the run's wall seconds after round 0 (timeline.jsonl);
  * eval loss at the budget against the homogeneous row's, and at the wall time the fixed-H row ended;
  * windows: every range a committed delta read disjoint from every other; the windows a worker did not read by its
    round's end and read first in its next round (carried), and those nobody reads (skipped: still carried when the
    run ends), as shares of the windows trained.
The last line: `hetero: fast-worker utilisation F% (fixed H U%), loss vs homogeneous +D%` (F and D of the default
weighting, outer.weighting). Writes bench/results/hetero.json and docs/img/hetero-utilisation.png.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, save_result, table

from train.core.store import read_jsonl

SLOW = "2=0.5,3=0.5"
FAST = (0, 1)


def run(base: Path, name: str, args, rounds: int, sets: list[str], slow: str, seed: int) -> dict:
    """One simulator run; returns its metrics records, timeline and layout."""
    project = f"hetero-{name}-s{seed}"
    allsets = [f"outer.num_workers={args.workers}", f"outer.rounds={rounds}", f"outer.local_steps={args.local_steps}",
               f"inner.total_steps={args.rounds * args.local_steps}", "inner.warmup_steps=5", f"seed={seed}",
               "outer.poll_interval_s=0.05", f"data.max_tokens={args.max_tokens}",
               "model.name=configs/micro-llama.json", "inner.device=cpu", "logging.plot=false", "eval.batches=4",
               "eval.every=1", *args.set, *sets]
    cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"), "--base-dir",
           str(base), "--project", project, "--no-progress", "--threads", "1",
           *[a for s in allsets for a in ("--set", s)], *(["--slow", slow] if slow else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"hetero: row {name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    root = base / project
    return {"name": name, "wall_s": time.perf_counter() - t0, "metrics": read_jsonl(root / "metrics.jsonl"),
            "timeline": read_jsonl(root / "timeline.jsonl"),
            "layout": json.loads((root / "data" / "layout.json").read_text())}


def utilisation(res: dict) -> tuple[dict[int, float], list[dict[int, float]]]:
    """Per worker: training seconds / wall seconds from round 0's close to the last close; and per round."""
    tl = sorted(res["timeline"], key=lambda x: x["round"])
    per_round: list[dict[int, float]] = []
    total: dict[int, float] = {}
    for prev, cur in zip(tl, tl[1:]):
        wall = cur["closed"] - prev["closed"]
        row = {}
        for d in cur["deltas"]:
            if d.get("round") == cur["round"]:
                row[d["worker"]] = min(1.0, float(d["train_seconds"]) / wall)
                total[d["worker"]] = total.get(d["worker"], 0.0) + float(d["train_seconds"])
        per_round.append(row)
    wall = tl[-1]["closed"] - tl[0]["closed"] if len(tl) > 1 else float("nan")
    return {w: s / wall for w, s in total.items()}, per_round


def at(points: list[tuple[float, float]], x: float) -> float:
    """The value at x, linear between the two points around it (points sorted by their first value)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1] if points and x >= points[-1][0] else float("nan")


def windows_check(res: dict) -> dict:
    """Every committed (round, worker) slice disjoint; skipped windows against the windows trained."""
    spans = []
    for rec in res["metrics"]:
        for key, (off, read) in (rec.get("data") or {}).items():
            spans.append((int(off), int(off) + int(read), rec["round"], key))
    spans.sort()
    overlaps = sum(1 for a, b in zip(spans, spans[1:]) if b[0] < a[1])
    trained = sum(e - s for s, e, *_ in spans)
    skipped = int(res["metrics"][-1].get("skipped_windows", 0)) if res["metrics"] else 0
    carried = sum(sum((rec.get("carried") or {}).values()) for rec in res["metrics"])
    return {"slices": len(spans), "overlaps": overlaps, "trained_windows": trained, "skipped_windows": skipped,
            "skipped_pct": 100.0 * skipped / max(1, trained + skipped), "carried_windows": carried,
            "carried_pct": 100.0 * carried / max(1, trained + skipped)}


def summarise(res: dict, budget_tokens: int, t_fixed: float | None) -> dict:
    recs = [r for r in res["metrics"] if isinstance(r.get("eval_loss"), (int, float)) and
            not math.isnan(r["eval_loss"])]
    by_tokens = sorted((float(r["tokens"]), r["eval_loss"]) for r in recs)
    t_start = res["metrics"][0]["time"]
    by_time = sorted((r["time"] - t_start, r["eval_loss"]) for r in recs)
    util, per_round = utilisation(res)
    fast = [util[w] for w in FAST if w in util]
    hs = [{int(k[1:]): v for k, v in (r.get("planned_steps") or {}).items()} for r in res["metrics"][1:]]
    return {"name": res["name"], "rounds": len(res["metrics"]) - 1, "tokens": res["metrics"][-1]["tokens"],
            "wall_s": res["metrics"][-1]["time"] - t_start, "loss_at_budget": at(by_tokens, budget_tokens),
            "loss_at_fixed_end": at(by_time, t_fixed) if t_fixed else float("nan"),
            "fast_util": statistics.mean(fast) if fast else float("nan"), "util": util, "util_rounds": per_round,
            "planned_steps": hs, "windows": windows_check(res)}


def picture(rows: dict[str, dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("fixed H", "time/tokens") if n in rows]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        per = rows[name]["util_rounds"]
        for w in sorted({w for r in per for w in r}):
            ax.plot(range(1, len(per) + 1), [100 * r.get(w, float("nan")) for r in per], marker="o", ms=3,
                    label=f"worker {w}" + (" (half speed)" if w not in FAST else ""))
        ax.set_title(f"{name}: training time / round time")
        ax.set_xlabel("round")
        ax.set_ylim(0, 105)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("utilisation %")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 4 rounds of H = 80, the default weighting only "
                                                         "(at most ~6 min on 2 cores)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the fixed-H rows (the token budget)")
    ap.add_argument("--local-steps", type=int, default=None, help="H of the fixed-H rows (the time rows' cap is 2H)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--weightings", nargs="+", default=None,
                    help="the time rows' outer.weighting (default: tokens, equal, per_step; --quick: the default one)")
    ap.add_argument("--max-tokens", type=int, default=2_000_000)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every row (e.g. data.cache_dir=... for a token cache made elsewhere)")
    args = ap.parse_args()
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.local_steps = args.local_steps or (80 if args.quick else 100)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1])
    if args.workers < 3:
        raise SystemExit("hetero: --workers must be >= 3 (workers 2 and 3 are the slow ones, 0 and 1 the fast)")
    from train.config import RunConfig
    default_weighting = RunConfig().outer.weighting
    args.weightings = args.weightings or ([default_weighting] if args.quick else ["tokens", "equal", "per_step"])
    H, R = args.local_steps, args.rounds
    batch = json.loads((REPO / "evolution.json").read_text())["inner"]["total_batch_size"]
    seq = json.loads((REPO / "evolution.json").read_text())["data"]["seq_length"]
    budget = R * H * args.workers * batch * seq
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="hetero-") as tmp:
        base = Path(tmp)
        for seed in args.seeds:
            homo = run(base, "homogeneous", args, R, [], "", seed)
            # the round time: what a homogeneous worker took for H steps (median over rounds after the first)
            secs = [d["train_seconds"] for t in homo["timeline"][1:] for d in t["deltas"]]
            T = round(statistics.median(secs), 2)
            fixed = run(base, "fixed", args, R, [], SLOW, seed)
            t_fixed = fixed["metrics"][-1]["time"] - fixed["metrics"][0]["time"]
            # fast workers ~H, slow ~H/2, one calibration round of H/2: rounds to pass the budget, and two more
            extra = math.ceil(R * H / (0.75 * H)) + 3
            rows = {"homogeneous": summarise(homo, budget, t_fixed), "fixed H": summarise(fixed, budget, t_fixed)}
            for wt in args.weightings:
                res = run(base, f"time-{wt}", args, extra,
                          [f"outer.round_time_s={T}", f"outer.local_steps={2 * H}", f"outer.weighting={wt}"],
                          SLOW, seed)
                rows[f"time/{wt}"] = summarise(res, budget, t_fixed)
                rows[f"time/{wt}"]["round_time_s"] = T
            for name, row in rows.items():
                results.setdefault(name, []).append(row)
            print(f"seed {seed}: round_time_s = {T}", flush=True)
    ref = statistics.mean(r["loss_at_budget"] for r in results["homogeneous"])
    lines = []
    for name, rs in results.items():
        loss = statistics.mean(r["loss_at_budget"] for r in rs)
        lines.append([name, f"{statistics.mean(r['fast_util'] for r in rs) * 100:.1f}",
                      f"{loss:.4f}", f"{(loss / ref - 1) * 100:+.2f}",
                      f"{statistics.mean(r['loss_at_fixed_end'] for r in rs):.4f}",
                      f"{statistics.mean(r['wall_s'] for r in rs):.1f}",
                      f"{statistics.mean(r['rounds'] for r in rs):.0f}",
                      sum(r["windows"]["overlaps"] for r in rs),
                      f"{statistics.mean(r['windows']['carried_pct'] for r in rs):.2f}",
                      f"{statistics.mean(r['windows']['skipped_pct'] for r in rs):.2f}"])
    print(table(lines, ["row", "fast util %", "eval loss @budget", "vs homog %", "loss @fixed-H wall", "wall s",
                        "rounds", "overlaps", "carried %", "skipped %"]))
    picture({k: v[0] for k, v in results.items()}, REPO / "docs" / "img" / "hetero-utilisation.png")
    save_result("hetero", {"args": vars(args), "budget_tokens": budget, "rows": results})
    fx = statistics.mean(r["fast_util"] for r in results["fixed H"]) * 100
    key = f"time/{default_weighting}"
    f = statistics.mean(r["fast_util"] for r in results[key]) * 100
    d = (statistics.mean(r["loss_at_budget"] for r in results[key]) / ref - 1) * 100
    print(f"hetero: fast-worker utilisation {f:.0f}% (fixed H {fx:.0f}%), loss vs homogeneous {d:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
