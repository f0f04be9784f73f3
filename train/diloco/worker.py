"""The DiLoCo worker process: train from the committed global model, publish the pseudo-gradient, repeat.

    python -m train.diloco.worker --config evolution.json --worker 0 [--set inner.lr=1e-3 ...]

Round r, worker w (docs/protocol.md):
  1. wait until θ_r is committed; load it (and our inner optimizer state on a restart)
  2. H inner AdamW steps on our slice of round r's data (train/exchange/layout.py: disjoint per round and worker)
  3. write Δ = θ_r − θ_w to workers/wXXX/delta-r.safetensors (private, atomic)
  4. save state.json {round_done: r, step, sidecar} (+ optimizer state in the background)   <- our resume point
  5. publish: move the delta into rounds/r/deltas/ and write its JSON sidecar (the sidecar marks it complete)
A crash before 4 redoes round r on the same data (a round's slice is fixed by the layout); a crash between 4 and 5
publishes the saved delta on restart (or drops it when the run has moved on). Nothing is trained twice.

A worker may be a torchrun group (`python -m torch.distributed.run --nproc_per_node N -m train.diloco.worker ...`, see
train/core/dist.py): rank 0 does every step above that touches BASE_DIR and tells the other ranks, by broadcast, which
round to train; θ_r and the resumed optimizer state reach them by broadcast too; each rank trains on its slice of
every step's batch, and the group's gradients are averaged, so the worker publishes what one process would.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from pathlib import Path

import torch

from train.core import sharedfs
from train.core.config import ConfigError, RunConfig
from train.core.data import StreamSampler, TokenData, find_data
from train.core.dist import (
    DistInfo,
    RankBatches,
    broadcast_full,
    broadcast_json,
    close_group,
    full_tensor,
    init_group,
    load_full,
)
from train.core.inner import InnerTrainer

from train.core.background import OneSlot
from train.core.heartbeat import CoordinatorWatch, Heartbeat
from train.exchange.codec import Residual
from train.exchange.layout import Layout
from train.exchange.master import exchange_codecs
from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
from train.exchange.theta import GlobalTheta
from train.core.store import (
    PROTOCOL_VERSION,
    ProtocolError,
    RunPaths,
    atomic_write_json,
    exclusive_lock,
    prepare_run_dir,
    read_json,
    wait_for,
)
from train.core.tensorio import iter_tensors, save_streaming

log = logging.getLogger("worker")

def build_worker_model(paths: RunPaths, model_config: dict | None = None):
    """An empty model of the run's architecture (from θ_0's config, or that config.json's contents as rank 0 read
    them); weights come from the global model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_config is None:
        mcfg = AutoConfig.from_pretrained(str(paths.global_dir(0)))
    else:
        mcfg = AutoConfig.for_model(**model_config)
    return AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)

class Worker:
    def __init__(self, cfg: RunConfig, worker_id: int):
        if not 0 <= worker_id < 1000:
            raise ConfigError(f"--worker {worker_id}: must be in 0..999 (0..outer.num_workers-1 for the run's "
                              f"workers; the next id to join a running run, docs/elastic.md)")
        self.cfg, self.w = cfg, worker_id
        self.dist = DistInfo()  # set by setup(): rank 0 of 1 unless started by torchrun
        self.paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        self.poll = cfg.outer.poll_interval_s
        self.hb = Heartbeat(self.paths.progress(worker_id), worker_id)
        # called while waiting: says when the coordinator dies or comes back (train/core/heartbeat.py); may raise
        self.monitor = CoordinatorWatch.of(cfg, "diloco")  # (train_fsdp.py: its coordinator child died)

    # -- setup ----------------------------------------------------------------------------------------------------
    def wait_for_run(self) -> None:
        log.info("waiting for the coordinator to initialise %s", self.paths.root)
        self.hb.beat(force=True, status="waiting for round 0")
        wait_for(lambda: self.monitor() or self.paths.is_committed(0), None, self.poll)
        run = read_json(self.paths.run_json)
        if run.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"{self.paths.run_json}: protocol {run.get('protocol')}, this worker speaks "
                                f"{PROTOCOL_VERSION}")

    def lock(self) -> None:
        """One live process per worker id: an exclusive lock on workers/wXXX/lock, held until the process exits."""
        self._lock_f = exclusive_lock(self.paths.worker_dir(self.w) / "lock", f"worker {self.w}",
                                     lease=self.paths.progress(self.w))

    def setup(self) -> None:
        cfg = self.cfg
        self.dist, self.device = init_group(cfg)
        main = self.dist.main
        if main:
            self.lock()
        if cfg.inner.threads:
            torch.set_num_threads(cfg.inner.threads)
        torch.manual_seed(cfg.seed * 1000 + self.w)
        if main:
            self.wait_for_run()
        # What the other ranks need from BASE_DIR, read by rank 0: the model config, the data cache, our state.
        start = None
        if main:
            state = read_json(self.paths.worker_state(self.w)) if self.paths.worker_state(self.w).is_file() else \
                {"round_done": -1, "position": 0, "step": 0}
            start = {"data": str(find_data(cfg)), "state": state,
                     "model_config": read_json(self.paths.global_dir(0) / "config.json")}
        start = broadcast_json(start, self.dist, self.device)
        model = build_worker_model(self.paths, start["model_config"] if self.dist.enabled else None)
        self.trainer = InnerTrainer(cfg, model, self.device, self.dist)
        self.data = TokenData.open(Path(start["data"]), cfg.data.seq_length, cfg.data.eval_fraction)
        self.state = start["state"]
        self.delta_codec, self.back_codec = exchange_codecs(cfg.outer)
        self.residual = Residual(self.delta_codec) if self.back_codec is not None else None
        self.theta = GlobalTheta(self.paths, self.back_codec) if main else None
        self.overlap = cfg.outer.overlap != "none"  # delayed or eager: the next segment starts before the commit
        self.eager = cfg.outer.overlap == "eager"
        self.progress: dict[str, torch.Tensor] | None = None  # overlap: our progress over the last segment
        self.snap = OneSlot("state-snapshot")    # the state snapshot, written in the background
        self.pub = OneSlot("publish")            # delayed overlap: a round's whole publication, in the background
        self.prefetch = OneSlot("prefetch-theta")  # delayed overlap: the next global model, read ahead
        self._prefetch_round: int | None = None
        self._prefetched: int | None = None  # the round the prefetch thread has brought θ to (no file check needed)
        self.trained = -1  # the last round this process trained (its publication may still be in flight)
        self._latest: int | None = None  # the last committed round seen (later lookups start from it)
        self._layout_cache: tuple | None = None  # ((inode, mtime, size) of layout.json, its Layout)
        self.io = {"read": 0, "written": 0}  # BASE_DIR bytes of the current round (into the next sidecar)
        self._io_lock = threading.Lock()
        self.restore_state()
        self.sampler = StreamSampler(self.data, cfg.seed)
        self.batches = RankBatches(self.sampler, self.dist, cfg.inner.total_batch_size) if self.dist.enabled \
            else self.sampler
        log.info("worker %d on %s: %d training windows of %d tokens, device %s%s", self.w, socket.gethostname(),
                 self.data.n_train_windows, cfg.data.seq_length, self.device,
                 f", {self.dist.world} processes ({cfg.inner.parallel})" if self.dist.enabled else "")
        self.replay()

    # -- private resume state (docs/compression.md: where it lives, what a restart resumes with) --------------------
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
            return
        f = self.state_dir / st["opt_file"]
        present = broadcast_json(f.is_file() if self.dist.main else None, self.dist, self.device)
        if not present:
            log.warning("the inner optimizer state of round %d (%s) is not on this host (outer.state_dir is host-"
                        "local?): resuming with fresh AdamW moments%s after round %d (no token is trained twice)",
                        st["opt_round"], f, " and no error-feedback residual" if self.residual else "",
                        st["round_done"])
            self.trainer.step = int(st.get("step", 0))
            st["opt_round"] = st["round_done"]
            return
        self.load_optimizer(f, st.get("opt_extra", st))
        if self.dist.main and (self.residual is not None or self.overlap):
            saved = dict(iter_tensors(f))
            if self.residual is not None:
                self.residual.load(saved)
            prog = {k[len("progress::"):]: v for k, v in saved.items() if k.startswith("progress::")}
            self.progress = prog or None
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
        bases = [k - 1 if self.overlap and k > 0 and self.progress is not None else k for k in todo]
        bases += [k for k in todo if self.fold_step(k) is not None]  # ... and folded θ_k in during the segment
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
        tensors = dict(opt_tensors)
        if self.overlap:  # training goes on while this is written: copy what the next steps change in place
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        if self.progress is not None:
            tensors.update({f"progress::{k}": v for k, v in self.progress.items()})
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
            for old in self.state_dir.glob("opt-r*.safetensors"):
                if old.name != opt_file:
                    sharedfs.unlink(old)
            if on_base:
                self.count_io("written", sharedfs.stat(self.state_dir / opt_file).st_size)

        if now:
            return write
        self.snap.submit(write)
        return None

    def join_snapshot(self) -> None:
        self.snap.join()

    def count_io(self, kind: str, nbytes: int) -> None:
        with self._io_lock:
            self.io[kind] += nbytes

    def take_io(self) -> dict:
        with self._io_lock:
            io, self.io = self.io, {"read": 0, "written": 0}
        return io

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

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        if self.dist.main:
            self.lead()
        else:
            while (r := broadcast_json(None, self.dist, self.device)) is not None:
                self.train_round(r)  # rank 0 said: train round r (None: the run is complete)
        # Only on success: after an error this rank just exits and torchrun stops the rest of the group. The model
        # and optimizer go first: FSDP2 keeps collective work objects that must not outlive the process group.
        self.trainer = None
        gc.collect()
        close_group()

    def lead(self) -> None:
        """Rank 0 (or the only process): follow the committed rounds; in a group, tell the others each round."""
        rounds = self.cfg.outer.rounds
        # a restart between our resume point and the publication (steps 4-5 above): publish the saved delta before
        # anything else; the next overlapped segment would wait for an outer step that waits for this delta
        if self.state["round_done"] >= 0:
            self.publish_pending(self.state["round_done"])
        while True:
            r = self._latest = self.paths.latest_committed(self._latest)
            if r >= rounds:
                self.pub.join()
                self.prefetch.cancel()
                self.join_snapshot()
                log.info("round %d committed: the run is complete", r)
                self.hb.beat(force=True, status="done", round=r)
                broadcast_json(None, self.dist, self.device)
                return
            slot = self.find_slot(r)
            if slot == "leave":
                broadcast_json(None, self.dist, self.device)
                return
            if slot == "wait":
                wait_for(lambda: self.monitor() or (self.paths.latest_committed() or 0) > r or
                         self.layout_changed(), 5.0, self.poll)
                continue
            if self.overlap:
                k = self.next_segment(r)
                if k is not None:
                    broadcast_json(k, self.dist, self.device)
                    self.train_round(k)
                    continue
                self.pub.join()  # our last round is published before we wait for the outer step
                self.publish_pending(self.state["round_done"])
                self.hb.beat(force=True, status="waiting for the outer step", round=r)
                wait_for(lambda: self.monitor() or (self.paths.latest_committed() or 0) > r, None, self.poll)
                continue
            if self.state["round_done"] >= r:
                self.publish_pending(self.state["round_done"])
                self.hb.beat(force=True, status="waiting for the outer step", round=r)
                wait_for(lambda: self.monitor() or (self.paths.latest_committed() or 0) > r, None, self.poll)
                continue
            broadcast_json(r, self.dist, self.device)
            self.train_round(r)

    # -- membership: our slot in the data layout (train/exchange/layout.py, docs/elastic.md) -------------------------
    def layout_changed(self) -> bool:
        f = Layout.path(self.paths)
        try:
            return f.stat().st_mtime_ns != self._layout_seen
        except OSError:
            return False

    def layout(self) -> Layout | None:
        """The data layout, read again only when the file changed (the coordinator replaces it atomically): a
        segment boundary costs a stat, not a read that waits behind the deltas in flight on a busy link."""
        f = Layout.path(self.paths)
        try:
            st = f.stat()
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._layout_cache is None or self._layout_cache[0] != key:
            self._layout_cache = (key, Layout.load(self.paths))
        return self._layout_cache[1]

    def find_slot(self, latest: int) -> str:
        """"train" when we have a slot in the next round we would train; "wait" while we ask to join (a new worker)
        or wait for the round a new segment gives us; "leave" when the run no longer has a slot for us."""
        f = Layout.path(self.paths)
        self._layout_seen = sharedfs.stat(f).st_mtime_ns if sharedfs.exists(f) else None
        lay = self.layout()
        if lay is None:
            raise ProtocolError(f"{f} is missing: the coordinator writes it before round 0 (an older coordinator?)")
        nxt = max(latest, self.state["round_done"] + 1, self.trained + 1)
        if nxt >= self.cfg.outer.rounds or self.w < lay.slots(nxt):
            if getattr(self, "_asked", False):
                log.info("worker %d joined the run at round %d", self.w, nxt)
                self._asked = False
            return "train"
        later = [s for s in lay.segments if s["from_round"] > nxt and s["slots"] > self.w]
        if later:
            first = later[0]["from_round"]
            self.pub.join()
            log.info("worker %d has a slot from round %d on (%s): waiting for it", self.w, first, later[0]["why"])
            self.state["round_done"] = first - 1
            self.progress = None
            atomic_write_json(self.paths.worker_state(self.w), self.state)
            return "train"
        if "sidecar" in self.state:  # we trained in this run before, and it has no slot for us any more
            why = f"the run has {lay.last['slots']} workers from round {lay.last['from_round']} ({lay.last['why']})"
            log.info("worker %d leaves: %s", self.w, why)
            self.join_snapshot()
            self.hb.stop("left", reason=why)
            return "leave"
        slots = lay.last["slots"]
        if not getattr(self, "_asked", False):
            log.info("worker %d asks to join a run of %d workers: the coordinator admits it at the next round "
                     "boundary%s", self.w, slots, "" if self.w == slots else
                     f" once workers {slots}..{self.w - 1} have joined (ids are given out in order)")
            self._asked = True
        self.hb.beat(force=True, status="joining", round=latest)
        return "wait"

    def next_segment(self, latest: int) -> int | None:
        """Delayed overlap: the round whose delta we train next, or None to wait for a commit. Segment k starts
        from θ_{k−1} + our progress over segment k−1, so it may start once θ_{k−1} is committed (one round ahead
        of the synchronous protocol). A worker whose rounds went on without it (restarted late) rejoins at the
        latest round from θ_latest; so does one that lost its progress (its snapshot was on another host)."""
        rounds = self.cfg.outer.rounds
        k = max(self.state["round_done"], self.trained) + 1
        if k >= rounds:
            return None
        if latest > k or (self.progress is None and k > 0):
            if latest > k:
                log.warning("rounds up to %d were committed without our segment %d: rejoining at round %d from "
                            "the committed model", latest - 1, k, latest)
                self.progress = None
            return latest if latest >= k else None
        return k if latest >= k - 1 else None

    def load_global(self, r: int, into_model: bool = True) -> dict[str, torch.Tensor]:
        """θ_r into the model (rank 0 brings its copy to round r — the full file without compression, else the
        logged updates — and the other ranks get it by broadcast); returns rank 0's float32 CPU copy of θ_r.
        `into_model` False (one process only): just the copy; the caller sets the parameters."""
        theta: dict[str, torch.Tensor] = {}
        if self.dist.main:
            self.finish_prefetch(r)
            self.theta.advance_to(r)
            self.count_io("read", self.theta.take_bytes())
            theta = self.theta.tensors
            if set(theta) != set(self.trainer.params):
                raise ProtocolError(f"round {r}: tensors {sorted(set(theta) ^ set(self.trainer.params))[:5]} of the "
                                    f"global model do not match the model's parameters")
        if not self.dist.enabled:
            if into_model:
                self.theta.load_into(self.trainer.model)
            return theta
        with torch.no_grad():
            for name, p in self.trainer.params.items():
                load_full(p, broadcast_full(theta.get(name), p.shape, torch.float32, self.dist, self.device))
        return theta

    def train_round(self, r: int, replay: bool = False) -> None:
        cfg, paths = self.cfg, self.paths
        H = cfg.outer.local_steps_at(r)
        main = self.dist.main
        if main and not self.overlap:
            self.join_snapshot()  # the moments of the last round are on disk before they change
        t0 = time.perf_counter()
        fold = None
        if self.overlap and r > 0 and self.progress is not None:
            # overlap: this segment starts from θ_{r−1} + our progress over segment r−1 (delayed), or + that
            # progress at the weight the outer step gives it, γ = η (1 + μ) / M (eager; docs/overlap.md)
            theta = self.load_global(r - 1, into_model=False)  # the parameters are set to theta_r below
            gain = self.eager_gain(r - 1) if self.eager else 1.0
            theta_r = {n: theta[n].add(self.progress[n], alpha=gain) for n in self.theta.names}
            params = self.trainer.params
            with torch.no_grad():
                for n in self.theta.names:
                    params[n].copy_(theta_r[n])
            tau = self.fold_step(r)
            if tau is not None:
                fold = {"base": theta_r, "wait": 0.0, "step": None, "H": H}
                if replay or tau > 0:  # a replay folds where the published segment did
                    fold["at"] = self.state.get("fold_steps", {}).get(str(r), H) if replay else tau
        else:
            theta_r = self.load_global(r)
        t_load = time.perf_counter() - t0
        if self.overlap and not replay:
            self.start_prefetch(r)  # θ_r, where the next segment starts, read while this one trains

        def on_step(i: int, loss) -> None:
            if main:
                self.hb.beat(status="replaying" if replay else "training", round=r, step=i + 1, steps=H, loss=loss)

        if main:
            # with overlap the lease thread writes it within a second: no file write between two segments
            self.hb.beat(force=not self.overlap, status="replaying" if replay else "training", round=r, step=0,
                         steps=H)
        if cfg.inner.reset_state:  # the paper's "reset" variant: fresh inner moments every round (replays too)
            self.trainer.reset_optimizer_state()
        data = self.data_slice(r)
        self.sampler.begin(data["offset"], data["windows"])
        stats = self.trainer.train_steps(self.batches.next_batch, H, on_step, before_step=None if fold is None else
                                         lambda i: self.maybe_fold(r, i, fold))
        if fold is not None:
            if fold["step"] is None:  # θ_r came too late for every step boundary: fold it in at the end
                self.maybe_fold(r, H, fold)  # (after train_steps stopped its clock: its wait is not in "seconds")
            else:
                stats["seconds"] -= fold["wait"]  # waited between two steps, inside train_steps' clock
            theta_r = fold["base"]  # the delta is taken against θ_r
            t_load += fold["wait"]
        if self.dist.enabled:
            # FSDP2 shards are gathered (a collective: every rank takes part); DDP copies are already whole.
            params = {n: full_tensor(p.detach()) for n, p in self.trainer.params.items()}
            opt_tensors = self.trainer.optimizer_tensors()
            if not main:
                return
        else:
            params, opt_tensors = dict(self.trainer.model.named_parameters()), None
        log.info("round %d: %d steps, loss %.4f (last %.4f), %.0f tok/s%s", r, H, stats["loss"], stats["last_loss"],
                 stats["tokens"] / max(stats["seconds"], 1e-9), " (replay)" if replay else "")

        meta = {"inner_steps": H, "tokens": stats["tokens"], "loss": stats["loss"], "last_loss": stats["last_loss"],
                "train_seconds": stats["seconds"], "load_seconds": t_load, "processes": self.dist.world,
                "trained_at": time.time()}
        if fold is not None:
            meta["fold_step"] = fold["step"]
        if self.overlap and not replay:
            # Delayed overlap: the next segment starts now. What it changes in place is copied to host memory here
            # (the parameters, and the moments in snapshot_state); encoding, writing and publishing the delta and
            # the snapshot run on the publisher thread, one round at a time (train/core/background.py).
            host = {n: params[n].detach().to("cpu", torch.float32, copy=True) for n in self.theta.names}
            self.progress = {n: host[n] - theta_r[n] for n in self.theta.names}
            write_snapshot = self.snapshot_state(r, opt_tensors, now=True)
            position = self.sampler.position
            extra = self.trainer.extra_state()
            self.trained = r
            t = time.perf_counter()
            self.pub.join()  # back-pressure: round r − 1 is published (and its snapshot written) before r is queued
            meta["handoff_seconds"] = time.perf_counter() - t
            if meta["handoff_seconds"] > 0.5:
                log.info("round %d: waited %.2f s for round %d's publication (BASE_DIR is slower than training)",
                         r, meta["handoff_seconds"], r - 1)
            self.pub.submit(lambda: self.publish_round(r, theta_r, host, meta, data, position, extra, write_snapshot))
            return
        self.trained = r
        # Δ = θ_r − θ_w, in the order of the global file so the reducer reads every file sequentially.
        pending = paths.worker_pending_delta(self.w, r)
        if replay:
            pending = pending.with_name(f".replay-{pending.name}")
        file = write_delta(pending, self.theta.names, theta_r, params, self.delta_codec, r, self.w, self.residual)
        if self.overlap:
            self.progress = {n: params[n].detach().to("cpu", torch.float32) - theta_r[n] for n in self.theta.names}
        if replay:
            sharedfs.unlink(pending)
            published = self.state["sidecar"]["sha256"] if self.state["round_done"] == r else None
            if published is not None and published != file["sha256"]:
                log.warning("round %d: the replayed delta differs from the published one (non-deterministic "
                            "kernels?); the state goes on from the replay", r)
            self.snapshot_state(r, opt_tensors)
            return
        self.finish_round(r, file, meta, data, self.sampler.position, self.trainer.extra_state())
        self.snapshot_state(r, opt_tensors)

    def fold_step(self, r: int) -> int | None:
        """Overlap: after how many steps segment r folds θ_r in (0: as soon as it is read, adaptive); None: at the
        segment's end (outer.overlap_steps >= its H), or no overlap."""
        tau = self.cfg.outer.overlap_steps
        return tau if self.overlap and tau < self.cfg.outer.local_steps_at(r) else None

    def maybe_fold(self, r: int, i: int, fold: dict) -> None:
        """Overlap, before step i of segment r (which started from θ_{r−1} + our progress, its base): fold θ_r in,
        parameters ← θ_r + (parameters − base), keeping the progress made since the base (docs/overlap.md). When:
        at fold["at"] (outer.overlap_steps = τ, or a replay: the step the published segment used), waiting for
        θ_r if needed; adaptive (τ = 0): at the first step boundary after the prefetch thread has read θ_r, never
        waiting. The wait is not training time (fold["wait"]); fold["step"] is recorded for replays."""
        if fold["step"] is not None:
            return
        at = fold.get("at")
        if at is not None and i != at:
            return
        if at is None and i < fold["H"] and self._prefetched != r:
            return  # adaptive: θ_r is not read yet (the training thread looks at a flag, not at BASE_DIR)
        t = time.perf_counter()
        if self._prefetched != r and not self.paths.is_committed(r):
            self.hb.beat(force=True, status="waiting for the outer step", round=r - 1)
            wait_for(lambda: self.monitor() or self.paths.is_committed(r), None, self.poll)
        params, names = self.trainer.params, self.theta.names
        start = fold["base"]
        q = {n: params[n].detach().to("cpu", torch.float32) - start[n] for n in names}
        theta = dict(self.load_global(r))  # into the model; our own dict: the next prefetch replaces its entries
        with torch.no_grad():
            for n in names:
                params[n].add_(q[n].to(params[n].device))
        fold.update(base=theta, step=i, wait=time.perf_counter() - t)
        log.info("round %d: folded θ_%d in after %d of %d steps (waited %.2f s for it)", r, r, i, fold["H"],
                 fold["wait"])

    def eager_gain(self, r: int) -> float:
        """γ of round r's outer step (train/core/outer.py eager_gain), with the workers the layout gives round r."""
        from train.core.outer import eager_gain

        lay = self.layout()
        return eager_gain(r, self.cfg.outer, lay.slots(r) if lay is not None else self.cfg.outer.num_workers)

    def finish_round(self, r: int, file: dict, meta: dict, data: dict, position: int, extra: dict) -> None:
        """The delta of round r is in our pending file: write our resume point (small, synchronous: the round is
        done and what to publish; the moments and residual follow in the snapshot, and a restart replays the rounds
        they missed), then publish."""
        if not file["finite"]:
            log.error("round %d: the delta has non-finite values (diverged?); publishing it anyway so the reducer "
                      "rejects it visibly", r)
        self.count_io("written", file["bytes"])
        sidecar = delta_sidecar(r, self.w, file, **meta)
        sidecar["lease"] = self.hb.lease_id  # which process delivered it (membership: a restart's first delivery)
        sidecar["io"] = self.take_io()
        sidecar["position"] = position
        sidecar["data"] = {**data, "read": position - data["offset"]}
        self.state.update(round_done=r, position=position, sidecar=sidecar, **extra)
        if "fold_step" in meta:  # where segment r folded θ_r in: a replay must fold it in at the same step
            folds = {k: v for k, v in self.state.get("fold_steps", {}).items() if int(k) > r - 8}
            self.state["fold_steps"] = {**folds, str(r): meta["fold_step"]}
        atomic_write_json(self.paths.worker_state(self.w), self.state)
        self.publish_pending(r)

    def publish_round(self, r: int, theta_r: dict, host: dict, meta: dict, data: dict, position: int, extra: dict,
                      write_snapshot) -> None:
        """Delayed overlap, on the publisher thread: encode and write Δ_r from the host copy, publish it, then
        write the state snapshot of round r (the same files, in the same order, as the synchronous path)."""
        pending = self.paths.worker_pending_delta(self.w, r)
        file = write_delta(pending, self.theta.names, theta_r, host, self.delta_codec, r, self.w, self.residual)
        self.finish_round(r, file, meta, data, position, extra)
        write_snapshot()

    # -- delayed overlap: the next global model, read ahead -----------------------------------------------------------
    def start_prefetch(self, r: int) -> None:
        """Bring our copy of θ to round r as soon as it is committed, on the prefetch thread."""
        self.prefetch.cancel()
        stop = self.prefetch.stop

        def job() -> None:
            while not self.paths.is_committed(r):
                if stop.wait(self.poll):
                    return
            self.theta.advance_to(r)
            self._prefetched = r

        self._prefetch_round, self._prefetched = r, None
        self.prefetch.submit(job)

    def finish_prefetch(self, r: int) -> None:
        """Before our copy of θ is used: wait for a prefetch of round r (its error is raised), cancel any other."""
        if self._prefetch_round == r and (self._prefetched == r or self.paths.is_committed(r)):
            self.prefetch.join()
        else:
            self.prefetch.cancel()
        self._prefetch_round = None

    def data_slice(self, r: int) -> dict:
        """Our slice of round r's data: {segment, offset, windows} (rank 0 reads the layout; the group shares it)."""
        out = None
        if self.dist.main:
            lay = self.layout()
            if lay is None:
                raise ProtocolError(f"{Layout.path(self.paths)} is missing (the coordinator writes it at round 0)")
            offset, windows = lay.slice(r, self.w)
            need = self.cfg.outer.local_steps_at(r) * self.cfg.inner.total_batch_size
            if need > windows:
                raise ConfigError(f"worker {self.w} would read {need} windows in round {r} (outer.local_steps x "
                                  f"inner.total_batch_size) but the run gives each worker {windows}: start it with "
                                  f"the coordinator's values")
            out = {"segment": lay.index(r), "offset": offset, "windows": windows}
        return broadcast_json(out, self.dist, self.device)

    def publish_pending(self, r: int) -> None:
        """Move our saved delta of round r into rounds/r/deltas/ and write its sidecar (idempotent: a kill between
        the move and the sidecar leaves the delta in place, and the sidecar saved in state.json completes it)."""
        paths = self.paths
        pending = paths.worker_pending_delta(self.w, r)
        moved = not pending.is_file()
        if paths.delta_meta(r, self.w).is_file() or (moved and not paths.delta_file(r, self.w).is_file()) or \
                self.state.get("sidecar", {}).get("round") != r:
            return
        latest = paths.latest_committed()
        late = self.cfg.outer.late_weight > 0
        if latest is not None and latest > r + late:
            log.warning("round %d was committed without us (we were too slow or restarted); dropping our delta "
                        "and rejoining at round %d", r, latest)
            sharedfs.unlink(pending)  # (a delta already moved goes with its round when that is pruned)
            return
        if latest is not None and latest > r:
            log.info("round %d was committed without us: publishing our delta late, to be folded into round %d "
                     "with weight %g (outer.late_weight)", r, latest, self.cfg.outer.late_weight)
        try:
            if not moved:
                paths.deltas_dir(r).mkdir(parents=True, exist_ok=True)
                sharedfs.replace(pending, paths.delta_file(r, self.w))
            publish_sidecar(paths, self.state["sidecar"])
        except FileNotFoundError:
            log.warning("round %d disappeared while publishing (already reduced and cleaned up)", r)
            return
        log.info("round %d: published delta (%.1f MB)", r, self.state["sidecar"]["bytes"] / 1e6)

def main(argv: list[str] | None = None) -> int:
    from train.core.entry import worker_main
    return worker_main("diloco", Worker, __doc__.split("\n")[0], argv)

if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "worker", background_log=True)
