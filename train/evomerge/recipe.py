"""`evomerge.initial_recipe`: a mergekit YAML whose models become the run's when the config names none.

Read when the config is built, in every process of the run, so that all of them agree on edt.initial_population
and evomerge.base_model. Only the YAML's structure is read here (which two models a pairwise child merges, which
base); its merge_method and parameters seed generation 0's recipe genes on the coordinator
(train/evomerge/mergekit_io.py), which refuses any value the genome cannot encode. A model reference is looked up
beside the YAML first (as mergekit does), then as the config resolves a model (its folder, the repo, the hub).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from train.config.fields import bad_value

KEY = "evomerge.initial_recipe"
TASK_VECTOR = ("task_arithmetic", "ties", "dare_linear", "dare_ties")   # merge model - base
PAIRWISE = ("linear", "slerp", *TASK_VECTOR)                             # what an EvoMerge child can be


def read_recipe_yaml(path: Path, value: str) -> dict:
    """The YAML as a mapping (ConfigError naming evomerge.initial_recipe otherwise)."""
    import yaml

    if not path.is_file():
        raise bad_value(KEY, value, f"no such file ({path}): give a mergekit YAML (merge_method, models, parameters)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise bad_value(KEY, value, f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise bad_value(KEY, value, "must be a mapping with merge_method and models (a mergekit YAML)")
    return raw


def recipe_models(raw: dict, yaml_dir: Path, value: str) -> tuple[list[str], str | None]:
    """(the two models a pairwise child of this recipe merges, in the YAML's order; the base model of a task-vector
    method, else None). slerp's base_model is its first model (t = 0), as in mergekit."""
    def refuse(why: str):
        return bad_value(KEY, value, why)

    if "slices" in raw or "modules" in raw:
        raise refuse("slices / modules (frankenmerges, passthrough of layer ranges) cannot seed EvoMerge: a child is "
                     "a merge of two whole models; use `models:`")
    method = raw.get("merge_method")
    if method not in PAIRWISE:
        raise refuse(f"merge_method {method!r}: EvoMerge's genome encodes {', '.join(PAIRWISE)} (a pairwise merge)")
    entries = raw.get("models")
    if not isinstance(entries, list) or not entries or \
            not all(isinstance(e, dict) and isinstance(e.get("model"), str) and e["model"] for e in entries):
        raise refuse("models: a list of {model: path or hub id, parameters: {...}} is required")
    refs = [e["model"] for e in entries]
    base = raw.get("base_model")
    if base is not None and (not isinstance(base, str) or not base):
        raise refuse(f"base_model {base!r} must be a path or hub id")
    for ref in refs + ([base] if base else []):
        if "+" in ref or "@" in ref:
            raise refuse(f"model {ref!r}: LoRA (model+lora) and @revision references are not supported here; give "
                         f"a directory or a hub id (model.revision sets the revision)")
    if method == "slerp":
        if base is None:
            raise refuse("slerp needs base_model (its t = 0 model), as in mergekit")
        models = list(dict.fromkeys([base, *refs]))
    elif method == "linear":
        if base is not None and base not in refs:
            raise refuse("linear with a base_model that is not among the models merges the base as one more model; "
                         "list it under models or drop it")
        models, base = list(dict.fromkeys(refs)), None
    else:
        if base is None:
            raise refuse(f"{method} merges task vectors: base_model is required")
        models = list(dict.fromkeys(r for r in refs if r != base))
    if len(models) != 2:
        raise refuse(f"{method} of {len(models)} model(s) besides the base: an EvoMerge child is a merge of exactly "
                     f"two parents, so the recipe must merge two models")
    return [_beside(yaml_dir, m) for m in models], (_beside(yaml_dir, base) if base else None)


def _beside(yaml_dir: Path, ref: str) -> str:
    """A reference that names a directory beside the YAML, made absolute; anything else as written."""
    cand = yaml_dir / os.path.expanduser(ref)
    return str(cand.resolve()) if cand.is_dir() else ref


def apply_initial_recipe(cfg: Any) -> None:
    """Fill edt.initial_population (when empty) and evomerge.base_model (when empty) from the YAML's models;
    refuse a base_model that differs from the configured one. Idempotent (validate may run twice)."""
    value = cfg.evomerge.initial_recipe
    if cfg.edt.mode != "evomerge":
        raise bad_value(KEY, value, "is for edt.mode = \"evomerge\" (it seeds the recipe genes of a merge)")
    path = Path(cfg.resolve_path(value))
    models, base = recipe_models(read_recipe_yaml(path, value), path.parent, value)
    if not cfg.edt.initial_population:
        cfg.edt.initial_population = models
    if base is not None:
        if not cfg.evomerge.base_model:
            cfg.evomerge.base_model = base
        elif not _same(cfg, cfg.evomerge.base_model, base):
            raise bad_value(KEY, value, f"its base_model {base!r} differs from evomerge.base_model "
                                        f"{cfg.evomerge.base_model!r}: leave that out or make the two equal")


def _same(cfg: Any, a: str, b: str) -> bool:
    return os.path.realpath(cfg.resolve_path(a)) == os.path.realpath(cfg.resolve_path(b)) or a == b
