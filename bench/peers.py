"""Side by side with torchft: the same DiLoCo job in torchft (`torchft.local_sgd.DiLoCo`, gloo on loopback, its
lighthouse for quorum) and in EDT (`diloco_sim.py`: coordinator + workers on a local BASE_DIR), timed and scored in
one run.

    python bench/peers.py --quick            # 2 workers, Nesterov, + one kill in each (<= 6 min on 2 cores)
    python bench/peers.py                    # 2 and 4 workers x Nesterov and averaging, + one kill in each
    python bench/peers.py --workers 4 --outer avg --rounds 12 --local-steps 25 --no-fault

torchft is an optional extra: `pip install -c requirements/lock.txt -e '.[peers]'`.

What is the same in both (one config: evolution.json + the --set overrides below, loaded by both sides):
  - the model: the tiny Llama of configs/micro-llama.json, θ_0 = `build_model` with the run's seed, saved here and
    loaded into every torchft replica (EDT's coordinator builds and commits the same θ_0);
  - the inner loop: EDT's `InnerTrainer` in both (AdamW, warmup + cosine over the run's steps, grad clip 1, fp32,
    1 torch thread per worker process), H inner steps per round, its state kept across rounds;
  - the tokens: the shipped corpus and tokenizer; worker w of round r reads stream slice `Layout.slice(r, w)` of the
    seeded `StreamSampler` in both (torchft's round = `manager.current_step()`);
  - the outer step: torch SGD on the averaged pseudo-gradient θ_r − θ_w: Nesterov (lr 0.7, momentum 0.9, OpenDiLoCo)
    or averaging (lr 1, momentum 0). torchft runs it on every replica; EDT's coordinator runs it once and commits;
  - the score: the final model's mean loss on the same held-out windows (`evaluate`, eval.batches x eval.batch_size).
What differs: torchft weighs every participant equally, EDT by tokens (equal here); a torchft replica that heals
after a restart copies a peer's model, so that round averages that peer's pseudo-gradient twice (torchft's own
"batches can be overrepresented"); EDT's restarted worker replays its own slice from its saved state.

Per run: s/round = median commit-to-commit time over rounds 2..R (round 1 holds process start, quorum and first
reads), total wall (start to exit of every process), bytes/round (torchft: what each replica's process wrote during
the sync, /proc/self/io wchar, x workers ~ the gloo ring's 2(N-1)/N x model bytes each + quorum RPCs; EDT: every
byte that crossed BASE_DIR in the round, metrics.jsonl bytes_total), eval loss.
Fault: worker 1 is SIGKILLed a third into round --at and restarted 1 s later (EDT: its supervisor in diloco_sim;
torchft: this script, as torchelastic would): the time lost against the same run without the kill (first to last
commit), the rounds committed without it, the final loss. The lighthouse's heartbeat timeout and EDT's
outer.dead_after_s are both --dead-after.

Last line: `peers: torchft S_T s/round loss L_T; edt S_E s/round loss L_E` (the 2-worker Nesterov row).
Writes bench/results/peers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, save_result, table

INSTALL = "pip install -c requirements/lock.txt -e '.[peers]'"
OUTERS = {"nesterov": ("0.7", "0.9"), "avg": ("1.0", "0.0")}
TRAIN_LINE = re.compile(r"round (\d+): (\d+) steps, loss \S+ \(last \S+\), (\d+) tok/s")


def torchft_missing() -> str | None:
    """None when torchft imports, else the line saying how to install it."""
    try:
        import torchft  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
    except ImportError as e:
        return (f"bench/peers.py needs torchft (the peer it compares against), which does not import here "
                f"({type(e).__name__}: {e}): install the optional extra with `{INSTALL}` (torchft==0.2.0, pinned "
                f"in requirements/lock.txt; the constraint keeps torch at its locked version)")
    return None


def config_sets(args, n: int, outer: str) -> list[str]:
    lr, momentum = OUTERS[outer]
    return [f"outer.num_workers={n}", f"outer.rounds={args.rounds}", f"outer.local_steps={args.local_steps}",
            f"outer.lr={lr}", f"outer.momentum={momentum}", "outer.nesterov=true",
            f"outer.dead_after_s={args.dead_after}", f"outer.poll_interval_s={args.poll}",
            f"model.name={args.model}", "inner.device=cpu", "inner.precision=fp32", "logging.plot=false",
            f"eval.batches={args.eval_batches}", f"eval.every={args.rounds}", *args.set]


def prepare(tmp: Path, args) -> tuple[Path, Path]:
    """θ_0 (safetensors) and the token cache, built once by the product's own code for every run here."""
    from safetensors.torch import save_model

    from train.config import load_config
    from train.core.data import prepare_data
    from train.core.model import build_model, check_model_fits, load_tokenizer, quiet_transformers

    quiet_transformers()
    cfg = load_config(REPO / "evolution.json", [*config_sets(args, 2, "nesterov"), f"base_dir={tmp}",
                                                 "project_name=peers-data"])
    tok = load_tokenizer(cfg)
    model = build_model(cfg)
    data_dir = prepare_data(cfg, tok, check_model_fits(cfg, model, tok), progress=False)
    args.tokens_per_step = cfg.inner.total_batch_size * cfg.data.seq_length
    theta0 = tmp / "theta0.safetensors"
    save_model(model, str(theta0))
    return theta0, data_dir


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        return s.getsockname()[1]


def kill_at_third(times: dict[int, float], at: int) -> float:
    """When to kill: a third of a round after round `at` began (a round = the last commit-to-commit time)."""
    return times[at] + (times[at] - times[at - 1]) / 3


# -- torchft ----------------------------------------------------------------------------------------------------------
def run_torchft(tmp: Path, args, n: int, outer: str, theta0: Path, data_dir: Path, fault: bool) -> dict:
    name = f"torchft-{n}w-{outer}{'-kill' if fault else ''}"
    out = tmp / name
    out.mkdir()
    port = free_port()
    # Without a fault every quorum waits for all n replicas (with 1, the first quorums formed around whichever replica
    # started first, so the row measured 1-replica rounds on a busy box); with the kill, n - 1 may go on without the
    # dead one, as EDT's coordinator does.
    min_replicas = max(1, n - 1) if fault else n
    lh_log = open(out / "lighthouse.log", "w")
    lighthouse = subprocess.Popen(  # torchft's own lighthouse binary, as a cluster would run it
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}",
         "--min_replicas", str(min_replicas),
         "--join_timeout_ms", str(int(args.join_timeout * 1000)),
         "--heartbeat_timeout_ms", str(int(args.dead_after * 1000))], stdout=lh_log, stderr=subprocess.STDOUT)
    spec = {"config": str(REPO / "evolution.json"), "overrides": config_sets(args, n, outer), "threads": 1,
            "theta0": str(theta0), "data_dir": str(data_dir), "out": str(out), "lighthouse": f"http://127.0.0.1:{port}",
            "eval_worker": 0, "pg_timeout_s": 60, "quorum_timeout_s": 600, "min_replicas": min_replicas}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(REPO / "bench" / "peers_torchft.py"), str(out / "spec.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [open(out / f"w{w}.log", "a") for w in range(n)]

    def start(w):
        return subprocess.Popen([*cmd, str(w)], stdout=logs[w], stderr=subprocess.STDOUT, cwd=REPO, env=env)

    t0 = time.time()
    procs = {w: start(w) for w in range(n)}
    killed_at, restarted = None, 0
    try:
        deadline = t0 + args.run_timeout
        while any(p.poll() is None for p in procs.values()):
            if time.time() > deadline:
                raise SystemExit(f"{name}: not done after {args.run_timeout:g} s; logs in {out}")
            if fault and killed_at is None:
                t = {r["step"]: r["time"] for r in read_jsonl(out / "tf-w1.jsonl") if r.get("committed")}
                if args.at in t and args.at - 1 in t and time.time() >= kill_at_third(t, args.at):
                    procs[1].send_signal(signal.SIGKILL)
                    procs[1].wait()
                    killed_at = time.time()
                    time.sleep(1.0)  # the restart backoff EDT's supervisor uses
                    procs[1] = start(1)
                    restarted += 1
            if restarted and all(procs[w].poll() == 0 for w in procs if w != 1) and procs[1].poll() is None:
                procs[1].kill()  # the others finished the run before the restarted replica joined a quorum
                procs[1].wait()
                procs[1].returncode = 0
                break
            bad = [w for w, p in procs.items() if p.poll() not in (None, 0)]
            if bad:
                raise SystemExit(f"{name}: worker {bad[0]} exited {procs[bad[0]].returncode}; its log: "
                                 f"{out / f'w{bad[0]}.log'}\n" + (out / f"w{bad[0]}.log").read_text()[-3000:])
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lighthouse.terminate()
        lighthouse.wait(10)
        for f in [*logs, lh_log]:
            f.close()
    wall = time.time() - t0
    recs = read_jsonl(out / "tf-w0.jsonl")
    syncs = [r for r in recs if r["event"] == "sync"]
    commits = {r["step"]: r for r in syncs if r["committed"]}
    evals = [r for r in recs if r["event"] == "eval"]
    train = {}  # round -> the slowest replica's compute in it (its H steps without the sync)
    for w in range(n):
        for r in read_jsonl(out / f"tf-w{w}.jsonl"):
            if r.get("committed"):
                train[r["step"]] = max(train.get(r["step"], 0.0), r["train_s"])
    w1 = read_jsonl(out / "tf-w1.jsonl")
    starts = [i for i, r in enumerate(w1) if r["event"] == "start"]
    rejoined = None
    if restarted and len(starts) > 1:  # the first round the restarted replica committed in
        rejoined = next((r["round"] for r in w1[starts[-1]:] if r.get("committed")), None)
    return {"system": "torchft", "workers": n, "outer": outer, "fault": fault, "wall_s": wall, "rejoined": rejoined,
            "train_s": train,
            "commit_times": {s: r["time"] for s, r in commits.items()},
            "participants": {s: r["participants"] for s, r in commits.items()},
            "failed_syncs": sum(1 for r in syncs if not r["committed"]),
            "bytes_round": n * statistics.median(r["wchar"] for r in syncs) if syncs else None,
            "sync_s": statistics.median(r["sync_s"] for r in syncs) if syncs else None,
            "eval_loss": evals[-1]["eval_loss"] if evals else None, "killed": killed_at is not None,
            "restarts": restarted, "dir": str(out)}


# -- EDT --------------------------------------------------------------------------------------------------------------
def run_edt(tmp: Path, args, n: int, outer: str, fault: bool) -> dict:
    project = f"edt-{n}w-{outer}{'-kill' if fault else ''}"
    run = tmp / project
    cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"), "--base-dir",
           str(tmp), "--project", project, "--no-progress", "--threads", "1",
           *[a for s in config_sets(args, n, outer) for a in ("--set", s)]]
    t0 = time.time()
    sim_log = open(tmp / f"{project}.sim.log", "w")
    sim = subprocess.Popen(cmd, stdout=sim_log, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    killed = False
    try:
        deadline = t0 + args.run_timeout
        while sim.poll() is None:
            if time.time() > deadline:
                raise SystemExit(f"{project}: not done after {args.run_timeout:g} s; run folder {run}")
            if fault and not killed:
                t = edt_commit_times(run)
                if args.at in t and args.at - 1 in t and time.time() >= kill_at_third(t, args.at):
                    try:
                        pid = json.loads((run / "workers" / "w001" / "progress.json").read_text())["pid"]
                        os.kill(pid, signal.SIGKILL)
                        killed = True
                    except (OSError, ValueError, KeyError):
                        pass
            time.sleep(0.05)
    finally:
        if sim.poll() is None:
            sim.kill()
        sim_log.close()
    wall = time.time() - t0
    if sim.returncode != 0:
        err = (tmp / f"{project}.sim.log").read_text()
        coord = run / "logs" / "coordinator.log"
        raise SystemExit(f"{project} failed (exit {sim.returncode}):\n{err[-3000:]}"
                         + (f"\n{coord}:\n{coord.read_text()[-2000:]}" if coord.exists() else ""))
    recs = {r["round"]: r for r in read_jsonl(run / "metrics.jsonl") if "round" in r}
    last = recs[max(recs)]
    rounds = [r for r in recs.values() if r["round"] >= 1]
    train = {}  # committed round -> the slowest worker's compute for it, from the worker's own per-round line
    for w in range(n):
        for m in TRAIN_LINE.finditer((run / "logs" / f"worker-{w:03d}.log").read_text()):
            secs = args.tokens_per_step * int(m[2]) / max(1.0, float(m[3]))  # tokens / (tokens / s)
            train[int(m[1]) + 1] = max(train.get(int(m[1]) + 1, 0.0), secs)
    return {"system": "edt", "workers": n, "outer": outer, "fault": fault, "wall_s": wall, "train_s": train,
            "commit_times": {r: rec["time"] for r, rec in recs.items()},
            "participants": {r["round"]: len(r.get("workers_used", [])) for r in rounds},
            "bytes_round": statistics.median(r["bytes_deltas"] + r["worker_bytes_read"] / max(1, len(r["workers_used"]))
                                             for r in rounds) if rounds else None,
            "bytes_written_round": statistics.median(r["bytes_written"] + r["worker_bytes_written"] for r in rounds)
            if rounds else None,
            "wait_s": statistics.median(r.get("wait_s", 0) for r in rounds) if rounds else None,
            "eval_loss": last.get("eval_loss"), "killed": killed, "rejoined": rejoined_edt(recs, n, args.at, killed),
            "restarts": sum((run / "logs" / f"worker-{w:03d}.log").read_text().count("; restart ") for w in range(n)),
            "dir": str(run)}


def rejoined_edt(recs: dict, n: int, at: int, killed: bool) -> int | None:
    """The first round after the kill whose commit used every worker's delta again (as workers count rounds)."""
    if not killed:
        return None
    return next((r - 1 for r in sorted(recs) if r > at + 1 and len(recs[r].get("workers_used", [])) == n), None)


def edt_commit_times(run: Path) -> dict[int, float]:
    """Round r (as workers count it, from 0) began when round r was committed: metrics.jsonl's `round` r record."""
    return {r["round"]: r["time"] for r in read_jsonl(run / "metrics.jsonl") if "round" in r and "time" in r}


# -- the report -------------------------------------------------------------------------------------------------------
def per_round(res: dict) -> float:
    t = {int(k): v for k, v in res["commit_times"].items()}
    d = [t[r] - t[r - 1] for r in sorted(t) if r >= 2 and r - 1 in t]
    return statistics.median(d) if d else float("nan")


def overhead(res: dict) -> float:
    """Median over rounds 2..R of (round wall - the slowest worker's compute in it): what the exchange costs."""
    t = {int(k): v for k, v in res["commit_times"].items()}
    tr = {int(k): v for k, v in res["train_s"].items()}
    d = [t[r] - t[r - 1] - tr[r] for r in sorted(t) if r >= 2 and r - 1 in t and r in tr]
    return statistics.median(d) if d else float("nan")


def stall(res: dict, at: int) -> tuple[float, float]:
    """(the round the kill hit, the run's normal round before it): commit-to-commit, same run, so the box's load of
    the moment weighs on both."""
    t = {int(k): v for k, v in res["commit_times"].items()}
    d = {r: t[r] - t[r - 1] for r in t if r >= 2 and r - 1 in t}
    before = [d[r] for r in d if r <= at]
    return d.get(at + 1, float("nan")), statistics.median(before) if before else float("nan")


def span(res: dict) -> float:
    t = {int(k): v for k, v in res["commit_times"].items()}
    return t[max(t)] - t[min(k for k in t if k >= 1)]


def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 workers, Nesterov, 6 rounds of H = 12, one kill each")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--outer", nargs="+", default=["nesterov", "avg"], choices=sorted(OUTERS))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-steps", type=int, default=25, help="H")
    ap.add_argument("--model", default="configs/micro-llama.json")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--poll", type=float, default=0.2, help="EDT's outer.poll_interval_s (its default: 0.2)")
    ap.add_argument("--dead-after", type=float, default=5.0,
                    help="EDT outer.dead_after_s = torchft lighthouse heartbeat timeout (s)")
    ap.add_argument("--join-timeout", type=float, default=60.0, help="torchft lighthouse join timeout (s; its default)")
    ap.add_argument("--at", type=int, default=2, help="the round (from 0) a third into which worker 1 is killed")
    ap.add_argument("--no-fault", action="store_true")
    ap.add_argument("--fault-workers", type=int, help="workers of the kill runs (default: the first of --workers)")
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--set", action="append", default=[], help="one more config override for both systems")
    ap.add_argument("--results", type=Path, help="write the results JSON here (default bench/results/peers.json)")
    args = ap.parse_args()
    if args.quick:
        args.workers, args.outer, args.rounds, args.local_steps = [2], ["nesterov"], 6, 12
    missing = torchft_missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if not args.no_fault and not 2 <= args.at < args.rounds - 1:
        raise SystemExit("--at must leave two rounds before it and one after it")
    fault_n = args.fault_workers or args.workers[0]
    print(f"{args.model}, {args.rounds} rounds of H = {args.local_steps}, 1 thread per worker; workers "
          f"{args.workers}, outer {args.outer}", flush=True)
    results = []
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="edt-bench-peers-") as tmp_s:
        tmp = Path(tmp_s)
        theta0, data_dir = prepare(tmp, args)
        for n in args.workers:
            for outer in args.outer:
                for system in ("torchft", "edt"):
                    res = (run_torchft(tmp, args, n, outer, theta0, data_dir, False) if system == "torchft"
                           else run_edt(tmp, args, n, outer, False))
                    print(f"  {system} {n}w {outer}: {per_round(res):.2f} s/round, wall {res['wall_s']:.0f} s, "
                          f"loss {res['eval_loss']:.4f}", flush=True)
                    results.append(res)
        if not args.no_fault:
            outer = args.outer[0]
            for system in ("torchft", "edt"):
                res = (run_torchft(tmp, args, fault_n, outer, theta0, data_dir, True) if system == "torchft"
                       else run_edt(tmp, args, fault_n, outer, True))
                print(f"  {system} {fault_n}w {outer} + kill: wall {res['wall_s']:.0f} s, loss "
                      f"{res['eval_loss']:.4f}", flush=True)
                results.append(res)

    clean = {(r["system"], r["workers"], r["outer"]): r for r in results if not r["fault"]}
    rows = []
    for (system, n, outer), r in clean.items():
        other = clean.get(("edt" if system == "torchft" else "torchft", n, outer))
        rows.append([system, n, outer, f"{per_round(r):.2f}", f"{overhead(r):.2f}",
                     f"{per_round(r) / per_round(other):.2f}x" if other and system == "edt" else "",
                     f"{r['wall_s']:.0f}", fmt_bytes(r["bytes_round"]), fmt_bytes(r.get("bytes_written_round")),
                     f"{r['eval_loss']:.4f}",
                     f"{(r['eval_loss'] / other['eval_loss'] - 1) * 100:+.2f}%" if other and system == "edt" else ""])
    print(table(rows, ["system", "workers", "outer", "s/round", "exchange s/round", "vs torchft", "total wall s",
                       "exchanged/round", "all writes/round", "eval loss", "loss vs torchft"]))
    frows = []
    for r in results:
        if not r["fault"]:
            continue
        base = clean[(r["system"], r["workers"], r["outer"])]
        without = sum(1 for k, v in r["participants"].items() if int(k) >= 1 and v < r["workers"])
        frows.append([r["system"], r["workers"], r["outer"], "yes" if r["killed"] else "NO", r["restarts"],
                      "-" if r.get("rejoined") is None else f"round {r['rejoined'] + 1}",
                      "{:.1f} ({:.1f})".format(*stall(r, args.at)), f"{span(r) - span(base):+.1f}", without,
                      r.get("failed_syncs", 0), f"{r['eval_loss']:.4f}",
                      f"{(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}%"])
    if frows:
        print(f"\nworker 1 SIGKILLed a third into round {args.at + 1} and restarted after 1 s "
              f"(heartbeat timeout / dead_after_s {args.dead_after:g} s)")
        print(table(frows, ["system", "workers", "outer", "killed", "restarts", "back in", "hit round s (normal)",
                            "vs no-kill run s",
                            "rounds without it", "failed syncs", "eval loss", "vs no kill"]))
    record = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results, "time": time.time(), "total_s": time.time() - t_all}
    if args.results:
        path = args.results
        path.write_text(json.dumps(record, indent=1))
    else:
        path = save_result("peers", record)
    print(f"written: {path}; {time.time() - t_all:.0f} s in all")
    key_t, key_e = clean.get(("torchft", 2, "nesterov")), clean.get(("edt", 2, "nesterov"))
    if key_t and key_e:
        print(f"peers: torchft {per_round(key_t):.2f} s/round loss {key_t['eval_loss']:.4f}; "
              f"edt {per_round(key_e):.2f} s/round loss {key_e['eval_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
