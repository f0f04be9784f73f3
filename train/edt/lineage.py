"""An EDT run's population and lineage, for notebooks and plots (read-only; matplotlib headless).

    load_lineage(run_dir)        every genome ever evaluated (lineage.jsonl: survives disk cleanup)
    load_population(run_dir, g)  the members of generation g (default: the latest evaluated one) with their files
    plot_lineage / plot_fitness  lineage.png (who descends from whom, coloured by eval loss) and fitness.png
"""
from __future__ import annotations

import math
from pathlib import Path

from train.core import sharedfs
from train.core.plot import save_figure
from train.edt.store import EDTPaths, parse_member_id
from train.core.store import base_path, read_json, read_jsonl


def load_lineage(run_dir: str | Path) -> list[dict]:
    """Genomes (id, generation, member, parents, dna, hyper, mutated, elite, fitness, eval_loss, path), one per
    evaluated member, in the order they were evaluated (the last record of an id wins after a resume)."""
    by_id: dict[str, dict] = {}
    for rec in read_jsonl(EDTPaths(base_path(run_dir)).lineage):  # a folder, or s3://bucket/prefix/<project>
        by_id[rec["id"]] = rec
    return sorted(by_id.values(), key=lambda r: (r["generation"], r["member"]))


def load_population(run_dir: str | Path, generation: int | None = None) -> list[dict]:
    """The evaluated members of one generation: their genome plus `model_dir` (a from_pretrained-loadable folder,
    or None when disk cleanup removed it; on an s3:// run, this machine's copy) and `result` (the worker's
    result.json, when still on disk)."""
    paths = EDTPaths(base_path(run_dir))
    lineage = load_lineage(run_dir)
    if generation is None:
        gens = [r["generation"] for r in lineage]
        if not gens:
            return []
        generation = max(gens)
    out = []
    for rec in (r for r in lineage if r["generation"] == generation):
        mdir = paths.member_dir(generation, rec["member"])
        res = paths.result(generation, rec["member"])
        model = sharedfs.is_file(mdir / "model.safetensors")  # on a bucket: downloaded to this machine's mirror
        out.append({**rec, "model_dir": str(sharedfs.local_copy(mdir)) if model else None,
                    "result": read_json(res) if sharedfs.is_file(res) else None})
    return out


def plot_lineage(records: list[dict], out: Path, title: str = "") -> None:
    """Generation on x, member slot on y; a line from each parent to its child (thick: elite carried); points
    coloured by eval loss (EvoMerge: by fitness); mutated DNA drawn as a ring."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_id = {}
    for r in records:
        by_id[r["id"]] = r
    recs = list(by_id.values())
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * (1 + max([r["generation"] for r in recs], default=0))), 4.5),
                           dpi=110)
    for r in recs:
        for p in r.get("parents", []):
            pg, pm = parse_member_id(p["id"])
            ax.plot([pg, r["generation"]], [pm, r["member"]], color="0.35" if r.get("elite") else "0.7",
                    lw=2.2 if r.get("elite") else 0.8, zorder=1)
    # Pretraining: colour by eval loss (what fitness ranks). EvoMerge: by fitness, the weighted task score.
    by_fitness = any("scores" in r for r in recs)
    key, cmap, label = (("fitness", "viridis_r", "fitness: weighted task score (darker = fitter)") if by_fitness
                        else ("eval_loss", "viridis", "eval loss (darker = fitter)"))
    losses = [r.get(key) for r in recs]
    ok = [(r, v) for r, v in zip(recs, losses) if isinstance(v, (int, float)) and math.isfinite(v)]
    if ok:
        sc = ax.scatter([r["generation"] for r, _ in ok], [r["member"] for r, _ in ok], c=[v for _, v in ok],
                        cmap=cmap, s=60, zorder=2, edgecolors=["red" if r.get("mutated") else "none"
                                                                   for r, _ in ok], linewidths=1.5)
        fig.colorbar(sc, ax=ax, label=label)
    bad = [r for r, v in zip(recs, losses) if not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        ax.scatter([r["generation"] for r in bad], [r["member"] for r in bad], marker="x", color="red", zorder=2,
                   label="diverged / rejected")
        ax.legend(loc="upper left")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generation")
    ax.set_ylabel("member slot")
    ax.set_title(f"{title} lineage (thick: elite; red ring: DNA mutated)".strip())
    ax.grid(alpha=0.2)
    fig.tight_layout()
    save_figure(fig, out)


def plot_fitness(records: list[dict], out: Path, title: str = "") -> None:
    """Average and top fitness per generation (left axis), best and mean eval loss (right axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_gen = {r["generation"]: r for r in records if "generation" in r}
    gens = sorted(by_gen)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for key, label, style in (("top_fitness", "top fitness", "o-"), ("avg_fitness", "average fitness", ".--")):
        pts = [(g, by_gen[g][key]) for g in gens if by_gen[g].get(key) is not None]
        ax.plot([g for g, _ in pts], [v for _, v in pts], style, label=label)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generation")
    ax.set_ylabel("fitness")
    ax2 = ax.twinx()
    for key, label, style in (("best_eval_loss", "best eval loss", "s:"), ("avg_eval_loss", "mean eval loss", "x:")):
        pts = [(g, by_gen[g][key]) for g in gens if by_gen[g].get(key) is not None]
        ax2.plot([g for g, _ in pts], [v for _, v in pts], style, color="tab:red", alpha=0.7, label=label)
    ax2.set_ylabel("eval loss (nats/token)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center right")
    ax.set_title(f"{title} fitness per generation".strip())
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
