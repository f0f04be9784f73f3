"""One worker of tests/e2e/test_diloco_optimizer.py: a user's own training loop with DiLoCoOptimizer that does, step for
step, what `python -m train.diloco.worker` does (train/diloco/worker.py, train/core/inner.py) for the same config.

    python tests/helpers/diloco_opt_worker.py EVOLUTION_JSON WORKER BASE_DIR [--threads N]

Same θ_0 (build_model with the run's seed), the same batches (each round's slice of the data stream, as the
coordinator's layout gives it: train/exchange/layout.py), AdamW with the same hyperparameters, warmup + cosine
as a LambdaLR, gradient clipping, fp32, `--threads` torch threads (default 1; the test passes the simulator's
workers' value, through tests.helpers.proc.with_threads).
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from train.config import load_config  # noqa: E402
from train.core.data import StreamSampler, TokenData, find_data  # noqa: E402
from train.exchange.layout import Layout  # noqa: E402
from train.diloco.optimizer import DiLoCoOptimizer  # noqa: E402
from train.core.inner import lm_loss, lr_at  # noqa: E402
from train.core.model import build_model, quiet_transformers  # noqa: E402


def main(config: str, worker: int, base_dir: str, threads: int = 1) -> None:
    quiet_transformers()
    cfg = load_config(config)
    ic, oc = cfg.inner, cfg.outer
    assert ic.grad_accum == 1 and ic.precision == "fp32", "this loop replicates the fp32, no-accumulation worker"
    torch.set_num_threads(threads)
    model = build_model(cfg)  # θ_0 from the run's seed, as the coordinator builds it; worker 0 commits it
    torch.manual_seed(cfg.seed * 1000 + worker)
    model.train()
    data = TokenData.open(find_data(cfg), cfg.data.seq_length, cfg.data.eval_fraction)
    sampler = StreamSampler(data, cfg.seed)
    layout = Layout.single(oc.num_workers, oc.local_steps * ic.total_batch_size)
    total = cfg.total_inner_steps
    opt = DiLoCoOptimizer(
        model, base_dir=base_dir, run_id=cfg.project_name, worker=worker, num_workers=oc.num_workers,
        num_inner_steps=oc.local_steps, batch_size=ic.total_batch_size * cfg.data.seq_length,
        inner_optimizer=partial(torch.optim.AdamW, lr=ic.lr, betas=(ic.beta1, ic.beta2), eps=ic.eps,
                                weight_decay=ic.weight_decay),
        outer_optimizer=partial(torch.optim.SGD, lr=oc.lr, momentum=oc.momentum, nesterov=oc.nesterov),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: lr_at(s, ic.lr, ic.warmup_steps, total, ic.min_lr_ratio) / ic.lr),
        averaging_timeout=120, poll_interval=0.05, keep_rounds=oc.keep_rounds)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # the fp16 path's calls; a no-op in fp32, as in the worker
    for step in range(total):
        if step % oc.local_steps == 0:
            sampler.begin(*layout.slice(step // oc.local_steps, worker))
        batch = sampler.next_batch(ic.per_device_batch_size)
        loss = lm_loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt.inner_optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), ic.grad_clip)
        opt.step(scaler=scaler, loss=loss.detach())
        opt.zero_grad()
        if opt.local_step == 0:
            print(f"worker {worker}: step {step + 1}, round {opt.round}, loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("worker", type=int)
    ap.add_argument("base_dir")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    main(a.config, a.worker, a.base_dir, a.threads)
