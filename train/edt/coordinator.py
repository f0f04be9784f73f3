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
"""
from __future__ import annotations

import logging
import math
import shutil
import time

from train.core.config import ConfigError, RunConfig
from train.core.data import TokenData, prepare_data
from train.edt.breed import (Member, breed, load_job, population_size, write_initial_population)
from train.edt.modes import mode_of
from train.edt.store import EDTPaths, lease_age, member_id, requeue, server_now, stale_count, write_committed
from train.core.evolution import fitness_function, rank_order
from train.core.logs import make_metric_logger
from train.core.model import WEIGHTS, build_model, check_model_fits, load_tokenizer
from train.core.store import (MANIFEST, ProtocolError, append_jsonl, atomic_publish_dir, atomic_write_json,
                              ensure_run_manifest, exclusive_lock, new_tmp_dir, prepare_run_dir, read_json, read_jsonl,
                              verify_manifest, write_manifest)
from train.core.tensorio import read_header

log = logging.getLogger("edt-coordinator")


def run_identity(cfg: RunConfig) -> dict:
    """What may not change when an EDT run is resumed (generations, genes, selection, lrs may)."""
    ident = {"strategy": "edt", "model": cfg.model.name, "initial_population": list(cfg.edt.initial_population),
             "tokenizer": cfg.model.tokenizer, "dataset": cfg.data.dataset, "fake_data": cfg.data.fake_data,
             "seq_length": cfg.data.seq_length, "population": population_size(cfg), "seed": cfg.seed}
    return {**ident, **mode_of(cfg).identity(cfg)}


class EDTCoordinator:
    def __init__(self, cfg: RunConfig, progress: bool = True, monitor=None):
        self.cfg = cfg
        self.paths = EDTPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        self.progress = progress and cfg.logging.progress
        self.monitor = monitor or (lambda: None)  # called while waiting (the simulator checks its children)
        self.P, self.G = population_size(cfg), cfg.edt.max_generations
        self.fitness = fitness_function(cfg.edt.fitness)
        self._ready = False

    # -- setup ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Everything before the workers can start: run manifest, data, generation 0. Idempotent."""
        if self._ready:
            return
        cfg, paths = self.cfg, self.paths
        self._lock_f = exclusive_lock(paths.root / "coordinator.lock", "the EDT coordinator")  # one per run
        if paths.run_json.is_file() and read_json(paths.run_json).get("identity", {}).get("strategy") != "edt":
            raise ProtocolError(f"{paths.root} holds a DiLoCo run: give the EDT run another project_name")
        ensure_run_manifest(paths, run_identity(cfg))
        atomic_write_json(paths.config_json, cfg.to_dict())
        latest = paths.latest_generation()
        mode_of(cfg).setup(self, latest)
        done = read_json(paths.done) if paths.done.is_file() else None
        if done and done.get("generations", 0) < self.G:
            paths.done.unlink()  # asked for more generations: the workers must stay
        if latest is None:
            write_initial_population(cfg, paths, mode_of(cfg).breeding(cfg))
            write_committed(paths, 0, {"population": self.P, "bytes_read": 0, "bytes_written": 0})
        self.logger = make_metric_logger(cfg.logging.metrics, paths.root, cfg.project_name, cfg.to_dict())
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

    def P_of(self, g: int) -> int:
        return self.paths.population(g)

    def _running_steps(self, g: int, done: set[int]) -> int:
        total = 0
        for p in self.paths.root.glob("workers/w*/progress.json"):
            try:
                hb = read_json(p)
            except (OSError, ValueError):
                continue
            if hb.get("status") == "training" and hb.get("generation") == g and hb.get("member") not in done:
                total += int(hb.get("step", 0))
        return total

    def check_leases(self, g: int, done: set[int]) -> None:
        now = server_now(self.paths, g)
        for m in range(self.P_of(g)):
            if m in done:
                continue
            age = lease_age(self.paths, g, m, now)
            if age is not None and age > self.cfg.edt.job_lease_s:
                n = requeue(self.paths, g, m, f"lease expired ({age:.0f}s without renewal)")
                log.warning("generation %d: job m%03d re-queued, its worker stopped renewing the lease "
                            "(attempt %d of %d)", g, m, n, self.cfg.edt.max_attempts)
            if stale_count(self.paths, g, m) >= self.cfg.edt.max_attempts:
                raise RuntimeError(f"generation {g}: job m{m:03d} was abandoned {self.cfg.edt.max_attempts} times "
                                   f"(see {self.paths.jobs_dir(g)} and the worker logs); fix the cause and rerun")

    # -- evaluation of one generation -----------------------------------------------------------------------------
    def load_member(self, g: int, m: int) -> Member:
        paths = self.paths
        job = load_job(paths, g, m)
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
        except (ProtocolError, OSError, ValueError) as e:
            log.error("generation %d: member m%03d rejected (%s): it takes no part in selection", g, m, e)
            result, fitness = {"rejected": str(e), "position": job["position"]}, float("-inf")
        return Member(g, m, job["genome"], result, fitness if math.isfinite(fitness) else float("-inf"), paths)

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
            if mb.dir.is_dir():
                atomic_write_json(paths.genome(g, mb.m), genome)
            if mb.id not in logged:
                append_jsonl(paths.lineage, genome)
        best = members[rank_order([mb.fitness for mb in members])[0]]
        atomic_write_json(paths.gen_dir(g) / "EVALUATED.json", {"generation": g, "best": best.m, "best_id": best.id,
                                                                "fitness": {f"m{mb.m:03d}": mb.fitness for mb in
                                                                            members}})
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
            **({"scores": {f"m{mb.m:03d}": mb.result.get("scores") for mb in members}}
               if any("scores" in mb.result for mb in members) else {}),
        }

    # -- the next generation ---------------------------------------------------------------------------------------
    def pool(self, g: int, members: list[Member]) -> list[Member]:
        """Selection pool for generation g+1: the members of g and of g−1 (the prototype's rule)."""
        prev = [self.load_member(g - 1, m) for m in range(self.P_of(g - 1))] if g > 0 else []
        return members + [p for p in prev if p.dir.is_dir()]

    def make_generation(self, g: int, members: list[Member]) -> None:
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
            if d > g - keep or not ev.is_file() or (self.paths.gen_dir(d) / "PRUNED").is_file():
                continue
            best = read_json(ev)["best"]
            victims = [self.paths.jobs_dir(d)] + [p for p in self.paths.members_dir(d).iterdir()
                                                  if p.name != f"m{best:03d}"]
            for v in victims:
                trash = v.with_name(f".{v.name}.deleting")
                try:
                    v.rename(trash)
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
            self._drop_optimizer(self.paths.member_dir(d, best))
            atomic_write_json(self.paths.gen_dir(d) / "PRUNED", {"kept": member_id(d, best), "time": time.time()})

    @staticmethod
    def _drop_optimizer(member_dir) -> None:
        opt = member_dir / "optimizer.safetensors"
        if not opt.is_file():
            return
        old = read_json(member_dir / MANIFEST)["files"]
        opt.unlink()
        write_manifest(member_dir, hashes={k: v["sha256"] for k, v in old.items()})

    # -- the whole run --------------------------------------------------------------------------------------------
    def run(self) -> dict:
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
            self.cleanup(g)
            self.plots()
            if g + 1 >= self.G:
                break
            self.make_generation(g + 1, members)
            g += 1
        bar.close()
        self.finalize(g, members)
        self.logger.close()
        self.close()
        return rec

    def close(self) -> None:
        """Give up the coordinator role (its lock), as the end of the process does."""
        if getattr(self, "_lock_f", None) is not None:
            self._lock_f.close()
            self._lock_f = None

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
        tmp = new_tmp_dir(paths.final)
        for f in best.dir.iterdir():
            if f.is_file() and f.name not in (MANIFEST, "optimizer.safetensors"):
                shutil.copy2(f, tmp / f.name)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(tmp))
        write_manifest(tmp)
        atomic_publish_dir(tmp, paths.final)
        mode_of(self.cfg).finish(self, best.id)
        atomic_write_json(paths.done, {"generations": g + 1, "best": best.id, "time": time.time()})
        log.info("final model (%s, eval loss %s) in %s", best.id, _fmt(best.result.get("eval_loss")), paths.final)


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


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else str(x)


def config_summary(cfg: RunConfig) -> str:
    return mode_of(cfg).summary(cfg)
