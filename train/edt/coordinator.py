"""The EDT coordinator: prepare the run, then per generation wait for the members' results, evaluate fitness,
select, cross over, and commit the next generation's jobs.

Generation g (docs/edt.md):
  jobs of g committed ─► workers mutate + evaluate every member (any worker, any order; re-queued when a lease
  expires) ─► all results in: fitness, genome.json per member, lineage.jsonl, metrics.jsonl, plots, disk cleanup
  ─► selection over the members of g and g−1 ─► crossover (streaming) ─► jobs of g+1 ─► COMMITTED of g+1.
The coordinator is light (it never trains; a merge holds about one tensor per input) and the only writer of
generation folders' jobs, genomes and markers, so it may run on any host. Rerunning it after a crash resumes at
the last committed generation: results already published are used as they are, and an uncommitted next
generation is rebuilt identically (selection and DNA draws are seeded by (seed, generation)).

Dead workers (docs/elastic.md): a job whose worker is gone — its heartbeat lease says exited / left, its process is
gone on this host, or its beat stopped for outer.dead_after_s (train/exchange/membership.py) — is re-queued at
once, without waiting for edt.job_lease_s. A job abandoned edt.max_attempts times (it keeps killing workers) does
not stop the generation: its slot is refilled by selection, a copy of a tournament-selected finished member of
the same generation (weights, optimizer state and the pre-mutation weights a crossover needs), recorded with
`refilled: true`, the reason and `copy_of` in result.json, genome.json, lineage.jsonl and the metrics record.
"""
from __future__ import annotations

import logging
import math
import socket
import time
import uuid

from train.core import logship, objstore, sharedfs
from train.config import ConfigError, RunConfig
from train.core.data import TokenData, prepare_data
from train.core.errors import UserError
from train.edt.breed import (Member, breed, load_job, population_size, write_initial_population)
from train.edt.modes import mode_of
from train.edt.protocol import (create_claim, lease_age, mark_pruned, publish_member, read_claim, requeue,
                                server_now, stale_count, write_committed, write_done, write_evaluated, write_genome)
from train.edt.store import EDTPaths, member_id
from train.status.recorder import TimelineRecorder
from train.edt.genes import fitness_function, generation_rng, rank_order, rank_pick, tournament
from train.core.coordinator_lease import NO_LEASE, CoordinatorLease, coordinator_lease_path
from train.exchange.membership import Membership, local_pid_alive
from train.core.logs import make_metric_logger
from train.core.model import WEIGHTS, build_model, check_model_fits, load_tokenizer
from train.core.store import (MANIFEST, NO_LOCK, ProtocolError, atomic_write_json, ensure_run_manifest,
                              exclusive_lock, prepare_run_dir, publish_dir, read_json, read_jsonl, verify_manifest,
                              write_manifest)
from train.core.tensorio import read_header
from train.merge.crossover import ParentFiles

log = logging.getLogger("edt-coordinator")

REFILL_WORKER = -1  # the worker id of the coordinator's own claim on a job whose slot it refills


def run_identity(cfg: RunConfig) -> dict:
    """What may not change when an EDT run is resumed (generations, genes, selection, lrs may)."""
    ident = {"strategy": "edt", "model": cfg.model.name, "initial_population": list(cfg.edt.initial_population),
             "tokenizer": cfg.model.tokenizer, "dataset": cfg.data.dataset, "fake_data": cfg.data.fake_data,
             "seq_length": cfg.data.seq_length, "population": population_size(cfg), "seed": cfg.seed}
    return {**ident, **mode_of(cfg).identity(cfg)}


class EDTCoordinator:
    def __init__(self, cfg: RunConfig, progress: bool = True, monitor=None):
        self.cfg = cfg
        self._lock_f = NO_LOCK  # the coordinator's lock, taken in setup()
        sharedfs.configure_from(cfg.outer)
        self.paths = EDTPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        logship.start()  # on an s3:// BASE_DIR: this process's log goes to the bucket too
        self.progress = progress and cfg.logging.progress
        self.monitor = monitor or (lambda: None)  # called while waiting (the simulator checks its children)
        self.P, self.G = population_size(cfg), cfg.edt.max_generations
        self.fitness = fitness_function(cfg.edt.fitness)
        self._ready = False
        self.lease = NO_LEASE  # its lease (train/core/coordinator_lease.py), started by setup() once it holds the lock
        # timeline.jsonl each generation, timeline.png redrawn in the background (train/status/recorder.py)
        self.timeline = TimelineRecorder(self.paths.root, cfg.logging.plot, title=f"{cfg.project_name}: EDT")

    # -- setup ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Everything before the workers can start: run manifest, data, generation 0. Idempotent."""
        if self._ready:
            return
        cfg, paths = self.cfg, self.paths
        self._lock_f = exclusive_lock(paths.root / "coordinator.lock", "the EDT coordinator",  # one per run
                                      lease=coordinator_lease_path(paths.root))
        # its lease, from now until it exits (workers say so when it goes silent: train/core/coordinator_lease.py)
        self.lease = CoordinatorLease(paths.root).start("preparing")
        if sharedfs.is_file(paths.run_json) and \
                read_json(paths.run_json).get("identity", {}).get("strategy") != "edt":
            raise ProtocolError(f"{paths.root} holds a DiLoCo run: give the EDT run another project_name")
        ensure_run_manifest(paths, run_identity(cfg))
        atomic_write_json(paths.config_json, cfg.to_dict())
        latest = paths.latest_generation()
        mode_of(cfg).setup(self, latest)
        done = read_json(paths.done) if sharedfs.is_file(paths.done) else None
        if done and done.get("generations", 0) < self.G:
            sharedfs.unlink(paths.done)  # asked for more generations: the workers must stay
        if latest is None:
            write_initial_population(cfg, paths, mode_of(cfg).breeding(cfg))
            write_committed(paths, 0, {"population": self.P, "bytes_read": 0, "bytes_written": 0})
        self.logger = make_metric_logger(cfg.logging.metrics, paths.root, cfg.project_name, cfg.to_dict())
        self.liveness = Membership(paths, cfg.outer.num_workers, cfg.outer)  # workers' leases, from now on
        self._refill_wait: set[tuple[int, int]] = set()
        self._ready = True

    def _setup_evomerge(self, latest: int | None) -> None:
        """Post-training: the fine-tunes must be mergeable (one architecture, vocabulary and set of shapes)."""
        from train.evomerge.breeding import check_population
        from train.evomerge.mutate import load_sft_tokenizer

        if latest is None:
            info = check_population(self.cfg)
            log.info("EvoMerge: %d models of one architecture (%s tensors), methods %s",
                     len(set(self.cfg.edt.initial_population)), len(info.get("names", [])) or "?",
                     ", ".join(self.cfg.evomerge.merge_methods))
        self.tokenizer = load_sft_tokenizer(self.cfg)

    def _setup_pretrain(self, latest: int | None) -> None:
        """Pretraining: tokenize the data once (memory-mapped by every worker), check it suits the population."""
        cfg, paths = self.cfg, self.paths
        self.tokenizer = load_tokenizer(cfg) if not cfg.data.fake_data or cfg.model.tokenizer else None
        vocab = None
        if latest is None:
            probe = build_model(cfg, (cfg.edt.initial_population or [cfg.model.name])[0])
            vocab = check_model_fits(cfg, probe, self.tokenizer)
            del probe
        else:
            vocab = read_json(paths.job_dir(latest, 0) / "config.json").get("vocab_size")
        if self.tokenizer is not None and vocab and len(self.tokenizer) > vocab:
            raise ConfigError(f"{cfg.source}: the tokenizer has {len(self.tokenizer)} tokens but the model's "
                              f"vocabulary is {vocab}: set vocab_size >= {len(self.tokenizer)} in the model config")
        data_dir = prepare_data(cfg, self.tokenizer, vocab, progress=self.progress)
        atomic_write_json(paths.data / "current.json", {"key": data_dir.name})
        data = TokenData.open(data_dir, cfg.data.seq_length, cfg.data.eval_fraction)
        for m in range(self.P):
            data.shard(m, self.P)  # fail now, clearly, if the data is too small for the population
        data.eval_windows(cfg.eval.batches * cfg.eval.batch_size)

    # -- waiting for the members ----------------------------------------------------------------------------------
    def wait_results(self, g: int) -> None:
        """Block until every member of generation g is published; re-queue jobs whose lease expired."""
        from tqdm import tqdm

        P, paths = self.P_of(g), self.paths
        steps = [int(load_job(paths, g, m)["steps"]) for m in range(P)]
        bar = tqdm(total=sum(steps), desc=f"generation {g + 1}/{self.G} mutation steps", unit="step", leave=False,
                   disable=not self.progress, dynamic_ncols=True)
        self.lease.set("collecting", generation=g)
        next_lease_check = 0.0
        while True:
            self.monitor()
            done = {m for m in range(P) if paths.has_result(g, m)}
            bar.n = min(sum(steps), sum(steps[m] for m in done) + self._running_steps(g, done))
            bar.set_postfix_str(f"members {len(done)}/{P}")
            if len(done) == P:
                break
            if time.monotonic() >= next_lease_check:
                self.check_leases(g, done)
                next_lease_check = time.monotonic() + min(1.0, self.cfg.edt.job_lease_s / 4)
            time.sleep(self.cfg.outer.poll_interval_s)
        bar.close()
        self.lease.set("evaluating", generation=g)

    def P_of(self, g: int) -> int:
        return self.paths.population(g)

    def _running_steps(self, g: int, done: set[int]) -> int:
        total = 0
        for name in sharedfs.names(self.paths.root / "workers"):
            p = self.paths.root / "workers" / name / "progress.json"
            if not name.startswith("w"):
                continue
            try:
                hb = read_json(p)
            except (OSError, ValueError):
                continue
            if hb.get("status") == "training" and hb.get("generation") == g and hb.get("member") not in done:
                total += int(hb.get("step", 0))
        return total

    def check_leases(self, g: int, done: set[int]) -> None:
        """Re-queue jobs whose worker is gone (its heartbeat) or whose claim's lease expired; refill the slots of
        jobs abandoned edt.max_attempts times."""
        now = server_now(self.paths, g)
        gone = self.liveness.gone()
        ec = self.cfg.edt
        for m in range(self.P_of(g)):
            if m in done:
                continue
            claim = read_claim(self.paths, g, m)
            if claim and claim.get("worker") == REFILL_WORKER:
                self.refill(g, m, claim.get("reason", "abandoned"))
                continue
            why = self._holder_gone(claim, gone) if claim else None
            age = lease_age(self.paths, g, m, now)
            if why is None and age is not None and age > ec.job_lease_s:
                why = f"lease expired ({age:.0f}s without renewal)"
            if why is not None and read_claim(self.paths, g, m) == claim:
                n = requeue(self.paths, g, m, why)
                log.warning("generation %d: job m%03d re-queued: %s (attempt %d of %d)", g, m, why, n,
                            ec.max_attempts)
            n = stale_count(self.paths, g, m)
            if n >= ec.max_attempts:
                self.refill(g, m, f"job abandoned {n} times (edt.max_attempts = {ec.max_attempts})")

    def _holder_gone(self, claim: dict, gone: dict[int, str]) -> str | None:
        """Why the process holding `claim` is gone (None: it may be alive). Its worker's lease says so, or the
        claim names this host and a pid that no longer runs."""
        w = claim.get("worker")
        if w in gone:
            return f"worker {w} is gone ({gone[w]})"
        pid = claim.get("pid")
        if claim.get("host") == socket.gethostname() and isinstance(pid, int) and not local_pid_alive(pid):
            return f"worker {w}'s process {pid} is gone on this host"
        return None

    # -- refilling a slot by selection ----------------------------------------------------------------------------
    def refill(self, g: int, m: int, why: str) -> bool:
        """Fill slot m of generation g with a copy of a finished member of g chosen by edt.selection (seeded by
        (seed, g, m)), instead of stopping the run. The coordinator first holds the job's claim (a worker still
        on it loses its lease); without a finished member to copy yet it keeps the claim and tries again at the
        next check. Returns True once the slot is filled."""
        paths, cfg = self.paths, self.cfg
        if paths.has_result(g, m):
            return True
        claim = read_claim(paths, g, m)
        if not claim or claim.get("worker") != REFILL_WORKER:
            if claim is not None:
                requeue(paths, g, m, f"refilled by selection: {why}")
            if not self._hold_claim(g, m, why):
                return False  # a worker claimed it in between: the next check decides again
            log.warning("generation %d: slot m%03d will be refilled by selection: %s", g, m, why)
        done = [mb for mb in (self.load_member(g, k) for k in range(self.P_of(g)) if k != m and paths.has_result(g, k))
                if math.isfinite(mb.fitness) and not mb.result.get("refilled")]
        if not done:
            if (g, m) not in self._refill_wait:
                log.warning("generation %d: slot m%03d waits for a finished member to copy", g, m)
                self._refill_wait.add((g, m))
            return False
        rng = generation_rng(cfg.seed, g, 1000 + m)
        fit = [mb.fitness for mb in done]
        src = done[tournament(fit, cfg.edt.tournament_size, rng) if cfg.edt.selection == "tournament" else
                   rank_pick(fit, rng)]
        attempt = f"refill-{uuid.uuid4().hex[:8]}"

        def fill(tmp) -> tuple[dict, None]:
            nbytes = 0
            for name in sharedfs.listdir(src.dir):
                if name not in (MANIFEST, "result.json", "genome.json") and not name.startswith("."):
                    sharedfs.copy_file(src.dir / name, tmp / name)
                    nbytes += sharedfs.stat(tmp / name).st_size
            for f in (WEIGHTS, "outer_momentum.safetensors"):  # what a crossover reads as the parent's base
                pre = paths.job_dir(g, src.m) / f
                if sharedfs.exists(pre):
                    sharedfs.copy_file(pre, tmp / f"pre-{f}")
                    nbytes += sharedfs.stat(pre).st_size
            job = load_job(paths, g, m)
            genome = {**src.genome, "id": member_id(g, m), "member": m, "elite": False, "refilled": True,
                      "refill_reason": why, "copy_of": src.id, "replaced": job["genome"].get("parents", [])}
            return {**src.result, "generation": g, "member": m, "attempt": attempt, "worker": None,
                    "refilled": True, "refill_reason": why, "copy_of": src.id, "genome": genome, "steps": 0,
                    "tokens": 0, "train_loss": None, "position": job["position"], "bytes_read": nbytes,
                    "bytes_written": nbytes, "time": time.time()}, None
        _, published = publish_member(paths, g, m, attempt, fill)
        if read_claim(paths, g, m) is not None:
            sharedfs.unlink(paths.claim(g, m))
        self._refill_wait.discard((g, m))
        if published:
            log.warning("generation %d: slot m%03d refilled by selection: a copy of %s (fitness %.4g); reason: %s",
                        g, m, src.id, src.fitness, why)
        return True

    def _hold_claim(self, g: int, m: int, why: str) -> bool:
        """The coordinator's own claim on job (g, m) (O_EXCL, like a worker's): no worker takes the job again."""
        return create_claim(self.paths, g, m, {"worker": REFILL_WORKER, "attempt": f"refill-{g}-{m}", "reason": why})

    # -- evaluation of one generation -----------------------------------------------------------------------------
    def load_member(self, g: int, m: int) -> Member:
        paths = self.paths
        job = load_job(paths, g, m)
        genome = job["genome"]
        try:
            verify_manifest(paths.member_dir(g, m), check_hashes=False)
            result = read_json(paths.result(g, m))
            if (result.get("generation"), result.get("member")) != (g, m):
                raise ProtocolError(f"result.json says {result.get('generation')}/{result.get('member')}")
            want = {k: v["shape"] for k, v in read_header(paths.job_dir(g, m) / WEIGHTS)[0].items()}
            got = {k: v["shape"] for k, v in read_header(paths.member_dir(g, m) / WEIGHTS)[0].items()}
            if want != got:
                raise ProtocolError("tensor names or shapes differ from the job's model")
            fitness = float(self.fitness(result)) if result.get("finite", True) else float("-inf")
            if result.get("refilled"):
                genome = result["genome"]
        except (ProtocolError, OSError, ValueError) as e:
            if isinstance(e, UserError) and not isinstance(e, (ProtocolError, OSError)):
                raise  # a ConfigError / DataError from edt.fitness: the config's to fix, not this member's fault
            log.error("generation %d: member m%03d rejected (%s): it takes no part in selection", g, m, e)
            result, fitness = {"rejected": str(e), "position": job["position"]}, float("-inf")
        cls = RefilledMember if result.get("refilled") else Member
        return cls(g, m, genome, result, fitness if math.isfinite(fitness) else float("-inf"), paths)

    def collect(self, g: int) -> list[Member]:
        """Fitness of every member of g; genome.json per member; lineage.jsonl and metrics.jsonl (once each)."""
        paths = self.paths
        members = [self.load_member(g, m) for m in range(self.P_of(g))]
        logged = {r.get("id") for r in read_jsonl(paths.lineage)}
        for mb in members:
            genome = {**mb.genome, "fitness": mb.fitness if math.isfinite(mb.fitness) else None,
                      "eval_loss": mb.result.get("eval_loss"), "train_loss": mb.result.get("train_loss"),
                      "tokens": mb.result.get("tokens"), "path": paths.rel(mb.dir)}
            if "scores" in mb.result:  # EvoMerge: per-task scores, kept in the lineage for the report
                genome["scores"] = mb.result["scores"]
            if mb.result.get("carried_from"):  # EvoMerge: an elite scored by its parent's evaluation
                genome["carried_from"] = mb.result["carried_from"]
            if mb.result.get("refilled"):  # a copy of another member (the slot's job kept failing)
                genome.update(refilled=True, refill_reason=mb.result.get("refill_reason"),
                              copy_of=mb.result.get("copy_of"))
            write_genome(paths, g, mb.m, genome, new_in_lineage=mb.id not in logged)
        best = members[rank_order([mb.fitness for mb in members])[0]]
        write_evaluated(paths, g, best.m, best.id, {f"m{mb.m:03d}": mb.fitness for mb in members})
        mode_of(self.cfg).evaluated(self, g, best.id)  # EvoMerge: the best member's recipe as mergekit YAML
        if not any(r.get("generation") == g for r in read_jsonl(paths.metrics)):
            self.logger.log(self.metrics_record(g, members))
        return members

    def metrics_record(self, g: int, members: list[Member]) -> dict:
        fin = [mb for mb in members if math.isfinite(mb.fitness)]
        losses = [mb.result["eval_loss"] for mb in fin]
        commit = read_json(self.paths.gen_committed(g))
        prev = [r for r in read_jsonl(self.paths.metrics) if r.get("generation", -1) < g]
        tokens = sum(mb.result.get("tokens", 0) for mb in members)
        w_bytes = sum(mb.result.get("bytes_read", 0) + mb.result.get("bytes_written", 0) for mb in members)
        c_bytes = commit.get("bytes_read", 0) + commit.get("bytes_written", 0)
        best = max(fin, key=lambda mb: mb.fitness) if fin else None
        return {
            "generation": g, "time": time.time(),
            "fitness": {f"m{mb.m:03d}": mb.fitness if math.isfinite(mb.fitness) else None for mb in members},
            "eval_loss": {f"m{mb.m:03d}": mb.result.get("eval_loss") for mb in members},
            "train_loss": {f"m{mb.m:03d}": mb.result.get("train_loss") for mb in members},
            "avg_fitness": sum(mb.fitness for mb in fin) / len(fin) if fin else None,
            "top_fitness": best.fitness if best else None, "best": best.id if best else None,
            "best_eval_loss": min(losses) if losses else None,
            "avg_eval_loss": sum(losses) / len(losses) if losses else None,
            "hyper": {f"m{mb.m:03d}": mb.genome.get("hyper") for mb in members},
            "parents": {f"m{mb.m:03d}": [p["id"] for p in mb.genome.get("parents", [])] for mb in members},
            "tokens_generation": tokens, "tokens": (prev[-1].get("tokens", 0) if prev else 0) + tokens,
            "bytes_workers": w_bytes, "bytes_coordinator": c_bytes,
            "bytes_total": (prev[-1].get("bytes_total", 0) if prev else 0) + w_bytes + c_bytes,
            "crossover_s": commit.get("crossover_s"),
            "requeued": sum(stale_count(self.paths, g, mb.m) for mb in members),
            "refilled": {f"m{mb.m:03d}": mb.result.get("refill_reason") for mb in members if mb.result.get("refilled")},
            **({"scores": {f"m{mb.m:03d}": mb.result.get("scores") for mb in members}}
               if any("scores" in mb.result for mb in members) else {}),
        }

    # -- the next generation ---------------------------------------------------------------------------------------
    def pool(self, g: int, members: list[Member]) -> list[Member]:
        """Selection pool for generation g+1: the members of g and of g−1 (the prototype's rule)."""
        prev = [self.load_member(g - 1, m) for m in range(self.P_of(g - 1))] if g > 0 else []
        return members + [p for p in prev if sharedfs.exists(p.dir / MANIFEST)]

    def make_generation(self, g: int, members: list[Member]) -> None:
        self.lease.set("breeding", generation=g)
        pool = self.pool(g - 1, members)
        positions = {}
        for m in range(self.P):  # the slot's data position continues where its last mutation stopped
            prev = next((mb for mb in members if mb.m == m), None)
            positions[m] = dict(prev.result.get("position") or load_job(self.paths, g - 1, m)["position"]) \
                if prev else {"own": 0, "mix": 0}
        stats = breed(self.cfg, self.paths, g, pool, positions, mode_of(self.cfg).breeding(self.cfg))
        write_committed(self.paths, g, {"population": self.P, "bytes_read": stats["bytes_read"],
                                        "bytes_written": stats["bytes_written"], "crossover_s": stats["crossover_s"],
                                        "pairs": stats["pairs"]})
        log.info("generation %d committed: %s", g, ", ".join(f"{k[-4:]} <- {' x '.join(v)}" if v[0] != v[1] else
                                                              f"{k[-4:]} <- {v[0]} (elite)"
                                                              for k, v in stats["pairs"].items()))

    # -- disk hygiene ---------------------------------------------------------------------------------------------
    def cleanup(self, g: int) -> None:
        """After generation g is evaluated (no job of any generation runs now, the next one does not exist yet):
        generations older than the last keep_generations lose everything but their best member."""
        keep = self.cfg.edt.keep_generations
        for d in self.paths.committed_generations():
            ev = self.paths.gen_dir(d) / "EVALUATED.json"
            if d > g - keep or not sharedfs.is_file(ev) or sharedfs.is_file(self.paths.gen_dir(d) / "PRUNED"):
                continue
            best = read_json(ev)["best"]
            victims = [self.paths.jobs_dir(d)] + [self.paths.members_dir(d) / name for name in
                                                  sharedfs.names(self.paths.members_dir(d)) if name != f"m{best:03d}"]
            for v in victims:
                try:
                    sharedfs.rmtree(v)
                except OSError:
                    continue
            self._drop_optimizer(self.paths.member_dir(d, best))
            mark_pruned(self.paths, d, member_id(d, best))

    @staticmethod
    def _drop_optimizer(member_dir) -> None:
        opt = member_dir / "optimizer.safetensors"
        if not sharedfs.is_file(opt):
            return
        old = read_json(member_dir / MANIFEST)["files"]
        sharedfs.unlink(opt)
        write_manifest(member_dir, hashes={k: v["sha256"] for k, v in old.items()})

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
        paths = self.paths
        g = paths.latest_generation()
        if g:
            log.info("resuming at generation %d of %d (committed state in %s)", g, self.G, paths.root)
        bar = tqdm(total=self.G, initial=min(g, self.G), desc="EDT generations", unit="gen",
                   disable=not self.progress, dynamic_ncols=True)
        while True:
            self.wait_results(g)
            members = self.collect(g)
            rec = [r for r in read_jsonl(paths.metrics) if r.get("generation") == g][-1]
            bar.update(1)
            bar.set_postfix(best=f"{rec['best_eval_loss']:.3f}" if rec["best_eval_loss"] else "-",
                            avg=f"{rec['avg_eval_loss']:.3f}" if rec["avg_eval_loss"] else "-")
            log.info("generation %d evaluated: best %s eval loss %s, mean %s", g, rec["best"],
                     _fmt(rec["best_eval_loss"]), _fmt(rec["avg_eval_loss"]))
            self.timeline.generation_closed(g)  # before the pruning: results hold the jobs' timings
            self.cleanup(g)
            self.plots()
            if g + 1 >= self.G:
                break
            self.make_generation(g + 1, members)
            g += 1
        bar.close()
        self.lease.set("finalizing", generation=g)
        self.timeline.close()  # the final timeline.png
        self.finalize(g, members)
        self.logger.close()
        self.lease.set("done", generation=g)
        self.close()
        return rec

    def close(self) -> None:
        """Give up the coordinator role (its lease's final record, then its lock), as the end of the process does."""
        self.lease.end()
        self._lock_f.release()

    def plots(self) -> None:
        if self.cfg.logging.plot:
            from train.edt.lineage import plot_fitness, plot_lineage
            plot_lineage(read_jsonl(self.paths.lineage), self.paths.lineage_png, title=self.cfg.project_name)
            plot_fitness(read_jsonl(self.paths.metrics), self.paths.fitness_png, title=self.cfg.project_name)

    def finalize(self, g: int, members: list[Member]) -> None:
        """final/ = the fittest member of the last generation (+ tokenizer); DONE.json lets the workers exit."""
        paths = self.paths
        best = members[rank_order([mb.fitness for mb in members])[0]]
        verify_manifest(best.dir, check_hashes=False)
        def fill(tmp) -> None:
            for name in sharedfs.listdir(best.dir):
                if name not in (MANIFEST, "optimizer.safetensors") and not name.startswith("."):
                    sharedfs.copy_file(best.dir / name, tmp / name)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))
        publish_dir(paths.final, fill)
        mode_of(self.cfg).finish(self, best.id)
        write_done(paths, g + 1, best.id)
        log.info("final model (%s, eval loss %s) in %s", best.id, _fmt(best.result.get("eval_loss")),
                 objstore.where(paths.final))


    def write_report(self, final_id: str) -> None:
        """EvoMerge: per-task scores of the parents and of the final member (evomerge_report.md/.json/.png)."""
        from train.evomerge.breeding import plot_report, report, report_markdown
        from train.edt.lineage import load_lineage
        from train.core.store import atomic_write_bytes

        rep = report(load_lineage(self.paths.root), final_id)
        atomic_write_json(self.paths.root / "evomerge_report.json", rep)
        md = report_markdown(rep)
        atomic_write_bytes(self.paths.root / "evomerge_report.md", md.encode())
        if self.cfg.logging.plot:
            plot_report(rep, self.paths.root / "evomerge_report.png", title=self.cfg.project_name)
        log.info("EvoMerge report (%s):\n%s", self.paths.root / "evomerge_report.md", md)


class RefilledMember(Member):
    """A slot refilled by selection: a copy of another member, whose pre-mutation weights and outer momentum (what
    a crossover reads as this parent's base) were copied beside its weights."""

    def files(self) -> ParentFiles:
        return ParentFiles(pre=self.dir / f"pre-{WEIGHTS}", mutated=self.dir / WEIGHTS,
                           momentum=self.dir / "pre-outer_momentum.safetensors")


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else str(x)


def config_summary(cfg: RunConfig) -> str:
    return mode_of(cfg).summary(cfg)
