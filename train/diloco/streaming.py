"""Streaming DiLoCo's worker loop (Douillard et al. 2025; docs/streaming.md): the overlap policy of outer.fragments,
outer.fragment_delay (τ) and outer.fragment_mix (α), asked by train/diloco/worker.py as the others in overlap.py are.

A worker keeps its own model from round to round: round r (H / P inner steps) trains it, then publishes the delta of
fragment r mod P only (Δ = θ_r − local, on that fragment's pieces: train/exchange/fragments.py). The commit of round
r + 1 changes that fragment of θ and nothing else; the worker takes it in during its next segment, after τ inner
steps (0: before the first, waiting for the commit; τ > 0: it trains on meanwhile and waits at step τ only if the
commit is not there yet), as local ← α·local + (1 − α)·global on that fragment (torch.lerp; α = 0 replaces it).
With P = 1, τ = 0 and α = 0 this is DiLoCo (the run then uses the Synchronous policy itself).

Its own model is part of the state snapshot (`local::` tensors), so a restart resumes it, replays the rounds the
snapshot missed, and goes on bit for bit. A worker without it (a first round, a restart before its first snapshot,
a snapshot on another host, rounds that went on without it) starts from the whole θ_r.
"""
from __future__ import annotations

import logging
import time

import torch

from train.core.store import wait_for
from train.diloco.overlap import Segment, Synchronous

log = logging.getLogger("worker")
LOCAL = "local::"


def await_commit(w, r: int) -> None:
    """Until round r is committed (the worker's lease says it waits for the outer step of round r − 1)."""
    if not w.paths.is_committed(r):
        w.hb.beat(force=True, status="waiting for the outer step", round=r - 1)
        wait_for(lambda: w.monitor() or w.paths.is_committed(r), None, w.poll)


class Mix(Segment):
    """Segment r of a worker that kept its model: the fragment round r − 1 synced comes in from θ_r at step `at`
    (τ; a replay mixes at the same step). `base` is θ_r once it came in: the delta is taken against it."""

    def __init__(self, policy: "Streaming", w, r: int, H: int, load_s: float):
        super().__init__(None, load_s)
        self.policy, self.w, self.r, self.H, self.at = policy, w, r, H, policy.tau
        self.step: int | None = None
        self.wait = 0.0  # how long the mix waited for the commit (not training time)

    def before_step(self, i: int) -> None:
        if self.step is None and i == self.at:
            self.mix(i)

    def mix(self, i: int) -> None:
        w, r = self.w, self.r
        t = time.perf_counter()
        await_commit(w, r)
        theta = w.load_global(r, into_model=False)
        fr, alpha, params = w.theta.frags, self.policy.alpha, w.trainer.params
        with torch.no_grad():
            for n in fr.pieces(r - 1):
                p = fr.get(params, n)
                g = fr.get(theta, n).to(p.device)
                p.copy_(g if alpha == 0 else torch.lerp(g, p, alpha))
        self.base, self.step, self.wait = theta, i, time.perf_counter() - t
        if self.wait > 0.5 and self.at > 0:
            log.info("round %d: waited %.2f s for round %d's commit after %d overlapped steps", r, self.wait, r - 1,
                     self.at)

    def end(self, stats: dict) -> dict:
        if self.step is None:  # (τ < H / P: only a segment shorter than its schedule gets here)
            self.mix(self.H)
        elif self.at > 0:
            stats["seconds"] -= self.wait  # waited between two steps, inside train_steps' clock
        self.load_s += self.wait
        return {"fold_step": self.step}


class Streaming(Synchronous):
    """outer.fragments > 1, outer.fragment_delay > 0 or outer.fragment_mix > 0 (see the module doc)."""
    restores = True

    def __init__(self, oc):
        super().__init__(oc)
        self.tau, self.alpha = int(oc.fragment_delay), float(oc.fragment_mix)
        # τ > 0: segment r + 1 trains while round r is open (the coordinator keeps its data slice free)
        self.rounds_ahead = 1 if self.tau > 0 else 0
        self.trains_ahead = self.tau > 0
        self.ended: int | None = None  # the round whose segment our model ended (None: start from θ)
        self.saved: dict[str, torch.Tensor] | None = None  # our model from the snapshot, into the next segment
        self._params: dict | None = None

    def _ended(self, w) -> int | None:
        if self.saved is not None:
            return int(w.state.get("opt_round", -1))
        return self.ended

    def next_segment(self, w, latest: int) -> int | None:
        k = max(w.state["round_done"], w.trained) + 1
        if k >= self.oc.rounds:
            return None
        if latest > k:
            log.warning("rounds up to %d were committed without our segment %d: rejoining at round %d from the "
                        "global model (our own model's progress since round %d is dropped)", latest - 1, k, latest,
                        k - 1)
            self.ended, self.saved = None, None
            return latest
        need = k - 1 if self.tau > 0 and self._ended(w) == k - 1 else k
        return k if latest >= need else None

    def begin(self, w, r: int, H: int, replay: bool) -> Segment:
        t0 = time.perf_counter()
        self._params = w.trainer.params
        if not self.trains_ahead and w.dist.main:
            w.join_snapshot()  # the moments of the last round are on disk before they change
        if r > 0 and self._ended(w) == r - 1:
            if self.saved is not None:  # a restart: our model as the snapshot of round r − 1 left it
                with torch.no_grad():
                    for n, t in self.saved.items():
                        self._params[n].copy_(t.to(self._params[n].device))
                self.saved = None
                log.info("round %d: our own model restored from the state snapshot of round %d", r, r - 1)
            return Mix(self, w, r, H, time.perf_counter() - t0)
        if self.saved is not None or (self.ended is not None and r > 0):
            log.info("round %d: starting from the whole global model (our own model is of round %s)", r,
                     self._ended(w))
        self.saved = None
        await_commit(w, r)
        return Segment(w.load_global(r), time.perf_counter() - t0)

    def hand_off(self, w, r: int, base: dict, params: dict, opt_tensors: dict | None, meta: dict, data: dict,
                 replay: bool) -> None:
        w.deliver(r, base, params, opt_tensors, meta, data, replay)  # fragment r mod P's delta (worker.deliver)
        self.ended = r

    # -- the state snapshot: our own model ----------------------------------------------------------------------------
    def snapshot_due(self, r: int) -> bool:
        """Once a cycle (the round that syncs fragment P − 1), after round 0 and after the last round: a snapshot
        is the moments and our own model (3 x the model's bytes), so one per round would write P times DiLoCo's
        snapshot bytes per H steps to the shared disk; a restart replays at most P − 1 rounds (< H steps) instead."""
        P = max(1, self.oc.fragments)
        return r == 0 or r % P == P - 1 or r >= self.oc.rounds - 1

    def for_background(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.trains_ahead:
            return tensors
        return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}

    def saved_progress(self) -> dict[str, torch.Tensor]:
        if self._params is None:
            return {}
        return {LOCAL + n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self._params.items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        local = {k[len(LOCAL):]: v for k, v in saved.items() if k.startswith(LOCAL)}
        self.saved = local or None
