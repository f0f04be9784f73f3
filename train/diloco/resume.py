"""The DiLoCo worker's private resume state (docs/compression.md: where it lives, what a restart resumes with).

A mixin of train/diloco/worker.py's Worker: its inner optimizer moments, error-feedback residual and overlap progress
are snapshot after every round (in the background; state.json points at the newest), loaded on a restart, and the
rounds published after the last snapshot are replayed from it, so a restart goes on as an uninterrupted run would.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from train.core import sharedfs
from train.core.dist import broadcast_full, broadcast_json
from train.core.store import atomic_write_json
from train.core.tensorio import iter_tensors, save_streaming

log = logging.getLogger("worker")  # the worker's log


class ResumeState:
    """Needs the Worker's cfg, paths, w, dist, device, trainer, sampler, state, residual, theta, overlap, snap (a
    OneSlot), fresh_moments, count_io and train_round."""

    @property
    def state_dir(self) -> Path:
        """Where the inner optimizer moments and the residual go: BASE_DIR's worker directory, or outer.state_dir."""
        sd = self.cfg.outer.state_dir
        if not sd:
            return self.paths.worker_dir(self.w)
        return Path(os.path.expanduser(sd.format(worker=self.w))) / self.cfg.project_name / f"w{self.w:03d}"

    def restore_state(self) -> None:
        """Load the newest snapshot of our private state (rounds after it are replayed by `replay`, or skipped when
        they cannot be, see there). The data needs no state: a round's slice is fixed by the layout."""
        st = self.state
        st.setdefault("opt_round", st["round_done"])
        if "opt_file" not in st:
            st["opt_round"] = st["round_done"]
            if st["round_done"] >= 0:  # killed before its first snapshot was written
                log.info("resumed worker state: last round done %d, no optimizer snapshot yet (fresh AdamW moments), "
                         "inner step %d", st["round_done"], self.trainer.step)
            return
        f = self.state_dir / st["opt_file"]
        present = broadcast_json(sharedfs.is_file(f) if self.dist.main else None, self.dist, self.device)
        if not present:
            log.warning("the inner optimizer state of round %d (%s) is not on this host (outer.state_dir is host-"
                        "local?): resuming with fresh AdamW moments%s after round %d (no token is trained twice)",
                        st["opt_round"], f, " and no error-feedback residual" if self.residual else "",
                        st["round_done"])
            self.trainer.step = int(st.get("step", 0))
            st["opt_round"] = st["round_done"]
            return
        self.load_optimizer(f, st.get("opt_extra", st))
        self.fresh_moments = False
        if self.dist.main and (self.residual is not None or self.overlap.restores):
            saved = dict(iter_tensors(f))
            if self.residual is not None:
                self.residual.load(saved)
            # our progress p_k (overlap: the next segment starts from θ_k + p_k), or our own model (streaming)
            self.overlap.restore(saved)
        log.info("resumed worker state: last round done %d, optimizer state of round %d, inner step %d",
                 st["round_done"], st["opt_round"], self.trainer.step)

    def replay(self) -> None:
        """Rounds we published after our last state snapshot (a kill while it was being written): retrain them from
        the snapshot without publishing, so the moments and residual are those of an uninterrupted
        run; the re-computed delta must equal the published one (checked by sha256)."""
        st = self.state
        todo = list(range(st["opt_round"] + 1, st["round_done"] + 1))
        if not todo:
            return
        bases = self.overlap.replay_bases(todo)  # the rounds of θ the segments started from and folded in
        ok = broadcast_json(all(self.theta.buildable(b) for b in bases) if self.dist.main else None,
                            self.dist, self.device)
        if not ok:
            log.warning("rounds %s were trained but their state snapshot was lost and their global models are gone: "
                        "going on from the older optimizer state", todo)
            self.trainer.step = int(st.get("step", self.trainer.step))
            return
        for k in todo:
            log.info("replaying round %d (its state snapshot was not written before the restart)", k)
            self.train_round(k, replay=True)

    def snapshot_state(self, r: int, opt_tensors: dict | None, now: bool = False):
        """Write the optimizer moments (+ residual, + progress) of round r to state_dir in the background, then point
        state.json at them. The next round joins it before training (the tensors must not change while being
        written). The tensors are taken here; `now`: return the write as a function instead (the caller runs it on
        its own background thread, after the write_delta that updates the residual)."""
        paths, w = self.paths, self.w
        self.join_snapshot()
        if opt_tensors is None:
            opt_tensors = self.trainer.optimizer_tensors()
        tensors = self.overlap.for_background(dict(opt_tensors))  # (copied if the next steps change them meanwhile)
        tensors.update(self.overlap.saved_progress())
        extra = self.trainer.extra_state()
        position = self.sampler.position
        opt_file = f"opt-r{r:06d}.safetensors"
        on_base = not self.cfg.outer.state_dir

        def write() -> None:
            if self.residual is not None:  # only write_delta changes it, and never while this runs
                tensors.update(self.residual.tensors())
            save_streaming(self.state_dir / opt_file, tensors)
            self.state.update(opt_file=opt_file, opt_round=r, opt_position=position, opt_extra=extra)
            atomic_write_json(paths.worker_state(w), self.state)
            for name in sharedfs.names(self.state_dir):
                if name.startswith("opt-r") and name.endswith(".safetensors") and name != opt_file:
                    sharedfs.unlink(self.state_dir / name)
            if on_base:
                self.count_io("written", sharedfs.stat(self.state_dir / opt_file).st_size)

        if now:
            return write
        self.snap.submit(write)
        return None

    def join_snapshot(self) -> None:
        self.snap.join()

    def load_optimizer(self, opt_file: Path, extra: dict) -> None:
        """Rank 0 reads the saved AdamW state; in a group every rank gets it by broadcast."""
        if not self.dist.enabled:
            self.trainer.load_state(opt_file, extra)
            return
        tensors = {k: t for k, t in iter_tensors(opt_file) if not k.startswith("residual::")} \
            if self.dist.main else {}
        specs = broadcast_json({k: list(t.shape) for k, t in tensors.items()}, self.dist, self.device)
        full = {k: broadcast_full(tensors.get(k), shape, torch.float32, self.dist, self.device)
                for k, shape in specs.items()}
        self.trainer.set_optimizer_tensors(full, extra)
