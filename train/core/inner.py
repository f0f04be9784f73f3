"""The inner loop: AdamW with warmup + cosine, gradient accumulation, clipping, mixed precision, optional compile.

The optimizer (and fp16 grad-scaler) state lives across rounds, as in DiLoCo, and is saved as safetensors + JSON
(never pickled) so a restarted worker resumes it exactly.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from train.core.config import ConfigError, RunConfig
from train.core.dist import DistInfo, all_mean, full_tensor, like, parallelize
from train.core.tensorio import load_tensors, save_streaming


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `peak * min_ratio` at `total` (held there after)."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq_length + 1) windows."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def autocast_for(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device,
             precision: str = "fp32") -> float:
    """Mean loss over fixed windows (every window weighs the same)."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size].to(device)
        with autocast_for(precision, device):
            total += lm_loss(model, batch).item() * len(batch)
        n += len(batch)
    model.train(was_training)
    return total / max(1, n)


class InnerTrainer:
    """Owns the model on its device, the AdamW optimizer and the schedule position (`step`).

    In a torchrun group (`dist`, train/core/dist.py) every rank holds one: the model runs through DDP (or is FSDP2-
    sharded), each rank does total_batch_size / world windows per step, and the gradients are averaged over the
    group, so one step is the same step as in one process."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, device: torch.device, dist: DistInfo | None = None):
        ic = cfg.inner
        if dist is None and ic.nproc_per_node > 1:
            raise ConfigError(f"inner.nproc_per_node = {ic.nproc_per_node}, but this kind of worker trains in one "
                              f"process (only DiLoCo workers, train.diloco.worker, run as torchrun groups): set "
                              f"inner.nproc_per_node = 1")
        self.cfg, self.device, self.dist = cfg, device, dist or DistInfo()
        self.model = model.to(device)
        self.model.train()
        wrapped = parallelize(self.model, self.dist, device, ic.parallel)  # after this, FSDP2 params are shards
        self.params = dict(self.model.named_parameters())
        self.opt = torch.optim.AdamW(self.params.values(), lr=ic.lr, betas=(ic.beta1, ic.beta2), eps=ic.eps,
                                     weight_decay=ic.weight_decay)
        self.scaler = torch.amp.GradScaler(device.type, enabled=ic.precision == "fp16-mixed")
        self.forward_model = torch.compile(wrapped) if ic.compile else wrapped
        # Micro-batches per step on this rank; DDP skips the gradient all-reduce on all but the last of them.
        self.accum = ic.total_batch_size // (ic.per_device_batch_size * self.dist.world)
        self._no_sync = getattr(wrapped, "no_sync", None)
        self.step = 0  # inner steps taken so far (drives the schedule)

    def lr(self) -> float:
        ic = self.cfg.inner
        return lr_at(self.step, ic.lr, ic.warmup_steps, self.cfg.total_inner_steps, ic.min_lr_ratio)

    def train_steps(self, next_batch: Callable[[int], torch.Tensor], n_steps: int,
                    on_step: Callable[[int, float], None] | None = None) -> dict:
        """Run `n_steps` optimizer steps; `on_step(i, loss_tensor)` is called after each."""
        ic = self.cfg.inner
        accum = self.accum
        losses = torch.zeros(n_steps, device=self.device)  # stays on the device: no sync per step
        t0 = time.perf_counter()
        for i in range(n_steps):
            for group in self.opt.param_groups:
                group["lr"] = self.lr()
            step_loss = torch.zeros((), device=self.device)
            for k in range(accum):
                batch = next_batch(ic.per_device_batch_size).to(self.device, non_blocking=True)
                sync = self._no_sync is None or k == accum - 1
                with nullcontext() if sync else self._no_sync():
                    with autocast_for(ic.precision, self.device):
                        loss = lm_loss(self.forward_model, batch) / accum
                    self.scaler.scale(loss).backward()
                step_loss += loss.detach()
            if ic.grad_clip > 0:
                self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.params.values(), ic.grad_clip)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            losses[i] = step_loss
            if on_step:
                on_step(i, step_loss)  # a tensor: the callback decides when a .item() sync is worth it
        n_tokens = n_steps * ic.total_batch_size * self.cfg.data.seq_length  # the whole worker's (all ranks)
        losses = all_mean(losses, self.dist).cpu()  # each rank's loss covers its slice; the group mean is the step's
        return {"loss": float(losses.mean()) if n_steps else float("nan"), "last_loss": float(losses[-1]),
                "steps": n_steps, "tokens": n_tokens, "seconds": time.perf_counter() - t0}

    # -- optimizer state as safetensors + JSON --------------------------------------------------------------------
    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The AdamW state as full CPU tensors (FSDP2 shards are gathered: call it on every rank of a group)."""
        out = {}
        for name, p in self.params.items():
            st = self.opt.state.get(p)
            if not st:
                continue
            out[f"{name}::exp_avg"] = full_tensor(st["exp_avg"].detach()).cpu()
            out[f"{name}::exp_avg_sq"] = full_tensor(st["exp_avg_sq"].detach()).cpu()
            out[f"{name}::step"] = torch.as_tensor(float(st["step"]), dtype=torch.float32).reshape(1).cpu()
        return out

    def save_state(self, path) -> dict:
        """Write the optimizer tensors (atomically); returns the JSON-able rest of the state."""
        save_streaming(path, self.optimizer_tensors())
        return self.extra_state()

    def extra_state(self) -> dict:
        return {"step": self.step, "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}

    def load_state(self, path, extra: dict) -> None:
        self.set_optimizer_tensors(load_tensors(path), extra)

    def set_optimizer_tensors(self, tensors: dict[str, torch.Tensor], extra: dict) -> None:
        """Restore the AdamW state from full tensors (laid out like each parameter: shards under FSDP2)."""
        for name, p in self.params.items():
            if f"{name}::exp_avg" not in tensors:
                continue
            self.opt.state[p] = {
                "exp_avg": like(p, tensors[f"{name}::exp_avg"]),
                "exp_avg_sq": like(p, tensors[f"{name}::exp_avg_sq"]),
                "step": torch.tensor(float(tensors[f"{name}::step"][0])),
            }
        self.step = int(extra.get("step", 0))
        if extra.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(extra["scaler"])
