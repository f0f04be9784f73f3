"""Benchmark the DiLoCo outer step on a SmolLM2-135M-shaped model with 4 workers.

    python bench/outer_step.py [--workers 4] [--repeats 3] [--small]

Compares, in one run on the same disk:
  ours       Coordinator.reduce: stream θ_r, m_r and the 4 deltas tensor by tensor, validate each delta (sha256,
             finiteness, shapes) in the same pass, write θ_{r+1} (HF dir + manifest) and m_{r+1} atomically.
  prototype  the research prototype's method: from_pretrained the base and every worker model, average per
             parameter in a Python loop, SGD + Nesterov step, save_pretrained once per worker.
  I/O floor  bytes ours must read / sequential read bandwidth + bytes it must write / sequential write bandwidth
             (fsync'd), both measured here on the same disk with the same page-cache state.
Targets: ours >= 3x faster than the prototype; ours <= 1.5x the I/O floor. Prints ratios, writes
bench/results/outer_step.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import drop_caches, median, save_result, smollm_config, table, timed

import torch


def setup_round(root: Path, n: int, small: bool):
    """A BASE_DIR at round 1 (with outer momentum) and n published deltas, exactly as workers publish them."""
    from transformers import AutoModelForCausalLM
    from train.core.config import build_config
    from train.core.model import save_model_dir
    from train.core.store import PROTOCOL_VERSION, RunPaths, atomic_write_json
    from train.core.tensorio import save_streaming

    cfg = build_config({"base_dir": str(root), "project_name": "bench", "outer": {"num_workers": n}})
    paths = RunPaths(cfg.run_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(smollm_config(small), dtype=torch.float32)
    save_model_dir(model, paths.global_dir(1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    from train.core.tensorio import read_header
    header, _ = read_header(paths.global_dir(1) / "model.safetensors")
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    save_streaming(paths.outer_state(1), {k: torch.randn_like(params[k]) * 1e-3 for k in order})
    metas = {}
    worker_dirs = []
    for w in range(n):
        g = torch.Generator().manual_seed(w)
        delta = {k: torch.randn(params[k].shape, generator=g) * 1e-3 for k in order}
        f = paths.delta_file(1, w)
        sha = save_streaming(f, delta)
        metas[w] = {"protocol": PROTOCOL_VERSION, "round": 1, "worker": w, "inner_steps": 50, "tokens": 1000 + w,
                    "loss": 3.0, "sha256": sha, "bytes": f.stat().st_size}
        atomic_write_json(paths.delta_meta(1, w), metas[w])
        # the prototype reads whole worker models instead of deltas
        wd = root / "proto" / f"worker{w}"
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.sub_(delta[k])
            model.save_pretrained(str(wd))
            for k, p in model.named_parameters():
                p.add_(delta[k])
        worker_dirs.append(wd)
    return cfg, paths, metas, worker_dirs


def run_ours(cfg, paths, metas, n):
    from train.diloco.coordinator import Coordinator
    co = Coordinator(cfg, progress=False)
    out = co.reduce(1, list(range(n)), metas)
    shutil.rmtree(paths.global_dir(2))
    paths.outer_state(2).unlink()
    return out


def run_prototype(paths, worker_dirs, out_root: Path, lr=0.7, mu=0.9):
    """The prototype: full models in memory, a Python loop per parameter, save_pretrained once per worker."""
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file, save_file

    base = AutoModelForCausalLM.from_pretrained(str(paths.global_dir(1)), dtype=torch.float32)
    workers = [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32) for d in worker_dirs]
    momentum = load_file(str(paths.outer_state(1)))
    wparams = [dict(w.named_parameters()) for w in workers]
    with torch.no_grad():
        for name, p in base.named_parameters():
            grad = sum(p - wp[name] for wp in wparams) / len(wparams)
            buf = momentum[name].mul_(mu).add_(grad)
            p.sub_(lr * (grad + mu * buf))
    for i in range(len(worker_dirs)):
        base.save_pretrained(str(out_root / f"global_for_worker{i}"))
    save_file(momentum, str(out_root / "momentum.safetensors"))
    t0 = time.perf_counter()
    os.sync()  # what it wrote is only in the page cache: the time to make it durable, as ours is
    sync_s = time.perf_counter() - t0
    shutil.rmtree(out_root)
    return sync_s


def disk_bandwidth(root: Path, nbytes: int) -> tuple[float, float]:
    """(read B/s, write B/s): write nbytes sequentially with fsync, then read them back."""
    path = root / "bw.bin"
    chunk = os.urandom(1 << 24)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write_bw = (nbytes // len(chunk) * len(chunk)) / (time.perf_counter() - t0)
    return path, write_bw


def read_bandwidth(path: Path, cold: bool) -> float:
    if cold:
        drop_caches()
    buf = bytearray(1 << 24)
    n = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a tiny model, to check the script quickly")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir on /tmp's disk)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    root = Path(tempfile.mkdtemp(prefix="edt-bench-", dir=args.dir))
    try:
        print(f"setting up a round with {args.workers} deltas in {root} ...", flush=True)
        cfg, paths, metas, worker_dirs = setup_round(root, args.workers, args.small)
        model_bytes = (paths.global_dir(1) / "model.safetensors").stat().st_size
        read_bytes = model_bytes * (2 + args.workers)  # θ_r, m_r, deltas
        write_bytes = model_bytes * 2  # θ_{r+1}, m_{r+1}
        bw_file, write_bw = disk_bandwidth(root, max(read_bytes // 2, 64 << 20))
        # Warm-cache measurements (the deltas were just written, as in a real round). Interleaved repetitions.
        ours_t, proto_t, proto_durable, rbw = [], [], [], []
        for i in range(args.repeats):
            rbw.append(read_bandwidth(bw_file, cold=False))
            t, io = timed(run_ours, cfg, paths, metas, args.workers)
            ours_t.append(t)
            os.sync()
            t, sync_s = timed(run_prototype, paths, worker_dirs, root / "proto_out")
            proto_t.append(t - sync_s)
            proto_durable.append(t)
            print(f"  repeat {i + 1}: ours {ours_t[-1]:.2f}s, prototype {proto_t[-1]:.2f}s "
                  f"(+{sync_s:.2f}s to flush its writes)", flush=True)
        read_bw = median(rbw)
        floor = read_bytes / read_bw + write_bytes / write_bw
        ours, proto = median(ours_t), median(proto_t)
        rows = [["model", f"{model_bytes / 1e6:.0f} MB fp32 ({'small' if args.small else 'SmolLM2-135M shape'})"],
                ["bytes read / written by the outer step", f"{read_bytes / 1e9:.2f} GB / {write_bytes / 1e9:.2f} GB"],
                ["disk: sequential read (page cache warm) / write (fsync)",
                 f"{read_bw / 1e9:.2f} GB/s / {write_bw / 1e9:.2f} GB/s"],
                ["I/O floor", f"{floor:.2f} s"],
                ["ours (streaming reduce, validated, atomic)", f"{ours:.2f} s"],
                ["prototype method (writes left in the page cache)", f"{proto:.2f} s"],
                ["prototype method + os.sync() (durable, like ours)", f"{median(proto_durable):.2f} s"],
                ["speed-up vs prototype (target >= 3x)", f"{proto / ours:.2f}x"],
                ["speed-up vs durable prototype", f"{median(proto_durable) / ours:.2f}x"],
                ["ours / I/O floor (target <= 1.5x)", f"{ours / floor:.2f}x"]]
        print(table(rows, ["outer step, " + f"{args.workers} workers", "value"]))
        save_result("outer_step" + ("_small" if args.small else ""),
                    {"model_bytes": model_bytes, "read_bytes": read_bytes, "write_bytes": write_bytes,
                     "read_bw": read_bw, "write_bw": write_bw, "floor_s": floor, "ours_s": ours_t,
                     "prototype_s": proto_t, "prototype_durable_s": proto_durable, "speedup": proto / ours,
                     "speedup_durable": median(proto_durable) / ours, "floor_ratio": ours / floor})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
