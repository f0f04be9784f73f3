"""The fast inner loop (#14): `auto` settings per device, the CPU loop equal bit for bit to a bare PyTorch loop,
the chunked (memory-lean) loss, and the GPU defaults (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO, pin_threads
from train.config import build_config
from train.core.inner import (InnerTrainer, lr_at, resolve_compile, resolve_loss_chunk, resolve_precision,
                              token_cross_entropy)
from train.core.model import build_model

MICRO = str(REPO / "configs" / "micro-llama.json")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _cfg(device="cpu", **inner):
    return build_config({"model": {"name": MICRO}, "data": {"seq_length": 16},
                         "inner": {"device": device, "per_device_batch_size": 4, "total_batch_size": 4, "lr": 3e-3,
                                   "warmup_steps": 2, **inner},
                         "outer": {"rounds": 1, "local_steps": 6}})


def test_auto_means_fast_on_cuda_and_unchanged_on_cpu():
    assert resolve_precision("auto", CPU) == "fp32" and resolve_precision("fp16-mixed", CPU) == "fp16-mixed"
    assert resolve_compile("auto", CPU) is False and resolve_compile("auto", CUDA) is True
    assert resolve_compile(True, CPU) is True and resolve_compile(False, CUDA) is False
    assert resolve_loss_chunk("auto", CPU, False) == 0 and resolve_loss_chunk("auto", CUDA, False) == 4096
    assert resolve_loss_chunk("auto", CUDA, True) == 0 and resolve_loss_chunk(128, CPU, True) == 128
    tr = InnerTrainer(_cfg("auto"), build_model(_cfg()), CPU)  # device auto on a CPU: settled by the trainer
    assert tr.precision == "fp32" and not tr.scaler.is_enabled() and tr.forward_model is tr.model
    assert tr.opt.defaults["foreach"] is True and not tr.opt.defaults["fused"]


def test_cpu_loop_is_a_bare_pytorch_loop_bit_for_bit():
    """Our loop on CPU (defaults: fp32, eager, foreach AdamW, read-back every 10 steps) against the loop anyone would
    write with torch's defaults: the same weights and losses, exactly."""
    pin_threads()
    cfg = _cfg()
    ic = cfg.inner
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 2048, (4, 17), generator=g) for _ in range(6)]
    torch.manual_seed(0)
    tr = InnerTrainer(cfg, build_model(cfg), CPU)
    it = iter(batches)
    stats = tr.train_steps(lambda n: next(it), 6)

    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=ic.lr, betas=(ic.beta1, ic.beta2), eps=ic.eps,
                            weight_decay=ic.weight_decay)
    losses = []
    for step, batch in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, ic.lr, ic.warmup_steps, cfg.total_inner_steps, ic.min_lr_ratio)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ic.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    for (n, p), q in zip(tr.model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
    assert stats["last_loss"] == float(losses[-1]) and stats["loss"] == float(torch.stack(losses).mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_is_the_cross_entropy(dtype):
    pin_threads()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 97, generator=g).to(dtype)
    targets = torch.randint(0, 97, (3, 50), generator=g)
    results = []
    for chunk in (0, 16, 150, 1000):  # 16 does not divide 150 tokens; >= 150 is one piece
        x = logits.clone().requires_grad_(True)
        loss = token_cross_entropy(x, targets, chunk)
        loss.backward()
        assert loss.dtype == torch.float32
        results.append((loss.detach(), x.grad.float()))
    want = F.cross_entropy(logits.float().reshape(-1, 97), targets.reshape(-1))
    for loss, grad in results:
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_chunked_loss_keeps_less_for_the_backward_under_autocast():
    """Under bf16 autocast the loss in one piece keeps fp32 log-probabilities (4 bytes per token and vocabulary
    entry); in chunks it keeps only the bf16 logits (2 bytes)."""
    logits = torch.randn(64, 40, 512, requires_grad=True)
    targets = torch.randint(0, 512, (64, 40))

    def saved_bytes(chunk: int) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            token_cross_entropy(logits.to(torch.bfloat16), targets, chunk)
        return sum(seen.values())

    full = 64 * 40 * 512
    assert saved_bytes(0) >= 4 * full
    assert saved_bytes(256) <= 2 * full + 64 * 40 * 8


def test_trainer_with_a_chunked_loss_trains_like_the_plain_one():
    pin_threads()
    out = []
    for chunk in (0, 24):
        torch.manual_seed(0)
        tr = InnerTrainer(_cfg(loss_chunk=chunk), build_model(_cfg()), CPU)
        g = torch.Generator().manual_seed(1)
        out.append(tr.train_steps(lambda b: torch.randint(0, 64, (b, 17), generator=g), 4)["last_loss"])
    assert out[0] == pytest.approx(out[1], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_defaults_are_fused_bf16_compiled():
    cfg = _cfg("cuda")
    tr = InnerTrainer(cfg, build_model(cfg), CUDA)
    assert tr.precision == "bf16-mixed" and tr.opt.defaults["fused"] is True and tr.forward_model is not tr.model
    g = torch.Generator().manual_seed(1)
    seen = []
    stats = tr.train_steps(lambda b: torch.randint(0, 64, (b, 17), generator=g), 12, lambda i, x: seen.append(x))
    assert all(x is None or isinstance(x, float) for x in seen) and any(isinstance(x, float) for x in seen)
    assert stats["last_loss"] < stats["loss"] + 1.0 and torch.isfinite(torch.tensor(stats["loss"]))
