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
With outer.overlap the next segment starts before θ_{r+1} is committed: the policy in train/diloco/overlap.py says
where a segment starts, when it folds θ in and how its delta is handed over (docs/overlap.md); the snapshots, the
restore and the replay are in train/diloco/resume.py.

A worker may be a torchrun group (`python -m torch.distributed.run --nproc_per_node N -m train.diloco.worker ...`, see
train/core/dist.py): rank 0 does every step above that touches BASE_DIR and tells the other ranks, by broadcast, which
round to train; θ_r and the resumed optimizer state reach them by broadcast too; each rank trains on its slice of
every step's batch, and the group's gradients are averaged, so the worker publishes what one process would.
"""
from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from pathlib import Path

import torch

from train.core import sharedfs
from train.config import ConfigError, RunConfig
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
from train.core.coordinator_lease import CoordinatorWatch
from train.core.heartbeat import Heartbeat
from train.diloco.pace import CALIBRATE, GRACE, schedule_for, split_carry
from train.exchange.reduce import arrived
from train.diloco.policy import for_config
from train.diloco.resume import ResumeState
from train.exchange.codec import Residual
from train.exchange.expect import Expect, wait_commit
from train.exchange.layout import Layout
from train.exchange.master import exchange_codecs
from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
from train.exchange.theta import GlobalTheta
from train.core.store import (
    PROTOCOL_VERSION,
    ProtocolError,
    atomic_write_json,
    exclusive_lock,
    prepare_run_dir,
    read_json,
    wait_for,
)
from train.exchange.store import DiLoCoPaths

log = logging.getLogger("worker")

def build_worker_model(paths: DiLoCoPaths, model_config: dict | None = None):
    """An empty model of the run's architecture (from θ_0's config, or that config.json's contents as rank 0 read
    them); weights come from the global model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_config is None:
        mcfg = AutoConfig.from_pretrained(str(sharedfs.local_copy(paths.global_dir(0) / "config.json").parent))
    else:
        mcfg = AutoConfig.for_model(**model_config)
    return AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)

class Worker(ResumeState):
    def __init__(self, cfg: RunConfig, worker_id: int):
        if not 0 <= worker_id < 1000:
            raise ConfigError(f"--worker {worker_id}: must be in 0..999 (0..outer.num_workers-1 for the run's "
                              f"workers; the next id to join a running run, docs/elastic.md)")
        self.cfg, self.w = cfg, worker_id
        self.dist = DistInfo()  # set by setup(): rank 0 of 1 unless started by torchrun
        self.paths = DiLoCoPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        self.poll = cfg.outer.poll_interval_s
        # when the commit usually comes after our delta; the N workers share its fast polls (expect.py)
        self.expect_commit = Expect(self.poll, cfg.outer.num_workers)
        self.hb = Heartbeat(self.paths.progress(worker_id), worker_id)
        # called while waiting: says when the coordinator dies or comes back (train/core/coordinator_lease.py);
        # may raise
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
            own = self.paths.worker_state(self.w)
            state = read_json(own) if sharedfs.is_file(own) else \
                {"round_done": -1, "position": 0, "step": 0}
            start = {"data": str(find_data(cfg)), "state": state,
                     "model_config": read_json(self.paths.global_dir(0) / "config.json")}
        start = broadcast_json(start, self.dist, self.device)
        model = build_worker_model(self.paths, start["model_config"] if self.dist.enabled else None)
        self.trainer = InnerTrainer(cfg, model, self.device, self.dist)
        self.data = TokenData.open(Path(start["data"]), cfg.data.seq_length, cfg.data.eval_fraction)
        self.state = start["state"]
        self.delta_codec, self.back_codec = exchange_codecs(cfg.outer)
        # synchronous rounds can take back the error feedback of a rejected delta (take_back_rejected)
        sync = cfg.outer.overlap == "none" and cfg.outer.fragments <= 1
        self.residual = Residual(self.delta_codec, undo=sync) if cfg.outer.compression != "none" else None
        self.theta = GlobalTheta(self.paths, self.back_codec, cfg.outer.fragments) if main else None
        self.overlap = for_config(cfg.outer)  # none / delayed / eager: where a segment starts, its hand-off
        # rounds by time with measured speeds: no step starts after GRACE x round_time_s (not in a torchrun group,
        # whose ranks would have to agree on the step; nor with given rates, whose plan is exact)
        oc = cfg.outer
        self.deadline_s = GRACE * oc.round_time_s if oc.paced and not oc.step_rates and not self.dist.enabled \
            else None
        self.snap = OneSlot("state-snapshot")    # the state snapshot, written in the background
        self.trained = -1  # the last round this process trained (its publication may still be in flight)
        self.carry: list = []  # windows of our slices not read yet: read first in our next round (set in restore)
        self._latest: int | None = None  # the last committed round seen (later lookups start from it)
        self._layout_cache: tuple | None = None  # ((inode, mtime, size) of layout.json, its Layout)
        self.io = {"read": 0, "written": 0}  # BASE_DIR bytes of the current round (into the next sidecar)
        self._io_lock = threading.Lock()
        self.fresh_moments = True  # no inner optimizer moments yet (restore_state loads them on a restart)
        self.restore_state()
        self.carry = [list(x) for x in self.state.get("carry", [])]  # (replays recompute it, to the same)
        self.sampler = StreamSampler(self.data, cfg.seed)
        self.batches = RankBatches(self.sampler, self.dist, cfg.inner.total_batch_size) if self.dist.enabled \
            else self.sampler
        log.info("worker %d on %s: %d training windows of %d tokens, device %s%s", self.w, socket.gethostname(),
                 self.data.n_train_windows, cfg.data.seq_length, self.device,
                 f", {self.dist.world} processes ({cfg.inner.parallel})" if self.dist.enabled else "")
        self.replay()

    # -- BASE_DIR bytes per round (into the next sidecar) ---------------------------------------------------------
    def count_io(self, kind: str, nbytes: int) -> None:
        with self._io_lock:
            self.io[kind] += nbytes

    def take_io(self) -> dict:
        with self._io_lock:
            io, self.io = self.io, {"read": 0, "written": 0}
        return io

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
            if r is None:  # round 0 was committed before we started: the run's folder went away under us
                raise ProtocolError(f"{self.paths.root}: no committed round any more (the run folder was removed, "
                                    f"or BASE_DIR's mount is gone on this host): check the mount, then start the "
                                    f"worker again")
            if r >= rounds:
                self.overlap.close()
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
            k = self.overlap.next_segment(self, r)  # r; with overlap possibly r + 1 (trained from θ_r + progress)
            if k is None:
                self.overlap.flush()  # our last round is published before we wait for the outer step
                self.publish_pending(self.state["round_done"])
                self.hb.beat(force=True, status="waiting for the outer step", round=r)
                self.wait_commit(r)
                continue
            broadcast_json(k, self.dist, self.device)
            self.train_round(k)

    def wait_commit(self, r: int) -> None:
        """Until round r is committed (or the coordinator's watch raises): polled every outer.poll_interval_s, and
        faster where the commit usually comes after our delta (train/exchange/expect.py)."""
        latest = wait_commit(self.paths, r, self._latest, self.expect_commit, self.monitor)
        if latest is not None:
            self._latest = latest

    # -- membership: our slot in the data layout (train/exchange/layout.py, docs/elastic.md) -------------------------
    def layout_changed(self) -> bool:
        f = Layout.path(self.paths)
        try:
            return sharedfs.stat(f).st_mtime_ns != self._layout_seen
        except OSError:
            return False

    def layout(self) -> Layout | None:
        """The data layout, read again only when the file changed (the coordinator replaces it atomically): a
        segment boundary costs a stat, not a read that waits behind the deltas in flight on a busy link."""
        f = Layout.path(self.paths)
        try:
            st = sharedfs.stat(f)
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
            self.overlap.flush()
            log.info("worker %d has a slot from round %d on (%s): waiting for it", self.w, first, later[0]["why"])
            self.state["round_done"] = first - 1
            self.overlap.progress = None
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

    def load_global(self, r: int, into_model: bool = True) -> dict[str, torch.Tensor]:
        """θ_r into the model (rank 0 brings its copy to round r — the full file without compression, else the
        logged updates — and the other ranks get it by broadcast); returns rank 0's float32 CPU copy of θ_r.
        `into_model` False (one process only): just the copy; the caller sets the parameters."""
        theta: dict[str, torch.Tensor] = {}
        if self.dist.main:
            self.overlap.finish_prefetch(self, r)  # θ_r read ahead (overlap): that read is done
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
        """Segment r (steps 1-5 above; with overlap docs/overlap.md): start it where the overlap policy says, train
        its H inner steps on our slice of round r's data, hand the delta over."""
        data = self.data_slice(r)  # our slice of round r's stream: its length is our H (train/diloco/pace.py)
        H = data["windows"] // self.cfg.inner.total_batch_size
        seg = self.overlap.begin(self, r, H, replay)  # the model at the segment's start; what Δ is taken against
        # fresh moments this segment (not the reset_state variant, where every worker's are): the sidecar says so
        fresh, self.fresh_moments = self.fresh_moments and not self.cfg.inner.reset_state, False
        stats = self.train_segment(r, H, seg, replay, data)
        fields = seg.end(stats)  # (a fold not done yet comes in now)
        if self.dist.enabled:
            # FSDP2 shards are gathered (a collective: every rank takes part); DDP copies are already whole.
            params = {n: full_tensor(p.detach()) for n, p in self.trainer.params.items()}
            opt_tensors = self.trainer.optimizer_tensors()
            if not self.dist.main:
                return
        else:
            params, opt_tensors = dict(self.trainer.model.named_parameters()), None
        done = stats["steps"]
        log.info("round %d: %s steps, loss %.4f (last %.4f), %.0f tok/s%s", r,
                 done if done == H else f"{done} of {H} (outer.round_time_s x {GRACE:g} reached)", stats["loss"],
                 stats["last_loss"], stats["tokens"] / max(stats["seconds"], 1e-9), " (replay)" if replay else "")
        meta = {"inner_steps": done, "planned_steps": H, "tokens": stats["tokens"], "loss": stats["loss"],
                "last_loss": stats["last_loss"], "lr": stats["lr"],
                "train_seconds": stats["seconds"], "load_seconds": seg.load_s, "processes": self.dist.world,
                "trained_at": time.time(), **fields, **({"fresh_moments": True} if fresh else {})}
        self.overlap.hand_off(self, r, seg.base, params, opt_tensors, meta, data, replay)

    def train_segment(self, r: int, H: int, seg, replay: bool, data: dict) -> dict:
        """H inner steps on our slice of round r's data (the layout's), at the run's place on the learning-rate
        schedule; returns train_steps' stats. With rounds by time (measured speeds, one process) no step starts
        after GRACE x outer.round_time_s: a worker that slowed down publishes what it trained (train/diloco/pace.py);
        a replay runs the steps its delta had."""
        main = self.dist.main
        status = "replaying" if replay else "training"

        def on_step(i: int, loss) -> None:
            if main:
                self.hb.beat(status=status, round=r, step=i + 1, steps=H, loss=loss)

        if main:
            # with overlap the lease thread writes it within a second: no file write between two segments
            self.hb.beat(force=not self.overlap.trains_ahead, status=status, round=r, step=0, steps=H)
        if self.cfg.inner.reset_state:  # the paper's "reset" variant: fresh inner moments every round (replays too)
            self.trainer.reset_optimizer_state()
        # windows carried over from our earlier rounds come first (read within this round's H: pace.py)
        carry = self.state.get("carry_of", {}).get(str(r), []) if replay else self.carry
        used, kept = split_carry(carry, data["windows"])
        self.sampler.begin(data["offset"], data["windows"] - sum(n for _, n in used), before=used)
        tr = self.trainer
        tr.step, tr.step_size, tr.total_steps = data["schedule"]
        stop = None
        if replay:  # the steps its delta had (fewer than H where the round's end stopped it)
            H = int(self.state.get("steps_of", {}).get(str(r), H))
        elif self.deadline_s:
            stop = self.round_end(r, data)
        stats = tr.train_steps(self.batches.next_batch, H, on_step, before_step=seg.before_step, stop=stop)
        reads = self.sampler.reads()
        data.update(read=reads[-1][1], carried_in=[[o, n] for o, n in reads[:-1] if n], carry_used=carry,
                    carry_out=[*kept, *([o, n] for o, n in self.sampler.unread())])
        self.carry = data["carry_out"]
        return stats

    def round_end(self, r: int, data: dict):
        """Rounds by time: stop() for train_steps. True once every other worker of the round has published and
        round_time_s has passed (the round waits for nobody but us: what we did not read goes on to our next round),
        or at GRACE x round_time_s (train/diloco/pace.py)."""
        t0, oc = time.perf_counter(), self.cfg.outer
        if data.get("calibrate"):  # a calibration: CALIBRATE x round_time_s of steps, whatever our speed
            until = t0 + CALIBRATE * oc.round_time_s
            return lambda: time.perf_counter() >= until
        hard, soft = t0 + self.deadline_s, t0 + oc.round_time_s
        others = data["slots"] - 1
        seen = {"t": 0.0, "done": False}

        def stop() -> bool:
            now = time.perf_counter()
            if now >= hard:
                return True
            if now < soft or now - seen["t"] < oc.poll_interval_s:
                return seen["done"]
            seen["t"] = now
            seen["done"] = len([w for w in arrived(self.paths, r, data["slots"]) if w != self.w]) >= others
            return seen["done"]
        return stop

    def deliver(self, r: int, theta_r: dict, params: dict, opt_tensors: dict | None, meta: dict, data: dict,
                replay: bool) -> None:
        """Round r on the training thread (synchronous, and every replay): Δ = θ_r − θ_w to our pending file, in
        the order of the global file so the reducer reads every file sequentially; then the resume point and the
        publication (finish_round), and the state snapshot. A replay only checks its delta against the published
        one and snapshots."""
        self.trained = r
        pending = self.paths.worker_pending_delta(self.w, r)
        if replay:
            pending = pending.with_name(f".replay-{pending.name}")
        fr = self.theta.frags  # round r's fragment (the whole model without streaming DiLoCo's fragments)
        self.take_back_rejected(r)
        published = self.state["sidecar"]["sha256"] if replay and self.state["round_done"] == r else None
        file = write_delta(pending, fr.pieces(r), fr.view(r, theta_r), fr.view(r, params), self.delta_codec, r,
                           self.w, self.residual, like=published)  # a replay hashes as its published twin was
        if replay:
            sharedfs.unlink(pending)
            if published is not None and published != file["sha256"]:
                log.warning("round %d: the replayed delta differs from the published one (non-deterministic "
                            "kernels?); the state goes on from the replay", r)
            if self.overlap.snapshot_due(r):
                self.snapshot_state(r, opt_tensors)
            return
        self.finish_round(r, file, meta, data, self.sampler.position, self.trainer.extra_state())
        if self.overlap.snapshot_due(r):  # (streaming DiLoCo: once a cycle of P rounds; the rest are replayed)
            self.snapshot_state(r, opt_tensors)

    def take_back_rejected(self, r: int) -> None:
        """Before round r is encoded, in synchronous rounds: when the commit of round r (which round r trains from,
        so it exists, and a replay of round r decides the same) rejected our delta of round r − 1, the error
        feedback goes back to what it was before that delta (Residual.take_back): the receivers took none of it,
        and what it left to carry came from a delta judged bad. (Not with overlap or fragments: their next delta
        is encoded before the verdict on the last one; nor after a restart between the two, the undo is not in the
        resume state: there what a rejected delta left to carry is carried, as before.)"""
        if self.residual is None or not self.residual.undo or r < 1:
            return
        try:
            why = (read_json(self.paths.committed(r)).get("rejected") or {}).get(f"w{self.w:03d}")
        except (OSError, ValueError, AttributeError):
            return
        if why and self.residual.take_back():
            log.warning("round %d: our delta of round %d was rejected (%s); the error feedback is back to what it "
                        "was before it", r, r - 1, why)

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
        sidecar["data"] = {k: v for k, v in data.items() if k != "carry_used"}
        if "read" not in data:
            sidecar["data"]["read"] = position - data["offset"]
        # the windows we did not read go on to our next round (a restart reads them there too)
        self.state.update(round_done=r, position=position, sidecar=sidecar, carry=data.get("carry_out", []), **extra)
        carries = {k: v for k, v in self.state.get("carry_of", {}).items() if int(k) > r - 8}
        if data.get("carry_used"):  # what round r read first: a replay reads the same
            carries[str(r)] = data["carry_used"]
        self.state["carry_of"] = carries
        steps = {k: v for k, v in self.state.get("steps_of", {}).items() if int(k) > r - 8}
        if meta["inner_steps"] != meta.get("planned_steps", meta["inner_steps"]):  # stopped by its deadline:
            # a replay runs as many steps
            steps[str(r)] = meta["inner_steps"]
        self.state["steps_of"] = steps
        if "fold_step" in meta:  # where segment r folded θ_r in: a replay must fold it in at the same step
            folds = {k: v for k, v in self.state.get("fold_steps", {}).items() if int(k) > r - 8}
            self.state["fold_steps"] = {**folds, str(r): meta["fold_step"]}
        atomic_write_json(self.paths.worker_state(self.w), self.state)
        self.publish_pending(r)

    def data_slice(self, r: int) -> dict:
        """Our slice of round r's data: {segment, offset, windows} (rank 0 reads the layout; the group shares it)."""
        out = None
        if self.dist.main:
            lay = self.layout()
            if lay is None:
                raise ProtocolError(f"{Layout.path(self.paths)} is missing (the coordinator writes it at round 0)")
            offset, windows = lay.slice(r, self.w)
            batch = self.cfg.inner.total_batch_size
            if windows % batch:
                raise ConfigError(f"worker {self.w}: round {r} gives it {windows} windows, not a whole number of "
                                  f"inner steps of inner.total_batch_size = {batch} windows: start it with the "
                                  f"coordinator's inner.total_batch_size")
            out = {"segment": lay.index(r), "offset": offset, "windows": windows, "slots": lay.slots(r),
                   "calibrate": self.w in lay.segment(r).get("calibrate", ()),
                   "schedule": schedule_for(lay, r, self.w, self.cfg)}
        return broadcast_json(out, self.dist, self.device)

    def publish_pending(self, r: int) -> None:
        """Move our saved delta of round r into rounds/r/deltas/ and write its sidecar (idempotent: a kill between
        the move and the sidecar leaves the delta in place, and the sidecar saved in state.json completes it)."""
        paths = self.paths
        pending = paths.worker_pending_delta(self.w, r)
        moved = not sharedfs.is_file(pending)
        if sharedfs.is_file(paths.delta_meta(r, self.w)) or \
                (moved and not sharedfs.is_file(paths.delta_file(r, self.w))) or \
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
                sharedfs.makedirs(paths.deltas_dir(r))  # (the retry policy: a full disk is waited out)
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
    run_main(main, "worker", background_log=True, fast_exit=True)
