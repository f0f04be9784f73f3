"""Plots written into the run folder (matplotlib, headless)."""
from __future__ import annotations

import os
from pathlib import Path


def plot_losses(records: list[dict], out: Path, title: str = "") -> None:
    """Train and eval loss against tokens (per worker and in total) from metrics.jsonl records."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_round = {}
    for rec in records:  # a resumed run may have logged a round twice: keep the last
        if "round" in rec:
            by_round[rec["round"]] = rec
    recs = [by_round[k] for k in sorted(by_round)]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if recs:
        tr = [(r["tokens"], r["train_loss"]) for r in recs if r.get("train_loss") is not None]
        ax.plot([t for t, _ in tr], [v for _, v in tr], marker=".", label="train loss (mean over workers)")
        ev = [(r["tokens"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
        if ev:
            ax.plot([t for t, _ in ev], [v for _, v in ev], marker="o", label="eval loss (global model)")
    ax.set_xlabel("tokens (all workers)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)


def save_figure(fig, out: Path) -> None:
    """Write a figure atomically (a temp name, then a rename: a viewer never opens half a PNG) and close it."""
    import matplotlib.pyplot as plt

    from train.core import sharedfs

    sharedfs.makedirs(out.parent)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    sharedfs.replace(tmp, out)  # an object store (train/core/objstore.py): the upload
