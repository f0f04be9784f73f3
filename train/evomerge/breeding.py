"""EvoMerge (EDT in post-training mode): the recipe genome, children by streaming merges, and the report.

The population starts from several fine-tunes of one architecture (edt.initial_population). Each child of a
generation is a *merge* of its two parents by the recipe its DNA encodes, then a mutation by SFT on the data mix the
same DNA encodes (train/evomerge/mutate.py, on a worker), then a task evaluation (fitness). The recipe evolves with
the weights: selection, uniform DNA crossover and Gaussian gene mutation act on these genes (train/edt/genes.py):

    method             which merge (evomerge.methods): linear, slerp, task_arithmetic, ties, dare_linear, dare_ties
    t_attn_i, t_mlp_i  slerp's t-curves for self_attn / mlp tensors (evomerge.curve_points points each), t_rest for
                       everything else (embeddings, norms, lm_head): mergekit "gradients" with filters
    weight             the first parent's weight w (the second's 1 - w) in linear and task-vector merges
    density            fraction of each task vector that ties / dare keep
    scale              lambda: the factor on the merged task vector (task_arithmetic, ties, dare)
    mix_<dataset>      the SFT data mix of the mutation (normalised over evomerge.datasets)
    inner_lr           the SFT learning rate (x inner.lr, log scale; when edt.genes has it)

Every gene is a number u in [0, 1]; `decode_evomerge` turns a DNA into the concrete recipe (a merge Recipe as a JSON
dict), the mix and the lr, which go into job.json / genome.json as `hyper`, so a lineage shows which recipe made
every member. An elite is carried unchanged (no merge, no SFT).
"""
from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Callable

from train.core import sharedfs
from train.core.errors import ConfigError, NotFound
from train.config import BASE_METHODS, RunConfig
from train.edt.genes import decode as decode_genes
from train.evomerge.mergekit_io import NORMALIZE, SPARSE, recipe_genes

log = logging.getLogger("edt-coordinator")


# -- the genome ------------------------------------------------------------------------------------------------------
def evomerge_genes(cfg: RunConfig) -> dict[str, list[float]]:
    """The genes of an EvoMerge DNA and their value ranges (only the genes the configured methods use)."""
    em, methods = cfg.evomerge, cfg.evomerge.merge_methods
    genes: dict[str, list[float]] = {}
    if len(methods) > 1:
        genes["method"] = [0.0, 1.0]
    if "slerp" in methods:
        for i in range(em.curve_points):
            genes[f"t_attn_{i}"] = [0.0, 1.0]
            genes[f"t_mlp_{i}"] = [0.0, 1.0]
        genes["t_rest"] = [0.0, 1.0]
    if set(methods) - {"slerp"}:
        genes["weight"] = list(em.weight)
    if set(methods) & set(SPARSE):
        genes["density"] = list(em.density)
    if set(methods) & set(BASE_METHODS):
        genes["scale"] = list(em.scale)
    if len(em.datasets) > 1:
        for name in em.datasets:
            genes[f"mix_{name}"] = [0.0, 1.0]
    if "inner_lr" in cfg.edt.genes:
        genes["inner_lr"] = list(cfg.edt.genes["inner_lr"])
    return genes


def _value(dna: dict, genes: dict, name: str, default: float) -> float:
    if name not in genes or name not in dna:
        return default
    lo, hi = genes[name]
    return float(lo) + (float(hi) - float(lo)) * min(1.0, max(0.0, float(dna[name])))


def decode_evomerge(dna: dict, cfg: RunConfig, g: int, m: int) -> dict:
    """A DNA -> {"method", "recipe" (merge Recipe as JSON), "mix" {dataset: weight}, "inner_lr"}."""
    em, genes = cfg.evomerge, evomerge_genes(cfg)
    methods = em.merge_methods
    u = min(1.0, max(0.0, float(dna.get("method", 0.0))))
    method = methods[min(int(u * len(methods)), len(methods) - 1)]
    recipe: dict = {"method": method, "normalize": NORMALIZE[method]}
    if method == "slerp":
        k = em.curve_points
        recipe["t_curves"] = {"self_attn": [round(_value(dna, genes, f"t_attn_{i}", 0.5), 6) for i in range(k)],
                              "mlp": [round(_value(dna, genes, f"t_mlp_{i}", 0.5), 6) for i in range(k)],
                              "default": round(_value(dna, genes, "t_rest", 0.5), 6)}
    else:
        w = _value(dna, genes, "weight", 0.5)
        recipe["weights"] = [round(w, 6), round(1.0 - w, 6)]
    if method in SPARSE:
        recipe["density"] = round(_value(dna, genes, "density", 1.0), 6)
    if method in ("ties", "dare_ties"):
        recipe["consensus_method"] = em.consensus_method
    if method in BASE_METHODS:
        recipe["lambda"] = round(_value(dna, genes, "scale", 1.0), 6)
    if method.startswith("dare"):
        recipe["seed"] = (cfg.seed * 1_000_003 + g) * 1009 + m  # DARE's random stream: a rerun merges identically
    names = list(em.datasets)
    raw = {n: float(dna.get(f"mix_{n}", 1.0)) for n in names}
    total = sum(raw.values())
    mix = {n: round(v / total if total > 0 else 1.0 / len(names), 6) for n, v in raw.items()}
    lr = decode_genes(dna, {"inner_lr": genes["inner_lr"]} if "inner_lr" in genes else {},
                      {"inner_lr": cfg.inner.lr, "outer_lr": 0.0, "outer_momentum": 0.0, "data_mix": 0.0})["inner_lr"]
    return {"method": method, "recipe": recipe, "mix": mix, "inner_lr": lr}


# -- models on disk --------------------------------------------------------------------------------------------------
def local_model_dir(cfg: RunConfig, spec: str) -> Path:
    """A model spec as a local HF directory: a directory as is, a hub id through the HF cache (download when the
    hub is reachable, else a clear error)."""
    from train.core.model import hub_error, model_source

    kind, path = model_source(cfg, spec)
    if kind == "dir":
        return Path(path)
    if kind == "config":
        raise ConfigError(f"{cfg.source}: edt.initial_population / evomerge.base_model: {spec}: EvoMerge merges "
                          f"trained models; a config JSON has no weights (use a model directory or a hub id)")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(path, revision=cfg.model.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # noqa: BLE001  (offline, unknown repo, ...: one clear message)
        raise hub_error("model", path, e) from e


def base_model_dir_of(cfg: RunConfig) -> Path | None:
    return local_model_dir(cfg, cfg.evomerge.base_model) if cfg.evomerge.base_model else None


def check_population(cfg: RunConfig) -> dict:
    """Architecture, tensor names, shapes and vocabulary of every initial model (and the base) agree: a clear
    error before any work is done."""
    from train.merge.stream import check_compatible

    try:
        dirs = [local_model_dir(cfg, s) for s in dict.fromkeys(cfg.edt.initial_population)]
        base = base_model_dir_of(cfg)
    except FileNotFoundError as e:
        hint = (" (the offline demo's models: run `python scripts/make_specialists.py` first)"
                if "evomerge-models" in str(e) else "")
        raise NotFound(f"{cfg.source}: edt.initial_population / evomerge.base_model: {e}{hint}") from None
    return check_compatible(dirs, base)


class EvoMergeBreeding:
    """edt_breed's breeding strategy in evomerge mode (the interface of edt_breed.PretrainBreeding): the recipe
    genome, children by streaming merges, elites carried unchanged, generation 0 evaluated as given."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.genes = evomerge_genes(cfg)

    def hyper(self, dna: dict, g: int, m: int) -> dict:
        return decode_evomerge(dna, self.cfg, g, m)

    def initial_dna(self, dna: dict) -> dict:
        """A DNA of generation 0: random, but with evomerge.initial_recipe's recipe genes when it is set."""
        return {**dna, **recipe_genes(self.cfg, self.genes)} if self.cfg.evomerge.initial_recipe else dna

    def origin(self, hyper: dict, elite: bool) -> str:
        return "elite" if elite else hyper["method"]

    def steps(self, g: int, elite: bool) -> int:
        """SFT steps of a job: none for an elite (carried unchanged: its fitness can only be matched, never lost),
        none for generation 0 unless evomerge.train_initial (the fine-tunes as given are the baseline), none
        without evomerge.datasets (the merges alone evolve)."""
        cfg = self.cfg
        if elite or (g == 0 and not cfg.evomerge.train_initial) or not cfg.evomerge.datasets:
            return 0
        return cfg.edt.mutation_steps or cfg.outer.local_steps

    def fill(self, g: int, a, b, hyper: dict, elite: bool, stats: dict) -> Callable[[Path], str | None]:
        """Writes a child's model files into a job's temp dir: an elite's files as they are, else the merge of the
        parents' (mutated) weights by the child's recipe, streaming tensor by tensor."""
        from train.merge.methods import Recipe
        from train.merge.stream import merge_model_dirs
        from train.core.model import WEIGHTS
        cfg = self.cfg

        def fill(tmp: Path) -> str | None:
            if elite:
                for f in ("config.json", "generation_config.json", WEIGHTS):
                    if sharedfs.is_file(a.dir / f):
                        sharedfs.copy_file(a.dir / f, tmp / f)
                stats["bytes_read"] += sharedfs.stat(a.dir / WEIGHTS).st_size
                stats["bytes_written"] += sharedfs.stat(a.dir / WEIGHTS).st_size
                return None
            out = tmp / "merged"
            # the parents by name (an object store: their mirror copies, downloaded)
            io = merge_model_dirs(Recipe.from_dict(hyper["recipe"]), [sharedfs.local_copy(a.dir),
                                                                      sharedfs.local_copy(b.dir)], out,
                                  base_model_dir=base_model_dir_of(cfg))
            for f in out.iterdir():
                if f.name != "MANIFEST.json":
                    f.rename(tmp / f.name)
            shutil.rmtree(out)
            if not io.get("finite", True):
                log.warning("generation %d: merge of %s x %s has non-finite weights", g, a.id, b.id)
            stats["bytes_read"] += io["bytes_read"]
            stats["bytes_written"] += io["bytes_written"]
            return io["sha256"]
        return fill


# -- the report ------------------------------------------------------------------------------------------------------
def report(records: list[dict], final_id: str | None) -> dict:
    """Per-task scores of every initial model (the parents) and of the final member, from the lineage."""
    by_origin: dict[str, dict] = {}
    for r in records:
        if r.get("generation") == 0 and r.get("scores") is not None:
            by_origin.setdefault(str(r.get("origin")), r)
    evolved = [r for r in records if r.get("generation", 0) > 0 and r.get("scores") is not None]
    final = next((r for r in records if r.get("id") == final_id), None)
    best_ever = max(evolved, key=lambda r: r.get("fitness") if r.get("fitness") is not None else -math.inf,
                    default=None)
    rows = [{"model": Path(o).name or o, "id": r["id"], "scores": r["scores"], "fitness": r.get("fitness")}
            for o, r in by_origin.items()]
    if final is not None:
        rows.append({"model": f"final ({final['id']}, {final.get('hyper', {}).get('method', final.get('origin'))})",
                     "id": final["id"], "scores": final["scores"], "fitness": final.get("fitness")})
    return {"rows": rows, "final": final_id,
            "best_evolved": best_ever["id"] if best_ever else None,
            "final_recipe": (final or {}).get("hyper")}


def report_markdown(rep: dict) -> str:
    tasks = sorted({t for row in rep["rows"] for t in row["scores"]})
    lines = ["| model | " + " | ".join(tasks) + " | mean | fitness |", "|---" * (len(tasks) + 3) + "|"]
    for row in rep["rows"]:
        vals = [row["scores"].get(t) for t in tasks]
        nums = [v for v in vals if isinstance(v, (int, float))]
        mean = f"{sum(nums) / len(nums):.3f}" if nums else "-"
        fit = "-" if row["fitness"] is None else f"{row['fitness']:.4f}"
        lines.append(f"| {row['model']} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) +
                     f" | {mean} | {fit} |")
    return "\n".join(lines) + "\n"


def plot_report(rep: dict, out: Path, title: str = "") -> None:
    """Grouped bars: per-task score of each parent and of the final member."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.core.plot import save_figure

    tasks = sorted({t for row in rep["rows"] for t in row["scores"]})
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.6))
    width = 0.8 / max(1, len(rep["rows"]))
    for i, row in enumerate(rep["rows"]):
        xs = [j + (i - (len(rep["rows"]) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, [row["scores"].get(t) or 0.0 for t in tasks], width, label=row["model"])
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("score (exact match: accuracy)")
    ax.set_title(title or "EvoMerge: parents vs the evolved merge")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out)
