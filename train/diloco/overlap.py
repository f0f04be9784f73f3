"""outer.overlap as a policy object the coordinator and the worker ask (docs/overlap.md).

    Synchronous  "none"     segment r starts from θ_r once it is committed; Δ_r is written on the training thread,
                            then the worker waits for the outer step
    Delayed      "delayed"  segment r starts from θ_{r−1} + p_{r−1} as soon as Δ_{r−1} is handed to the publisher
                            thread, folds θ_r in during the segment (outer.overlap_steps) and reads it ahead
    Eager        "eager"    the same from θ_{r−1} + γ p_{r−1}, γ = η (1 + μ) / M (Kale et al. 2025's eager update)

The coordinator asks one thing, `rounds_ahead`: how many rounds past the latest commit a worker may be training
(the data layout's free round, joins, the H schedule, pruning). The worker asks the rest, passing itself where the
answer needs its model, θ or files. Synchronous is the null object: its answers are the trivial ones, so the
worker's loop has no overlap branches (../shared/STYLE.md item 5).

One policy per process: the worker's also holds its overlap state (p_k, the publisher and prefetch threads).
"""
from __future__ import annotations

import logging
import time

import torch

from train.core.background import OneSlot
from train.exchange.outer import eager_gain
from train.core.store import wait_for
from train.exchange.protocol import write_delta

log = logging.getLogger("worker")  # the worker's log lines, as before the policy moved here


class Segment:
    """Segment r as the worker trains it: `base`, the model its delta is taken against (θ_r, or the stale start when
    it never folds θ_r in), and `load_s`, how long its start took."""
    before_step = None  # called before each inner step (train/core/inner.py train_steps): the fold, in Fold

    def __init__(self, base: dict[str, torch.Tensor], load_s: float):
        self.base, self.load_s = base, load_s

    def end(self, stats: dict) -> dict:
        """After the last step: the sidecar's fields this segment adds (train/exchange/protocol.py delta_sidecar)."""
        return {}


class Fold(Segment):
    """A segment that folds θ_r in at a step boundary: parameters ← θ_r + (parameters − base), keeping the progress
    made since its stale start (docs/overlap.md). When: at `at` (outer.overlap_steps = τ, or a replay: the step the
    published segment used), waiting for θ_r if needed; adaptive (`at` None): at the first step boundary after the
    prefetch thread has read θ_r, never waiting. The wait is not training time; `step` is recorded for replays."""

    def __init__(self, policy: Delayed, w, r: int, H: int, base: dict, load_s: float, at: int | None):
        super().__init__(base, load_s)
        self.policy, self.w, self.r, self.H, self.at = policy, w, r, H, at
        self.step: int | None = None  # where θ_r came in
        self.wait = 0.0  # how long the fold waited for θ_r

    def before_step(self, i: int) -> None:
        w, r = self.w, self.r
        if self.step is not None or (self.at is not None and i != self.at):
            return
        if self.at is None and i < self.H and self.policy.prefetched != r:
            return  # adaptive: θ_r is not read yet (the training thread looks at a flag, not at BASE_DIR)
        t = time.perf_counter()
        if self.policy.prefetched != r and not w.paths.is_committed(r):
            w.hb.beat(force=True, status="waiting for the outer step", round=r - 1)
            wait_for(lambda: w.monitor() or w.paths.is_committed(r), None, w.poll)
        params, names = w.trainer.params, w.theta.names
        q = {n: params[n].detach().to("cpu", torch.float32) - self.base[n] for n in names}
        theta = dict(w.load_global(r))  # into the model; our own dict: the next prefetch replaces its entries
        with torch.no_grad():
            for n in names:
                params[n].add_(q[n].to(params[n].device))
        self.base, self.step, self.wait = theta, i, time.perf_counter() - t
        log.info("round %d: folded θ_%d in after %d of %d steps (waited %.2f s for it)", r, r, i, self.H, self.wait)

    def end(self, stats: dict) -> dict:
        if self.step is None:  # θ_r came too late for every step boundary: fold it in at the end
            self.before_step(self.H)  # (after train_steps stopped its clock: its wait is not in "seconds")
        else:
            stats["seconds"] -= self.wait  # waited between two steps, inside train_steps' clock
        self.load_s += self.wait
        return {"fold_step": self.step}


class Synchronous:
    """outer.overlap = "none": a worker trains round r from θ_r and waits for θ_{r+1} after publishing."""
    rounds_ahead = 0  # rounds past the latest commit a worker may train (segment r + 1 while round r is open: 1)
    trains_ahead = False  # training goes on while the round's files are written (in-place tensors must be copied)
    restores = False  # its state snapshot holds tensors of its own (`saved_progress`), loaded by `restore`

    def __init__(self, oc):
        self.oc = oc
        self.progress: dict[str, torch.Tensor] | None = None  # p_k, our progress over the last segment (overlap)

    # -- the loop -------------------------------------------------------------------------------------------------
    def next_segment(self, w, latest: int) -> int | None:
        """The round the worker trains next, or None: publish what is pending and wait for the next commit."""
        return latest if w.state["round_done"] < latest else None

    def begin(self, w, r: int, H: int, replay: bool) -> Segment:
        """Set the model to segment r's start; the segment knows what its delta is taken against."""
        if w.dist.main:
            w.join_snapshot()  # the moments of the last round are on disk before they change
        t0 = time.perf_counter()
        base = w.load_global(r)
        return Segment(base, time.perf_counter() - t0)

    def hand_off(self, w, r: int, base: dict, params: dict, opt_tensors: dict | None, meta: dict, data: dict,
                 replay: bool) -> None:
        """Round r is trained: write, publish and snapshot it (train/diloco/worker.py deliver)."""
        w.deliver(r, base, params, opt_tensors, meta, data, replay)

    def flush(self) -> None:
        """Our last round is published (a failed publication raises here)."""

    def close(self) -> None:
        """The run is complete: nothing stays in flight."""

    def finish_prefetch(self, w, r: int) -> None:
        """Before the worker's copy of θ is used for round r: a read ahead of it is done (its error raised)."""

    # -- replays and the private state ----------------------------------------------------------------------------
    def snapshot_due(self, r: int) -> bool:
        """Whether round r's state snapshot is written (rounds after the last one are replayed on a restart)."""
        return True

    def fold_step(self, r: int) -> int | None:
        """After how many steps segment r folds θ_r in (0: as soon as it is read, adaptive); None: it does not."""
        return None

    def replay_bases(self, todo: list[int]) -> list[int]:
        """The committed rounds whose θ a replay of rounds `todo` needs."""
        return list(todo)

    def for_background(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors to be written in the background: copied when training goes on meanwhile."""
        return tensors

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Our progress from a state snapshot (its `progress::` tensors)."""
        prog = {k[len("progress::"):]: v for k, v in saved.items() if k.startswith("progress::")}
        self.progress = prog or None

    def saved_progress(self) -> dict[str, torch.Tensor]:
        """Our progress as `progress::` tensors of the state snapshot."""
        return {f"progress::{k}": v for k, v in (self.progress or {}).items()}


class Delayed(Synchronous):
    """outer.overlap = "delayed": x_{k+1} = θ_k + p_k, θ_{k+1} folded in during segment k + 1 (docs/overlap.md)."""
    rounds_ahead = 1
    trains_ahead = True
    restores = True

    def __init__(self, oc):
        super().__init__(oc)
        self.pub = OneSlot("publish")  # a round's whole publication, in the background
        self.prefetch = OneSlot("prefetch-theta")  # the next global model, read ahead
        self._prefetch_round: int | None = None
        self.prefetched: int | None = None  # the round the prefetch thread has brought θ to (no file check needed)

    def gain(self, w, r: int) -> float:
        """The weight of our progress in the start of the segment after round r's: 1 (delayed), γ (eager)."""
        return 1.0

    def fold_step(self, r: int) -> int | None:
        tau = self.oc.overlap_steps
        return tau if tau < self.oc.local_steps_at(r) else None

    def replay_bases(self, todo: list[int]) -> list[int]:
        bases = [k - 1 if k > 0 and self.progress is not None else k for k in todo]
        return bases + [k for k in todo if self.fold_step(k) is not None]  # ... and folded θ_k in during the segment

    def for_background(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}

    def next_segment(self, w, latest: int) -> int | None:
        """Segment k starts from θ_{k−1} + our progress over segment k−1, so it may start once θ_{k−1} is committed
        (one round ahead of the synchronous protocol). A worker whose rounds went on without it (restarted late)
        rejoins at the latest round from θ_latest; so does one that lost its progress (its snapshot was on another
        host)."""
        k = max(w.state["round_done"], w.trained) + 1
        if k >= self.oc.rounds:
            return None
        if latest > k or (self.progress is None and k > 0):
            if latest > k:
                log.warning("rounds up to %d were committed without our segment %d: rejoining at round %d from "
                            "the committed model", latest - 1, k, latest)
                self.progress = None
            return latest if latest >= k else None
        return k if latest >= k - 1 else None

    def begin(self, w, r: int, H: int, replay: bool) -> Segment:
        t0 = time.perf_counter()
        if r > 0 and self.progress is not None:
            # this segment starts from θ_{r−1} + our progress over segment r−1 at its weight (docs/overlap.md)
            theta = w.load_global(r - 1, into_model=False)  # the parameters are set to the start below
            gain = self.gain(w, r - 1)
            start = {n: theta[n].add(self.progress[n], alpha=gain) for n in w.theta.names}
            params = w.trainer.params
            with torch.no_grad():
                for n in w.theta.names:
                    params[n].copy_(start[n])
            tau = self.fold_step(r)
            if tau is None:
                seg = Segment(start, time.perf_counter() - t0)
            else:
                at = None  # adaptive; a replay folds where the published segment did
                if replay or tau > 0:
                    at = w.state.get("fold_steps", {}).get(str(r), H) if replay else tau
                seg = Fold(self, w, r, H, start, time.perf_counter() - t0, at)
        else:
            seg = Segment(w.load_global(r), time.perf_counter() - t0)
        if not replay:
            self.start_prefetch(w, r)  # θ_r, where the next segment starts, read while this one trains
        return seg

    def hand_off(self, w, r: int, base: dict, params: dict, opt_tensors: dict | None, meta: dict, data: dict,
                 replay: bool) -> None:
        """The next segment starts now. What it changes in place is copied to host memory here (the parameters, and
        the moments in snapshot_state); encoding, writing and publishing the delta and the snapshot run on the
        publisher thread, one round at a time (train/core/background.py). A replay publishes nothing: synchronous."""
        names = w.theta.names
        if replay:
            self.progress = {n: params[n].detach().to("cpu", torch.float32) - base[n] for n in names}
            w.deliver(r, base, params, opt_tensors, meta, data, replay)
            return
        host = {n: params[n].detach().to("cpu", torch.float32, copy=True) for n in names}
        self.progress = {n: host[n] - base[n] for n in names}
        write_snapshot = w.snapshot_state(r, opt_tensors, now=True)
        position = w.sampler.position
        extra = w.trainer.extra_state()
        w.trained = r
        t = time.perf_counter()
        self.pub.join()  # back-pressure: round r − 1 is published (and its snapshot written) before r is queued
        meta["handoff_seconds"] = time.perf_counter() - t
        if meta["handoff_seconds"] > 0.5:
            log.info("round %d: waited %.2f s for round %d's publication (BASE_DIR is slower than training)",
                     r, meta["handoff_seconds"], r - 1)

        def publish() -> None:  # on the publisher thread: the same files, in the same order, as deliver's
            pending = w.paths.worker_pending_delta(w.w, r)
            file = write_delta(pending, names, base, host, w.delta_codec, r, w.w, w.residual)
            w.finish_round(r, file, meta, data, position, extra)
            write_snapshot()
        self.pub.submit(publish)

    def flush(self) -> None:
        self.pub.join()

    def close(self) -> None:
        self.pub.join()
        self.prefetch.cancel()

    # -- the next global model, read ahead --------------------------------------------------------------------------
    def start_prefetch(self, w, r: int) -> None:
        """Bring the worker's copy of θ to round r as soon as it is committed, on the prefetch thread."""
        self.prefetch.cancel()
        stop = self.prefetch.stop

        def job() -> None:
            while not w.paths.is_committed(r):
                if stop.wait(w.poll):
                    return
            w.theta.advance_to(r)
            self.prefetched = r

        self._prefetch_round, self.prefetched = r, None
        self.prefetch.submit(job)

    def finish_prefetch(self, w, r: int) -> None:
        if self._prefetch_round == r and (self.prefetched == r or w.paths.is_committed(r)):
            self.prefetch.join()
        else:
            self.prefetch.cancel()
        self._prefetch_round = None


class Eager(Delayed):
    """outer.overlap = "eager": x_{k+1} = θ_k + γ p_k, our progress at the weight the outer step gives it."""

    def gain(self, w, r: int) -> float:
        """γ of round r's outer step (train/exchange/outer.py eager_gain), with the workers the layout gives round r."""
        lay = w.layout()
        M = lay.slots(r) if lay is not None else self.oc.num_workers
        if self.oc.compression == "topk":  # θ − η · mean, no outer momentum (train/exchange/sparse.py): γ = η / M
            from train.exchange.outer import outer_lr_at
            return outer_lr_at(r, self.oc) / max(1, M)
        return eager_gain(r, self.oc, M)


POLICIES = {"none": Synchronous, "delayed": Delayed, "eager": Eager}
