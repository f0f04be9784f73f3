"""The inner loop: AdamW (or Muon for the hidden matrices + AdamW for the rest) with warmup + cosine, gradient
accumulation, clipping, mixed precision, optional compile and a memory-lean loss.

Where a GPU is present the defaults are the fast ones (issue #14): fused AdamW, bf16 autocast, torch.compile of the
model and the loss, no host sync per step (the loss is read back every `inner.log_every` steps, asynchronously). On
CPU they resolve to what the loop always did (fp32, eager, the loss in one piece, AdamW's `foreach` path, which gives
the same numbers as its default there), so CPU results are bit-identical to the loop before these options.

The optimizer (and fp16 grad-scaler) state lives across rounds, as in DiLoCo (`inner.reset_state` drops it every
round), and is saved as safetensors + JSON (never pickled) so a restarted worker resumes it exactly.
"""
from __future__ import annotations

import logging
import math
import re
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.config import ConfigError, RunConfig
from train.core.dist import DistInfo, all_mean, full_tensor, like, parallelize
from train.core.tensorio import load_tensors, save_streaming

log = logging.getLogger("inner")


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `peak * min_ratio` at `total` (held there after)."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# -- what `auto` means on a device ----------------------------------------------------------------------------------
def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto`: bf16-mixed on a CUDA device that has bf16, else fp32; anything else as given."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def resolve_compile(compile: Any, device: torch.device) -> bool:
    """`auto`: compile on CUDA (inductor pays off there), not on CPU."""
    return device.type == "cuda" if compile == "auto" else bool(compile)


def resolve_loss_chunk(loss_chunk: Any, device: torch.device, compiled: bool) -> int:
    """`auto`: 4096-token chunks on CUDA in eager mode; 0 (one piece) when compiled (inductor fuses the upcast
    and the log-softmax itself) and on CPU (bit-identical to the plain loss)."""
    if loss_chunk != "auto":
        return int(loss_chunk)
    return 4096 if device.type == "cuda" and not compiled else 0


def autocast_for(precision: str, device: torch.device):
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# -- the loss -------------------------------------------------------------------------------------------------------
def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Mean cross-entropy (in fp32) of (..., vocab) logits against (...) targets.

    chunk = 0: in one piece, `F.cross_entropy(logits.float(), ...)`: under autocast that keeps an fp32 copy of the
    logits and the fp32 log-probabilities for the backward pass, 2 x 4 bytes per token and vocabulary entry.
    chunk > 0: `chunk` tokens at a time, each recomputed in the backward pass (activation checkpointing), so only the
    logits themselves (bf16 under autocast) and one chunk's fp32 temporaries are alive at a time. Same value up to
    the order of the summation."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    if chunk <= 0 or logits.size(0) <= chunk:
        return F.cross_entropy(logits.float(), targets)
    # torch.split (not slicing): its backward concatenates the chunks' gradients once
    parts = [checkpoint(_ce_sum, lg, tg, use_reentrant=False)
             for lg, tg in zip(logits.split(chunk), targets.split(chunk))]
    return torch.stack(parts).sum() / targets.numel()


def lm_loss(model: torch.nn.Module, windows: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy of (batch, seq_length + 1) windows."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(input_ids=inputs).logits
    return token_cross_entropy(logits, targets, chunk)


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


# -- the Muon / AdamW split -----------------------------------------------------------------------------------------
_NOT_HIDDEN = re.compile(r"(^|\.)(embed\w*|wte|wpe|lm_head)(\.|$)")


def muon_param_names(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> list[str]:
    """The parameters Muon trains: the 2-D weight matrices of the hidden layers. Embeddings and the output head
    (tied or not; found through the HF accessors, else by name), norms and biases stay on AdamW (Keller Jordan's
    split, used by MuLoCo, Thérien et al. 2025)."""
    skip: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            mod = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            mod = None
        if isinstance(mod, torch.nn.Module):
            skip |= {id(p) for p in mod.parameters()}
    return [n for n, p in params.items() if p.ndim == 2 and id(p) not in skip and not _NOT_HIDDEN.search(n)]


class _LossReadback:
    """The last training loss known on the host, refreshed every `every` steps without stalling the device: on CUDA
    the loss is copied to pinned memory asynchronously and read once the copy has landed (a step or so later); on
    CPU it is simply read."""

    def __init__(self, every: int, device: torch.device):
        self.every, self.value = every, None
        self._cuda = device.type == "cuda"
        self._host = torch.empty((), pin_memory=True) if self._cuda else None
        self._ready: torch.cuda.Event | None = None

    def update(self, i: int, loss: torch.Tensor) -> float | None:
        if self._ready is not None and self._ready.query():
            self.value, self._ready = float(self._host), None
        if i % self.every == 0:
            if not self._cuda:
                self.value = float(loss)
            elif self._ready is None:
                self._host.copy_(loss, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
        return self.value


class InnerTrainer:
    """Owns the model on its device, the inner optimizer(s) and the schedule position (`step`).

    `opt` is the AdamW optimizer (every parameter, or with inner.optimizer = muon all but the hidden matrices, which
    `muon` trains); `opts` lists the ones in use. In a torchrun group (`dist`, train/core/dist.py) every rank holds
    one: the model runs through DDP (or is FSDP2-sharded), each rank does total_batch_size / world windows per step,
    and the gradients are averaged over the group, so one step is the same step as in one process."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, device: torch.device, dist: DistInfo | None = None):
        ic = cfg.inner
        if dist is None and ic.nproc_per_node > 1:
            raise ConfigError(f"inner.nproc_per_node = {ic.nproc_per_node}, but this kind of worker trains in one "
                              f"process (only DiLoCo workers, train.diloco.worker, run as torchrun groups): set "
                              f"inner.nproc_per_node = 1")
        self.cfg, self.device, self.dist = cfg, device, dist or DistInfo()
        self.precision = resolve_precision(ic.precision, device)
        self.model = model.to(device)
        self.model.train()
        wrapped = parallelize(self.model, self.dist, device, ic.parallel)  # after this, FSDP2 params are shards
        self.params = dict(self.model.named_parameters())
        self.muon_names = set(muon_param_names(self.model, self.params)) if ic.optimizer == "muon" else set()
        if ic.optimizer == "muon" and not self.muon_names:
            log.warning("inner.optimizer = muon, but the model has no hidden weight matrices: AdamW trains it all")
        self.opt, self.muon = self._build_optimizers()
        self.opts = [o for o in (self.opt, self.muon) if o is not None]
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision == "fp16-mixed")
        compiled = resolve_compile(ic.compile, device)
        chunk = resolve_loss_chunk(ic.loss_chunk, device, compiled)

        def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return token_cross_entropy(logits, targets, chunk)

        # Compiled, the loss is a graph of its own: inductor fuses the fp32 upcast into the log-softmax.
        self.forward_model = torch.compile(wrapped) if compiled else wrapped
        self.cross_entropy = torch.compile(cross_entropy) if compiled else cross_entropy
        # Micro-batches per step on this rank; DDP skips the gradient all-reduce on all but the last of them.
        self.accum = ic.total_batch_size // (ic.per_device_batch_size * self.dist.world)
        self._no_sync = getattr(wrapped, "no_sync", None)
        self.step = 0  # the position on the learning-rate schedule: inner steps taken so far, unless a caller sets it
        # how far one step moves `step`, and the schedule's length (None: cfg.total_inner_steps). The DiLoCo worker
        # sets all three each round from the data layout: the schedule counts the run's windows per slot, not the
        # worker's own steps (train/diloco/pace.py schedule_for)
        self.step_size: float = 1
        self.total_steps: float | None = None

    # -- optimizers and schedule ----------------------------------------------------------------------------------
    def weight_decay(self, peak_lr: float) -> float:
        """λ of an optimizer whose peak lr is `peak_lr` (torch's decoupled form: θ ← θ − lr_t·λ·θ per step)."""
        ic = self.cfg.inner
        if ic.weight_decay_mode == "inverse_steps":  # independent decay 1/T: lr_peak·λ = 1/T
            return 1.0 / (self.cfg.total_inner_steps * peak_lr)
        return ic.weight_decay

    def _build_optimizers(self) -> tuple[torch.optim.Optimizer | None, torch.optim.Optimizer | None]:
        ic = self.cfg.inner
        if self.device.type == "cuda":
            impl = {"fused": True}  # one kernel for all parameters
        elif self.dist.world == 1 or ic.parallel == "ddp":
            impl = {"foreach": True}  # plain tensors on CPU: the same numbers as the per-tensor default
        else:
            impl = {}  # FSDP2 shards on CPU: torch's default
        adam = [p for n, p in self.params.items() if n not in self.muon_names]
        opt = torch.optim.AdamW(adam, lr=ic.lr, betas=(ic.beta1, ic.beta2), eps=ic.eps,
                                weight_decay=self.weight_decay(ic.lr), **impl) if adam else None
        muon = None
        if self.muon_names:
            muon = torch.optim.Muon([p for n, p in self.params.items() if n in self.muon_names], lr=ic.muon_lr,
                                    momentum=ic.muon_momentum, nesterov=True,
                                    weight_decay=self.weight_decay(ic.muon_lr), adjust_lr_fn="original")
        return opt, muon

    def lr(self) -> float:
        """AdamW's learning rate at the current step."""
        ic = self.cfg.inner
        return lr_at(self.step, ic.lr, ic.warmup_steps, self.schedule_length, ic.min_lr_ratio)

    @property
    def schedule_length(self) -> float:
        return self.total_steps if self.total_steps is not None else self.cfg.total_inner_steps

    def _set_lrs(self) -> None:
        ic = self.cfg.inner
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = self.lr()
        if self.muon is not None:  # the same warmup + cosine, from Muon's own peak
            lr = lr_at(self.step, ic.muon_lr, ic.warmup_steps, self.schedule_length, ic.min_lr_ratio)
            for group in self.muon.param_groups:
                group["lr"] = lr

    def reset_optimizer_state(self) -> None:
        """Forget the optimizer state (AdamW moments and step counts, Muon momentum); the schedule position `step`
        and the fp16 grad scale are kept. The next step starts the moments afresh, as on a new optimizer."""
        for opt in self.opts:
            opt.state.clear()

    # -- the loop -------------------------------------------------------------------------------------------------
    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return batch.pin_memory().to(self.device, non_blocking=True)  # the copy overlaps the running step
        return batch.to(self.device)

    def train_steps(self, next_batch: Callable[[int], torch.Tensor], n_steps: int,
                    on_step: Callable[[int, float | None], None] | None = None,
                    before_step: Callable[[int], None] | None = None,
                    stop: Callable[[], bool] | None = None) -> dict:
        """Run `n_steps` optimizer steps; `on_step(i, loss)` is called after each, with the last training loss read
        back to the host (a float, refreshed every inner.log_every steps; None before the first read-back), so no
        step waits for the device. The returned statistics are exact: every step's loss stays on the device and is
        read once, at the end. `before_step(i)` is called before step i (the overlapped fold). `stop()`, asked before
        every step but the first: True ends the loop there (rounds by time); `steps` says how many ran."""
        ic = self.cfg.inner
        accum = self.accum
        losses = torch.zeros(n_steps, device=self.device)
        readback = _LossReadback(ic.log_every, self.device)
        t0 = time.perf_counter()
        done = n_steps
        lrs = [float("nan"), float("nan")]  # AdamW's learning rate at the first and the last step
        for i in range(n_steps):
            if stop is not None and i > 0 and stop():
                done = i
                break
            if before_step is not None:
                before_step(i)
            self._set_lrs()
            lrs[i > 0] = self.lr()
            step_loss = torch.zeros((), device=self.device)
            for k in range(accum):
                batch = self._to_device(next_batch(ic.per_device_batch_size))
                sync = self._no_sync is None or k == accum - 1
                with nullcontext() if sync else self._no_sync():
                    with autocast_for(self.precision, self.device):
                        logits = self.forward_model(input_ids=batch[:, :-1]).logits
                        loss = self.cross_entropy(logits, batch[:, 1:]) / accum
                    del logits
                    self.scaler.scale(loss).backward()
                step_loss += loss.detach()
            if ic.grad_clip > 0:
                for opt in self.opts:
                    self.scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self.params.values(), ic.grad_clip)
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
            self.step += self.step_size
            losses[i] = step_loss
            if on_step:
                on_step(i, readback.update(i, step_loss))
        n_tokens = done * ic.total_batch_size * self.cfg.data.seq_length  # the whole worker's (all ranks)
        # each rank's loss covers its slice; the group mean is the step's
        losses = all_mean(losses[:done], self.dist).cpu()
        return {"loss": float(losses.mean()) if done else float("nan"),
                "last_loss": float(losses[-1]) if done else float("nan"),
                "steps": done, "tokens": n_tokens, "seconds": time.perf_counter() - t0,
                "lr": [lrs[0], lrs[1] if done > 1 else lrs[0]]}

    # -- optimizer state as safetensors + JSON --------------------------------------------------------------------
    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer state as full CPU tensors, `<param>::exp_avg` / `::exp_avg_sq` / `::step` (AdamW) and
        `<param>::momentum_buffer` (Muon). FSDP2 shards are gathered: call it on every rank of a group."""
        out = {}
        for name, p in self.params.items():
            muon = name in self.muon_names
            st = (self.muon if muon else self.opt).state.get(p)
            if not st:
                continue
            if muon:
                out[f"{name}::momentum_buffer"] = full_tensor(st["momentum_buffer"].detach()).cpu()
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
        """Restore the optimizer state from full tensors (laid out like each parameter: shards under FSDP2)."""
        fused = self.opt is not None and bool(self.opt.defaults.get("fused"))
        for name, p in self.params.items():
            muon = name in self.muon_names
            saved_adam, saved_muon = f"{name}::exp_avg" in tensors, f"{name}::momentum_buffer" in tensors
            if (saved_adam and muon) or (saved_muon and not muon):
                raise ConfigError(f"inner.optimizer = {self.cfg.inner.optimizer}: the saved optimizer state of "
                                  f"{name} is {'AdamW' if saved_adam else 'Muon'}'s; resume with the inner.optimizer "
                                  f"it was saved with (or start the run afresh)")
            if saved_muon:
                self.muon.state[p] = {"momentum_buffer": like(p, tensors[f"{name}::momentum_buffer"])}
            elif saved_adam:
                step = float(tensors[f"{name}::step"][0])
                self.opt.state[p] = {
                    "exp_avg": like(p, tensors[f"{name}::exp_avg"]),
                    "exp_avg_sq": like(p, tensors[f"{name}::exp_avg_sq"]),
                    # fused AdamW keeps its step count on the parameter's device
                    "step": torch.tensor(step, dtype=torch.float32, device=p.device) if fused else torch.tensor(step),
                }
        step = extra.get("step", 0)
        self.step = int(step) if float(step).is_integer() else float(step)
        if extra.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(extra["scaler"])
