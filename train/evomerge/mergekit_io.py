"""EvoMerge speaks mergekit: a member's merge as a mergekit YAML, and a mergekit YAML as generation 0's recipe genes.

Out (`best_config.yaml`, as mergekit-evolve writes it): per generation `generations/gXXXXXX/best_config.yaml` (its
fittest member) and at the end `best_config.yaml` in the run folder (the final member). A member is a merge of two
parents by its recipe, then mutated by SFT; an elite (or a refilled slot) is a copy of an earlier member. The YAML is
the recipe of the member whose merge made the weights (the copies followed back), naming its two parents' folders
(absolute paths on BASE_DIR) and evomerge.base_model; `python -m train.merge best_config.yaml OUT` rebuilds that
merge bit for bit (mergekit-yaml: within float rounding; DARE's mask in distribution only). A member that SFT then
mutated is not what a merge gives: the YAML then reproduces the merge before mutation, the job's model
(`jobs/mXXX/`), and says so in its comments (`# reproduces: PATH`, `# sft-mutated: true`). A member of generation 0
is one of the fine-tunes as given: a passthrough of it.

In (evomerge.initial_recipe): train/evomerge/recipe.py takes the YAML's two models (and base) as the population;
`recipe_genes` turns its merge_method and parameters into the values of the recipe genes (method, t curves, weight,
density, scale) that every member of generation 0 carries, so the first children start from that recipe. What the
genome cannot encode is refused, naming the value.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from train.core import sharedfs
from train.config import ConfigError, RunConfig
from train.evomerge.recipe import KEY, TASK_VECTOR, read_recipe_yaml, recipe_models
from train.core.tensorio import read_header

log = logging.getLogger("edt-coordinator")

# EvoMerge's `normalize` per method: mergekit's defaults, except dare_ties, which normalises like ties
NORMALIZE = {"linear": True, "slerp": False, "task_arithmetic": False, "ties": True, "dare_linear": False,
             "dare_ties": True}
SPARSE = ("ties", "dare_linear", "dare_ties")
MK_NORMALIZE = {"linear": True, "task_arithmetic": False, "ties": True, "dare_linear": False, "dare_ties": False}
MK_RESCALE = {"task_arithmetic": False, "ties": False, "dare_linear": True, "dare_ties": True}
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


MACHINE_KEYS = ("reproduces", "random-seed", "sft-mutated", "run")  # best_config.yaml's `# key: value` comments


class NotExpressible(ValueError):
    """A recipe mergekit's YAML cannot say (ties with consensus_method count)."""


# -- out: a recipe as mergekit YAML ----------------------------------------------------------------------------------
def to_mergekit(recipe: dict, parents: list[str], base: str | None, out_dtype: str | None = None) -> dict:
    """The mergekit config (a dict for yaml) of one EvoMerge merge: `recipe` (train.merge.methods.Recipe as JSON)
    applied to parents [a, b] (and `base`, for the task-vector methods)."""
    m = recipe["method"]
    cfg: dict = {"merge_method": m}
    if m == "slerp":  # t = 0 is parent a: mergekit's base_model
        curves = recipe.get("t_curves") or {"default": 0.5}
        rest = curves.get("default", 0.5)
        cond = [{"filter": k, "value": v} for k, v in curves.items() if k != "default"]
        cfg["base_model"] = parents[0]
        cfg["models"] = [{"model": p} for p in parents]
        cfg["parameters"] = {"t": cond + [{"value": rest}] if cond else rest}
    else:
        if m in TASK_VECTOR:
            if base is None:
                raise ValueError(f"{m} needs the base model")
            cfg["base_model"] = base
        w = recipe.get("weights") or [0.5, 0.5]
        dens = recipe.get("density", 1.0)
        dens = list(dens) if isinstance(dens, (list, tuple)) else [dens, dens]
        models = []
        for i, p in enumerate(parents):
            params = {"weight": w[i]}
            if m in SPARSE:
                params["density"] = dens[i]
            models.append({"model": p, "parameters": params})
        cfg["models"] = models
        cfg["parameters"] = {"normalize": bool(recipe.get("normalize", NORMALIZE[m]))}
        if m in TASK_VECTOR:
            if recipe.get("consensus_method") not in (None, "sum"):
                raise NotExpressible(f"{m} with consensus_method {recipe['consensus_method']!r}: mergekit's YAML "
                                     f"has no such parameter (its {m} elects signs by sum)")
            cfg["parameters"]["lambda"] = recipe.get("lambda", 1.0)
    cfg["dtype"] = "float32"  # EvoMerge's arithmetic; the output keeps the parents' dtype
    if out_dtype and out_dtype != "float32":
        cfg["out_dtype"] = out_dtype
    return cfg


def dump_yaml(cfg: dict) -> str:
    import yaml
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=118)


def _dtype_of(model_dir: Path) -> str | None:
    """The one floating dtype of a single-file model's tensors, else None."""
    f = model_dir / "model.safetensors"
    if not sharedfs.is_file(f):
        return None
    kinds = {v["dtype"] for v in read_header(f)[0].values()} & set(ST_DTYPES)
    return ST_DTYPES[kinds.pop()] if len(kinds) == 1 else None


def model_ref(cfg: RunConfig, spec: str) -> str:
    """A model spec of the config as a mergekit reference: an absolute directory, or the hub id."""
    from train.core.model import model_source
    return model_source(cfg, spec)[1]


def origin_of(by_id: dict[str, dict], mid: str) -> tuple[dict, list[str]]:
    """The lineage record whose merge (or initial model) made member `mid`'s weights, following refilled slots
    (copy_of) and elites (a copy of their first parent) back; and the ids on the way."""
    rec, chain = by_id[mid], [mid]
    while len(chain) < 10_000:
        if rec.get("refilled") and rec.get("copy_of") in by_id:
            rec = by_id[rec["copy_of"]]
        elif rec.get("elite") and rec.get("parents"):
            rec = by_id[rec["parents"][0]["id"]]
        else:
            return rec, chain
        chain.append(rec["id"])
    raise ValueError(f"{mid}: the lineage's copies form a loop")


def member_config(cfg: RunConfig, paths, records: list[dict], mid: str, what: str) -> tuple[str, dict]:
    """(best_config.yaml's text, facts: origin, reproduces, sft, seed, missing) for member `mid` of the run whose
    layout is `paths` (train/edt/store.py's EDTPaths: `root`, `member_job_dir`), from its lineage `records`."""
    root = paths.root
    by_id = {r["id"]: r for r in records}
    rec, chain = origin_of(by_id, mid)
    oid, fitness = rec["id"], by_id[mid].get("fitness")
    sft = bool(rec.get("tokens"))
    head = [f"EvoMerge {what}: member {mid}" + ("" if fitness is None else f" (fitness {fitness:.6g})") +
            f" of the run {root}"]
    if len(chain) > 1:
        head.append(f"{mid} is a copy (elite / refilled slot) of {oid}: these are {oid}'s weights")
    info: dict = {"member": mid, "origin": oid, "sft": sft, "seed": None, "missing": []}
    if not rec.get("parents"):  # generation 0: one of the fine-tunes as given
        src = model_ref(cfg, str(rec["origin"]))
        mk: dict = {"merge_method": "passthrough", "models": [{"model": src}]}
        info["reproduces"] = src
        head.append(f"{oid} is an initial model (edt.initial_population), not a merge: passthrough of it")
    else:
        recipe = rec["hyper"]["recipe"]
        parents = [str(root / p["path"]) for p in rec["parents"]]
        base = model_ref(cfg, cfg.evomerge.base_model) if recipe["method"] in TASK_VECTOR else None
        try:
            mk = to_mergekit(recipe, parents, base, _dtype_of(Path(parents[0])))
        except NotExpressible as e:
            text = _comments(head + [f"{oid} was made by {e}: no mergekit recipe."])
            return text, {**info, "reproduces": None}
        info["reproduces"] = str(paths.member_job_dir(oid))
        head.append(f"{oid} = {recipe['method']} of {' x '.join(p['id'] for p in rec['parents'])} (the folders "
                    f"below)" + (" on evomerge.base_model" if base else ""))
        if recipe["method"].startswith("dare"):
            info["seed"] = int(recipe["seed"])
            head.append("DARE's mask: --random-seed below makes python -m train.merge draw EvoMerge's mask bit for "
                        "bit; mergekit-yaml draws its own mask of the same density")
    head.append(f"reproduces: {info['reproduces']}")
    if info["seed"] is not None:
        head.append(f"random-seed: {info['seed']}")
    head.append(f"sft-mutated: {str(sft).lower()}")
    if sft:
        head.append(f"{oid} was then mutated by SFT ({rec.get('tokens')} tokens): this YAML rebuilds the model "
                    f"before that mutation (the folder above); the member's own weights are the model after SFT")
    else:
        head.append(f"{oid} was not trained after it was made: this YAML rebuilds the member itself")
    seed_flag = "" if info["seed"] is None else f" --random-seed {info['seed']}"
    head.append(f"run: python -m train.merge best_config.yaml OUT{seed_flag}   (or mergekit-yaml, same arguments)")
    local = [info["reproduces"]] + [e["model"] for e in mk["models"]] + [mk.get("base_model")]
    for p in dict.fromkeys(x for x in local if x and x.startswith("/")):
        if not sharedfs.exists(p):
            info["missing"].append(p)
            head.append(f"NOTE: {p} no longer exists (edt.keep_generations keeps only the best member of older "
                        f"generations): raise edt.keep_generations to keep every folder a best_config names")
    return _comments(head) + dump_yaml(mk), info


def _comments(lines: list[str]) -> str:
    """Comment lines; prose wrapped at 118 columns, `key: value` lines (read by tools) kept whole."""
    import textwrap
    out = []
    for line in lines:
        if line.split(":", 1)[0] in MACHINE_KEYS:
            out.append(f"# {line}")
        else:
            out += textwrap.wrap(line, 116, initial_indent="# ", subsequent_indent="#   ", break_long_words=False,
                                 break_on_hyphens=False)
    return "\n".join(out) + "\n"


def write_best_config(cfg: RunConfig, paths, load_records, mid: str, out: Path, what: str) -> dict | None:
    """Write best_config.yaml for member `mid` (atomically) of the run whose layout is `paths` (as member_config),
    its lineage read by `load_records()`. A failure is logged, never fatal to the run."""
    from train.core.store import atomic_write_bytes

    try:
        text, info = member_config(cfg, paths, load_records(), mid, what)
        atomic_write_bytes(out, text.encode())
    except (KeyError, ValueError, OSError) as e:
        log.warning("best_config.yaml of %s not written (%s: %s)", mid, type(e).__name__, e)
        return None
    if info["missing"]:
        log.warning("%s names folders that no longer exist: %s", out, ", ".join(info["missing"]))
    log.info("%s: %s's recipe as mergekit YAML (rebuilds %s%s)", out, mid, info["reproduces"],
             ", the merge before SFT" if info["sft"] else "")
    return info


# -- in: a mergekit YAML as the recipe genes of generation 0 ---------------------------------------------------------
ALLOWED_TOP = {"merge_method", "models", "base_model", "parameters", "dtype", "out_dtype", "tokenizer_source",
               "chat_template", "name"}
PER_MODEL = {"linear": {"weight"}, "slerp": set(), "task_arithmetic": {"weight", "density"},
             "ties": {"weight", "density"}, "dare_linear": {"weight", "density"}, "dare_ties": {"weight", "density"}}
SHARED = {"linear": {"normalize"}, "slerp": {"t"}, **{m: {"normalize", "lambda", "rescale", "int8_mask"}
                                                      for m in TASK_VECTOR}}


def recipe_genes(cfg: RunConfig, genes: dict) -> dict[str, float]:
    """The recipe genes (values u in [0, 1]) that decode to the recipe of evomerge.initial_recipe; ConfigError for
    anything the genome cannot encode exactly."""
    value = cfg.evomerge.initial_recipe
    path = Path(cfg.resolve_path(value))

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{cfg.source}: {KEY} = {value!r}: {why}")

    try:
        raw = read_recipe_yaml(path, value)
        recipe_models(raw, path.parent, value)
    except ConfigError as e:
        raise ConfigError(f"{cfg.source}: {e}") from None
    unknown = set(raw) - ALLOWED_TOP
    if unknown:
        raise refuse(f"key(s) {sorted(unknown)} cannot seed EvoMerge's recipe genes")
    method, methods = raw["merge_method"], cfg.evomerge.merge_methods
    if method not in methods:
        raise refuse(f"merge_method {method} is not among evomerge.methods {methods}: add it")
    top = raw.get("parameters") or {}
    base = raw.get("base_model")
    entries = [e for e in raw["models"] if method in ("linear", "slerp") or e["model"] != base]
    per = [e.get("parameters") or {} for e in entries]
    for where, keys, ok in [("parameters", set(top), PER_MODEL[method] | SHARED[method])] + \
            [(f"models[{e['model']}].parameters", set(p), PER_MODEL[method]) for e, p in zip(entries, per)]:
        if keys - ok:
            raise refuse(f"{where}: {sorted(keys - ok)} is not a parameter EvoMerge's {method} genome encodes "
                         f"(it takes {sorted(ok) or 'none'})")

    def num(v, what: str, lo: float | None = None, hi: float | None = None) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise refuse(f"{what} = {v!r}: the genome holds one number here (no gradient, no filter list)")
        if lo is not None and not lo - 1e-12 <= v <= hi + 1e-12:
            raise refuse(f"{what} = {v!r} is outside its gene's range [{lo}, {hi}]: widen the range in the config")
        return float(v)

    def gene(name: str, v: float) -> None:
        if name in genes:
            lo, hi = (float(x) for x in genes[name])
            out[name] = 0.5 if hi == lo else min(1.0, max(0.0, (v - lo) / (hi - lo)))

    out: dict[str, float] = {}
    if "method" in genes:
        out["method"] = (methods.index(method) + 0.5) / len(methods)
    if method == "slerp":
        attn, mlp, rest = _slerp_curves(top.get("t", None), cfg.evomerge.curve_points, refuse)
        for i in range(cfg.evomerge.curve_points):
            gene(f"t_attn_{i}", attn[i])
            gene(f"t_mlp_{i}", mlp[i])
        gene("t_rest", rest)
        return out
    for key in ("normalize", "rescale", "int8_mask"):
        if key in top and not isinstance(top[key], bool):
            raise refuse(f"parameters.{key} = {top[key]!r}: must be true or false")
    if top.get("rescale", MK_RESCALE.get(method)) != MK_RESCALE.get(method):
        raise refuse(f"rescale: {top['rescale']} for {method}: EvoMerge's {method} keeps mergekit's default "
                     f"({MK_RESCALE.get(method)})")
    normalize = top.get("normalize", MK_NORMALIZE[method])
    w = [num(p.get("weight", top.get("weight")), f"models[{e['model']}] weight") for e, p in zip(entries, per)]
    total = sum(w)
    if min(w) < 0 or total <= 0:
        raise refuse(f"weights {w}: EvoMerge's are w and 1 - w (non-negative)")
    lam = num(top.get("lambda", 1.0), "lambda") if method in TASK_VECTOR else 1.0
    if normalize != NORMALIZE[method]:
        if NORMALIZE[method] or method == "linear":  # sign-electing methods: normalising is not a scale
            if method != "linear" or abs(total - 1.0) > 1e-9:
                raise refuse(f"normalize: {str(normalize).lower()} for {method}: EvoMerge's {method} uses normalize: "
                             f"{str(NORMALIZE[method]).lower()}, which gives another model here")
    elif not normalize and method in TASK_VECTOR:
        lam *= total  # λ Σ wᵢ δᵢ = (λ Σw) Σ (wᵢ / Σw) δᵢ
    lo, hi = cfg.evomerge.weight
    gene("weight", num(w[0] / total, "weight (of the first model, normalised)", lo, hi))
    if method in SPARSE:
        d = [num(p.get("density", top.get("density", 1.0)), f"models[{e['model']}] density")
             for e, p in zip(entries, per)]
        if abs(d[0] - d[1]) > 1e-12:
            raise refuse(f"densities {d}: the genome holds one density for both parents")
        gene("density", num(d[0], "density", *cfg.evomerge.density))
    if method in TASK_VECTOR:
        gene("scale", num(lam, "lambda (x the weights' sum when normalize is false)", *cfg.evomerge.scale))
        if method in ("ties", "dare_ties") and cfg.evomerge.consensus_method != "sum":
            raise refuse(f"{method} in a mergekit YAML elects signs by sum; evomerge.consensus_method is "
                         f"{cfg.evomerge.consensus_method}")
    return out


def _slerp_curves(t, k: int, refuse) -> tuple[list[float], list[float], float]:
    """slerp's t as EvoMerge's genes: a number, or [{filter: self_attn | mlp, value: t or k points}, ...,
    {value: t}] (the filterless entry: every other tensor, one number)."""
    def curve(v, what: str) -> list[float]:
        vals = v if isinstance(v, list) else [v]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in vals):
            raise refuse(f"t ({what}) = {v!r}: numbers in [0, 1]")
        if len(vals) == 1:
            return [float(vals[0])] * k
        if len(vals) != k:
            raise refuse(f"t ({what}) has {len(vals)} points: the genome's curves have evomerge.curve_points = {k} "
                         f"(set it to {len(vals)})")
        return [float(x) for x in vals]

    if t is None:
        raise refuse("slerp needs parameters.t")
    if isinstance(t, dict):
        t = [t]
    if not isinstance(t, list) or not t or not all(isinstance(c, dict) for c in t):
        if isinstance(t, list) and len(t) > 1:
            raise refuse(f"t = {t!r}: one gradient for every tensor; EvoMerge's genome holds one t for the tensors "
                         f"outside self_attn / mlp: write [{{filter: self_attn, value: [...]}}, {{filter: mlp, value: "
                         f"[...]}}, {{value: T}}]")
        r = curve(t, "every tensor")[0]
        return [r] * k, [r] * k, r
    found: dict = {}
    rest = None
    for c in t:
        flt = c.get("filter")
        if set(c) - {"filter", "value"} or "value" not in c:
            raise refuse(f"t entry {c!r}: {{filter, value}}")
        if flt in (None, "*"):
            rest = c["value"]
            break  # mergekit stops at the first match: later entries are never read
        if flt not in ("self_attn", "mlp"):
            raise refuse(f"t filter {flt!r}: the genome has t curves for self_attn and mlp only")
        found.setdefault(flt, c["value"])
    if rest is None or isinstance(rest, list) and len(rest) > 1:
        raise refuse("t needs a filterless entry with one number (the t of every tensor outside self_attn / mlp)")
    r = curve(rest, "rest")[0]
    return curve(found.get("self_attn", r), "self_attn"), curve(found.get("mlp", r), "mlp"), r
