"""Benchmark the DiLoCo round's critical path on a SmolLM2-135M-shaped model: the coordinator's tail (last arrival ->
commit) and the worker's two sides of it (last inner step -> delta published; commit -> next first step), each
against its own I/O floor measured in the same run, with the breakdown of where the time goes.

    python bench/outer_step.py [--workers 2 8] [--repeats 3] [--codec none|int8|topk] [--small]
    EDT_FUSED=0 python bench/outer_step.py ...   # the step with torch's ops, not the fused kernels (an A/B)

The coordinator reduces on arrival (train/exchange/accumulate.py): each delta is read, checked (size, header, values,
sha256) and added to a float64 sum when it is published, while the other workers still train. What is left after
the last arrival — that delta, the screen's decision, the outer step, writing θ_{r+1} (+ momentum) and the commit —
should not grow with N.

For each N, in the same run, on the same disk, after one round that is not counted (--warmup 0: none; the first
round of a process faults in its memory, 2-3x slower on a VM), the measurements interleaved repeat by repeat (medians
reported):
  tail        the last arrival -> committed: add the last delta, screen, OuterMaster.step, COMMITTED — without a
              codec the last delta is read inside the step and the screen decides after it, as the coordinator
              does (train/diloco/coordinator.py: step_with_last) (the N−1
              earlier deltas were added before the clock starts, as they are in a real round, and the outer momentum
              m_r exists, as in every round after the first); then, after the commit (the workers already go on),
              the metrics line and the timeline record
  at the end  the same work if every delta were reduced only after the last arrival (what protocol 1 did)
  floor       the tail's bytes (one delta read; θ_{r+1} and the momentum written, fsync'd) at the disk's sequential
              bandwidth measured in the same repeat (reads with a warm page cache, as the just-written delta is;
              writes the faster of through the page cache and O_DIRECT, as the product writes θ and the momentum)
  RAM floor   the tail's least memory traffic (ram_bytes: the last delta, the float64 sum, θ, the momentum, the
              residual, the bytes written) at the memory bandwidth of a copy measured in the same repeat: a tail
              whose floor this is, not the disk's, is bound by memory, and no ordering of the I/O reaches the disk's
  publish     a worker's last inner step -> its delta published: Δ = θ_r − θ_w, encode (with error feedback), write,
              fsync, sidecar; floor: the delta's bytes written with fsync
  load        the commit -> the worker's next first step: θ_{r+1} brought to the worker's copy (the global file, or
              θ_r + the update, or the sum of the sparse deltas; the checksum checked) and into its model; floors:
              the bytes read at the page-cached read bandwidth, and read from the disk (O_DIRECT: how a worker on
              another host reads what the coordinator wrote, and a worker on its host reads θ, written O_DIRECT)
Each breakdown row is busy seconds summed over threads (reading, hashing and writing run beside the arithmetic, so
the rows can sum to more than the wall time). Targets: tail / floor <= 1.5 at every N; tail(N max) / tail(N min)
<= 1.2. Writes bench/results/outer_step[_<codec>].json.

    python bench/outer_step.py --loss-screen [--small] [--device cuda]

The loss screen's cost per delta (outer.screen_loss, train/exchange/loss_screen.py) at the micro and the 135M shapes
(--small: the small one instead of 135M), each against adding the same delta without it, measured in the same run:
the accumulator's add of one delta with the norm / cosine screen (the baseline), the same add with the loss screen
(θ_r − Δ written as the delta is decoded, then one evaluation on outer.screen_loss_windows windows of
data.seq_length tokens), and what outer.screen_loss = auto decides there. Writes bench/results/loss_screen.json.
"""
from __future__ import annotations

import argparse
import math
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
    from train.exchange.master import exchange_codecs
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
    theta = {k: v.detach().clone() for k, v in model.named_parameters()}
    c, _ = exchange_codecs(cfg.outer)
    for w in range(n):
        g = torch.Generator().manual_seed(w)
        params = {k: theta[k] - torch.randn(theta[k].shape, generator=g) * 1e-3 for k in names}
        file = write_delta(paths.delta_file(0, w), names, theta, params, c, 0, w)
        publish_sidecar(paths, delta_sidecar(0, w, file, inner_steps=50, tokens=1000 + w, loss=3.0))
        del params
    return cfg, paths, model, names, theta


def steady_momentum(names, theta) -> dict:
    """An outer momentum m_r as every round after the first has one (round 0's step starts it from nothing, an
    allocation a round in the steady state does not make)."""
    g = torch.Generator().manual_seed(123)
    return {k: torch.randn(theta[k].shape, generator=g) * 1e-3 for k in names}


def one_round(cfg, paths, n: int, at_end: bool, worker=None, momentum=None) -> dict:
    """The tail (or the reduce at the end): {s, read, written, phases}; with `worker` (a bench Worker), the worker's
    load of the committed θ_1 too ({load_s, load_read, load_phases}). `momentum`: m_r (steady_momentum), copied in."""
    from train.core.phases import Phases
    from train.core.store import append_jsonl
    from train.exchange.master import OuterMaster
    from train.exchange.protocol import check_sidecar, commit
    from train.exchange.screen import screen_round
    from train.status.recorder import TimelineRecorder

    m = OuterMaster(paths, cfg.outer, 10)
    m.resume(0)
    if momentum is not None and not m.sparse:  # (topk keeps no momentum)
        m.momentum = {k: v.clone() for k, v in momentum.items()}
    ph = Phases()
    m.phases = ph
    acc = m.new_accumulator(0)
    early = [] if at_end else list(range(n - 1))
    for w in early:
        acc.add(w, check_sidecar(paths, 0, w, m.delta_codec))
    ph.busy.clear()
    read_before = acc.bytes_read
    t0 = time.perf_counter()
    if not at_end and m.can_take_last(acc):  # as the coordinator does: the last delta read inside the step
        fields = m.step(0, acc, last=(n - 1, check_sidecar(paths, 0, n - 1, m.delta_codec)))
        with ph("screen (decision)"):
            rejected, _ = screen_round(acc, cfg.outer.screen_norm_ratio, cfg.outer.screen_min_cosine)
    else:
        for w in range(n):
            if w not in early:
                acc.add(w, check_sidecar(paths, 0, w, m.delta_codec))
        with ph("screen (decision)"):
            rejected, _ = screen_round(acc, cfg.outer.screen_norm_ratio, cfg.outer.screen_min_cosine)
        fields = m.step(0, acc)
    assert fields is not None and not rejected, rejected
    with ph("commit"):
        commit(paths, 1, {"workers": acc.workers, **{k: fields[k] for k in (
            "update_sha256", "theta_sha256", "checkpoint", "codec", "sparse_step") if k in fields}})
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    with ph("metrics line (after the commit)"):
        append_jsonl(paths.root / "bench-metrics.jsonl", {"round": 0, "workers": acc.workers, "tail_s": dt})
    with ph("timeline (after the commit)"):
        TimelineRecorder(paths.root, draw=False).round_closed(0)
    after = time.perf_counter() - t1
    out = {"s": dt, "after_commit_s": after, "read": acc.bytes_read - read_before,
           "written": fields["bytes_written"], "phases": dict(ph.busy)}
    out["ram"] = ram_bytes(m, out["read"], out["written"])
    if worker is not None:
        out.update(worker.load(1))
    m.discard_uncommitted(0)
    paths.committed(1).unlink()
    (paths.root / "timeline.jsonl").unlink(missing_ok=True)
    return out


class Worker:
    """Worker 0's side of the round, with the real code: its copy of θ (GlobalTheta), its model, its residual."""

    def __init__(self, cfg, paths, model, names, theta):
        from train.exchange.codec import Residual
        from train.exchange.master import exchange_codecs
        from train.exchange.theta import GlobalTheta

        self.cfg, self.paths, self.model, self.names, self.theta_r = cfg, paths, model, names, theta
        self.delta_codec, back = exchange_codecs(cfg.outer)
        self.copy = GlobalTheta(paths, back)
        self.residual = Residual(self.delta_codec) if cfg.outer.compression != "none" else None
        g = torch.Generator().manual_seed(99)
        self.params = {k: theta[k] - torch.randn(theta[k].shape, generator=g) * 1e-3 for k in names}

    def publish(self) -> dict:
        """Last inner step -> delta published (into round 9's folder, which no reducer reads)."""
        from train.core.phases import Phases
        from train.core.store import atomic_write_json
        from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta

        ph = Phases()
        if self.residual is not None:
            self.residual.error.clear()  # every repeat sends the same message
        t0 = time.perf_counter()
        file = write_delta(self.paths.delta_file(9, 0), self.names, self.theta_r, self.params, self.delta_codec, 9, 0,
                           self.residual, phases=ph)
        with ph("state + sidecar"):
            atomic_write_json(self.paths.root / "bench-worker-state.json", {"round_done": 9})
            publish_sidecar(self.paths, delta_sidecar(9, 0, file, inner_steps=50, tokens=1000, loss=3.0))
        dt = time.perf_counter() - t0
        shutil.rmtree(self.paths.round_dir(9), ignore_errors=True)
        return {"s": dt, "written": file["bytes"], "phases": dict(ph.busy)}

    def load(self, r: int) -> dict:
        """Commit of round r -> θ_r in the model (the worker's load_global, one process)."""
        from train.core.phases import Phases

        self.copy.load_checkpoint(0)
        self.copy.take_bytes()
        ph = Phases()
        self.copy.phases = ph
        t0 = time.perf_counter()
        with ph("θ brought to round r (read, decode, add, checksum)"):
            self.copy.advance_to(r)
        with ph("θ into the model"):
            self.copy.load_into(self.model)
        dt = time.perf_counter() - t0
        return {"load_s": dt, "load_read": self.copy.take_bytes(), "load_phases": dict(ph.busy)}


def ram_bytes(m, read: int, written: int) -> int | None:
    """The least memory traffic of a dense tail (None for topk, whose step is N·K scattered adds, not a stream):
    the last delta's bytes read once, then per value the float64 sum read (8 B), θ read and written (8 B), the
    momentum read and written (8 B), the way-back residual read and written (8 B, with a lossy codec), and every
    byte written to the disk read once more by the disk's DMA — what any implementation that keeps this state in
    memory (the sum in float64: accumulate.py says why) moves at least once per round."""
    if m.sparse:
        return None
    values = sum(math.prod(s) for s in m.shapes.values())
    per_value = 8 + 8 + 8 + (8 if m.residual is not None and not m.codec.lossless else 0)
    return read + values * per_value + written


def memory_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second a copy between two buffers moves (read + written) with every core's thread: this box's
    streaming memory bandwidth, the best of three."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def bandwidth(root: Path, nbytes: int) -> tuple[float, float, float, float]:
    """(read B/s with a warm page cache, write B/s with fsync through the page cache, write B/s with fsync and
    O_DIRECT, read B/s with O_DIRECT: from the disk, as a worker on another host reads what the coordinator wrote —
    the last two 0 where the filesystem refuses O_DIRECT), sequential, on `root`'s disk. The floor takes the faster
    write: the best this disk does, whichever way the product writes."""
    import mmap

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
    direct_bw = cold_bw = 0.0
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0))
    except OSError:
        return read_bw, write_bw, direct_bw, cold_bw
    stage = mmap.mmap(-1, len(chunk))  # page aligned, as the product's O_DIRECT stage
    try:
        t0 = time.perf_counter()
        for i in range(max(1, nbytes // len(chunk))):
            stage[:] = chunk  # the copy into the stage is part of the product's cost too
            os.pwrite(fd, stage, i * len(chunk))
        os.fsync(fd)
        size = os.fstat(fd).st_size
        direct_bw = size / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(max(1, nbytes // len(chunk))):
            os.preadv(fd, [stage], i * len(chunk))
        cold_bw = size / (time.perf_counter() - t0)
    except OSError:
        pass
    finally:
        stage.close()
        os.close(fd)
        path.unlink()
    return read_bw, write_bw, direct_bw, cold_bw


def _med_phases(runs: list[dict], key: str = "phases") -> dict[str, float]:
    names = sorted({k for r in runs for k in r[key]}, key=lambda k: -median([r[key].get(k, 0.0) for r in runs]))
    return {k: median([r[key].get(k, 0.0) for r in runs]) for k in names}


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def loss_screen_cost(shape: str, model_cfg, seq: int, windows: int, repeats: int, device: str) -> dict:
    """One shape: the add of one delta without and with the loss screen (medians of `repeats`), the evaluation
    alone, and auto's decision."""
    from transformers import AutoModelForCausalLM

    from train.core.model import save_model_dir
    from train.core.phases import Phases
    from train.core.store import atomic_write_json
    from train.exchange.accumulate import Accumulator
    from train.exchange.codec import get_codec
    from train.exchange.fragments import Fragments
    from train.exchange.loss_screen import LossScreen, auto_decision, forward_flops
    from train.exchange.protocol import check_sidecar, delta_sidecar, publish_sidecar, write_delta
    from train.exchange.store import DiLoCoPaths
    from train.exchange.theta import file_order

    root = Path(tempfile.mkdtemp(prefix="edt-bench-ls-"))
    try:
        paths = DiLoCoPaths(root / "bench")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_cfg, dtype=torch.float32)
        save_model_dir(model, paths.global_dir(0))
        atomic_write_json(paths.committed(0), {"round": 0})
        names = file_order(paths.global_dir(0) / "model.safetensors")
        theta = {k: v.detach().clone() for k, v in model.named_parameters()}
        params = {k: theta[k] - torch.randn(theta[k].shape) * 1e-3 for k in names}
        codec = get_codec("float32")
        file = write_delta(paths.delta_file(0, 0), names, theta, params, codec, 0, 0)
        publish_sidecar(paths, delta_sidecar(0, 0, file, inner_steps=50, tokens=1000, loss=3.0))
        del params
        shapes = {k: tuple(theta[k].shape) for k in names}
        numel = sum(t.numel() for t in theta.values())
        vocab = model_cfg.vocab_size

        class _Data:  # held-out windows of random tokens: the cost does not depend on what they say
            seq_length, tokens, n_eval_tokens = seq, range((windows + 2) * seq + 1), (windows + 2) * seq + 1

            @staticmethod
            def window(start: int):
                import numpy as np
                return np.random.default_rng(start).integers(0, vocab, seq + 1, dtype=np.int64)

        class _Theta:
            tensors = theta

        from train.exchange.loss_screen import ScreenWindows

        dev = torch.device(device)
        ls = LossScreen(model.to(dev), ScreenWindows(_Data(), 0, windows, 0), min(windows, 16), dev, "fp32", names)
        ls.begin(0, _Theta(), Fragments(shapes, 1), shapes)  # warm-up: the first evaluation allocates
        meta = check_sidecar(paths, 0, 0, codec)
        base, with_ls = [], []
        for _ in range(repeats):
            for on in (False, True):
                acc = Accumulator(paths, 0, shapes, codec, True, screen=True, phases=Phases())
                if on:
                    acc.loss = ls
                t = time.perf_counter()
                acc.add(0, meta)
                (with_ls if on else base).append(time.perf_counter() - t)
        ev = median(ls.seconds[1:])
        flops = forward_flops(numel, windows, seq)
        on, line = auto_decision("auto", flops, dev.type, ev, f"{windows} windows x {seq} tokens")
        return {"shape": shape, "params": numel, "windows": windows, "seq": seq, "device": device,
                "add_s": median(base), "add_with_loss_s": median(with_ls), "evaluation_s": ev, "gflop": flops / 1e9,
                "auto_on": on, "auto_line": line}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def loss_screen_main(args) -> None:
    from common import REPO

    from transformers import AutoConfig

    micro = AutoConfig.from_pretrained(str(REPO / "configs" / "micro-llama.json"))
    rows, res = [], []
    for shape, mcfg, seq in (("micro (configs/micro-llama.json)", micro, 32),
                             ("small" if args.small else "SmolLM2-135M", smollm_config(args.small), 128)):
        print(f"{shape}: measuring ...", flush=True)
        r = loss_screen_cost(shape, mcfg, seq, args.loss_windows, args.repeats, args.device)
        res.append(r)
        extra = r["add_with_loss_s"] - r["add_s"]
        rows.append([shape, f"{r['params'] / 1e6:.2f}M", f"{r['windows']} x {r['seq']}", r["device"],
                     f"{r['add_s'] * 1e3:.1f} ms", f"{r['add_with_loss_s'] * 1e3:.1f} ms",
                     f"{extra * 1e3:.1f} ms", f"{r['evaluation_s'] * 1e3:.1f} ms",
                     f"{r['add_with_loss_s'] / r['add_s']:.2f}x", "on" if r["auto_on"] else "off"])
        print(f"  {r['auto_line']}", flush=True)
    print(f"\nthe loss screen's cost per delta ({len(os.sched_getaffinity(0))} cores, torch threads "
          f"{torch.get_num_threads()}; medians of {args.repeats})")
    print(table(rows, ["shape", "parameters", "windows x tokens", "device", "add one delta (norm/cos screen)",
                       "add with the loss screen", "the loss screen's share", "of it: one evaluation",
                       "ratio to the add", "auto"]))
    save_result("loss_screen" + ("_small" if args.small else ""), {"args": vars(args), "results": res})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codec", default="none", help="outer.compression of the run (none = fp32 deltas)")
    ap.add_argument("--small", action="store_true", help="a tiny model, to check the script quickly")
    ap.add_argument("--no-at-end", action="store_true", help="skip the reduce-at-the-end comparison (faster)")
    ap.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                    help="one round first, not counted (default 1: the process's first round faults in its memory)")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir on /tmp's disk)")
    ap.add_argument("--loss-screen", action="store_true", help="the loss screen's cost per delta instead (see above)")
    ap.add_argument("--loss-windows", type=int, default=16, help="--loss-screen: outer.screen_loss_windows")
    ap.add_argument("--device", default="cpu", help="--loss-screen: the coordinator's device (cpu, cuda)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(cores)
    if args.loss_screen:
        loss_screen_main(args)
        return
    results, rows, wrows, breakdowns = {}, [], [], []
    loads = [load_average()]
    for n in args.workers:
        root = Path(tempfile.mkdtemp(prefix="edt-bench-", dir=args.dir))
        try:
            print(f"N={n}: publishing {n} deltas in {root} ...", flush=True)
            cfg, paths, model, names, theta = setup_round(root, n, args.small, args.codec)
            worker = Worker(cfg, paths, model, names, theta)
            momentum = steady_momentum(names, theta)
            tails, ends, pubs, bws, mems = [], [], [], [], []
            if args.warmup:  # not counted: the process's first rounds fault in fresh memory (the reader's buffers,
                # the sums, θ) — on this VM 2-3x the steady state; a coordinator pays that once, not every round
                w0 = one_round(cfg, paths, n, at_end=False, worker=worker, momentum=momentum)
                print(f"  warm-up (not counted): tail {w0['s']:.2f}s, load {w0['load_s']:.2f}s", flush=True)
            for i in range(args.repeats):  # interleaved: each repeat measures everything, the floor included
                tails.append(one_round(cfg, paths, n, at_end=False, worker=worker, momentum=momentum))
                if not args.no_at_end:
                    ends.append(one_round(cfg, paths, n, at_end=True, momentum=momentum))
                pubs.append(worker.publish())
                bws.append(bandwidth(root, max(tails[-1]["written"], pubs[-1]["written"], 64 << 20)))
                mems.append(memory_bandwidth())
                loads.append(load_average())
                print(f"  repeat {i + 1}: tail {tails[-1]['s']:.2f}s"
                      + (f", reduce at the end {ends[-1]['s']:.2f}s" if ends else "")
                      + f", publish {pubs[-1]['s']:.2f}s, load {tails[-1]['load_s']:.2f}s (load avg {loads[-1]})",
                      flush=True)
            read_bw, write_bw = median([b[0] for b in bws]), median([max(b[1], b[2]) for b in bws])
            buffered_bw, direct_bw = median([b[1] for b in bws]), median([b[2] for b in bws])
            t = tails[-1]
            floor = t["read"] / read_bw + t["written"] / write_bw
            mem_bw = median(mems)
            ram_floor = t["ram"] / mem_bw if t["ram"] is not None else None
            pub_floor = pubs[-1]["written"] / write_bw
            cold_bw = median([b[3] for b in bws])
            load_floor = t["load_read"] / read_bw
            load_floor_disk = t["load_read"] / cold_bw if cold_bw else float("nan")
            tail, pub, load = (median([x["s"] for x in tails]), median([x["s"] for x in pubs]),
                               median([x["load_s"] for x in tails]))
            results[n] = {"tail_s": [x["s"] for x in tails], "at_end_s": [x["s"] for x in ends], "floor_s": floor,
                          "read_bytes": t["read"], "written_bytes": t["written"], "read_bw": read_bw,
                          "write_bw": write_bw, "write_bw_buffered": buffered_bw, "write_bw_direct": direct_bw,
                          "tail_phases": _med_phases(tails),
                          "after_commit_s": median([x["after_commit_s"] for x in tails]),
                          "publish_s": [x["s"] for x in pubs], "publish_floor_s": pub_floor,
                          "publish_phases": _med_phases(pubs), "load_s": [x["load_s"] for x in tails],
                          "load_floor_s": load_floor, "load_floor_disk_s": load_floor_disk, "read_bw_disk": cold_bw,
                          "load_phases": _med_phases(tails, "load_phases"), "memory_bw": mem_bw,
                          "ram_bytes": t["ram"], "ram_floor_s": ram_floor}
            rows.append([n, f"{tail:.2f} s", f"{median([x['s'] for x in ends]):.2f} s" if ends else "-",
                         f"{floor:.2f} s", f"{tail / floor:.2f}x",
                         "-" if ram_floor is None else f"{ram_floor:.2f} s",
                         "-" if ram_floor is None else f"{tail / max(floor, ram_floor):.2f}x"])
            wrows.append([n, f"{pub:.2f} s", f"{pub_floor:.2f} s", f"{pub / pub_floor:.2f}x", f"{load:.2f} s",
                          f"{load_floor:.3f} s", f"{load / max(load_floor, 1e-9):.1f}x", f"{load_floor_disk:.3f} s",
                          f"{load / load_floor_disk:.2f}x"])
            breakdowns.append((n, tail, results[n]))
            print(f"  the disk: read {read_bw / 1e9:.2f} GB/s (page cache), {cold_bw / 1e9:.2f} GB/s with O_DIRECT; "
                  f"write + fsync {buffered_bw / 1e9:.2f} GB/s through the page cache, {direct_bw / 1e9:.2f} GB/s "
                  f"with O_DIRECT (the floor takes the faster); memory {mem_bw / 1e9:.1f} GB/s (a copy, read + "
                  f"written)", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    shape = "small model" if args.small else "SmolLM2-135M shape"
    from train.exchange import fused

    kernels = "fused kernels" if fused.kernels() is not None else "torch's ops"
    print(f"\nouter step, {shape}, codec {args.codec}, {kernels}, {cores} cores, load average before / during: "
          f"{loads[0]} / {', '.join(loads[1:])}")
    print(table(rows, ["workers", "tail (last arrival -> commit)", "reduce all at the end", "tail's I/O floor",
                       "tail / floor (target <= 1.5x)", "its RAM floor", "tail / the larger floor"]))
    for n, tail, res in breakdowns:
        print(f"\nN={n}: the tail's breakdown (busy seconds, summed over threads; wall {tail:.2f} s; after the "
              f"commit {res['after_commit_s']:.3f} s more)")
        print(table([[k, f"{v:.3f}"] for k, v in res["tail_phases"].items()], ["phase", "busy s"]))
    print("\nthe worker's side (the same run)")
    print(table(wrows, ["workers", "last step -> delta published", "its floor (write + fsync)", "ratio",
                        "commit -> next first step", "its floor (read, page cache)", "ratio",
                        "its floor (read from the disk)", "ratio"]))
    n0, _, res0 = breakdowns[-1]
    print(f"\nN={n0}: the worker's breakdown (busy seconds)")
    print(table([[f"publish: {k}", f"{v:.3f}"] for k, v in res0["publish_phases"].items()]
                + [[f"load: {k}", f"{v:.3f}"] for k, v in res0["load_phases"].items()], ["phase", "busy s"]))
    if len(args.workers) >= 2:
        lo, hi = min(args.workers), max(args.workers)
        growth = median(results[hi]["tail_s"]) / median(results[lo]["tail_s"])
        end_growth = (f"; reduce at the end: {median(results[hi]['at_end_s']) / median(results[lo]['at_end_s']):.2f}x"
                      if results[hi]["at_end_s"] else "")
        print(f"\ntail growth N={lo} -> N={hi}: {growth:.2f}x (target <= 1.2x){end_growth}")
        results["growth"] = growth
    results["load_average"] = loads
    results["kernels"] = kernels
    suffix = ("" if args.codec == "none" else f"_{args.codec}") + ("_small" if args.small else "")
    save_result("outer_step" + suffix, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
