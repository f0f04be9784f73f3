"""Benchmark the DiLoCo outer step on a SmolLM2-135M-shaped model: the work left after the last delta arrives.

    python bench/outer_step.py [--workers 2 8] [--repeats 3] [--codec none] [--small]

The coordinator reduces on arrival (train/exchange/accumulate.py): each delta is read, checked (size, sha256, header,
values) and added to a float64 sum when it is published, while the other workers still train. What is left after
the last arrival — that delta, the outer step, writing θ_{r+1} (+ momentum) and the commit — should not grow with N.

For each N, in the same run, on the same disk:
  tail        the last arrival -> committed: add the last delta, OuterMaster.step, COMMITTED (the N−1 earlier
              deltas were added before the clock starts, as they are in a real round)
  at the end  the same work if every delta were reduced only after the last arrival (what protocol 1 did)
  I/O floor   the tail's bytes (one delta read; θ_{r+1} and the momentum written, fsync'd) at the disk's measured
              sequential bandwidth (read with a warm page cache, as the just-written delta is)
Targets: tail(N=8) / tail(N=2) <= 1.2; tail <= 1.5x its I/O floor. Writes bench/results/outer_step.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import median, save_result, smollm_config, table

import torch


def setup_round(root: Path, n: int, small: bool, codec: str):
    """A BASE_DIR at round 0 and n deltas of round 0 published the way workers publish them."""
    from transformers import AutoModelForCausalLM
    from train.config import build_config
    from train.core.model import save_model_dir
    from train.core.store import atomic_write_json
    from train.exchange.store import DiLoCoPaths
    from train.exchange.codec import get_codec
    from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
    from train.exchange.theta import file_order

    cfg = build_config({"base_dir": str(root), "project_name": "bench",
                        "outer": {"num_workers": n, "compression": codec, "momentum": 0.9, "lr": 0.7}})
    paths = DiLoCoPaths(cfg.run_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(smollm_config(small), dtype=torch.float32)
    save_model_dir(model, paths.global_dir(0))
    atomic_write_json(paths.committed(0), {"round": 0})
    names = file_order(paths.global_dir(0) / "model.safetensors")
    theta = {k: v.detach() for k, v in model.named_parameters()}
    c = get_codec("float32" if codec == "none" else codec, cfg.outer.block_size)
    for w in range(n):
        g = torch.Generator().manual_seed(w)
        params = {k: theta[k] - torch.randn(theta[k].shape, generator=g) * 1e-3 for k in names}
        file = write_delta(paths.delta_file(0, w), names, theta, params, c, 0, w)
        publish_sidecar(paths, delta_sidecar(0, w, file, inner_steps=50, tokens=1000 + w, loss=3.0))
        del params
    return cfg, paths


def one_round(cfg, paths, n: int, at_end: bool) -> tuple[float, int, int]:
    """(seconds from the last arrival to the commit, bytes read, bytes written in that time)."""
    from train.exchange.master import OuterMaster
    from train.exchange.protocol import check_sidecar, commit

    m = OuterMaster(paths, cfg.outer, 10)
    m.resume(0)
    acc = m.new_accumulator(0)
    early = [] if at_end else list(range(n - 1))
    for w in early:
        acc.add(w, check_sidecar(paths, 0, w, m.delta_codec))
    read_before = acc.bytes_read
    t0 = time.perf_counter()
    for w in range(n):
        if w not in early:
            acc.add(w, check_sidecar(paths, 0, w, m.delta_codec))
    fields = m.step(0, acc)
    commit(paths, 1, {k: fields[k] for k in ("theta_sha256", "checkpoint", "codec") if k in fields})
    dt = time.perf_counter() - t0
    read, written = acc.bytes_read - read_before, fields["bytes_written"]
    m.discard_uncommitted(0)
    paths.committed(1).unlink()
    return dt, read, written


def bandwidth(root: Path, nbytes: int) -> tuple[float, float]:
    """(read B/s with a warm page cache, write B/s with fsync), sequential, on `root`'s disk."""
    path = root / "bw.bin"
    chunk = os.urandom(1 << 24)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(chunk))):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    size = path.stat().st_size
    write_bw = size / (time.perf_counter() - t0)
    buf = bytearray(1 << 24)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_bw = size / (time.perf_counter() - t0)
    path.unlink()
    return read_bw, write_bw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codec", default="none", help="outer.compression of the run (none = fp32 deltas)")
    ap.add_argument("--small", action="store_true", help="a tiny model, to check the script quickly")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir on /tmp's disk)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results, rows = {}, []
    for n in args.workers:
        root = Path(tempfile.mkdtemp(prefix="edt-bench-", dir=args.dir))
        try:
            print(f"N={n}: publishing {n} deltas in {root} ...", flush=True)
            cfg, paths = setup_round(root, n, args.small, args.codec)
            tails, ends, bws = [], [], []
            for i in range(args.repeats):
                t, read, written = one_round(cfg, paths, n, at_end=False)
                tails.append(t)
                e, _, _ = one_round(cfg, paths, n, at_end=True)
                ends.append(e)
                bws.append(bandwidth(root, max(written, 64 << 20)))
                print(f"  repeat {i + 1}: tail {t:.2f}s, reduce at the end {e:.2f}s", flush=True)
            read_bw, write_bw = median([b[0] for b in bws]), median([b[1] for b in bws])
            floor = read / read_bw + written / write_bw
            results[n] = {"tail_s": tails, "at_end_s": ends, "floor_s": floor, "read_bytes": read,
                          "written_bytes": written, "read_bw": read_bw, "write_bw": write_bw}
            rows.append([n, f"{median(tails):.2f} s", f"{median(ends):.2f} s", f"{floor:.2f} s",
                         f"{median(tails) / floor:.2f}x"])
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nouter step, {'small model' if args.small else 'SmolLM2-135M shape'}, codec {args.codec}")
    print(table(rows, ["workers", "tail (last arrival -> commit)", "reduce all at the end", "tail's I/O floor",
                       "tail / floor (target <= 1.5x)"]))
    if len(args.workers) >= 2:
        lo, hi = min(args.workers), max(args.workers)
        growth = median(results[hi]["tail_s"]) / median(results[lo]["tail_s"])
        print(f"tail growth N={lo} -> N={hi}: {growth:.2f}x (target <= 1.2x); reduce at the end: "
              f"{median(results[hi]['at_end_s']) / median(results[lo]['at_end_s']):.2f}x")
        results["growth"] = growth
    save_result("outer_step" + ("_small" if args.small else ""), {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
