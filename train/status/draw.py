"""timeline.png from a Timeline (train/status/timeline.py): lanes over time, round boundaries, marks; under it the
bytes per round and the utilisation per worker. matplotlib, headless (Agg)."""
from __future__ import annotations

from pathlib import Path

from train.core.plot import save_figure
from train.status.timeline import Timeline

COLOURS = {"compute": "#2e7d32", "publishing": "#1565c0", "waiting": "#f9a825", "idle": "#bdbdbd",
           "restarting": "#6d4c41", "collecting": "#90caf9", "reducing": "#7e57c2", "committing": "#c62828",
           "evaluating": "#26a69a", "breeding": "#ab47bc"}
MARKS = {"death": ("X", "#d50000"), "restart": ("^", "#4e342e"), "join": ("P", "#00838f"), "late": ("v", "#ef6c00"),
         "left": ("<", "#455a64"), "missed": ("x", "#d50000"), "rejected": ("D", "#880e4f"),
         "refilled": ("*", "#6a1b9a")}


def draw_timeline(tl: Timeline, out: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    n = len(tl.lanes)
    fig = plt.figure(figsize=(11, 2.2 + 0.45 * n + 2.2), dpi=100)
    gs = fig.add_gridspec(2, 2, height_ratios=[max(1.5, 0.45 * n), 2.0], width_ratios=[3, 1], hspace=0.45,
                          wspace=0.25)
    ax = fig.add_subplot(gs[0, :])
    t0 = tl.t0
    names = [ln.name for ln in tl.lanes]
    used, marks_used = set(), set()
    # One collection per (state, height) and one line per mark kind: matplotlib re-scales the axes over every
    # collection at each call, so a call per segment made a long run's picture quadratic (26k segments of a
    # 1000-round soak: over 10 minutes; batched, seconds).
    bars: dict[tuple[str, float, float], list[tuple[float, float]]] = {}
    points: dict[str, tuple[list[float], list[float]]] = {}
    # rounds by time: each compute bar says its worker's H (while the bars are few enough to read)
    hs = [(s, n - 1 - i) for i, lane in enumerate(tl.lanes) for s in lane.segments
          if s.state == "compute" and s.label.startswith("H")]
    if len(hs) <= 160:
        for s, y in hs:
            ax.text((s.start + s.end) / 2 - t0, y, s.label[1:], ha="center", va="center", fontsize=6, color="white",
                    clip_on=True)
    for i, lane in enumerate(tl.lanes):
        y = n - 1 - i
        split = any(x.sub for x in lane.segments)
        for s in lane.segments:
            if s.sub:
                base, h = y - 0.4, 0.35
            else:
                base, h = (y - 0.05, 0.45) if split else (y - 0.4, 0.8)
            bars.setdefault((s.state, base, h), []).append((s.start - t0, max(s.end - s.start, 1e-3)))
            used.add(s.state)
        for m in lane.marks:
            xs, ys = points.setdefault(m.kind, ([], []))
            xs.append(m.t - t0)
            ys.append(y + 0.45)
            marks_used.add(m.kind)
    for (state, base, h), spans in bars.items():
        ax.broken_barh(spans, (base, h), facecolors=COLOURS.get(state, "#9e9e9e"), edgecolor="none")
    for kind, (xs, ys) in points.items():
        sym, col = MARKS.get(kind, ("o", "k"))
        ax.plot(xs, ys, marker=sym, color=col, markersize=9, linestyle="none", clip_on=False)
    if tl.boundaries:  # one collection (axvline per boundary costs a line each)
        ax.vlines([t - t0 for _, t in tl.boundaries], -0.7, n - 0.2, colors="0.55", linewidth=0.6, linestyle=":")
    if tl.boundaries:
        ticks = tl.boundaries if len(tl.boundaries) <= 30 else tl.boundaries[::max(1, len(tl.boundaries) // 30)]
        top = ax.secondary_xaxis("top")
        # streaming DiLoCo: each commit syncs one fragment, named under its round (f0, f1, ...)
        top.set_xticks([t - t0 for _, t in ticks], [f"{k}\nf{tl.fragments[k]}" if k in tl.fragments else str(k)
                                                    for k, _ in ticks], fontsize=7)
        top.set_xlabel(("round committed" + (" (fN: the fragment it synced)" if tl.fragments else ""))
                       if tl.strategy == "diloco" else "generation committed", fontsize=8)
    ax.set_yticks(range(n), list(reversed(names)))
    ax.set_ylim(-0.7, n - 0.2)
    ax.set_xlim(0, max(tl.t1 - t0, 1e-3) * 1.01)
    ax.set_xlabel("seconds since the first event")
    handles = [Patch(color=COLOURS[s], label=s) for s in COLOURS if s in used]
    handles += [Line2D([], [], marker=MARKS[k][0], color=MARKS[k][1], linestyle="none", label=k)
                for k in MARKS if k in marks_used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"{tl.strategy} timeline", fontsize=10)

    bx = fig.add_subplot(gs[1, 0])
    if len(tl.bytes) > 200:  # a long run: one collection of lines, not a patch per round (bar() costs ~4 ms each)
        bx.vlines([k for k, _ in tl.bytes], 0, [b / 1e6 for _, b in tl.bytes], colors="#5c6bc0",
                  linewidth=max(0.3, 600 / len(tl.bytes)))
    elif tl.bytes and tl.fragments:  # one colour per fragment: the staggered syncs of streaming DiLoCo
        P = max(tl.fragments.values()) + 1
        cmap = matplotlib.colormaps["tab10"]
        for p in range(P):
            ks = [(k, b) for k, b in tl.bytes if tl.fragments.get(k) == p]
            bx.bar([k for k, _ in ks], [b / 1e6 for _, b in ks], color=cmap(p % 10), label=f"fragment {p}")
        bx.legend(fontsize=6, frameon=False, ncol=min(P, 4))
    elif tl.bytes:
        bx.bar([k for k, _ in tl.bytes], [b / 1e6 for _, b in tl.bytes], color="#5c6bc0")
    bx.set_xlabel("round" if tl.strategy == "diloco" else "generation")
    bx.set_ylabel("MB over BASE_DIR")
    bx.grid(alpha=0.3, axis="y")
    ux = fig.add_subplot(gs[1, 1])
    ws = sorted(tl.utilisation)
    ux.barh(range(len(ws)), [100 * tl.utilisation[w] for w in ws], color="#2e7d32")
    ux.set_yticks(range(len(ws)), ws, fontsize=7)
    ux.set_xlim(0, 100)
    ux.invert_yaxis()
    ux.set_xlabel("utilisation % (compute / span)")
    save_figure(fig, out)
