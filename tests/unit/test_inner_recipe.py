"""The inner recipe knobs (#16): schedule, weight decay 1/T, keeping vs resetting the optimizer state, the loss
read-back every `log_every` steps, the outer-lr schedule, and their config errors."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import REPO, pin_threads
from train.config import ConfigError, build_config
from train.core.inner import InnerTrainer, lr_at
from train.core.model import build_model
from train.exchange.outer import outer_lr_at

MICRO = str(REPO / "configs" / "micro-llama.json")


def _cfg(inner=None, outer=None):
    return build_config({"model": {"name": MICRO}, "data": {"seq_length": 16},
                         "inner": {"device": "cpu", "per_device_batch_size": 4, "total_batch_size": 4, "lr": 3e-3,
                                   **(inner or {})},
                         "outer": {"rounds": 2, "local_steps": 5, **(outer or {})}})


def _trainer(cfg, seed=0):
    torch.manual_seed(seed)
    return InnerTrainer(cfg, build_model(cfg), torch.device("cpu"))


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda b: torch.randint(0, 64, (b, 17), generator=g)


def _params(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


# -- schedule ---------------------------------------------------------------------------------------------------------
def test_schedule_is_linear_warmup_then_cosine_to_the_floor():
    peak, warm, total, floor = 1e-3, 10, 110, 0.05  # the paper's shape: warmup, cosine to 5%
    for step in range(warm):
        assert lr_at(step, peak, warm, total, floor) == pytest.approx(peak * (step + 1) / warm)
    for step in (10, 35, 60, 85, 109, 110, 500):
        progress = min(1.0, (step - warm) / (total - warm))
        want = peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert lr_at(step, peak, warm, total, floor) == pytest.approx(want)
    assert lr_at(60, peak, warm, total, floor) == pytest.approx(peak * (floor + (1 - floor) / 2))  # half way
    assert lr_at(110, peak, warm, total, floor) == pytest.approx(peak * floor)  # the floor, held after the end


def test_muon_follows_the_same_schedule_from_its_own_peak():
    cfg = _cfg({"optimizer": "muon", "muon_lr": 0.05, "warmup_steps": 3, "min_lr_ratio": 0.05})
    tr = _trainer(cfg)
    for step in (0, 2, 3, 7, 10):
        tr.step = step
        tr._set_lrs()
        want = lr_at(step, 0.05, 3, cfg.total_inner_steps, 0.05)
        assert tr.muon.param_groups[0]["lr"] == pytest.approx(want)
        assert tr.opt.param_groups[0]["lr"] == pytest.approx(want / 0.05 * 3e-3)


# -- weight decay ------------------------------------------------------------------------------------------------------
def test_weight_decay_fixed_and_inverse_steps():
    assert _trainer(_cfg({"weight_decay": 0.25})).opt.param_groups[0]["weight_decay"] == 0.25
    cfg = _cfg({"weight_decay_mode": "inverse_steps", "optimizer": "muon", "muon_lr": 0.02},
               {"rounds": 4, "local_steps": 25})
    tr = _trainer(cfg)
    T = cfg.total_inner_steps
    assert T == 100
    # independent decay 1/T: at the peak lr each step multiplies the weights by 1 - 1/T
    assert tr.opt.param_groups[0]["weight_decay"] * 3e-3 == pytest.approx(1 / T)
    assert tr.muon.param_groups[0]["weight_decay"] * 0.02 == pytest.approx(1 / T)


def test_inverse_steps_decay_shrinks_weights_by_1_over_T_per_peak_step():
    pin_threads()
    cfg = _cfg({"weight_decay_mode": "inverse_steps", "warmup_steps": 0, "min_lr_ratio": 1.0, "beta1": 0.0},
               {"rounds": 1, "local_steps": 8})
    tr = _trainer(cfg)
    before = _params(tr)
    for p in tr.params.values():  # zero gradients: the step is the decay alone (Adam's update of 0 is 0)
        p.grad = torch.zeros_like(p)
    tr._set_lrs()
    tr.opt.step()
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(p, before[n] * (1 - 1 / 8))


# -- optimizer state: kept or reset ------------------------------------------------------------------------------------
def test_reset_optimizer_state_is_a_fresh_optimizer_at_the_same_schedule_step():
    pin_threads()
    cfg = _cfg({"reset_state": True})
    assert cfg.inner.reset_state is True and _cfg().inner.reset_state is False
    a = _trainer(cfg)
    a.train_steps(_batches(), 3)
    assert a.opt.state
    a.reset_optimizer_state()
    assert not a.opt.state and a.step == 3 and a.optimizer_tensors() == {}
    b = _trainer(cfg, seed=1)  # a new optimizer on a's weights at a's schedule step
    with torch.no_grad():
        for n, p in b.model.named_parameters():
            p.copy_(dict(a.model.named_parameters())[n])
    b.step = 3
    kept = _trainer(cfg)
    kept.train_steps(_batches(), 3)  # the same first three steps, state kept
    for t in (a, b, kept):
        t.train_steps(_batches(5), 2)
    pa, pb, pk = _params(a), _params(b), _params(kept)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert any(not torch.equal(pa[n], pk[n]) for n in pa)


# -- log_every --------------------------------------------------------------------------------------------------------
def test_log_every_changes_neither_stats_nor_weights_and_reports_read_back_losses():
    pin_threads()
    runs = {}
    for every in (1, 3):
        tr = _trainer(_cfg({"log_every": every}))
        seen: list = []
        stats = [tr.train_steps(_batches(), 7, lambda i, loss: seen.append(loss)) for _ in range(2)]
        runs[every] = (stats, _params(tr), seen)
    (s1, p1, seen1), (s3, p3, seen3) = runs[1], runs[3]
    for a, b in zip(s1, s3):
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}
    assert all(torch.equal(p1[n], p3[n]) for n in p1)
    assert all(isinstance(x, float) for x in seen1 + seen3)  # never a tensor: the heartbeat does not sync
    # every = 3: the loss of steps 0, 3, 6 of each call, held in between
    per_step = seen1
    want = [per_step[c * 7 + (i // 3) * 3] for c in range(2) for i in range(7)]
    assert seen3 == want
    assert s1[0]["last_loss"] == pytest.approx(per_step[6], abs=1e-6)


# -- outer lr schedule ------------------------------------------------------------------------------------------------
def test_outer_lr_schedule():
    constant = _cfg(outer={"lr": 0.7}).outer
    assert [outer_lr_at(r, constant) for r in range(3)] == [0.7, 0.7, 0.7]
    warm = _cfg(outer={"lr": 0.8, "lr_schedule": "warmup", "lr_warmup_rounds": 4}).outer
    assert [outer_lr_at(r, warm) for r in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    with pytest.raises(ValueError):
        outer_lr_at(-1, warm)


# -- config errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("inner,outer,message", [
    ({"weight_decay_mode": "1/T"}, {}, 'inner.weight_decay_mode = "1/T": must be one of fixed, inverse_steps'),
    ({"compile": "yes"}, {}, 'inner.compile = "yes": must be true, false or "auto"'),
    ({"compile": 1}, {}, 'inner.compile = 1: must be true, false or "auto"'),
    ({"loss_chunk": -5}, {}, "inner.loss_chunk = -5: must be a number of tokens >= 0"),
    ({"loss_chunk": "big"}, {}, 'inner.loss_chunk = "big": must be a number of tokens >= 0'),
    ({"log_every": 0}, {}, "inner.log_every = 0: must be >= 1"),
    ({"optimizer": "sgd"}, {}, 'inner.optimizer = "sgd": must be one of adamw, muon'),
    ({"muon_lr": 0}, {}, "inner.muon_lr = 0.0: must be > 0.0"),
    ({"muon_momentum": 1.5}, {}, "inner.muon_momentum = 1.5: must be <= 1.0"),
    ({"optimizer": "muon", "nproc_per_node": 2, "total_batch_size": 8, "parallel": "fsdp"}, {},
     'inner.optimizer = "muon": does not work with inner.parallel = "fsdp"'),
    ({"precision": "auto8"}, {}, 'inner.precision = "auto8": must be one of fp32, bf16-mixed, fp16-mixed or auto'),
    ({}, {"lr_schedule": "cosine"}, 'outer.lr_schedule = "cosine": must be one of constant, warmup'),
    ({}, {"lr_schedule": "warmup"}, 'outer.lr_warmup_rounds = 0: must be >= 1 with outer.lr_schedule = "warmup"'),
    ({}, {"lr_warmup_rounds": -1}, "outer.lr_warmup_rounds = -1: must be >= 0"),
])
def test_config_errors(inner, outer, message):
    with pytest.raises(ConfigError) as e:
        _cfg(inner, outer)
    assert message in str(e.value), str(e.value)


def test_auto_settles_on_a_cpu_device_and_explicit_values_stay():
    ic = _cfg().inner
    assert (ic.precision, ic.compile, ic.loss_chunk) == ("fp32", False, 0)
    ic = build_config({"inner": {"device": "auto"}}).inner
    assert (ic.precision, ic.compile, ic.loss_chunk) == ("auto", "auto", "auto")  # the trainer settles these
    ic = _cfg({"precision": "bf16", "compile": True, "loss_chunk": 256}).inner
    assert (ic.precision, ic.compile, ic.loss_chunk) == ("bf16-mixed", True, 256)
    ic = _cfg({"optimizer": "muon", "nproc_per_node": 2, "total_batch_size": 8, "parallel": "ddp"}).inner
    assert ic.optimizer == "muon"  # DDP holds whole matrices: Muon works there
