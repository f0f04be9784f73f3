"""DiLoCo on an emulated NFS: the same micro run on a plain disk and with every process on its own caching mount.

    python bench/nfs.py                          # plain disk, then lookup-cache TTL 3, 10 and 30 s
    python bench/nfs.py --ttls 10                # plain disk and TTL 10 only
    python bench/nfs.py --ttls 0 10 --keep       # TTL 0: the FUSE mounts without caching (their own overhead)

Each configuration is one real run of the cluster path (README): a coordinator `python diloco.py` and N workers
`python -m train.diloco.worker`, all started at once with the same config and overrides, each process with its own
BASE_DIR mount of one backing directory (bench/throttlefs.py via tests/helpers/fusefs.py, uncapped): each process
is its own NFS client whose kernel caches the names it looked up, found or not, for the TTL (NFS lookupcache=all;
30-60 s on a default NFS mount). The plain-disk run uses the backing directory itself. Printed, as a markdown table:
the wall time of each run (all processes started until all exited; process start-up, about 15 s on 2 cores, is in
it) and its ratio to the plain disk; where it went: when round 1 was committed (start-up, data preparation, the
first round), the steady-state time per round (round 1's commit to the last one's, from metrics.jsonl) and its
ratio, the time from the last commit until every process exited (final model, shutdown); the rounds that closed
without some worker; and whether the final model (BASE_DIR/<project>/final/model.safetensors) is bit-identical to
the plain-disk run's, tensor by tensor ("identical" / "DIFFERS").

Target (issue #24): TTL 30 s at most 1.2x the plain disk, and the same final model. Processes train with one thread
each (`--threads 1`, OMP_NUM_THREADS=1), so all runs compute the same numbers; a difference means the protocol
changed the result under caching (a worker dropped from a round, a stale file read). Needs FUSE (/dev/fuse, libfuse2,
fusepy; tests/helpers/fusefs.py says what is missing). Writes bench/results/nfs.json.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, save_result

from tests.helpers.fusefs import fuse_skip_reason, nfs_mount  # one FUSE mount per process (common put REPO on sys.path)

PROJECT = "nfs"


def overrides(args, base_dir: Path) -> list[str]:
    model = Path(args.model).resolve() if Path(args.model).is_file() else REPO / "configs" / args.model
    sets = [f"base_dir={base_dir}", f"project_name={PROJECT}", "seed=0",
            f"model.name={model}", f"model.tokenizer={REPO / 'data' / 'tokenizer'}",
            f"data.dataset={REPO / 'data' / 'corpus'}", "data.seq_length=32", "data.max_tokens=200000",
            "inner.per_device_batch_size=8", "inner.total_batch_size=8", "inner.warmup_steps=2", "inner.device=cpu",
            f"outer.num_workers={args.workers}", f"outer.rounds={args.rounds}", f"outer.local_steps={args.H}",
            "eval.batch_size=8", "eval.batches=2", "logging.progress=false", "logging.plot=false", *args.set]
    return [a for s in sets for a in ("--set", s)]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(30)


def tail(log: Path, n: int = 2500) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def run_once(args, name: str, backing: Path, logs: Path, ttl: float | None) -> dict:
    """One run: coordinator + workers, each on its own mount of `backing` with lookup TTL `ttl` (None: all on
    `backing` itself; with --error-rate each mount fails reads, writes and fsyncs with EIO, its own seed and log).
    Returns wall seconds, the metrics records, the final model's path and the number of injected errors."""
    backing.mkdir(parents=True)
    logs.mkdir(parents=True)
    labels = ["coordinator"] + [f"worker-{w:03d}" for w in range(args.workers)]
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as mounts:
        if ttl is None:
            bases = {label: backing for label in labels}
        else:
            bases = {label: mounts.enter_context(nfs_mount(
                backing, backing.parent / f"mnt-{label}", lookup_ttl=ttl, error_rate=args.error_rate,
                seed=args.seed + i, error_log=logs / f"{label}.eio")) for i, label in enumerate(labels)}
        t0, t0_wall = time.perf_counter(), time.time()
        try:
            procs.append(start([str(REPO / "diloco.py"), "--config", str(REPO / "evolution.json"), "--no-progress",
                                *overrides(args, bases["coordinator"])], logs / "coordinator.log"))
            for w in range(args.workers):
                label = f"worker-{w:03d}"
                procs.append(start(["-m", "train.diloco.worker", "--config", str(REPO / "evolution.json"),
                                    "--worker", str(w), "--threads", "1", *overrides(args, bases[label])],
                                   logs / f"{label}.log"))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):
                failed = [(label, p.returncode) for label, p in zip(labels, procs) if p.poll() not in (None, 0)]
                if failed:
                    label, rc = failed[0]
                    raise SystemExit(f"{name}: {label} exited with code {rc}; its log ends:\n"
                                     f"{tail(logs / f'{label}.log')}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: not finished after {args.timeout:g} s (--timeout); the coordinator's "
                                     f"log ends:\n{tail(logs / 'coordinator.log')}")
                time.sleep(0.1)
            wall = time.perf_counter() - t0
        finally:
            stop(procs)  # before the mounts go: a process with files open would keep its mount busy
    bad = [(label, p.returncode) for label, p in zip(labels, procs) if p.returncode != 0]
    if bad:
        label, rc = bad[0]
        raise SystemExit(f"{name}: {label} exited with code {rc}; its log ends:\n{tail(logs / f'{label}.log')}")
    run_dir = backing / PROJECT
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []
    eio = sum(len(f.read_text().splitlines()) for f in logs.glob("*.eio"))
    first = trained(records)[:1]
    return {"wall_s": wall, "records": records, "final": run_dir / "final" / "model.safetensors", "eio": eio,
            "first_commit_s": first[0]["time"] - t0_wall if first else None,
            "after_last_s": t0_wall + wall - trained(records)[-1]["time"] if first else None}


def weights_digest(path: Path) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes (not the file: its header may order keys freely)."""
    import torch
    from safetensors.torch import load_file
    h = hashlib.sha256()
    for k, t in sorted(load_file(str(path)).items()):
        h.update(f"{k}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compare(a: Path, b: Path) -> str:
    if not b.is_file():
        return "no final model"
    import torch
    from safetensors.torch import load_file
    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        return "DIFFERS (tensor names)"
    diff = [k for k in sorted(x) if x[k].shape != y[k].shape or x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    return "identical" if not diff else f"DIFFERS ({len(diff)} of {len(x)} tensors)"


def trained(records: list[dict]) -> list[dict]:
    """The records of the rounds that trained (round 0 is the initial model's evaluation)."""
    return sorted((r for r in records if r.get("round", 0) >= 1), key=lambda r: r["round"])


def short_rounds(records: list[dict]) -> int:
    """Rounds committed without every worker's delta (missing or rejected)."""
    return sum(1 for r in trained(records) if r.get("missing") or r.get("rejected"))


def per_round_s(records: list[dict]) -> float | None:
    """Seconds per round in steady state: from round 1's commit to the last round's, per round (the start-up of
    the processes and round 1's data preparation left out)."""
    rs = trained(records)
    if len(rs) < 2:
        return None
    return (rs[-1]["time"] - rs[0]["time"]) / (rs[-1]["round"] - rs[0]["round"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttls", type=float, nargs="+", default=[3.0, 10.0, 30.0],
                    help="lookup-cache TTLs in seconds, one run each (0: FUSE mounts without caching)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--H", type=int, default=10, help="inner steps per round (outer.local_steps)")
    ap.add_argument("--model", default="micro-llama.json", help="a model config: a file, or a name in configs/")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another override for every process (repeatable)")
    ap.add_argument("--error-rate", type=float, default=0.0, metavar="P",
                    help="also a soft mount: each read, write and fsync of a mounted run fails with EIO with "
                         "probability P (one seeded stream per process; the table counts the injected errors)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the error streams (process i: seed + i)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration (interleaved); the table "
                    "gives medians")
    ap.add_argument("--keep", action="store_true", help="keep the backing directories and logs (path printed)")
    args = ap.parse_args()
    if any(t < 0 for t in args.ttls):
        ap.error("--ttls must be >= 0")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if not 0 <= args.error_rate < 1:
        ap.error("--error-rate must be in [0, 1)")
    why = fuse_skip_reason()
    if why:
        raise SystemExit(f"bench/nfs.py needs FUSE mounts: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="edt-nfs-"))
    plan = [("plain disk", None)] + [(f"TTL {t:g} s", t) for t in args.ttls]
    runs: dict[str, list[dict]] = {name: [] for name, _ in plan}
    try:
        for rep in range(args.repeat):  # interleaved, so slow spells of the machine spread over all configurations
            for i, (name, ttl) in enumerate(plan):
                d = tmp / f"rep{rep}-run{i}"
                print(f"{name}{f' (repeat {rep + 1} of {args.repeat})' if args.repeat > 1 else ''}: {args.workers} "
                      f"workers + coordinator" + (f", each on its own mount (lookup cache {ttl:g} s)"
                                                  if ttl is not None else ", one local disk"), flush=True)
                runs[name].append(run_once(args, name, d / "backing", d / "logs", ttl))
                print(f"  {runs[name][-1]['wall_s']:.1f} s", flush=True)
        reference = runs["plain disk"][0]["final"]
        if not reference.is_file():
            raise SystemExit(f"the plain-disk run wrote no final model ({reference})")
        summary = {name: summarise(rs, reference, name == "plain disk") for name, rs in runs.items()}
        plain = summary["plain disk"]
        rows = []
        for name, m in summary.items():
            m["ratio"] = m["wall_s"] / plain["wall_s"]
            pr, fc, tail_s = m["per_round_s"], m["first_commit_s"], m["after_last_commit_s"]
            rows.append([name, f"{m['wall_s']:.1f} s", f"{m['ratio']:.2f}x", "-" if fc is None else f"{fc:.1f} s",
                         "-" if pr is None else f"{pr:.2f} s" +
                         (f" ({pr / plain['per_round_s']:.1f}x)" if plain["per_round_s"] else ""),
                         "-" if tail_s is None else f"{tail_s:.1f} s", f"{m['short_rounds']} of {m['rounds']}",
                         m["final"]] + ([str("-" if m["eio"] is None else m["eio"])] if args.error_rate else []))
        print(f"\n{args.workers} workers + coordinator, {args.model}, {args.rounds} rounds x H={args.H}"
              + (f", median of {args.repeat} runs each" if args.repeat > 1 else "") +
              "; every process on its own FUSE mount of one directory (lookup cache = TTL" +
              (f", EIO on {args.error_rate:g} of reads, writes, fsyncs" if args.error_rate > 0 else "") +
              "), target: TTL 30 s <= 1.2x plain disk, final model identical\n")
        header = ["BASE_DIR", "wall", "vs plain disk", "round 1 committed at", "per round after round 1",
                  "last commit to exit", "rounds short of workers",
                  "final model vs plain disk"] + (["EIO injected"] if args.error_rate > 0 else [])
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        path = save_result("nfs", {"args": vars(args), "results": summary})
        print(f"\n(written to {path.relative_to(REPO)})")
    finally:
        if args.keep:
            print(f"kept: {tmp} (rep<r>-run<i>/backing/{PROJECT}/, rep<r>-run<i>/logs/)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def summarise(rs: list[dict], reference: Path, is_reference: bool) -> dict:
    """Medians over the repeats of one configuration; the final model must match the reference in every one."""
    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None
    verdicts = ["(reference)" if is_reference and k == 0 else compare(reference, r["final"]) for k, r in enumerate(rs)]
    bad = [v for v in verdicts if v not in ("identical", "(reference)")]
    final = bad[0] + (f" in {len(bad)} of {len(rs)} runs" if len(rs) > 1 else "") if bad else \
        ("(reference)" if is_reference else "identical")
    return {"wall_s": med(r["wall_s"] for r in rs), "wall_s_all": [r["wall_s"] for r in rs],
            "first_commit_s": med(r["first_commit_s"] for r in rs),
            "per_round_s": med(per_round_s(r["records"]) for r in rs),
            "after_last_commit_s": med(r["after_last_s"] for r in rs),
            "short_rounds": max(short_rounds(r["records"]) for r in rs),
            "rounds": max(len(trained(r["records"])) for r in rs), "final": final,
            "eio": sum(r["eio"] for r in rs) if not is_reference else None,
            "sha256": [weights_digest(r["final"]) if r["final"].is_file() else None for r in rs],
            "wait_s": [[rec.get("wait_s") for rec in trained(r["records"])] for r in rs]}


if __name__ == "__main__":
    main()
