"""The research prototypes' evolution.json, still accepted: their flat upper-case keys as aliases of ours, the keys
that no longer mean anything, and the EvoMerge prototype's convention for its mode.

An alias is only another spelling: the loader (train/config/loader.py) maps it to its dotted key, and the value
then goes through exactly the coercion and validation of that key, its errors naming the key as the user wrote it
(`POPULATION_SIZE: edt.population_size = -1: must be >= 0`). What this module adds is what the prototypes meant
where our key means more (PROTOTYPE_SENTINELS), and notes where a prototype's value reads differently here.
"""
from __future__ import annotations

import json
from typing import Any

from train.config.fields import FieldError
from train.config.schema import RunConfig
from train.core.errors import ConfigError

# The research prototype's flat keys -> our dotted names.
LEGACY_KEYS = {
    "PROJECT_NAME": "project_name", "BASE_DIR": "base_dir", "INITIAL_POPULATION": "edt.initial_population",
    "MAX_GENERATIONS": "edt.max_generations", "EVAL_BATCH_SIZE": "eval.batch_size",
    "MUTATION_PROBABILITY": "edt.mutation_probability", "MUTATION_STRENGTH": "edt.mutation_strength",
    "ELITISM": "edt.elitism", "OUTER_LR": "outer.lr", "OUTER_MOMENTUM": "outer.momentum",
    "OUTER_NESTEROV": "outer.nesterov", "NUM_MACHINES": "outer.num_workers",
    "POPULATION_SIZE": "edt.population_size", "population_size": "edt.population_size",  # EvoMerge / seed README
}
# The prototype's keys that no longer mean anything, and why: accepted, with a one-line note, never used.
IGNORED_KEYS = {
    "LOCAL_PACKAGE": "the prototype copied this folder to every machine before a run; here every machine runs the "
                     "installed package of its checkout (machines.json `workdir`, `pip install -e .`), so there is "
                     "nothing to copy",
}
# Values that our key reads as "derive it from another key", which the prototypes' keys never did (their
# population_size of 8 is 8 members, seeds 000 and 001): given under a prototype's name such a value would quietly run
# something the prototype could not have meant, so it is refused there. dotted key -> (value, what to write instead).
PROTOTYPE_SENTINELS = {
    "edt.population_size": (0, "must be >= 1: the prototype's population size counts the members; for one member "
                               "per worker (outer.num_workers) leave it out or set edt.population_size = 0"),
    "edt.initial_population": ([], "must list at least one model (the prototype's generation 0); leave it out to "
                                   "start every member from model.name"),
    "project_name": (None, "must name the run's folder; leave it out for the strategy's default "
                           "(<strategy>-shakespeare)"),
}


def modern_key(name: str) -> str:
    """The dotted key a top-level name or override key stands for (itself unless it is a prototype alias)."""
    return LEGACY_KEYS.get(name, name)


def aliases_of(key: str) -> list[str]:
    return [a for a, k in LEGACY_KEYS.items() if k == key]


def drop_ignored(flat: dict[str, Any], notes: list[str]) -> None:
    for key in [k for k in flat if k in IGNORED_KEYS]:
        notes.append(f"{key} = {json.dumps(flat.pop(key))} is ignored: {IGNORED_KEYS[key]}")


def note_changed_meanings(flat: dict[str, Any], written: dict[str, str], notes: list[str]) -> None:
    """Values given under a prototype's name that are valid here but read differently from the prototype."""
    v = flat.get("edt.mutation_strength")
    if written.get("edt.mutation_strength") == "MUTATION_STRENGTH" and isinstance(v, (int, float)) and \
            not isinstance(v, bool) and v > 1:
        notes.append(f"MUTATION_STRENGTH = {v} is edt.mutation_strength, the standard deviation of a gene "
                     f"perturbation on genes in [0, 1] (the EvoMerge prototype drew integers in [-{v}, {v}] for "
                     f"genes in 1..10): above 1 a mutated gene is redrawn almost at random; 0.05-0.5 is usual")


def check_sentinels(cfg: RunConfig, written: dict[str, str]) -> None:
    """Refuse PROTOTYPE_SENTINELS values given under a prototype's name (`written`: dotted key -> the alias used)."""
    for key in written:
        if key in PROTOTYPE_SENTINELS:
            obj = cfg
            *path, name = key.split(".")
            for part in path:
                obj = getattr(obj, part)
            sentinel, allowed = PROTOTYPE_SENTINELS[key]
            if getattr(obj, name) == sentinel:
                raise FieldError(key, sentinel, allowed)


def prototype_evomerge(raw: dict, flat: dict[str, Any], notes: list[str]) -> int:
    """The EvoMerge prototype had no mode key: its evolution.json listed the fine-tunes to merge in
    INITIAL_POPULATION (the pretraining prototype: the one model every member starts from). So a prototype-style
    INITIAL_POPULATION of >= 2 different models, with no edt.mode given, means edt.mode = evomerge (with a note).
    Returns how many models it lists when that applied, else 0."""
    models = raw.get("INITIAL_POPULATION")
    if "edt.mode" in flat or not isinstance(models, list) or len({json.dumps(m) for m in models}) < 2:
        return 0
    n = len({json.dumps(m) for m in models})
    flat["edt.mode"] = "evomerge"
    notes.append(f"INITIAL_POPULATION lists {n} different models: as in the EvoMerge prototype they are merged and "
                 f"evolved (edt.mode = \"evomerge\"); set edt.mode = \"pretrain\" to pretrain them instead")
    return n


def check_prototype_evomerge(cfg: RunConfig, merged: int) -> None:
    """An EvoMerge config by the prototype's convention (`merged` models) must name its fitness tasks: the
    prototype's were fixed in its code."""
    if merged and not cfg.evomerge.tasks:
        raise ConfigError(
            f"evomerge.tasks = []: INITIAL_POPULATION lists {merged} different models, so this is an EvoMerge "
            f"config (edt.mode = \"evomerge\", as in the EvoMerge prototype, whose fitness items were fixed in "
            f"its code); name the tasks members are scored on, e.g. \"evomerge\": {{\"tasks\": [{{\"name\": "
            f"\"gsm8k\", \"data\": \"gsm8k.jsonl\", \"metric\": \"exact_match\"}}]}} (docs/evomerge.md), or "
            f"set \"edt\": {{\"mode\": \"pretrain\"}}")
