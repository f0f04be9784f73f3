"""The DiLoCo coordinator: prepare the run, then per round wait for deltas, validate, reduce, commit.

Why a coordinator computes the outer step rather than every worker: one writer commits each global model once
(N workers would read N deltas each, N² traffic on NFS, and race to commit); workers only ever write their own
delta and state, so no two processes write the same file. The coordinator is light (streaming, one model of
memory) and can run on any host, including one of the workers'.

Validation, the streaming reduce and the commit live in train/exchange/reduce.py (shared with DiLoCoOptimizer's in-loop
reducer); this module adds the run around them: setup, waiting with progress, evaluation, metrics, final model.
"""
from __future__ import annotations

import logging
import time

import torch

from train.core import logship, objstore, sharedfs
from train.core.background import OneSlot
from train.config import RunConfig
from train.core.errors import ProtocolError
from train.core.data import TokenData, prepare_data
from train.core.coordinator_lease import NO_LEASE, CoordinatorLease, coordinator_lease_path
from train.core.inner import evaluate
from train.core.logs import make_metric_logger
from train.core.model import (build_model, check_model_fits, load_tokenizer, load_weights_into, pick_device,
                              save_model_dir)
from train.exchange.accumulate import Accumulator
from train.exchange.expect import Closing, Expect
from train.exchange.layout import Layout, per_slot
from train.exchange.master import OuterMaster
from train.exchange.membership import Membership, workers_alive
from train.exchange.protocol import RejectedDelta, check_sidecar, commit, round_record
from train.exchange.reduce import arrived, prune_rounds
from train.exchange.screen import STREAK, ScreenHistory, screen_round
from train.diloco.pace import Pace, data_record, describe
from train.diloco.policy import for_config
from train.status.recorder import TimelineRecorder
from train.core.store import (
    NO_LOCK,
    PROTOCOL_VERSION,
    atomic_write_json,
    ensure_run_manifest,
    exclusive_lock,
    prepare_run_dir,
    publish_dir,
    read_json,
    read_jsonl,
    verify_manifest,
    wait_for,
)
from train.exchange.store import DiLoCoPaths

log = logging.getLogger("coordinator")

LEASES_EVERY_S = 0.5  # how often the wait loop reads the workers' leases (they beat every 1 s: heartbeat.py) ...
LEASE_READS_PER_S = 32.0  # ... at most, so that with N workers the interval is N / 32 s (8 s at 256), and never more
                          # than dead_after_s / 5 (a dead worker is still noticed within 1.2 x dead_after_s)


def leases_every_s(n: int, dead_after_s: float) -> float:
    """How often a round's wait loop reads the leases of N workers: every 0.5 s up to 16 workers, then a bounded
    rate of lease reads (the NFS server's metadata load stays flat in N, bench/scale.py), but at least 5 times per
    dead_after_s."""
    return max(LEASES_EVERY_S, min(n / LEASE_READS_PER_S, dead_after_s / 5))


def run_identity(cfg: RunConfig) -> dict:
    """What may not change when a run is resumed (rounds, timeouts, lrs may; so may the number of workers: the data
    layout re-splits the stream, train/exchange/layout.py)."""
    return {"model": cfg.model.name, "tokenizer": cfg.model.tokenizer, "dataset": cfg.data.dataset,
            "fake_data": cfg.data.fake_data, "seq_length": cfg.data.seq_length, "seed": cfg.seed,
            "delta_dtype": cfg.outer.delta_dtype,
            **({"compression": cfg.outer.compression, "block_size": cfg.outer.block_size}
               if cfg.outer.compression != "none" else {}),
            **({"density": cfg.outer.density, "chunk_size": cfg.outer.chunk_size,
                "sparse_values": cfg.outer.sparse_values} if cfg.outer.compression == "topk" else {}),
            # round r syncs fragment r mod P: P cannot change on a resume (rounds_ahead and the rest may)
            **({"fragments": cfg.outer.fragments} if cfg.outer.fragments > 1 else {})}


class Coordinator:
    def __init__(self, cfg: RunConfig, progress: bool = True, monitor=None):
        self.cfg = cfg
        self._lock_f = NO_LOCK  # the coordinator's lock, taken in setup()
        sharedfs.configure_from(cfg.outer)
        self.paths = DiLoCoPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        logship.start()  # on an s3:// BASE_DIR: this process's log goes to the bucket too
        self.progress = progress and cfg.logging.progress
        self.monitor = monitor or (lambda: None)  # called while waiting (the simulator checks its children)
        self.evals = OneSlot("evaluate")  # a committed round's evaluation and metrics record, off the critical path
        self.expect_last = Expect(cfg.outer.poll_interval_s)  # when a round's last delta usually comes
        self._last_rec: dict | None = None  # the last record logged (read from metrics.jsonl once, on a resume)
        # outer.overlap (docs/overlap.md); the coordinator asks it how far past the latest commit workers may train
        self.overlap = for_config(cfg.outer)
        # outer.round_time_s: each worker's H from its speed (train/diloco/pace.py), planned into the data layout
        self.pace = Pace(cfg.outer, cfg.inner.total_batch_size)
        self.lease = NO_LEASE  # its lease (train/core/coordinator_lease.py), started by setup() once it holds the lock
        # timeline.jsonl each round, timeline.png redrawn in the background (train/status/recorder.py)
        self.timeline = TimelineRecorder(self.paths.root, cfg.logging.plot, title=f"{cfg.project_name}: DiLoCo")

    # -- setup ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, paths = self.cfg, self.paths
        # one coordinator per run: a second one (a forgotten `diloco.py`, a second launch) would race on commits
        self._lock_f = exclusive_lock(paths.root / "coordinator.lock", "the coordinator",
                                      lease=coordinator_lease_path(paths.root))
        # its lease, from now until it exits (workers say so when it goes silent: train/core/coordinator_lease.py)
        self.lease = CoordinatorLease(paths.root).start("preparing", round=paths.latest_committed() or 0)
        # every check a user can fail comes before the run's identity is written (a fixed config then starts clean)
        self.tokenizer = load_tokenizer(cfg) if not cfg.data.fake_data or cfg.model.tokenizer else None
        model = build_model(cfg)
        vocab = check_model_fits(cfg, model, self.tokenizer)
        ensure_run_manifest(paths, run_identity(cfg))
        atomic_write_json(paths.config_json, cfg.to_dict())
        data_dir = prepare_data(cfg, self.tokenizer, vocab, progress=self.progress)
        atomic_write_json(paths.data / "current.json", {"key": data_dir.name})
        self.data = TokenData.open(data_dir, cfg.data.seq_length, cfg.data.eval_fraction)
        self.check_data_size()
        self.layout = self.plan_layout()  # before round 0's commit: workers read it when they start
        self.follow_schedule((paths.latest_committed() or 0) + self.overlap.rounds_ahead, lo=self._free_round)
        self.eval_windows = torch.from_numpy(self.data.eval_windows(cfg.eval.batches * cfg.eval.batch_size))
        self.device = pick_device(cfg.inner.device)
        self.model = model.to(self.device)
        self.logger = make_metric_logger(cfg.logging.metrics, paths.root, cfg.project_name, cfg.to_dict())
        fresh = paths.latest_committed() is None
        if fresh:
            log.info("initialising round 0 (%s, %.2fM parameters)", cfg.model.name,
                     sum(p.numel() for p in model.parameters()) / 1e6)
            save_model_dir(model, paths.global_dir(0))
            # committed first, evaluated after: the workers start while the coordinator evaluates θ_0
            commit(paths, 0, {"protocol": PROTOCOL_VERSION, "record": {"round": 0, "time": time.time(), "tokens": 0,
                                                                       "inner_steps": 0}})
        self.listed: set[str] = set()  # the names of the last listing of a deltas folder (arrived)
        self.membership = Membership(paths, self.expected(paths.latest_committed())[1], cfg.outer)
        self.membership.join_from = self.layout.last["slots"]
        if not fresh:
            self.membership.out_before(*self.missing_at(paths.latest_committed()))
        self.master = OuterMaster(paths, cfg.outer, cfg.outer.rounds)
        self.master.resume(paths.latest_committed())
        self.names = self.master.names
        self.loss_screen = self.make_loss_screen()
        self.screen_history = ScreenHistory()  # the noise floor's memory for rounds of 2 (screen.py)
        if cfg.outer.fragments > 1:
            log.info("streaming DiLoCo: %d fragments, one synced every %d inner steps (τ = %d, α = %g): %s",
                     cfg.outer.fragments, cfg.outer.round_steps_at(0), cfg.outer.fragment_delay,
                     cfg.outer.fragment_mix, self.master.frags.describe())
            if cfg.outer.late_weight > 0:
                log.info("outer.late_weight = %g is not used with fragments: a delta that misses its round is "
                         "dropped (the next round syncs another fragment; docs/streaming.md)", cfg.outer.late_weight)
        self.log_missing_record(paths.latest_committed(), resumed=not fresh)

    def make_loss_screen(self):
        """outer.screen_loss (train/exchange/loss_screen.py): the screen's own copy of the model on the coordinator's
        device and its held-out windows, or None (off: outer.screen off, outer.screen_loss off, or auto and one
        evaluation too slow here); one line says which and why."""
        import copy

        from train.exchange.loss_screen import LossScreen, ScreenWindows, auto_decision, forward_flops

        cfg, oc = self.cfg, self.cfg.outer
        if not oc.screen or oc.screen_loss == "off":
            return None
        windows = ScreenWindows(self.data, cfg.eval.batches * cfg.eval.batch_size, oc.screen_loss_windows, cfg.seed)
        ls = LossScreen(copy.deepcopy(self.model), windows, cfg.eval.batch_size, self.device, cfg.inner.precision,
                        self.names)
        r = self.master.round
        ls.begin(r, self.master.theta, self.master.frags, self.master.frags.shapes(r))  # (the first one warms up)
        ls.begin(r, self.master.theta, self.master.frags, self.master.frags.shapes(r))
        flops = forward_flops(sum(t.numel() for t in self.master.theta.tensors.values()), len(ls.batch),
                              cfg.data.seq_length)
        on, line = auto_decision(oc.screen_loss, flops, self.device.type, ls.seconds[-1],
                                 f"{windows.describe()} on {self.device}")
        log.info("%s", line)
        return ls if on else None

    # -- the data layout (train/exchange/layout.py) ------------------------------------------------------------------
    def round_windows(self, r: int) -> int:
        """Stream windows one worker reads in round r (its H x the batch)."""
        return self.cfg.outer.round_steps_at(r) * self.cfg.inner.total_batch_size

    def check_data_size(self) -> None:
        oc, n = self.cfg.outer, self.data.n_train_windows
        if n < 1:
            from train.core.errors import DataError
            raise DataError(f"the dataset holds no training window of {self.cfg.data.seq_length + 1} tokens: use "
                            f"more data or a smaller data.seq_length")
        H = max(oc.round_steps_at(r) for r in range(oc.rounds))
        if n < oc.num_workers * H * self.cfg.inner.total_batch_size:
            log.warning("the dataset has %d training windows, fewer than one round reads (%d workers x %d steps x "
                        "%d windows): every round is more than an epoch", n, oc.num_workers, H,
                        self.cfg.inner.total_batch_size)

    def plan_layout(self) -> Layout:
        """The data layout, resized when this start changes the number of workers or the windows per round (a new
        segment from the first round no worker can have started: nothing already read is handed out again)."""
        paths, oc = self.paths, self.cfg.outer
        latest = paths.latest_committed() or 0
        lay = Layout.load(paths)
        N = oc.num_workers
        self._free_round = latest  # the first round no worker may have started (follow_schedule starts there)
        if lay is None:
            lay = Layout.single(N, self.pace.windows(N) if oc.paced else self.round_windows(0))
            if oc.paced:
                plan = describe(per_slot(lay.segments[0]), self.cfg.inner.total_batch_size)
                lay.segments[0]["why"] = f"start: {N} workers, rounds by time ({plan})"
                self.pace.mark(lay.segments[0])
            if latest > 0:  # a run from before data layouts: its first segment starts here
                lay.resize(latest, N, self.round_windows(latest),
                           f"resume at round {latest} (run started before data layouts)")
            lay.save(paths)
            return lay
        start = self._free_round = self.first_free_round(lay, latest)
        if oc.paced:  # the plan it had (the speeds it learned) for its workers; new ones calibrate
            self.pace.learn_from(lay, start)
            W = self.pace.windows(N)
            same = per_slot(lay.segment(start)) == W
        else:
            W = self.round_windows(start)
            same = W == lay.segment(start)["windows"]
        if N == lay.config_workers and same:
            return lay
        why = (f"resume: outer.num_workers {lay.config_workers} -> {N}" if N != lay.config_workers else
               f"resume: {W} windows per worker and round (was {lay.segment(start)['windows']})")
        seg = lay.resize(start, N, W, why)
        if oc.paced:
            self.pace.mark(seg)
        lay.config_workers = N
        lay.save(paths)
        log.info("data layout: %s from round %d (stream offset %d; rounds before it keep their slices)", why, start,
                 seg["offset"])
        return lay

    def first_free_round(self, lay: Layout, latest: int) -> int:
        """The first round no worker may have started under the current layout: after every published delta and
        worker state and, while workers are running, after the last round they may be training now: at most
        overlap.rounds_ahead past the latest commit (a worker starts round q only once θ_{q - rounds_ahead} is
        committed). Not later: the rounds from here take this start's H (outer.local_steps_schedule) and a later
        start kept the rounds before it on the old segment's H (a resume with live workers gave round 5 of
        [[0, 3], [2, 6], [5, 2]] H = 6: found by test_h_schedule's random kills in CI)."""
        paths, oc = self.paths, self.cfg.outer
        slots = max(s["slots"] for s in lay.segments)
        done = latest - 1
        for w in range(slots):
            f = paths.worker_state(w)
            if sharedfs.exists(f):
                try:
                    done = max(done, int(read_json(f).get("round_done", -1)))
                except (OSError, ValueError, TypeError):
                    pass
        r = latest
        while arrived(paths, r, slots):  # published deltas of rounds not yet committed
            done, r = max(done, r), r + 1
        start = max(latest, done + 1, lay.last["from_round"])
        if workers_alive(paths, slots, oc):  # they may be training up to round latest + rounds_ahead now
            start = max(start, latest + self.overlap.rounds_ahead + 1)
        return start

    def admit_joiners(self, r: int) -> None:
        """At the commit of round r: workers asking to join (their lease says "joining") get slots from the first
        round nobody has started (r + 1; r + 2 with delayed overlap, where segment r + 1 may be under way)."""
        lay = self.layout
        joiners = self.membership.joiners()
        if not joiners:
            return
        start = max(r + 1 + self.overlap.rounds_ahead, lay.last["from_round"])
        slots = lay.last["slots"] + len(joiners)
        windows = self.pace.windows(slots) if self.cfg.outer.paced else self.round_windows(start)
        seg = lay.resize(start, slots, windows, f"join: worker(s) {joiners} at round {start}")
        if self.cfg.outer.paced:
            self.pace.mark(seg)
        lay.save(self.paths)
        self.membership.join_from = slots
        log.info("workers %s join the run at round %d (%d workers from then on)", joiners, start, slots)

    def follow_schedule(self, upto: int, lo: int | None = None) -> None:
        """outer.local_steps_schedule: give rounds lo..upto (upto: the last round workers may start after the next
        commit; lo: the first no worker may have started, default upto) their H x batch windows, with a new layout
        segment where the H changes. Called before each commit, so every round's H is in the layout before anyone
        can start it; a round of an existing later segment keeps it (a resume that moved the layout further)."""
        if self.cfg.outer.paced:  # rounds by time: the H of each round come from the workers' speeds (replan)
            return
        lay, changed = self.layout, False
        for q in range(upto if lo is None else lo, upto + 1):
            W = self.round_windows(q)
            if q < lay.last["from_round"] or lay.segment(q)["windows"] == W:
                continue
            lay.resize(q, lay.segment(q)["slots"], W, f"H schedule: H = {self.cfg.outer.local_steps_at(q)} from "
                                                     f"round {q}")
            changed = True
            log.info("data layout: H = %d from round %d (outer.local_steps_schedule)",
                     self.cfg.outer.local_steps_at(q), q)
        if changed:
            lay.save(self.paths)

    def replan(self, q: int) -> None:
        """Rounds by time, at the commit before round q can start: a new plan from q when some worker's speed moved
        (train/diloco/pace.py; the rates of the round just collected are in)."""
        lay = self.layout
        q = max(q, lay.last["from_round"])
        cur = per_slot(lay.segment(q))
        new = self.pace.replan(cur)
        measured = [w for w in lay.segment(q).get("calibrate", ()) if w in self.pace.rates]  # calibrated now
        if new is None and not measured:
            return
        new = new or self.pace.windows(len(cur))
        batch = self.cfg.inner.total_batch_size
        self.pace.mark(lay.resize(q, len(cur), new, f"rounds by time: {describe(new, batch)}"))
        lay.save(self.paths)
        log.info("rounds by time: from round %d %s (outer.round_time_s = %g)", q, describe(new, batch),
                 self.cfg.outer.round_time_s)

    def expected(self, r: int) -> tuple[int, int]:
        """(slots of round r, workers awaited in round r): rounds of an older segment before a shrink do not wait
        for the workers that the new size drops (their deltas still count when they come)."""
        n = self.layout.slots(r)
        return n, min(n, self.layout.last["slots"])

    # -- waiting for deltas ---------------------------------------------------------------------------------------
    def arrived(self, r: int) -> list[int]:
        """Workers whose delta of round r is published; the listing's names stay in self.listed (check_sidecar needs
        no listing of its own per delta: one of 2N names each made a round's listings grow as N²)."""
        return arrived(self.paths, r, self.layout.slots(r), self.listed)

    def check_slice(self, r: int, w: int, meta: dict) -> dict:
        """The delta was trained on worker w's slice of round r in the current layout (not an older one)."""
        from train.exchange.protocol import RejectedDelta
        want = self.layout.slice(r, w)[0]
        got = (meta.get("data") or {}).get("offset")
        if got != want:
            raise RejectedDelta(w, f"trained on stream offset {got}, but round {r}'s slice of worker {w} starts at "
                                   f"{want} (the data layout changed: docs/elastic.md)")
        return meta

    def collect(self, r: int) -> tuple[Accumulator, dict[int, str], list[int], float, tuple[int, dict] | None]:
        """Wait for round r's deltas and add each as it arrives (train/exchange/accumulate.py), until every worker's
        is in (accepted or rejected) or the timeout passed with >= min_workers accepted. The delta that completes
        the round is not added here where the outer step can read it itself (OuterMaster.can_take_last): it is
        returned as `last` (its worker, its checked sidecar), and the screen waits for it (run_round).
        Returns (the accumulator, {worker: rejection reason}, missing workers, time of the last arrival, last)."""
        from tqdm import tqdm

        oc = self.cfg.outer
        slots, N = self.expected(r)
        Hs = [self.layout.windows_of(r, w) // self.cfg.inner.total_batch_size for w in range(N)]  # each one's H
        self.membership.set_workers(N)
        self.lease.set("collecting", round=r)
        acc = self.master.new_accumulator(r, N)
        if self.loss_screen is not None:  # θ_r's loss on the round's windows, now (off the tail)
            self.loss_screen.begin(r, self.master.theta, self.master.frags, acc.shapes)
            acc.loss = self.loss_screen
        rejected: dict[int, str] = {}
        t0 = time.monotonic()
        t_last = time.perf_counter()
        bar = tqdm(total=sum(Hs), desc=f"round {r + 1}/{oc.rounds} inner steps", unit="step", leave=False,
                   disable=not self.progress, dynamic_ncols=True)
        warned, shown = False, -1
        d, t_leases = None, 0.0
        every = leases_every_s(N, oc.dead_after_s)
        closing = Closing(N, oc.poll_interval_s)
        last = None
        fuse = self.master.can_take_last(acc)
        while True:
            self.monitor()
            got = self.arrived(r)
            for w in got:
                if w in acc.metas or w in rejected:
                    continue
                try:
                    meta = self.check_slice(r, w, check_sidecar(self.paths, r, w, self.master.delta_codec,
                                                                acc.shapes, self.listed, file_checks=False))
                    if fuse and 0 <= w < N and len(acc.workers) + 1 >= oc.min_workers and all(
                            v in acc.metas or v in rejected for v in range(N) if v != w):
                        last = (w, meta)  # the round's last delta: read inside the outer step
                    else:
                        acc.add(w, meta)
                except RejectedDelta as e:
                    rejected[w] = e.reason
                    log.error("round %d: rejected delta of worker %d: %s", r, w, e.reason)
                t_last = time.perf_counter()
            self.fold_late(r, acc)
            done_steps = min(sum(Hs), sum(Hs[w] if w in got else min(Hs[w], self._worker_step(w, r))
                                          for w in range(N)))
            if done_steps != bar.n or len(got) != shown:
                bar.n, shown = done_steps, len(got)
                bar.set_postfix_str(f"deltas {len(got)}/{N}")  # refreshes the bar
            if set(range(N)) <= set(got):
                why = {}
                break
            # the leases are rewritten once a second: read them every `every` s (leases_every_s), not at every
            # listing of the deltas (N reads per poll made each poll, and so the notice of the last arrival, grow
            # with N)
            if d is None or time.monotonic() - t_leases >= every:
                t_leases = time.monotonic()
                d = self.membership.poll(set(got), {w: m.get("lease") for w, m in acc.metas.items()})
            if d.close:
                why = d.missing
                log.warning("round %d: %s; going on with %d/%d deltas, missing workers %s (%s)", r, d.why,
                            len(got), N, sorted(d.missing), d.summary())
                break
            if not warned and time.monotonic() - t0 >= oc.round_timeout_s:
                log.warning("round %d: %.0fs and only %d deltas (min_workers = %d): still waiting (%s)", r,
                            time.monotonic() - t0, len(got), oc.min_workers, d.summary())
                warned = True
            fast = self.expect_last.interval(time.monotonic() - t0)
            if fast >= oc.poll_interval_s and closing.due(N - len(got)):
                fast = closing.fast  # the last few deltas are due: when rounds are too irregular for expect_last
            if fast < oc.poll_interval_s:  # the round's last delta is due: list the deltas folder alone, more often
                n_got, t_fast = len(got), time.monotonic()
                wait_for(lambda: len(self.arrived(r)) > n_got, oc.poll_interval_s, fast)
                closing.spent(time.monotonic() - t_fast)
            else:
                time.sleep(oc.poll_interval_s)
        if not why:  # every awaited delta came: when the last one did, for the next rounds' polling (expect.py)
            self.expect_last.seen(time.monotonic() - t0 - (time.perf_counter() - t_last))
        bar.close()
        self.lease.set("reducing", round=r)
        if last is None:
            self.screen(r, acc, rejected)
        self.membership.record_round()
        self.missing_why = {f"w{w:03d}": v for w, v in why.items()}
        if len(acc.workers) + (last is not None) < oc.min_workers:
            raise ProtocolError(f"round {r}: only {len(acc.workers)} valid deltas (min_workers = {oc.min_workers}); "
                                f"rejected: {rejected}. Fix the workers and rerun: the run resumes here.")
        missing = [w for w in range(slots) if w not in got]
        for w in missing:
            self.missing_why.setdefault(f"w{w:03d}", f"not awaited: the run has {N} workers from round "
                                                     f"{self.layout.last['from_round']} (data layout)")
        return acc, rejected, missing, t_last, last

    def step_with_last(self, r: int, acc: Accumulator, rejected: dict[int, str], last: tuple[int, dict]
                       ) -> dict | None:
        """The outer step that reads the round's last delta itself (OuterMaster.step's `last`), then the screen over
        every delta. Returns the step's fields, or None when the step must be taken the ordinary way: the delta
        was refused inside the step (it joins `rejected`), the screen took a delta out (the step is undone), or the
        step fell back (the delta is then added here first)."""
        oc, (w, meta) = self.cfg.outer, last
        try:
            fields = self.master.step(r, acc, last=last)
        except RejectedDelta as e:
            rejected[w] = e.reason
            log.error("round %d: rejected delta of worker %d: %s", r, w, e.reason)
            fields = None
        else:
            if fields is None:  # rolled back: the delta the ordinary way
                try:
                    acc.add(w, meta)
                except RejectedDelta as e:
                    rejected[w] = e.reason
                    log.error("round %d: rejected delta of worker %d: %s", r, w, e.reason)
        before = set(acc.workers)
        self.screen(r, acc, rejected)
        if fields is not None and set(acc.workers) != before:  # the screen took some out: θ_{r+1} is not this
            self.master.roll_back(r)
            fields = None
        if fields is None and len(acc.workers) < oc.min_workers:
            raise ProtocolError(f"round {r}: only {len(acc.workers)} valid deltas (min_workers = {oc.min_workers}); "
                                f"rejected: {rejected}. Fix the workers and rerun: the run resumes here.")
        return fields

    def screen(self, r: int, acc: Accumulator, rejected: dict[int, str]) -> None:
        """outer.screen (train/exchange/screen.py): the round's on-time deltas, as a set, once it closed; a rejected
        one joins `rejected` (its reason in metrics.jsonl) and is never averaged. A worker screened out STREAK rounds
        in a row is said in one line (and again each STREAK more), and listed in the round's record."""
        oc = self.cfg.outer
        self.screen_info, self.screen_streak = {}, {}
        if not oc.screen:
            return
        out, self.screen_info = screen_round(acc, oc.screen_norm_ratio, oc.screen_min_cosine, oc.screen_loss_margin,
                                             self.screen_history, r)
        streak = getattr(self, "_streak", {})
        for w in list(streak):
            if w in acc.workers:
                del streak[w]
        for w, why in sorted(out.items()):
            rejected[w] = why
            log.error("round %d: rejected delta of worker %d: %s", r, w, why)
            streak[w] = streak.get(w, 0) + 1
            if streak[w] % STREAK == 0:
                log.error("worker %d: its delta was screened out %d rounds in a row (round %d: %s): that worker is "
                          "training something else (its data, its hardware, a diverged state?); check its log, or "
                          "stop it and restart it from the global model (docs/protocol.md, the screen)", w,
                          streak[w], r, why)
        self._streak = streak
        self.screen_streak = {f"w{w:03d}": n for w, n in sorted(streak.items()) if n >= STREAK}

    def fold_late(self, r: int, acc: Accumulator) -> None:
        """outer.late_weight > 0: the deltas of round r - 1 that missed it (published since) go into round r with
        late_weight x their tokens as weight (a staleness weight); a bad one is logged and left out."""
        oc = self.cfg.outer
        if oc.late_weight <= 0 or r == 0 or oc.fragments > 1:  # (with fragments round r − 1 synced another one)
            return
        for w in self.late_candidates(r):
            if w in acc.late or w in self._late_rejected or not sharedfs.exists(self.paths.delta_meta(r - 1, w)):
                continue
            try:
                meta = self.check_slice(r - 1, w, check_sidecar(self.paths, r - 1, w, self.master.delta_codec))
                acc.add(w, meta, late_weight=oc.late_weight)
                log.info("round %d: folded in the late delta of worker %d from round %d (weight %g x %d tokens)",
                         r, w, r - 1, oc.late_weight, meta["tokens"])
            except RejectedDelta as e:
                self._late_rejected.add(w)
                log.error("round %d: rejected the late delta of worker %d from round %d: %s", r, w, r - 1, e.reason)

    def late_candidates(self, r: int) -> list[int]:
        """Workers whose delta of round r - 1 was missing when it closed (its COMMITTED record says)."""
        if getattr(self, "_late_round", None) != r:
            self._late_round, self._late_rejected = r, set()
            try:
                self._late = list(read_json(self.paths.committed(r)).get("missing", []))
            except (OSError, ValueError):
                self._late = []
        return self._late

    def _worker_step(self, w: int, r: int) -> int:
        """Worker w's inner step in round r, for the progress bar: from its lease as membership last read it (no
        read of its own: one per worker per poll grew each poll with N)."""
        ls = self.membership.leases.get(w)
        p = (ls.record if ls is not None else None) or {}
        try:
            return int(p.get("step", 0)) if p.get("round") == r and p.get("status") == "training" else 0
        except (TypeError, ValueError):
            return 0

    # -- one round ------------------------------------------------------------------------------------------------
    def run_round(self, r: int) -> dict:
        paths, oc = self.paths, self.cfg.outer
        t0 = time.perf_counter()
        acc, rejected, missing, t_last, last = self.collect(r)
        t_wait = t_last - t0
        t1 = time.perf_counter()
        try:
            fields = self.step_with_last(r, acc, rejected, last) if last is not None else None
            if fields is None:
                fields = self.master.step(r, acc)
        except BaseException:
            self.master.discard_uncommitted(r)
            raise
        t_reduce = time.perf_counter() - t1
        ok, metas = acc.workers, acc.metas
        self.evals.join()  # round r's record is logged (this record's tokens add to it)
        io = {"bytes_read": acc.bytes_read + self.master.theta.take_bytes(), "bytes_written": fields["bytes_written"]}
        record = round_record(r, sorted(ok), metas, rejected, missing, io, self._last_metrics(),
                              wait_s=round(t_wait, 3), reduce_s=round(t_reduce, 3))
        if self.cfg.outer.screen:
            record["screen"] = self.screen_info
            if self.loss_screen is not None:  # θ_r's loss on the round's windows (each delta's: in "screen")
                record["screen_loss_base"] = round(self.loss_screen.base_loss, 5)
            if self.screen_streak:
                record["screened_out_in_a_row"] = self.screen_streak
        record["bytes_deltas"] = sum(int(metas[w].get("bytes", 0)) for w in ok)  # the deltas averaged in
        if oc.fragments > 1:
            record["fragment"] = self.master.frags.of_round(r)
        # the windows each delta read (those a worker carried over from its earlier rounds too), the windows
        # passed on to a worker's next round, and those nobody will read (train/diloco/pace.py)
        data, carried, skipped = data_record({w: metas[w] for w in ok}, acc.late, r, r + 1 >= oc.rounds)
        record.update(codec=fields["codec"], checkpoint=fields["checkpoint"], missing_why=self.missing_why, data=data)
        late = {f"w{w:03d}": {"round": r - 1, "weight": oc.late_weight, "tokens": m["tokens"]}
                for w, m in sorted(acc.late.items())}
        if late:  # trained into θ_{r+1} too: their tokens and data count
            record["late"] = late
            record["tokens"] += sum(v["tokens"] for v in late.values())
        if carried:
            record["carried"] = carried
        if skipped:
            record["skipped"] = skipped
        record["skipped_windows"] = int((self._last_metrics() or {}).get("skipped_windows", 0)) + sum(skipped.values())
        if oc.paced:
            self.pace.observe(metas)
            record["planned_steps"] = {f"w{w:03d}": self.layout.windows_of(r, w) // self.cfg.inner.total_batch_size
                                       for w in range(self.layout.slots(r))}
        self.admit_joiners(r)
        if oc.paced:
            self.replan(r + 1 + self.overlap.rounds_ahead)
        else:
            self.follow_schedule(r + 1 + self.overlap.rounds_ahead)
        t3 = time.perf_counter()
        record["tail_s"] = round(t3 - t_last, 3)  # last arrival -> committing
        self.lease.set("committing", round=r)
        # The commit comes before the evaluation: the workers go on with θ_{r+1} while the coordinator evaluates it
        # (evaluating first kept every worker waiting for it, and delayed overlap's fold by as long). The marker
        # carries the metrics record, so a coordinator killed before logging it logs it when it resumes.
        commit(paths, r + 1, {"workers": ok, "missing": missing, "missing_why": self.missing_why,
                              "rejected": record["rejected"], "late": late, "record": record,
                              **{k: fields[k] for k in ("update_sha256", "theta_sha256", "codec", "checkpoint",
                                                        "sparse_step") if k in fields}})
        record["commit_s"] = round(time.perf_counter() - t3, 3)
        self.log_record(record)
        # before the pruning: the sidecars hold the workers' timings (those read for this round are passed on)
        self.timeline.round_closed(r, {**{(r, w): m for w, m in acc.metas.items()},
                                       **{(r - 1, w): m for w, m in acc.late.items()}})
        self.cleanup(r + 1)
        return record

    def log_record(self, record: dict) -> None:
        """Evaluate the committed global model of record["round"] (every eval.every rounds, the first and the last)
        and append the round's metrics record — in the background (`self.evals`): the coordinator collects the next
        round's deltas meanwhile, and joins the job before it builds the next record (tokens are cumulative)."""
        cfg, k = self.cfg, record["round"]
        due = k == 0 or k % cfg.eval.every == 0 or k == cfg.outer.rounds
        self.evals.join()  # round r's record is logged (this record's tokens add to it)
        if due:  # a copy of θ_k in the evaluation model, before the next outer step changes θ
            self.master.theta.load_into(self.model)

        def job() -> None:
            t = time.perf_counter()
            eval_loss = float("nan")
            if due:
                eval_loss = evaluate(self.model, self.eval_windows, cfg.eval.batch_size, self.device,
                                     cfg.inner.precision)
                log.info("round %d: eval loss %.4f%s", k, eval_loss, " (the initial model)" if k == 0 else "")
            record.update(eval_loss=eval_loss, eval_s=round(time.perf_counter() - t, 3))
            self.logger.log(record)
            self._last_rec = record

        self.evals.submit(job)

    def log_missing_record(self, latest: int, resumed: bool = True) -> None:
        """Resume: a coordinator killed between committing round `latest` and logging its metrics (the evaluation
        runs in between) logs them now, from the record its COMMITTED marker carries. A new run logs round 0 here
        (`resumed` False)."""
        if any(x.get("round") == latest for x in read_jsonl(self.paths.metrics)):
            return
        try:
            record = read_json(self.paths.committed(latest)).get("record")
        except (OSError, ValueError):
            record = None
        if not isinstance(record, dict):  # a marker from before records were carried: nothing to rebuild from
            log.warning("metrics.jsonl has no record of committed round %d (and its marker carries none)", latest)
            return
        if resumed:
            log.info("logging the metrics of round %d, committed before the coordinator stopped", latest)
        self.log_record(dict(record))

    def missing_at(self, r: int) -> tuple[dict[int, str], float]:
        """The workers round r's commit record says were missing (a dead, left or late worker), with why, and when
        it was committed."""
        try:
            rec = read_json(self.paths.committed(r))
        except (OSError, ValueError):
            return {}, 0.0
        why = rec.get("missing_why") or {}
        return ({int(w): str(why.get(f"w{int(w):03d}", why.get(str(w), "missing"))) for w in rec.get("missing") or []
                 if isinstance(w, int) or str(w).isdigit()}, float(rec.get("time") or 0.0))

    def _last_metrics(self) -> dict | None:
        """The last metrics record (its cumulative tokens and steps): kept from the last log, read from the file only
        the first time (a resume). Re-reading metrics.jsonl every round cost O(rounds x workers) before each commit."""
        if self._last_rec is None:
            recs = read_jsonl(self.paths.metrics)
            self._last_rec = recs[-1] if recs else None
        return self._last_rec

    def cleanup(self, latest: int) -> None:
        """Delete rounds older than the last `keep_rounds` committed ones (θ_0 stays: it is the run's template)."""
        # overlap: workers start a segment from θ_{r−1} while round r is open: keep one round more
        oc = self.cfg.outer
        # streaming DiLoCo: a restarted worker replays up to P − 1 rounds since its last snapshot (snapshot_due)
        prune_rounds(self.paths, latest, max(oc.keep_rounds, oc.fragments) + self.overlap.rounds_ahead,
                     before_checkpoint=int(oc.late_weight > 0 and oc.compression != "none"))

    # -- the whole run --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """The whole run (resumed from the last commit); the coordinator's lease ends saying how it ended."""
        try:
            return self._run()
        except BaseException as e:
            self.lease.end(e)
            raise

    def _run(self) -> dict:
        from tqdm import tqdm

        self.setup()
        cfg, paths = self.cfg, self.paths
        start = paths.latest_committed()
        if start:
            log.info("resuming at round %d of %d (committed state in %s)", start, cfg.outer.rounds, paths.root)
        bar = tqdm(total=cfg.outer.rounds, initial=min(start, cfg.outer.rounds), desc="DiLoCo rounds",
                   unit="round", disable=not self.progress, dynamic_ncols=True)
        last = None
        for r in range(start, cfg.outer.rounds):
            rec = self.run_round(r)
            last = rec
            bar.update(1)
            bar.set_postfix(train=f"{rec['train_loss']:.3f}")
            log.info("round %d committed: train loss %.4f, %d deltas%s", r + 1, rec["train_loss"],
                     len(rec["workers_used"]), f", missing {rec['missing']}" if rec["missing"] else "")
        self.lease.set("finalizing", round=cfg.outer.rounds)
        self.evals.join()  # the last round's evaluation and record
        bar.close()
        self.finalize()
        self.logger.close()
        self.lease.set("done", round=cfg.outer.rounds)
        self.close()
        return last or (self._last_metrics() or {})

    def close(self) -> None:
        """Give up the coordinator role (its lease's final record, then its lock), as the end of the process does."""
        self.lease.end()
        self._lock_f.release()

    def finalize(self) -> None:
        """final/ = the last global model + tokenizer (from_pretrained-loadable), and loss.png."""
        cfg, paths = self.cfg, self.paths
        last = paths.latest_committed()
        src = paths.global_dir(last)
        verify_manifest(src)
        def fill(tmp) -> None:
            for name in sharedfs.listdir(src):
                if name != "MANIFEST.json" and not name.startswith("."):
                    sharedfs.copy_file(src / name, tmp / name)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))
        publish_dir(paths.final, fill)
        if self.tokenizer is not None:
            log.info("sample from the final model: %r", self.sample(paths.final))
        if cfg.logging.plot:
            from train.core.plot import plot_losses
            plot_losses(read_jsonl(paths.metrics), paths.plot, title=f"{cfg.project_name}: DiLoCo")
        self.timeline.close()  # the final timeline.png
        log.info("final model in %s", objstore.where(paths.final))


    def sample(self, model_dir, prompt: str = "\n", tokens: int = 40) -> str:
        """A short greedy-free sample (top-k 40, seeded) to show the model generates text."""
        load_weights_into(self.model, model_dir)
        self.model.eval()
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
        torch.manual_seed(self.cfg.seed)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=tokens, do_sample=True, top_k=40,
                                      pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.decode(out[0][ids.shape[1]:], skip_special_tokens=True)


def config_summary(cfg: RunConfig) -> str:
    oc = cfg.outer
    H = f"H={oc.local_steps}" if not oc.local_steps_schedule else \
        "H=" + ", ".join(f"{h} from round {r}" for r, h in oc.local_steps_schedule)
    if oc.paced:
        H = (f"rounds by time ({oc.round_time_s:g} s, each worker's H from its speed, at most {oc.local_steps}; "
             f"deltas weighted by {oc.delta_weighting})")
    if oc.fragments > 1:
        H += f" in {oc.fragments} fragments (a round syncs one: {oc.round_steps_at(0)} steps; τ = " \
             f"{oc.fragment_delay}, α = {oc.fragment_mix:g})"
    elif oc.streaming:
        H += f" (τ = {oc.fragment_delay}, α = {oc.fragment_mix:g})"
    return (f"{cfg.project_name}: {oc.num_workers} workers x {oc.rounds} rounds x {H}, outer step "
            f"{outer_step_words(oc.lr, oc.momentum, oc.nesterov)}, model {cfg.model.name}, data "
            f"{'fake' if cfg.data.fake_data else cfg.data.dataset} -> {cfg.run_dir}")


def outer_step_words(lr: float, momentum: float, nesterov: bool) -> str:
    """The outer step as a reader should take it: with momentum 0, Nesterov changes nothing, and with lr 1 too the
    step is parameter averaging, which is DiLoCo's Nesterov outer step at those two values."""
    if momentum == 0:
        if lr == 1:
            return "parameter averaging (DiLoCo's Nesterov outer step at lr 1, momentum 0)"
        return f"SGD without momentum (lr {lr:g})"
    return f"SGD with {'Nesterov ' if nesterov else ''}momentum {momentum:g}, lr {lr:g}"

