"""Wide: N = 16, 64, 256 fake workers against the real DiLoCo coordinator, protocol only.

    python bench/scale.py --quick            # N = 16, 64, 256 on the FUSE layer, 12 rounds each (<= 6 min, 2 cores)
    python bench/scale.py                    # the same with 16 rounds, then a plain-disk run per N
    python bench/scale.py --ns 16 256 --rounds 8 --lookup-ttl 10

The coordinator is the real one (`python diloco.py`, a micro-llama, outer.num_workers = N) on its own FUSE mount
(bench/throttlefs.py, one NFS client) of a backing folder on /dev/shm; the N workers are threads of ONE other process
(`bench/scale.py --fake-workers ...`) on a second mount of the same folder. A fake worker does not train: it speaks
the worker's protocol with the product's own code, as train/diloco/worker.py does each round: its lock and heartbeat
lease (train/core/heartbeat.py, every second), the coordinator watch, waiting for rounds/r/COMMITTED as the worker does
(train/exchange/expect.py's wait_commit: the rounds after the last one seen, fast polling shared by the N), the data
layout (train/exchange/layout.py: its slice of the round), θ_r read through
GlobalTheta, then, after a random "training" time (--train-s ± --jitter), a pre-made delta of the model's size
(common direction + its own noise, so the coordinator's screen sees healthy deltas) written by write_delta to its
pending file, state.json, the rename into rounds/r/deltas/ and the sidecar (delta_sidecar, publish_sidecar). It skips
only the inner optimizer snapshot (the worker's own file, off the exchange's critical path; outer.state_dir moves
it off BASE_DIR).

Per N, over the rounds after the first two (start-up):
  tail        last delta published -> rounds/r+1/COMMITTED written: from the moment the last fake worker's
              publish_sidecar returned (the sidecar renamed into place and its folder fsync'd) to the marker's
              `time` (one clock). `from sidecar time` starts earlier, at the `time` the worker put in its sidecar
              before writing its state, renaming the delta and publishing: it adds the worker's own publication
              (slow when 256 workers share one core) to the coordinator's tail. The coordinator's own `tail_s`
              (metrics.jsonl) starts when its poll loop has *added* the last delta, so it leaves out how long the
              coordinator took to notice it (a poll over N leases, a listing of 2N files): it is printed as
              `coord tail_s`, the true tail as `tail`.
  ops         metadata calls per worker-round, counted by the FUSE layer (throttlefs --count-file): lookups and
              stats (getattr), opens, creates, renames, unlinks, mkdirs, xattr reads, and listings counted in
              READDIR pages (4 KB of entries each: a listing of 2N names costs more than one of 20), for the
              coordinator's mount and the workers' mount apart; `names/w-r` is the names listed per worker-round.
  bytes       per round, from metrics.jsonl's `bytes_total` (the coordinator's reads and writes + the workers' io).
  wall        per round, COMMITTED to COMMITTED.
Targets (issue #34): tail(256) / tail(16) <= 1.5, coordinator ops per worker-round (256) / (16) <= 1.2. The last
line is `scale: tail N=256/N=16 X, ops per worker-round N=256/N=16 Y`, measured in this run.
Needs FUSE (/dev/fuse, libfuse2, fusepy). Writes bench/results/scale.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, save_result, table

from tests.helpers.fusefs import fuse_skip_reason, nfs_mount

PROJECT = "scale"
# listing pages stand for listings; opendir/releasedir, the data calls and the handle bookkeeping are not counted
NOT_METADATA = {"read", "write", "flush", "release", "releasedir", "opendir", "readdir", "fsync", "fsyncdir", "ioctl",
                "init", "destroy", "statfs"}


def overrides(args, base_dir: Path, n: int) -> list[str]:
    sets = [f"base_dir={base_dir}", f"project_name={PROJECT}", "seed=0",
            f"model.name={REPO / 'configs' / 'micro-llama.json'}", f"model.tokenizer={REPO / 'data' / 'tokenizer'}",
            "data.fake_data=true", "data.fake_tokens=400000", "data.seq_length=16",
            "inner.per_device_batch_size=1", "inner.total_batch_size=1", "inner.device=cpu",
            f"outer.num_workers={n}", f"outer.rounds={args.rounds}", "outer.local_steps=1",
            "eval.batch_size=1", "eval.batches=1", f"eval.every={args.rounds}", "logging.progress=false",
            "logging.plot=false", *args.set]
    return [a for s in sets for a in ("--set", s)]


def metadata_ops(counts: dict) -> int:
    ops = counts.get("ops", {})
    return sum(v for k, v in ops.items() if k not in NOT_METADATA) + counts.get("readdir_pages", 0)


def read_counts(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# -- the fake workers (one process, one thread each) ----------------------------------------------------------------
def fake_workers(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fake-workers", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--backing", required=True, help="the run folder in the backing dir (bookkeeping, not counted)")
    ap.add_argument("--counts", nargs=2, required=True, help="count files of the coordinator's and the workers' mount")
    ap.add_argument("--log", required=True)
    ap.add_argument("--train-s", type=float, default=1.5)
    ap.add_argument("--jitter", type=float, default=0.5)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    import torch

    from train.config import load_config
    from train.core import sharedfs
    from train.core.coordinator_lease import CoordinatorWatch
    from train.core.heartbeat import Heartbeat
    from train.core.store import atomic_write_json, exclusive_lock, wait_for
    from train.exchange.expect import Expect, wait_commit
    from train.exchange.store import DiLoCoPaths
    from train.exchange.layout import Layout
    from train.exchange.master import exchange_codecs
    from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
    from train.exchange.theta import GlobalTheta

    torch.set_num_threads(1)
    cfg = load_config(a.config, a.set, strategy="diloco")
    sharedfs.configure_from(cfg.outer)
    oc, N = cfg.outer, a.fake_workers
    paths = DiLoCoPaths(cfg.run_dir)
    backing = DiLoCoPaths(a.backing)  # the same run seen outside the mounts: bookkeeping only
    delta_codec, back_codec = exchange_codecs(oc)
    events: list[dict] = []
    ev_lock = threading.Lock()
    seen_commit: dict[int, float] = {}
    failures: list[str] = []
    H, B = oc.local_steps, cfg.inner.total_batch_size
    tokens = H * B * cfg.data.seq_length

    def note_commit(r: int) -> None:
        with ev_lock:
            if r in seen_commit:
                return
            seen_commit[r] = time.time()
        try:
            t = float(json.loads(backing.committed(r).read_text())["time"])
        except (OSError, ValueError, KeyError):
            t = None
        c = [read_counts(Path(p)) for p in a.counts]
        with ev_lock:
            events.append({"kind": "commit", "round": r, "time": t, "seen": seen_commit[r], "counts": c})

    def one(w: int) -> None:
        rng = random.Random(1000 + w)
        hb = Heartbeat(paths.progress(w), w)
        try:
            lock = exclusive_lock(paths.worker_dir(w) / "lock", f"worker {w}", lease=paths.progress(w))
            hb.start_lease(at_first_beat=True)
            monitor = CoordinatorWatch.of(cfg, "diloco")
            hb.beat(force=True, status="waiting for round 0")
            wait_for(lambda: monitor() or paths.is_committed(0), None, oc.poll_interval_s)
            theta = GlobalTheta(paths, back_codec)
            g = torch.Generator().manual_seed(7)
            common = {n: torch.randn(theta.shapes[n], generator=g) * 1e-3 for n in theta.names}
            gw = torch.Generator().manual_seed(100 + w)
            premade = {n: common[n] + 0.3 * torch.randn(theta.shapes[n], generator=gw) * 1e-3 for n in theta.names}
            state = {"round_done": -1, "position": 0, "step": 0}
            latest, expect = None, Expect(oc.poll_interval_s, N)
            while True:
                r = latest = paths.latest_committed(latest)
                if r >= oc.rounds:
                    hb.beat(force=True, status="done", round=r)
                    break
                lay = Layout.load(paths)
                offset, windows = lay.slice(r, w)
                theta.advance_to(r)
                read = theta.take_bytes()
                hb.beat(status="training", round=r, step=0, steps=H)
                time.sleep(max(0.0, rng.uniform(a.train_s - a.jitter, a.train_s + a.jitter)))
                hb.beat(status="training", round=r, step=H, steps=H, loss=5.0)
                pending = paths.worker_pending_delta(w, r)
                params = {n: theta.tensors[n] - premade[n] for n in theta.names}
                file = write_delta(pending, theta.names, theta.tensors, params, delta_codec, r, w)
                sidecar = delta_sidecar(r, w, file, inner_steps=H, tokens=tokens, loss=5.0, last_loss=5.0,
                                        train_seconds=a.train_s, load_seconds=0.0, trained_at=time.time())
                sidecar["lease"] = hb.lease_id
                sidecar["io"] = {"read": read, "written": file["bytes"]}
                sidecar["position"] = offset + H * B
                sidecar["data"] = {"segment": lay.index(r), "offset": offset, "windows": windows, "read": H * B}
                state.update(round_done=r, position=offset + H * B, sidecar=sidecar)
                atomic_write_json(paths.worker_state(w), state)
                paths.deltas_dir(r).mkdir(parents=True, exist_ok=True)
                sharedfs.replace(pending, paths.delta_file(r, w))
                publish_sidecar(paths, sidecar)
                done = time.time()
                with ev_lock:
                    events.append({"kind": "published", "round": r, "worker": w, "time": sidecar["time"],
                                   "done": done})
                hb.beat(force=True, status="waiting for the outer step", round=r)
                latest = wait_commit(paths, r, latest, expect, monitor) or latest
                note_commit(r + 1)
            hb.stop("exited")
            lock.release()
        except BaseException as e:  # noqa: BLE001 (reported by the bench)
            import traceback
            failures.append(f"worker {w}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            hb.stop("exited", error=str(e)[:200])

    threads = [threading.Thread(target=one, args=(w,), daemon=True, name=f"w{w}") for w in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(a.log).write_text(json.dumps({"events": events, "failures": failures}))
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


# -- one run --------------------------------------------------------------------------------------------------------
def cpu_sides(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """The cores of the coordinator's side (it and its mount) and of the workers' side (the fake workers and their
    mount): half each, so that N fake workers on one machine do not take the coordinator's CPU (on a real cluster
    each runs on its own machine: the bench measures the coordinator's cost, not this box's load). None: no pinning
    (--no-pin, or a single core)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None):
    """Processes started inside run on `cpus` (they inherit this thread's affinity, restored after)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def run_once(args, n: int, fuse: bool, tmp: Path) -> dict:
    work = tmp / f"n{n}-{'fuse' if fuse else 'plain'}"
    backing = work / "backing"
    backing.mkdir(parents=True)
    counts = [work / "counts-coordinator.json", work / "counts-workers.json"]
    sides = cpu_sides(args.pin)
    with contextlib.ExitStack() as stack:
        if fuse:  # each mount's process runs on its side's cores (inherited from this thread's, set around the start)
            with on_cpus(sides[0]):
                mc = stack.enter_context(nfs_mount(backing, work / "mc", lookup_ttl=args.lookup_ttl,
                                                   count_file=counts[0]))
            with on_cpus(sides[1]):
                mw = stack.enter_context(nfs_mount(backing, work / "mw", lookup_ttl=args.lookup_ttl,
                                                   count_file=counts[1]))
        else:
            mc = mw = backing
        log_c, log_w, wlog = work / "coordinator.out", work / "workers.out", work / "workers.json"
        t0 = time.time()
        with open(log_c, "w") as fc, open(log_w, "w") as fw:
            with on_cpus(sides[0]):
                coord = subprocess.Popen([sys.executable, str(REPO / "diloco.py"), "--config",
                                          str(REPO / "evolution.json"), "--no-progress", *overrides(args, mc, n)],
                                         stdout=fc, stderr=subprocess.STDOUT, cwd=REPO, env=env())
            with on_cpus(sides[1]):
                workers = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--fake-workers", str(n),
                                            "--config", str(REPO / "evolution.json"), "--backing",
                                            str(backing / PROJECT), "--counts", *map(str, counts), "--log", str(wlog),
                                            "--train-s", str(args.train_s), "--jitter", str(args.jitter),
                                            *overrides(args, mw, n)],
                                           stdout=fw, stderr=subprocess.STDOUT, cwd=REPO, env=env())
            try:
                rc_w = workers.wait(args.timeout)
                rc_c = coord.wait(60)
            except subprocess.TimeoutExpired:
                for p in (coord, workers):
                    p.kill()
                raise SystemExit(f"N={n}: the run did not finish in {args.timeout} s; see {work}")
        wall = time.time() - t0
        if rc_c or rc_w:
            raise SystemExit(f"N={n}: coordinator exit {rc_c}, fake workers exit {rc_w}:\n"
                             f"{log_c.read_text()[-2000:]}\n{log_w.read_text()[-2000:]}")
        metrics = [json.loads(x) for x in (backing / PROJECT / "metrics.jsonl").read_text().splitlines() if x]
    return summarise(args, n, fuse, json.loads(wlog.read_text()), metrics, wall)


def summarise(args, n: int, fuse: bool, wlog: dict, metrics: list[dict], wall: float) -> dict:
    ev = wlog["events"]
    commits = {e["round"]: e for e in ev if e["kind"] == "commit"}
    last_pub: dict[int, float] = {}
    last_stamp: dict[int, float] = {}
    for e in ev:
        if e["kind"] == "published":
            last_pub[e["round"]] = max(last_pub.get(e["round"], 0.0), e["done"])
            last_stamp[e["round"]] = max(last_stamp.get(e["round"], 0.0), e["time"])
    first = args.warmup  # rounds 0..warmup-1 include the start-up
    rs = [r for r in range(first, args.rounds) if r in last_pub and r + 1 in commits and commits[r + 1]["time"]]
    tails = [commits[r + 1]["time"] - last_pub[r] for r in rs]
    stamp_tails = [commits[r + 1]["time"] - last_stamp[r] for r in rs]
    walls = [commits[r + 1]["time"] - commits[r]["time"] for r in rs if r in commits and commits[r]["time"]]
    recs = {m["round"]: m for m in metrics}
    coord_tails = [recs[r + 1]["tail_s"] for r in rs if r + 1 in recs and "tail_s" in recs[r + 1]]
    bytes_ = [recs[r + 1]["bytes_total"] for r in rs if r + 1 in recs]
    missing = sum(len(recs[r + 1].get("missing", [])) for r in rs if r + 1 in recs)
    out = {"n": n, "fuse": fuse, "rounds": len(rs), "tail_s": statistics.median(tails),
           "tail_max_s": max(tails), "tail_from_stamp_s": statistics.median(stamp_tails),
           "coord_tail_s": statistics.median(coord_tails) if coord_tails else None,
           "wall_s": statistics.median(walls) if walls else None, "bytes": statistics.median(bytes_),
           "missing": missing, "run_wall_s": round(wall, 1)}
    if fuse:
        a, b = commits[rs[0]], commits[rs[-1] + 1]
        wr = n * (rs[-1] + 1 - rs[0])
        for i, who in enumerate(("coord", "workers")):
            ca, cb = a["counts"][i], b["counts"][i]
            out[f"{who}_ops"] = (metadata_ops(cb) - metadata_ops(ca)) / wr
            out[f"{who}_names"] = (cb.get("readdir_names", 0) - ca.get("readdir_names", 0)) / wr
            ops = {k: (cb["ops"].get(k, 0) - ca["ops"].get(k, 0)) / wr for k in cb.get("ops", {})}
            out[f"{who}_by_op"] = {k: round(v, 2) for k, v in sorted(ops.items()) if v}
    return out


def main() -> None:
    if "--fake-workers" in sys.argv:
        raise SystemExit(fake_workers(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 rounds per N, FUSE only (<= 6 minutes on 2 cores)")
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rounds", type=int, default=None, help="rounds per run (default 16; --quick 12)")
    ap.add_argument("--warmup", type=int, default=2, help="first rounds left out of the medians (start-up)")
    ap.add_argument("--train-s", type=float, default=1.5, help="a fake worker's 'training' time per round, s")
    ap.add_argument("--jitter", type=float, default=0.5, help="± uniform jitter on it, s")
    ap.add_argument("--lookup-ttl", type=float, default=10.0, help="the mounts' lookup cache (NFS lookupcache)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-disk runs")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not split the cores between the coordinator's side and the fake workers' side")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run, s")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, every run")
    args = ap.parse_args()
    args.rounds = args.rounds or (12 if args.quick else 16)
    if args.rounds <= args.warmup + 1:
        ap.error(f"--rounds must be > --warmup + 1 = {args.warmup + 1}")
    if (why := fuse_skip_reason()):
        raise SystemExit(f"bench/scale.py needs FUSE: {why}")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    tmp = Path(tempfile.mkdtemp(prefix="edt-scale-", dir=shm))
    results = []
    try:
        configs = [(n, True) for n in args.ns] + ([] if args.quick or args.no_plain else [(n, False)
                                                                                          for n in args.ns])
        for n, fuse in configs:
            t = time.time()
            res = run_once(args, n, fuse, tmp)
            results.append(res)
            print(f"N={n} {'fuse' if fuse else 'plain'}: tail {res['tail_s']:.3f} s, wall/round "
                  f"{res['wall_s']:.2f} s" + (f", coordinator ops/worker-round {res['coord_ops']:.1f}"
                                              if fuse else "") + f" ({time.time() - t:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for r in results:
        rows.append([r["n"], "FUSE" if r["fuse"] else "plain", f"{r['tail_s']:.3f}", f"{r['tail_max_s']:.3f}",
                     f"{r['tail_from_stamp_s']:.3f}",
                     f"{r['coord_tail_s']:.3f}" if r["coord_tail_s"] is not None else "-",
                     f"{r['coord_ops']:.1f}" if r["fuse"] else "-", f"{r['coord_names']:.0f}" if r["fuse"] else "-",
                     f"{r['workers_ops']:.1f}" if r["fuse"] else "-", f"{r['bytes'] / 1e6:.2f}",
                     f"{r['wall_s']:.2f}", r["missing"]])
    print(table(rows, ["N", "disk", "tail s", "tail max", "from sidecar time", "coord tail_s", "coord ops/w-r",
                       "coord names/w-r", "worker ops/w-r", "MB/round", "wall/round s", "missing"]))
    for r in results:
        if r["fuse"]:
            print(f"N={r['n']} coordinator ops per worker-round by call: {r['coord_by_op']}")
    save_result("scale", {"args": vars(args), "results": results})
    fz = {r["n"]: r for r in results if r["fuse"]}
    lo, hi = min(fz), max(fz)
    print(f"scale: tail N={hi}/N={lo} {fz[hi]['tail_s'] / fz[lo]['tail_s']:.2f}, ops per worker-round "
          f"N={hi}/N={lo} {fz[hi]['coord_ops'] / fz[lo]['coord_ops']:.2f}")


if __name__ == "__main__":
    main()
