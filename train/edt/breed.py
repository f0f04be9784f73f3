"""Making a generation on disk: the initial population, and children by selection + DNA + streaming crossover.

Everything here is deterministic for (seed, generation): a coordinator that crashed while writing generation g+1
writes exactly the same jobs again when rerun. A job folder is written to a temp name with its manifest and moved
into place whole; the generation's COMMITTED marker (edt_coordinator) comes after all of them.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from train.core import sharedfs
from train.config import ConfigError, RunConfig
from train.edt.protocol import publish_job
from train.edt.store import EDTPaths, member_id
from train.edt.genes import (crossover_dna, decode, fit_dna, generation_rng, mutate_dna, random_dna, select_pairs)
from train.merge.crossover import MergeSpec, ParentFiles, merge_files
from train.core.model import WEIGHTS, build_model, model_source
from train.core.store import PROTOCOL_VERSION, read_json

log = logging.getLogger("edt-coordinator")


@dataclass
class Member:
    """One evaluated member: where its files are, its genome (from its job) and its result."""
    g: int
    m: int
    genome: dict
    result: dict
    fitness: float
    paths: EDTPaths = field(repr=False)

    @property
    def id(self) -> str:
        return member_id(self.g, self.m)

    @property
    def dir(self) -> Path:
        return self.paths.member_dir(self.g, self.m)

    def files(self) -> ParentFiles:
        job = self.paths.job_dir(self.g, self.m)
        return ParentFiles(pre=job / WEIGHTS, mutated=self.dir / WEIGHTS, momentum=job / "outer_momentum.safetensors")


def base_hyper(cfg: RunConfig) -> dict[str, float]:
    """The hyperparameters a gene falls back to when the DNA does not carry it."""
    return {"inner_lr": cfg.inner.lr, "outer_lr": cfg.outer.lr, "outer_momentum": cfg.outer.momentum,
            "data_mix": 0.0}


def steps_per_mutation(cfg: RunConfig) -> int:
    return cfg.edt.mutation_steps or cfg.outer.local_steps


def population_size(cfg: RunConfig) -> int:
    return cfg.edt.population_size or cfg.outer.num_workers


def job_record(cfg: RunConfig, g: int, m: int, genome: dict, position: dict, optimizer_from: str | None) -> dict:
    S = steps_per_mutation(cfg)
    return {"protocol": PROTOCOL_VERSION, "generation": g, "member": m, "id": member_id(g, m), "steps": S,
            "schedule_step": g * S, "schedule_total": cfg.inner.total_steps or cfg.edt.max_generations * S,
            "population": population_size(cfg), "hyper": genome["hyper"], "position": position,
            "optimizer_from": optimizer_from, "genome": genome}


# -- generation 0 ----------------------------------------------------------------------------------------------------
def initial_specs(cfg: RunConfig, P: int) -> list[str]:
    """INITIAL_POPULATION, filled by random choice when shorter than the population (the prototype's rule)."""
    specs = list(cfg.edt.initial_population) or [cfg.model.name]
    if len(specs) > P:
        raise ConfigError(f"edt.initial_population has {len(specs)} models but the population is {P}: raise "
                          f"edt.population_size or list fewer models")
    rng = generation_rng(cfg.seed, 0, 2)
    return specs + [rng.choice(specs) for _ in range(P - len(specs))]


def write_initial_population(cfg: RunConfig, paths: EDTPaths, breeding) -> list[str]:
    """Generation 0's jobs: each member is its model as loaded/initialised (one seed: members that share a config
    start identical, as DiLoCo's workers do) with a random DNA. Returns the specs used."""
    P = population_size(cfg)
    specs = initial_specs(cfg, P)
    dna_rng = generation_rng(cfg.seed, 0, 1)
    shapes = None
    built: dict[str, object] = {}
    for m, spec in enumerate(specs):
        model = built.get(spec) or build_model(cfg, spec)
        built[spec] = model
        sh = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if shapes is not None and sh != shapes:
            raise ConfigError(f"edt.initial_population: {spec!r} has another architecture than {specs[0]!r}; "
                              f"crossover needs every member to have the same tensor names and shapes")
        shapes = sh
        dna = breeding.initial_dna(fit_dna(random_dna(breeding.genes, dna_rng), breeding.genes, dna_rng))
        genome = {"id": member_id(0, m), "generation": 0, "member": m, "parents": [], "origin": spec,
                  "kind": model_source(cfg, spec)[0], "dna": dna, "mutated": False, "elite": False,
                  "hyper": breeding.hyper(dna, 0, m)}
        job = job_record(cfg, 0, m, genome, {"own": 0, "mix": 0}, None)
        job["steps"] = breeding.steps(0, elite=False)
        publish_job(paths, 0, m, lambda tmp, model=model: model.save_pretrained(str(tmp), safe_serialization=True),
                    job)
    log.info("generation 0: %d members from %s", P, sorted(set(specs)))
    return specs


# -- children --------------------------------------------------------------------------------------------------------
def assign_slots(pairs: list[tuple[int, int]], pool: list[Member], P: int) -> list[int]:
    """Slot of each child: an elite keeps its own slot (its data shard) when free, the rest fill slots in order."""
    slots: list[int | None] = [None] * len(pairs)
    taken: set[int] = set()
    for k, (a, b) in enumerate(pairs):
        if a == b and pool[a].m not in taken and pool[a].m < P:
            slots[k] = pool[a].m
            taken.add(pool[a].m)
    free = iter(s for s in range(P) if s not in taken)
    return [s if s is not None else next(free) for s in slots]


class PretrainBreeding:
    """What a DNA means and how a child's weights are made in evolutionary pretraining (edt.mode = pretrain).
    The same interface as train.evomerge.breeding.EvoMergeBreeding (post-training), which train/edt/modes.py picks
    instead."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.genes = cfg.edt.genes  # gene -> [low, high]

    def hyper(self, dna: dict, g: int, m: int) -> dict:
        """The hyperparameters a DNA selects."""
        return decode(dna, self.cfg.edt.genes, base_hyper(self.cfg))

    def initial_dna(self, dna: dict) -> dict:
        """A DNA of generation 0 (random: pretraining has no initial recipe)."""
        return dna

    def origin(self, hyper: dict, elite: bool) -> str:
        return self.cfg.edt.crossover

    def steps(self, g: int, elite: bool) -> int:
        """Mutation steps of a job (every member of every generation trains)."""
        return steps_per_mutation(self.cfg)

    def fill(self, g: int, a: Member, b: Member, hyper: dict, elite: bool, stats: dict) -> Callable[[Path], str]:
        """The child's weights by the configured crossover (an elite: a one-worker outer step with itself)."""
        cfg = self.cfg
        spec = MergeSpec(cfg.edt.crossover, cfg.edt.t_curves, hyper["outer_lr"], hyper["outer_momentum"],
                         cfg.outer.nesterov)

        def fill(tmp: Path) -> str:
            for fname in ("config.json", "generation_config.json"):
                if sharedfs.is_file(a.dir / fname):
                    sharedfs.copy_file(a.dir / fname, tmp / fname)
            io = merge_files(spec, a.files(), b.files(), tmp / WEIGHTS, tmp / "outer_momentum.safetensors")
            if not io["finite"]:
                log.warning("generation %d: child of %s x %s has non-finite weights", g, a.id, b.id)
            stats["bytes_read"] += io["bytes_read"]
            stats["bytes_written"] += io["bytes_written"]
            return io["sha256"]
        return fill


def breed(cfg: RunConfig, paths: EDTPaths, g: int, pool: list[Member], positions: dict[int, dict], breeding) -> dict:
    """Write generation g's jobs from the pool (members of g-1 and g-2) with the mode's breeding strategy
    (PretrainBreeding here, or train.evomerge.breeding.EvoMergeBreeding). Returns I/O stats and the pairs."""
    ec = cfg.edt
    P = population_size(cfg)
    pool = [p for p in pool if math.isfinite(p.fitness)]  # diverged or rejected members take no part
    if not pool:
        raise ConfigError(f"generation {g - 1}: every member diverged (non-finite eval loss); lower inner.lr or "
                          f"the inner_lr gene range and start a new run")
    pairs = select_pairs([p.fitness for p in pool], P, ec.elitism, ec.selection, ec.tournament_size,
                         generation_rng(cfg.seed, g, 0))
    slots = assign_slots(pairs, pool, P)
    dna_rng = generation_rng(cfg.seed, g, 1)
    stats = {"bytes_read": 0, "bytes_written": 0, "pairs": {}}
    t0 = time.perf_counter()
    for k, ((ia, ib), slot) in enumerate(zip(pairs, slots)):
        a, b = pool[ia], pool[ib]
        elite = k < min(ec.elitism, P, len(pool)) and ia == ib
        if elite:
            dna, mutated = dict(a.genome["dna"]), False
        else:
            dna, mutated = mutate_dna(crossover_dna(a.genome["dna"], b.genome["dna"], dna_rng),
                                      ec.mutation_probability, ec.mutation_strength, dna_rng)
        dna = fit_dna(dna, breeding.genes, dna_rng)
        hyper = breeding.hyper(dna, g, slot)
        genome = {"id": member_id(g, slot), "generation": g, "member": slot, "elite": elite, "dna": dna,
                  "mutated": mutated, "hyper": hyper, "origin": breeding.origin(hyper, elite),
                  "parents": [{"id": p.id, "path": paths.rel(p.dir), "fitness": p.fitness,
                               "eval_loss": p.result.get("eval_loss")} for p in (a, b)]}
        opt = a.dir / "optimizer.safetensors"
        job = job_record(cfg, g, slot, genome, positions[slot],
                         paths.rel(opt) if ec.inherit_optimizer and sharedfs.is_file(opt) else None)
        job["steps"] = breeding.steps(g, elite)
        publish_job(paths, g, slot, breeding.fill(g, a, b, hyper, elite, stats), job)
        stats["pairs"][member_id(g, slot)] = [a.id, b.id]
    stats["crossover_s"] = round(time.perf_counter() - t0, 3)
    return stats


def load_job(paths: EDTPaths, g: int, m: int) -> dict:
    return read_json(paths.job_json(g, m))
