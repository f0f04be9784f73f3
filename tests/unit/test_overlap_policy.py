"""What each outer.overlap policy answers (train/diloco/overlap.py, docs/overlap.md), against a stand-in worker."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from train.config import OuterConfig
from train.exchange.outer import eager_gain
from train.diloco.overlap import Delayed, Eager, Fold, Segment, Synchronous
from train.diloco.policy import for_config

NAMES = ["a", "b"]


def _oc(overlap: str = "delayed", **kw) -> OuterConfig:
    return OuterConfig(overlap=overlap, **{"local_steps": 8, "rounds": 10, **kw})


def _theta(r: int) -> dict[str, torch.Tensor]:
    """A stand-in θ_r: distinct for every round."""
    return {"a": torch.full((3,), float(r)), "b": torch.full((2, 2), 10.0 * r)}


class FakeWorker(SimpleNamespace):
    """What the policy uses of train/diloco/worker.py's Worker: θ, the model's parameters, state, files."""

    def __init__(self, tmp_path=None, round_done: int = -1, trained: int = -1, committed: int = 100, slots=None):
        params = {n: t.clone() for n, t in _theta(0).items()}
        super().__init__(
            state={"round_done": round_done}, trained=trained, poll=0.01, w=0, calls=[],
            dist=SimpleNamespace(main=True), trainer=SimpleNamespace(params=params, extra_state=lambda: {"step": 7}),
            theta=SimpleNamespace(names=NAMES, advance_to=lambda r: None),
            paths=SimpleNamespace(is_committed=lambda r: r <= committed,
                                  worker_pending_delta=lambda w, r: tmp_path / f"delta-{r}.safetensors"),
            hb=SimpleNamespace(beat=lambda **kw: None), monitor=lambda: None,
            sampler=SimpleNamespace(position=123), delta_codec="float32", residual=None,
            layout=lambda: None if slots is None else SimpleNamespace(slots=lambda r: slots))

    def load_global(self, r: int, into_model: bool = True) -> dict:
        self.calls.append(("load_global", r, into_model))
        theta = _theta(r)
        if into_model:
            with torch.no_grad():
                for n in NAMES:
                    self.trainer.params[n].copy_(theta[n])
        return theta

    def join_snapshot(self) -> None:
        self.calls.append(("join_snapshot",))

    def deliver(self, *args) -> None:
        self.calls.append(("deliver", *args))

    def snapshot_state(self, r, opt_tensors, now=False):
        self.calls.append(("snapshot_state", r, now))
        return lambda: self.calls.append(("snapshot written", r))

    def finish_round(self, r, file, meta, data, position, extra) -> None:
        self.calls.append(("finish_round", r, file["sha256"], meta, data, position, extra))


# -- what the coordinator asks -----------------------------------------------------------------------------------------
def test_for_config_gives_each_setting_its_policy_and_how_far_workers_train_ahead():
    none, delayed, eager = (for_config(_oc(o)) for o in ("none", "delayed", "eager"))
    assert type(none) is Synchronous and type(delayed) is Delayed and type(eager) is Eager
    assert (none.rounds_ahead, delayed.rounds_ahead, eager.rounds_ahead) == (0, 1, 1)
    assert (none.trains_ahead, delayed.trains_ahead, eager.trains_ahead) == (False, True, True)


# -- what the worker asks ----------------------------------------------------------------------------------------------
def test_fold_step_adaptive_after_tau_or_never():
    assert Synchronous(_oc("none", overlap_steps=3)).fold_step(5) is None
    assert Delayed(_oc(overlap_steps=0)).fold_step(5) == 0  # adaptive
    assert Delayed(_oc(overlap_steps=3)).fold_step(5) == 3
    assert Delayed(_oc(overlap_steps=8)).fold_step(5) is None  # τ >= H: one round late, no fold
    sched = Eager(_oc("eager", overlap_steps=6, local_steps=4, local_steps_schedule=[[4, 10]]))
    assert sched.fold_step(3) is None and sched.fold_step(4) == 6  # against each round's H


def test_synchronous_trains_the_latest_round_once():
    sync = Synchronous(_oc("none"))
    assert sync.next_segment(FakeWorker(round_done=2), 3) == 3
    assert sync.next_segment(FakeWorker(round_done=3), 3) is None  # wait for the outer step


def test_delayed_trains_one_segment_ahead_and_rejoins_when_it_cannot():
    pol = Delayed(_oc(rounds=6))
    pol.progress = _theta(1)
    assert pol.next_segment(FakeWorker(round_done=-1), 0) == 0
    assert pol.next_segment(FakeWorker(round_done=2, trained=3), 3) == 4  # θ_3 committed: segment 4 may start
    assert pol.next_segment(FakeWorker(round_done=2, trained=3), 2) is None  # needs θ_3
    assert pol.next_segment(FakeWorker(round_done=5, trained=5), 6) is None  # the run is complete
    assert pol.next_segment(FakeWorker(round_done=1, trained=1), 4) == 4 and pol.progress is None  # went on without us
    assert pol.next_segment(FakeWorker(round_done=2), 2) is None  # no progress: wait for θ_3 ...
    assert pol.next_segment(FakeWorker(round_done=2), 3) == 3  # ... and start from it


def test_replay_needs_the_start_and_the_folded_rounds():
    assert Synchronous(_oc("none")).replay_bases([3, 4]) == [3, 4]
    pol = Delayed(_oc(overlap_steps=3))
    assert pol.replay_bases([0, 1]) == [0, 1, 0, 1]  # no progress: from θ_k, folding θ_k in (a no-op)
    pol.progress = _theta(1)
    assert pol.replay_bases([0, 1, 2]) == [0, 0, 1, 0, 1, 2]
    assert Delayed(_oc(overlap_steps=8)).replay_bases([2]) == [2]


def test_gain_is_one_delayed_and_the_outer_steps_weight_eager():
    oc = _oc("eager", lr=0.7, momentum=0.9, num_workers=3)
    assert Delayed(oc).gain(FakeWorker(), 4) == 1.0
    assert Eager(oc).gain(FakeWorker(slots=4), 4) == eager_gain(4, oc, 4)
    assert Eager(oc).gain(FakeWorker(), 4) == eager_gain(4, oc, 3)  # no layout yet: outer.num_workers


def test_progress_round_trips_through_the_snapshot_and_background_tensors_are_copies():
    pol = Delayed(_oc())
    assert pol.saved_progress() == {}
    pol.progress = _theta(2)
    saved = {"a::exp_avg": torch.zeros(3), **pol.saved_progress()}
    other = Delayed(_oc())
    other.restore(saved)
    assert set(other.progress) == set(NAMES) and all(torch.equal(other.progress[n], _theta(2)[n]) for n in NAMES)
    t = {"m": torch.ones(2)}
    assert Synchronous(_oc("none")).for_background(t) is t
    copied = pol.for_background(t)
    t["m"].add_(1.0)
    assert torch.equal(copied["m"], torch.ones(2))


def test_synchronous_segment_starts_from_theta_r_and_hands_off_on_the_training_thread():
    w = FakeWorker()
    seg = Synchronous(_oc("none")).begin(w, 3, 8, replay=False)
    assert w.calls == [("join_snapshot",), ("load_global", 3, True)]
    assert seg.before_step is None and seg.end({"seconds": 1.0}) == {}
    assert all(torch.equal(seg.base[n], _theta(3)[n]) for n in NAMES)
    Synchronous(_oc("none")).hand_off(w, 3, seg.base, {}, None, {"m": 1}, {"d": 1}, False)
    assert w.calls[-1] == ("deliver", 3, seg.base, {}, None, {"m": 1}, {"d": 1}, False)


@pytest.mark.parametrize("policy", [Delayed, Eager])
def test_overlapped_segment_starts_from_the_stale_base_plus_progress_then_folds(policy):
    """x_r = θ_{r−1} + γ p_{r−1}; after τ steps x ← θ_r + (x − x_r), and Δ_r is taken against θ_r."""
    oc = _oc(overlap_steps=3, lr=0.7, momentum=0.9)
    w = FakeWorker(slots=2)
    pol = policy(oc)
    pol.progress = {"a": torch.full((3,), 0.5), "b": torch.full((2, 2), -1.0)}
    gain = pol.gain(w, 3)
    seg = pol.begin(w, 4, 8, replay=True)  # a replay: no prefetch thread; folds where the published one did (H)
    assert isinstance(seg, Fold) and seg.at == 8
    start = {n: _theta(3)[n] + gain * pol.progress[n] for n in NAMES}
    assert all(torch.allclose(w.trainer.params[n], start[n]) for n in NAMES)
    assert ("load_global", 3, False) in w.calls
    seg = pol.begin(w, 4, 8, replay=False)
    assert seg.at == 3
    for n in NAMES:  # two steps' worth of training
        w.trainer.params[n].add_(0.25)
    seg.before_step(2)
    assert seg.step is None
    seg.before_step(3)
    assert seg.step == 3 and all(torch.equal(seg.base[n], _theta(4)[n]) for n in NAMES)
    assert all(torch.allclose(w.trainer.params[n], _theta(4)[n] + 0.25) for n in NAMES)
    stats = {"seconds": 1.0}
    assert seg.end(stats) == {"fold_step": 3} and stats["seconds"] == 1.0 - seg.wait
    pol.close()


def test_overlapped_segment_without_progress_or_fold_is_a_plain_segment():
    w = FakeWorker()
    pol = Delayed(_oc(overlap_steps=8))
    seg = pol.begin(w, 2, 8, replay=True)  # no progress: from θ_2
    assert type(seg) is Segment and all(torch.equal(seg.base[n], _theta(2)[n]) for n in NAMES)
    pol.progress = _theta(1)
    seg = pol.begin(w, 2, 8, replay=True)  # τ >= H: Δ against the stale start
    assert type(seg) is Segment and torch.equal(seg.base["a"], _theta(1)["a"] + _theta(1)["a"])


def test_delayed_hand_off_publishes_on_the_publisher_thread(tmp_path):
    w = FakeWorker(tmp_path)
    pol = Delayed(_oc())
    base = _theta(1)
    params = {n: t + 1.0 for n, t in base.items()}
    meta = {"inner_steps": 8}
    pol.hand_off(w, 1, base, params, None, meta, {"offset": 0}, replay=False)
    pol.flush()
    assert w.trained == 1 and "handoff_seconds" in meta
    assert all(torch.equal(pol.progress[n], torch.ones_like(base[n])) for n in NAMES)
    assert [c[0] for c in w.calls] == ["snapshot_state", "finish_round", "snapshot written"]
    assert w.calls[1][4:] == ({"offset": 0}, 123, {"step": 7}) and (tmp_path / "delta-1.safetensors").is_file()
    pol.hand_off(w, 2, base, params, None, meta, {}, replay=True)  # a replay: on the training thread
    assert w.calls[-1][0] == "deliver"
