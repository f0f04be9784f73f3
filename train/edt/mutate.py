"""Mutation in evolutionary pretraining (edt.mode = pretrain): inner AdamW steps on the member's shard with the
DNA's learning rate and data mix, then the loss on the run's held-out windows. EvoMerge's mutation (SFT) is
train/evomerge/mutate.py; train/edt/modes.py picks one per run.
"""
from __future__ import annotations

import copy
import time

import torch

from train.core import sharedfs
from train.config import RunConfig
from train.core.data import ShardSampler, TokenData, find_data
from train.edt.store import EDTPaths
from train.core.inner import InnerTrainer, evaluate


class MixSampler:
    """The member's batches: its own shard, plus a `mix` fraction of windows from the whole training set (the
    data_mix gene). Both streams are ShardSamplers whose positions are the whole state, saved per member slot."""

    def __init__(self, data: TokenData, member: int, population: int, seed: int, own: int, mixed: int,
                 mix: float):
        self.own = ShardSampler(data, member, population, seed, own)
        self.mixed = ShardSampler(data, 0, 1, seed * 1_000_003 + 7919 * (member + 1), mixed)
        self.mix = float(mix)
        self._k = 0  # windows drawn in this job: the interleaving is a deterministic function of it

    def next_batch(self, batch_size: int) -> torch.Tensor:
        rows = []
        for _ in range(batch_size):
            k, f = self._k, self.mix
            from_mix = int((k + 1) * f) > int(k * f)  # exactly round(f * n) of the first n windows, spread out
            rows.append((self.mixed if from_mix else self.own).next_batch(1))
            self._k += 1
        return torch.cat(rows)

    @property
    def positions(self) -> dict:
        return {"own": self.own.position, "mix": self.mixed.position}


class PretrainMutation:
    """Mutation + evaluation of evolutionary pretraining: `steps` inner AdamW steps with the DNA's lr and data mix on
    the member's shard (inheriting its first parent's AdamW state), then the loss on the run's held-out windows."""

    def __init__(self, cfg: RunConfig, paths: EDTPaths, device: torch.device):
        self.cfg, self.paths, self.device = cfg, paths, device
        self.data = TokenData.open(find_data(cfg), cfg.data.seq_length, cfg.data.eval_fraction)
        self.eval_windows = torch.from_numpy(self.data.eval_windows(cfg.eval.batches * cfg.eval.batch_size))

    def __call__(self, model, job: dict, g: int, m: int, on_step, tmp) -> dict:
        cfg, paths = self.cfg, self.paths
        # The job's hyperparameters: the DNA's lr on the run's schedule (warmup once, cosine over all generations).
        jc = copy.deepcopy(cfg)
        jc.inner.lr = float(job["hyper"]["inner_lr"])
        jc.inner.total_steps = int(job["schedule_total"])
        trainer = InnerTrainer(jc, model, self.device)
        bytes_read = 0
        if job.get("optimizer_from"):
            opt = paths.root / job["optimizer_from"]
            trainer.load_state(opt, {})
            bytes_read += sharedfs.stat(opt).st_size
        trainer.step = int(job["schedule_step"])
        pos = job["position"]
        sampler = MixSampler(self.data, m, int(job["population"]), cfg.seed, int(pos["own"]), int(pos["mix"]),
                             float(job["hyper"]["data_mix"]))
        stats = trainer.train_steps(sampler.next_batch, int(job["steps"]), on_step)
        t0 = time.perf_counter()
        eval_loss = evaluate(model, self.eval_windows, cfg.eval.batch_size, self.device, cfg.inner.precision)
        extra = trainer.save_state(tmp / "optimizer.safetensors")
        return {"eval_loss": eval_loss, "train_loss": stats["loss"], "last_loss": stats["last_loss"],
                "tokens": stats["tokens"], "position": sampler.positions, "optimizer_step": extra["step"],
                "train_seconds": stats["seconds"], "eval_seconds": time.perf_counter() - t0,
                "bytes_read": bytes_read, "bytes_written": (tmp / "optimizer.safetensors").stat().st_size}
