"""Elastic DiLoCo on one box: what a dead, leaving or slow worker costs the round it happens in.

    python bench/elastic.py                                  # 3 workers, 5 rounds of H = 100 (~8 min on 2 busy cores)
    python bench/elastic.py --workers 4 --local-steps 200 --dead-after 5
    python bench/elastic.py --late 0 0.5 1 --seeds 0 1 --rounds 10 --slowdown 4   # drop vs fold a straggler's deltas

Every scenario is a real `diloco_sim.py` run (worker processes under their supervisors, the BASE_DIR protocol) of
the tiny Llama on the embedded corpus, in a temp folder; the disturbance hits worker 1 a third of the way into
round --at:
  baseline    nothing happens: the normal round time (the median over rounds 2..R) every ratio is against
  kill        SIGKILL worker 1: the supervisor restarts it (1 s backoff), it resumes from its saved state
  leave       SIGTERM worker 1: it leaves at its next inner step (exit 0, lease status "left"), no restart
  straggler   worker 1 runs at a third of its speed for the rest of the run (SIGSTOP 2/3 of every 60 ms)
  join        one more worker process (`python -m train.diloco.worker --worker N`) is started: it asks to join and
              trains from the next round boundary (the rounds after it use N + 1 deltas)
For each: the affected round's duration (commit to commit) / the baseline's normal round, the deltas that round
used, and the rounds after it. The issue's target for a death: <= dead_after_s + 1.5 x a normal round. A round
closes without a worker only where the coordinator consults train/exchange/membership.py; without that it waits
for the restarted worker (kill) or until outer.round_timeout_s (leave; --timeout, short here), which is what the
numbers then show. Writes bench/results/elastic.json.

--late W...: the straggler scenario only (worker 1 slowed from round --at to the end), once per outer.late_weight W
and seed: 0 drops a delta that misses its round's straggler deadline, W > 0 folds it into the next round with W x its
tokens as weight. Prints the final eval loss (the same held-out windows), the deltas used and folded, and the
tokens trained, against W = first value; writes bench/results/elastic_late.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, save_result, table


def progress(run: Path, w: int) -> dict:
    try:
        return json.loads((run / "workers" / f"w{w:03d}" / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def round_times(run: Path) -> dict[int, dict]:
    recs = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "round" in r:
            recs[r["round"]] = r
    return recs


class Throttle(threading.Thread):
    """Run a process at 1/`slowdown` of its speed: SIGSTOP / SIGCONT in a 60 ms cycle (a slow or shared GPU)."""

    def __init__(self, pid: int, slowdown: float, period: float = 0.06):
        super().__init__(daemon=True)
        self.pid, self.run_s, self.period = pid, period / slowdown, period
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.run_s)
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.period - self.run_s)
            except ProcessLookupError:
                return
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def scenario(name: str, base: Path, args, disturb, extra: tuple[str, ...] = ()) -> dict:
    """One simulator run; `disturb(pid)` is called when worker 1 is a third into round args.at."""
    project = f"elastic-{name}"
    run = base / project
    sets = [f"outer.num_workers={args.workers}", f"outer.rounds={args.rounds}", f"outer.local_steps={args.local_steps}",
            f"outer.dead_after_s={args.dead_after}", f"outer.round_timeout_s={args.timeout}",
            "outer.poll_interval_s=0.05", "data.max_tokens=400000", "model.name=configs/micro-llama.json",
            "inner.device=cpu", "logging.plot=false", "eval.batches=2", *extra]
    cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"), "--base-dir",
           str(base), "--project", project, "--no-progress", "--threads", "1",
           *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    sim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    hit_at, undo = None, None
    try:
        while sim.poll() is None:
            p = progress(run, 1)
            if disturb and hit_at is None and p.get("round") == args.at and p.get("status") == "training" and \
                    p.get("step", 0) >= args.local_steps // 3:
                hit_at, undo = time.time(), disturb(p["pid"])
            time.sleep(0.05)
        err = sim.stderr.read()
    finally:
        if undo:
            undo()
        if sim.poll() is None:
            sim.kill()
    if sim.returncode != 0:
        raise SystemExit(f"{name} failed (exit {sim.returncode}):\n{err[-3000:]}")
    recs = round_times(run)
    dur = {r: recs[r]["time"] - recs[r - 1]["time"] for r in recs if r > 0 and r - 1 in recs}
    print(f"  {name}: {time.perf_counter() - t0:.0f}s", flush=True)
    last = recs[max(recs)]
    return {"durations": dur, "used": {r: len(recs[r].get("workers_used", [])) for r in dur},
            "eval_loss": last.get("eval_loss"), "tokens": last.get("tokens"),
            "late": sum(len(recs[r].get("late") or {}) for r in recs),
            "hit": hit_at is not None, "restarts": sum((run / "logs" / f"worker-{w:03d}.log").read_text()
                                                       .count("; restart ") for w in range(args.workers))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--local-steps", type=int, default=100)
    ap.add_argument("--at", type=int, default=2, help="the round (0-based, as workers count) the disturbance hits")
    ap.add_argument("--dead-after", type=float, default=5.0, help="outer.dead_after_s")
    ap.add_argument("--timeout", type=float, default=30.0, help="outer.round_timeout_s")
    ap.add_argument("--slowdown", type=float, default=3.0, help="the straggler's slowdown")
    ap.add_argument("--skip", nargs="*", default=[], choices=("kill", "leave", "straggler", "join"))
    ap.add_argument("--late", type=float, nargs="+", help="compare these outer.late_weight values (straggler only)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the --late comparison")
    args = ap.parse_args()
    if not 1 <= args.at < args.rounds - 1:
        raise SystemExit("--at must leave a round before and after it")

    def kill(pid):
        os.kill(pid, signal.SIGKILL)

    def leave(pid):
        os.kill(pid, signal.SIGTERM)

    def straggle(pid):
        t = Throttle(pid, args.slowdown)
        t.start()
        return lambda: (t.stop.set(), t.join(2))

    if args.late:
        return late_comparison(args, straggle)
    results = {}
    with tempfile.TemporaryDirectory(prefix="edt-bench-elastic-") as tmp:
        def join(pid):
            run = Path(tmp) / "elastic-join"
            log = open(run / "joiner.log", "w")
            p = subprocess.Popen([sys.executable, "-m", "train.diloco.worker", "--config", str(run / "config.json"),
                                  "--worker", str(args.workers), "--threads", "1"], stdout=log,
                                 stderr=subprocess.STDOUT, cwd=REPO)
            return lambda: (p.wait(120) if p.poll() is None else None, log.close())

        base = Path(tmp)
        print(f"{args.workers} workers, {args.rounds} rounds of H = {args.local_steps}; worker 1 is hit in round "
              f"{args.at + 1} (dead_after_s = {args.dead_after:g}, round_timeout_s = {args.timeout:g})", flush=True)
        results["baseline"] = scenario("baseline", base, args, None)
        for name, fn in (("kill", kill), ("leave", leave), ("straggler", straggle), ("join", join)):
            if name not in args.skip:
                results[name] = scenario(name, base, args, fn)

    normal = statistics.median(results["baseline"]["durations"][r] for r in range(2, args.rounds + 1))
    hit = args.at + 1  # workers count rounds from 0; metrics name a round by the model it commits
    rows = []
    for name, res in results.items():
        d = res["durations"]
        after = [d[r] for r in range(hit + 1, args.rounds + 1) if r in d]
        rows.append([name, f"{d[hit]:.1f}", f"{d[hit] / normal:.2f}x", f"{res['used'][hit]}/{args.workers}",
                     f"{statistics.median(after) / normal:.2f}x" if after else "-", res["restarts"]])
    print(table(rows, ["scenario", f"round {hit} (s)", "vs normal", "deltas used", "rounds after", "restarts"]))
    target = args.dead_after + 1.5 * normal
    if "join" in results:
        used = results["join"]["used"]
        first = min((r for r in used if used[r] > args.workers), default=None)
        print(f"join: the extra worker started in round {hit}; its delta counts from round {first} on"
              if first else "join: the extra worker never contributed")
        results["join"]["joined_round"] = first
    if "kill" in results:
        took = results["kill"]["durations"][hit]
        print(f"normal round {normal:.1f} s; target for the round of a death: <= dead_after_s + 1.5 x normal = "
              f"{target:.1f} s: {'met' if took <= target else 'NOT met'} ({took:.1f} s)")
    path = save_result("elastic", {"args": vars(args), "normal_round_s": normal, "target_s": target,
                                   "results": {k: {kk: {str(r): v for r, v in vv.items()} if isinstance(vv, dict)
                                                   else vv for kk, vv in res.items()} for k, res in results.items()},
                                   "time": time.time()})
    print(f"written: {path}")
    return 0


def late_comparison(args, straggle) -> int:
    """Drop vs fold: the straggler scenario once per (late_weight, seed)."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="edt-bench-elastic-") as tmp:
        print(f"{args.workers} workers, {args.rounds} rounds of H = {args.local_steps}; worker 1 runs "
              f"{args.slowdown:g}x slower from round {args.at + 1} on (straggler_factor 3, dead_after_s "
              f"{args.dead_after:g})", flush=True)
        for w in args.late:
            for seed in args.seeds:
                key = f"late_weight={w:g} seed={seed}"
                out[key] = scenario(f"late{w:g}-s{seed}", Path(tmp), args, straggle,
                                    (f"outer.late_weight={w}", f"seed={seed}"))
    rows, base = [], {s: out[f"late_weight={args.late[0]:g} seed={s}"]["eval_loss"] for s in args.seeds}
    for w in args.late:
        res = [out[f"late_weight={w:g} seed={s}"] for s in args.seeds]
        rel = [r["eval_loss"] / base[s] - 1 for r, s in zip(res, args.seeds)]
        rows.append([f"{w:g}", " / ".join(f"{r['eval_loss']:.4f}" for r in res),
                     " / ".join(f"{x * 100:+.2f}%" for x in rel), " / ".join(str(sum(r["used"].values())) for r in res),
                     " / ".join(str(r["late"]) for r in res), " / ".join(f"{r['tokens']}" for r in res)])
    print(table(rows, ["late_weight", "eval loss (per seed)", f"vs late_weight {args.late[0]:g}", "deltas used",
                       "late folded", "tokens"]))
    path = save_result("elastic_late", {"args": vars(args), "results": {k: {kk: ({str(r): v for r, v in vv.items()}
                                        if isinstance(vv, dict) else vv) for kk, vv in r.items()}
                                        for k, r in out.items()}, "time": time.time()})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
