"""Worker utilisation: inner-step time / wall time and idle seconds per round, synchronous vs delayed outer step.

    python bench/utilisation.py                          # 4 workers, bench-llama, H=25, BASE_DIR on a 10 MB/s disk
    python bench/utilisation.py --mbps 0                 # no throttle (the local disk)
    python bench/utilisation.py --model configs/bench-llama.json --workers 4 --H 25 --rounds 8 --codecs none int8

Each configuration is a real `diloco_sim.py` run (worker processes, BASE_DIR protocol). BASE_DIR sits on a FUSE
passthrough with a bandwidth cap (bench/throttlefs.py: every read and write of the protocol crosses one shared
budget, like one NFS link), so the I/O share of a round is what a slow shared disk gives on a CPU box. Per worker,
from its sidecars: busy = Σ inner-step seconds, wall = from its first inner step to the end of its last one
(`trained_at`), idle per round = (wall − busy) / (rounds − 1): the gaps between segments. (Before `trained_at`,
wall ended when the last delta was published, which charged the last publication — in the background under
overlap — to idle time.) Printed for overlap=none, delayed folding at the segment's end, and delayed with
the default adaptive fold (at the first step boundary after the worker has read the commit; never waits) in the
same run, with the ratio of idle times and where in the next segment the workers folded each commit in.
Targets (issue #14): idle(delayed) <= 5% of idle(none); utilisation >= 97% where none gets <= 80%.
Also printed: the bytes a round moves over the shared link (every worker's delta, θ and state snapshot from its
sidecars' `io`, plus the coordinator's reads and writes) and their time at the cap, against a segment's compute.
Overlap hides the exchange only while the link time stays below the compute time; when it does not, the bench says
the run is link-bound (a faster box trains a segment sooner: at 10 MB/s fp32 needs H >= 50 on a 2-core EPYC).
Needs /dev/fuse, libfuse2 and fusepy for the throttle (`apt-get install fuse libfuse2`, `pip install -e '.[bench]'`;
otherwise use --mbps 0). Writes bench/results/utilisation.json.
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

from common import REPO, fold_steps, fold_summary, overlap_sets, save_result, table


def mount(backing: Path, mnt: Path, mbps: float, extra: list[str] | None = None) -> subprocess.Popen:
    """BASE_DIR's FUSE layer (bench/throttlefs.py) at `mbps` (0: uncapped), with throttlefs's `extra` arguments."""
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "throttlefs.py"), str(backing), str(mnt),
                             "--mbps", str(mbps), *(extra or [])], stderr=subprocess.PIPE, text=True)
    for _ in range(100):
        if subprocess.run(["mountpoint", "-q", str(mnt)]).returncode == 0:
            return proc
        if proc.poll() is not None:
            raise SystemExit(f"throttlefs failed: {proc.stderr.read()[-2000:]} (needs /dev/fuse, libfuse2 and fusepy: "
                             f"apt-get install fuse libfuse2; pip install -e '.[bench]'; or run with --mbps 0)")
        time.sleep(0.1)
    raise SystemExit("throttlefs did not mount in 10 s")


def unmount(mnt: Path, proc: subprocess.Popen) -> None:
    # fusermount comes with apt's fuse package (fusermount3 with fuse3); as root a plain umount does it
    tool = shutil.which("fusermount") or shutil.which("fusermount3")
    subprocess.run([tool, "-u", str(mnt)] if tool else ["umount", str(mnt)], check=False)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure(run_dir: Path, workers: int, rounds: int) -> dict:
    per = {}
    for w in range(workers):
        sides = []
        for r in range(rounds):
            f = run_dir / "rounds" / f"r{r:06d}" / "deltas" / f"w{w:03d}.json"
            if f.is_file():
                sides.append(json.loads(f.read_text()))
        if len(sides) < 2:
            continue
        busy = sum(s["train_seconds"] for s in sides)
        # from the first inner step to the last one's end (`trained_at`; older sidecars: when it was published)
        start = sides[0].get("trained_at", sides[0]["time"]) - sides[0]["train_seconds"]
        wall = sides[-1].get("trained_at", sides[-1]["time"]) - start
        # of the idle time: loading θ / folding it in (with the wait for it), from the sidecars' load_seconds
        load = sum(s.get("load_seconds", 0.0) for s in sides[1:])
        handoff = sum(s.get("handoff_seconds", 0.0) for s in sides[:-1])  # the wait before the next segment
        io = sum(s.get("io", {}).get("read", 0) + s.get("io", {}).get("written", 0) for s in sides[1:])
        per[w] = {"busy_s": busy, "wall_s": wall, "utilisation": busy / wall, "io_per_round": io / (len(sides) - 1),
                  "busy_per_round_s": busy / len(sides),
                  "idle_per_round_s": (wall - busy) / (len(sides) - 1), "load_per_round_s": load / (len(sides) - 1),
                  "handoff_per_round_s": handoff / (len(sides) - 1)}
    keys = ("utilisation", "idle_per_round_s", "load_per_round_s", "handoff_per_round_s", "busy_per_round_s")
    out = {"workers": per, **{k: statistics.mean(v[k] for v in per.values()) for k in keys}}
    # the shared link's load: every worker's reads and writes of a round (delta, θ, its state snapshot; the
    # sidecars' `io`) and the coordinator's (metrics.jsonl), rounds 2.. (round 1 also reads the data and θ_0)
    coord = [r.get("bytes_read", 0) + r.get("bytes_written", 0) for r in _records(run_dir) if r.get("round", 0) > 1]
    out["link_bytes_per_round"] = sum(v["io_per_round"] for v in per.values()) + \
        (statistics.mean(coord) if coord else 0.0)
    return out


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/bench-llama.json")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--H", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbps", type=float, default=10.0, help="shared-disk bandwidth cap in MB/s; 0 = no throttle")
    ap.add_argument("--codecs", nargs="+", default=["none"], help="outer.compression values to run")
    ap.add_argument("--overlaps", nargs="+", default=["none", "delayed@end", "delayed"],
                    help="outer.overlap values, @TAU sets outer.overlap_steps, @end folds at the segment's end "
                         "(the first is the baseline)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="edt-util-"))
    backing, mnt = tmp / "backing", tmp / "mnt"
    backing.mkdir()
    mnt.mkdir()
    fs = mount(backing, mnt, args.mbps) if args.mbps > 0 else None
    base = mnt if fs else backing
    results, rows, bound = {}, [], []
    try:
        for codec in args.codecs:
            for spec in args.overlaps:
                name = f"{codec}/{spec}"
                project = f"u_{codec}_{spec.replace('@', '_')}"
                sets = [f"model.name={args.model}", f"data.seq_length={args.seq}",
                        f"inner.per_device_batch_size={args.batch}", f"inner.total_batch_size={args.batch}",
                        f"outer.num_workers={args.workers}", f"outer.local_steps={args.H}",
                        f"outer.rounds={args.rounds}", f"outer.keep_rounds={args.rounds + 2}",
                        f"outer.compression={codec}", *overlap_sets(spec, args.H), "eval.every=1000",
                        "logging.plot=false", "data.max_tokens=2000000"]
                cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(REPO / "evolution.json"),
                       "--base-dir", str(base), "--project", project, "--no-progress",
                       *[a for s in sets for a in ("--set", s)]]
                t0 = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
                m = measure(base / project, args.workers, args.rounds)
                m["fold_steps"] = fold_steps(base / project)
                m["seconds"] = time.perf_counter() - t0
                results[name] = m
                rest = m["idle_per_round_s"] - m["load_per_round_s"] - m["handoff_per_round_s"]
                link_s = m["link_bytes_per_round"] / (args.mbps * 1e6) if args.mbps > 0 else 0.0
                m["link_s_per_round"] = link_s
                print(f"  {name}: utilisation {m['utilisation'] * 100:.1f}%, idle {m['idle_per_round_s']:.2f} s "
                      f"per round, of which loading / folding θ {m['load_per_round_s']:.2f} s, waiting for the "
                      f"previous publication {m['handoff_per_round_s']:.2f} s, the rest (hand-off and bookkeeping "
                      f"between two segments) {rest:.3f} s ({m['seconds']:.0f} s)", flush=True)
            sync = results[f"{codec}/{args.overlaps[0]}"]
            for spec in args.overlaps:
                m = results[f"{codec}/{spec}"]
                rows.append([codec, spec, f"{m['utilisation'] * 100:.1f}%", f"{m['idle_per_round_s']:.2f} s",
                             f"{m['idle_per_round_s'] / sync['idle_per_round_s'] * 100:.1f}%"
                             if sync["idle_per_round_s"] > 0 else "-", fold_summary(m["fold_steps"], args.H),
                             f"{m['link_bytes_per_round'] / 1e6:.1f} MB" +
                             (f" = {m['link_s_per_round']:.2f} s" if args.mbps > 0 else ""),
                             f"{m['busy_per_round_s']:.2f} s"])
                if spec != args.overlaps[0] and m["link_s_per_round"] > 0.9 * m["busy_per_round_s"]:
                    bound.append(f"{codec}/{spec}: a round moves {m['link_bytes_per_round'] / 1e6:.1f} MB over the "
                                 f"{args.mbps:g} MB/s link ({m['link_s_per_round']:.2f} s), about as long as or "
                                 f"longer than a segment's {m['busy_per_round_s']:.2f} s of compute: the exchange "
                                 f"is link-bound and no overlap can hide more than the compute time. A larger --H, "
                                 f"a higher --mbps or a codec shrinks the ratio; outer.state_dir (host-local) takes "
                                 f"the inner optimizer snapshot (the largest file) off the link.")
    finally:
        if fs:
            unmount(mnt, fs)
        shutil.rmtree(tmp, ignore_errors=True)
    disk = f"a FUSE passthrough capped at {args.mbps:g} MB/s" if args.mbps > 0 else "the local disk"
    print(f"\n{args.workers} workers, {args.model}, H={args.H}, {args.rounds} rounds, BASE_DIR on {disk}")
    print(table(rows, ["compression", "overlap", "utilisation (busy / wall)", "idle per round",
                       f"idle vs overlap={args.overlaps[0]} (target <= 5%)", "θ folded in", "link per round",
                       "segment (compute)"]))
    for line in bound:
        print(f"note: {line}")
    save_result("utilisation", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
