"""The DiLoCo worker process: train from the committed global model, publish the pseudo-gradient, repeat.

    python -m train.diloco.worker --config evolution.json --worker 0 [--set inner.lr=1e-3 ...]

Round r, worker w (docs/protocol.md):
  1. wait until θ_r is committed; load it (and our inner optimizer state / data position on a restart)
  2. H inner AdamW steps on our shard
  3. write Δ = θ_r − θ_w to workers/wXXX/delta-r.safetensors (private, atomic)
  4. save optimizer state + state.json {round_done: r, data position, step}   <- our resume point
  5. publish: move the delta into rounds/r/deltas/ and write its JSON sidecar (the sidecar marks it complete)
A crash before 4 redoes round r from the same data position; a crash between 4 and 5 publishes the saved delta on
restart (or drops it when the run has moved on). Nothing is trained twice and no data is replayed or skipped.

A worker may be a torchrun group (`python -m torch.distributed.run --nproc_per_node N -m train.diloco.worker ...`, see
train/core/dist.py): rank 0 does every step above that touches BASE_DIR and tells the other ranks, by broadcast, which
round to train; θ_r and the resumed optimizer state reach them by broadcast too; each rank trains on its slice of
every step's batch, and the group's gradients are averaged, so the worker publishes what one process would.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import time
from pathlib import Path

import torch

from train.core.config import ConfigError, RunConfig
from train.core.data import ShardSampler, TokenData, find_data
from train.core.dist import (
    DistInfo,
    RankBatches,
    broadcast_full,
    broadcast_json,
    close_group,
    full_tensor,
    init_group,
    load_full,
)
from train.core.inner import InnerTrainer
from train.core.model import WEIGHTS, load_weights_into
from train.core.heartbeat import Heartbeat
from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
from train.core.store import (
    PROTOCOL_VERSION,
    ProtocolError,
    RunPaths,
    atomic_write_json,
    exclusive_lock,
    prepare_run_dir,
    read_json,
    wait_for,
)
from train.core.tensorio import iter_tensors, read_header, save_streaming

log = logging.getLogger("worker")


def build_worker_model(paths: RunPaths, model_config: dict | None = None):
    """An empty model of the run's architecture (from θ_0's config, or that config.json's contents as rank 0 read
    them); weights come from the global model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_config is None:
        mcfg = AutoConfig.from_pretrained(str(paths.global_dir(0)))
    else:
        mcfg = AutoConfig.for_model(**model_config)
    return AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)


class Worker:
    def __init__(self, cfg: RunConfig, worker_id: int):
        if not 0 <= worker_id < cfg.outer.num_workers:
            raise ConfigError(f"--worker {worker_id}: must be in 0..{cfg.outer.num_workers - 1} "
                              f"(outer.num_workers = {cfg.outer.num_workers})")
        self.cfg, self.w = cfg, worker_id
        self.dist = DistInfo()  # set by setup(): rank 0 of 1 unless started by torchrun
        self.paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        self.poll = cfg.outer.poll_interval_s
        self.hb = Heartbeat(self.paths.progress(worker_id), worker_id)
        self.monitor = lambda: None  # called while waiting; may raise (train_fsdp.py: its coordinator child died)

    # -- setup ----------------------------------------------------------------------------------------------------
    def wait_for_run(self) -> None:
        log.info("waiting for the coordinator to initialise %s", self.paths.root)
        self.hb.beat(force=True, status="waiting for round 0")
        wait_for(lambda: self.monitor() or self.paths.committed(0).is_file(), None, self.poll)
        run = read_json(self.paths.run_json)
        if run.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"{self.paths.run_json}: protocol {run.get('protocol')}, this worker speaks "
                                f"{PROTOCOL_VERSION}")

    def lock(self) -> None:
        """One live process per worker id: an exclusive lock on workers/wXXX/lock, held until the process exits."""
        self._lock_f = exclusive_lock(self.paths.worker_dir(self.w) / "lock", f"worker {self.w}")

    def setup(self) -> None:
        cfg = self.cfg
        self.dist, self.device = init_group(cfg)
        main = self.dist.main
        if main:
            self.lock()
        if cfg.inner.threads:
            torch.set_num_threads(cfg.inner.threads)
        torch.manual_seed(cfg.seed * 1000 + self.w)
        if main:
            self.wait_for_run()
        # What the other ranks need from BASE_DIR, read by rank 0: the model config, the data cache, our state.
        start = None
        if main:
            state = read_json(self.paths.worker_state(self.w)) if self.paths.worker_state(self.w).is_file() else \
                {"round_done": -1, "position": 0, "step": 0}
            start = {"data": str(find_data(cfg)), "state": state,
                     "model_config": read_json(self.paths.global_dir(0) / "config.json")}
        start = broadcast_json(start, self.dist, self.device)
        model = build_worker_model(self.paths, start["model_config"] if self.dist.enabled else None)
        self.trainer = InnerTrainer(cfg, model, self.device, self.dist)
        self.data = TokenData.open(Path(start["data"]), cfg.data.seq_length, cfg.data.eval_fraction)
        self.state = start["state"]
        if "opt_file" in self.state:
            self.load_optimizer(self.paths.worker_dir(self.w) / self.state["opt_file"])
            log.info("resumed worker state: last round done %d, data position %d, inner step %d",
                     self.state["round_done"], self.state["position"], self.state["step"])
        self.sampler = ShardSampler(self.data, self.w, cfg.outer.num_workers, cfg.seed, self.state["position"])
        self.batches = RankBatches(self.sampler, self.dist, cfg.inner.total_batch_size) if self.dist.enabled \
            else self.sampler
        lo, hi = self.sampler.lo, self.sampler.hi
        log.info("worker %d on %s: shard windows [%d, %d) of %d tokens each, device %s%s", self.w,
                 socket.gethostname(), lo, hi, cfg.data.seq_length, self.device,
                 f", {self.dist.world} processes ({cfg.inner.parallel})" if self.dist.enabled else "")

    def load_optimizer(self, opt_file: Path) -> None:
        """Rank 0 reads the saved AdamW state; in a group every rank gets it by broadcast."""
        if not self.dist.enabled:
            self.trainer.load_state(opt_file, self.state)
            return
        tensors = dict(iter_tensors(opt_file)) if self.dist.main else {}
        specs = broadcast_json({k: list(t.shape) for k, t in tensors.items()}, self.dist, self.device)
        full = {k: broadcast_full(tensors.get(k), shape, torch.float32, self.dist, self.device)
                for k, shape in specs.items()}
        self.trainer.set_optimizer_tensors(full, self.state)

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        if self.dist.main:
            self.lead()
        else:
            while (r := broadcast_json(None, self.dist, self.device)) is not None:
                self.train_round(r)  # rank 0 said: train round r (None: the run is complete)
        # Only on success: after an error this rank just exits and torchrun stops the rest of the group. The model
        # and optimizer go first: FSDP2 keeps collective work objects that must not outlive the process group.
        self.trainer = None
        gc.collect()
        close_group()

    def lead(self) -> None:
        """Rank 0 (or the only process): follow the committed rounds; in a group, tell the others each round."""
        rounds = self.cfg.outer.rounds
        while True:
            r = self.paths.latest_committed()
            if r >= rounds:
                log.info("round %d committed: the run is complete", r)
                self.hb.beat(force=True, status="done", round=r)
                broadcast_json(None, self.dist, self.device)
                return
            if self.state["round_done"] >= r:
                self.publish_pending(self.state["round_done"])
                self.hb.beat(force=True, status="waiting for the outer step", round=r)
                wait_for(lambda: self.monitor() or (self.paths.latest_committed() or 0) > r, None, self.poll)
                continue
            broadcast_json(r, self.dist, self.device)
            self.train_round(r)

    def load_global(self, global_dir: Path) -> dict[str, torch.Tensor]:
        """θ_r into the model (rank 0 reads it; the other ranks get it by broadcast); θ_r's CPU copies on rank 0."""
        if not self.dist.enabled:
            return load_weights_into(self.trainer.model, global_dir)  # CPU copies of θ_r, model updated in place
        theta = dict(iter_tensors(global_dir / WEIGHTS)) if self.dist.main else {}
        if self.dist.main and set(theta) != set(self.trainer.params):
            raise ProtocolError(f"{global_dir}: tensors {sorted(set(theta) ^ set(self.trainer.params))[:5]} do not "
                                f"match the model's parameters")
        with torch.no_grad():
            for name, p in self.trainer.params.items():
                load_full(p, broadcast_full(theta.get(name), p.shape, torch.float32, self.dist, self.device))
        return theta

    def train_round(self, r: int) -> None:
        cfg, paths = self.cfg, self.paths
        H = cfg.outer.local_steps
        t0 = time.perf_counter()
        global_dir = paths.global_dir(r)
        theta_r = self.load_global(global_dir)
        t_load = time.perf_counter() - t0
        main = self.dist.main

        def on_step(i: int, loss) -> None:
            if main:
                self.hb.beat(status="training", round=r, step=i + 1, steps=H, loss=loss)

        if main:
            self.hb.beat(force=True, status="training", round=r, step=0, steps=H)
        stats = self.trainer.train_steps(self.batches.next_batch, H, on_step)
        if self.dist.enabled:
            # FSDP2 shards are gathered (a collective: every rank takes part); DDP copies are already whole.
            params = {n: full_tensor(p.detach()) for n, p in self.trainer.params.items()}
            opt_tensors = self.trainer.optimizer_tensors()
            if not main:
                return
        else:
            params, opt_tensors = dict(self.trainer.model.named_parameters()), None
        order = sorted(read_header(global_dir / WEIGHTS)[0].items(), key=lambda kv: kv[1]["data_offsets"][0])
        names = [n for n, _ in order]
        log.info("round %d: %d steps, loss %.4f (last %.4f), %.0f tok/s", r, H, stats["loss"], stats["last_loss"],
                 stats["tokens"] / max(stats["seconds"], 1e-9))

        # Δ = θ_r − θ_w, in the order of the global file so the reducer reads every file sequentially.
        file = write_delta(paths.worker_pending_delta(self.w, r), names, theta_r, params, cfg.outer.delta_dtype,
                           r, self.w)
        if not file["finite"]:
            log.error("round %d: the delta has non-finite values (diverged?); publishing it anyway so the reducer "
                      "rejects it visibly", r)
        sidecar = delta_sidecar(r, self.w, file, inner_steps=H, tokens=stats["tokens"], loss=stats["loss"],
                                last_loss=stats["last_loss"], train_seconds=stats["seconds"], load_seconds=t_load,
                                processes=self.dist.world)
        # Our resume point: optimizer state, data position, schedule step, and the sidecar to publish.
        opt_file = paths.worker_opt(self.w, r)
        if opt_tensors is None:
            extra = self.trainer.save_state(opt_file)
        else:
            save_streaming(opt_file, opt_tensors)
            extra = self.trainer.extra_state()
        self.state = {"round_done": r, "position": self.sampler.position, "opt_file": opt_file.name,
                      "sidecar": sidecar, **extra}
        atomic_write_json(paths.worker_state(self.w), self.state)
        for old in paths.worker_dir(self.w).glob("opt-r*.safetensors"):
            if old.name != opt_file.name:
                old.unlink(missing_ok=True)
        self.publish_pending(r)

    def publish_pending(self, r: int) -> None:
        """Move our saved delta of round r into rounds/r/deltas/ and write its sidecar (idempotent)."""
        paths = self.paths
        pending = paths.worker_pending_delta(self.w, r)
        if paths.delta_meta(r, self.w).is_file() or not pending.is_file():
            return
        latest = paths.latest_committed()
        if latest is not None and latest > r:
            log.warning("round %d was committed without us (we were too slow or restarted); dropping our delta "
                        "and rejoining at round %d", r, latest)
            pending.unlink(missing_ok=True)
            return
        try:
            paths.deltas_dir(r).mkdir(parents=True, exist_ok=True)
            os.replace(pending, paths.delta_file(r, self.w))
            publish_sidecar(paths, self.state["sidecar"])
        except FileNotFoundError:
            log.warning("round %d disappeared while publishing (already reduced and cleaned up)", r)
            return
        log.info("round %d: published delta (%.1f MB)", r, self.state["sidecar"]["bytes"] / 1e6)


def main(argv: list[str] | None = None) -> int:
    from train.core.entry import worker_main
    return worker_main("diloco", Worker, __doc__.split("\n")[0], argv)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "worker")
