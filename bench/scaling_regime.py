"""The paper's regime in outer steps: bench/scaling.py's default study (its --short flag keeps the 10-outer-step one).

Charles et al. 2025 (arXiv 2503.09799) train for about a hundred outer steps or more; with 10 (the short study),
outer momentum cannot warm up. Here every run has T = 2700 inner steps, so H = 30 is 90 outer steps, and H = 10 and
H = 100 (270 and 27 outer steps) are run at equal tokens. The study is staged, as a tuner would do it by hand:

  1. tune    DP at every inner lr of --lrs (seed --seeds[0]);
  2. outer   for every M at H = 30, at DP's best inner lr and the first seed: the paper's Nesterov step (momentum 0.9)
             at outer lr 0.4, 0.6, 0.8 and 1.0, plain (heavy-ball) momentum 0.9 at lr 0.6, and averaging (lr 1,
             momentum 0; for M > 1: with one worker it is DP itself);
  3. inner   for every M, the best Nesterov step and averaging again at the other inner lrs (the paper tunes the inner
             lr of every configuration);
  4. seeds   DP and those rows at their best inner lr on every seed;
  5. H       for every M, its better outer step at H = 10 and H = 100 on every seed (same tokens, same inner lr);
  6. beyond  at the largest M, H = 30, on the first --beyond-seeds seeds (2, --quick 1: the default ~100 minutes):
             the delayed and eager overlapped outer steps (with that M's better outer step), MuLoCo (Muon inner, the
             same outer step) with a DP Muon row, and the sparse exchange (topk 1.56%, 2-bit values) with the
             paper's recipe (chunk 4096, outer lr 1) against the setting tuned in docs/compression.md (chunk 128,
             outer lr 4).

Every run is a real diloco_sim.py run (bench/scaling.run) recorded in bench/results/<out>-runs.jsonl under the
fingerprint of the training code, so an interrupted study picks up where it stopped and --report redraws the table.
Writes bench/results/<out>.{md,json,png}.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import RESULTS, code_fingerprint, save_result, table

NESTEROV_LRS = (0.4, 0.6, 0.8, 1.0)
TOPK = {"paper": ("topk, the paper's recipe (chunk 4096, outer lr 1)", 4096, 1.0),
        "tuned": ("topk, tuned (chunk 128, outer lr 4)", 128, 4.0)}


def outer_steps(M: int, quick: bool) -> list[dict]:
    """The outer steps swept at H = 30 for M workers: name, lr, momentum, nesterov, family."""
    lrs = (0.6, 1.0) if quick else NESTEROV_LRS
    out = [{"outer": f"Nesterov 0.9, lr {lr:g}", "lr": lr, "mom": 0.9, "nesterov": True, "family": "nesterov"}
           for lr in lrs]
    if not quick:
        out.append({"outer": "heavy-ball momentum 0.9, lr 0.6", "lr": 0.6, "mom": 0.9, "nesterov": False,
                    "family": "heavy-ball"})
    if M > 1:  # one worker averaged with itself is DP
        out.append({"outer": "averaging (lr 1, momentum 0)", "lr": 1.0, "mom": 0.0, "nesterov": True,
                    "family": "averaging"})
    return out


def row(M: int, H: int, step: dict, inner_lr: float, extra: tuple[str, ...] = (), label: str = "") -> dict:
    name = "DP" if M == 0 else f"{'MuLoCo' if 'inner.optimizer=muon' in extra else 'DiLoCo'} M={M} H={H}, " \
                                f"{step['outer']}" + (f", {label}" if label else "")
    return {"name": name, "M": M, "H": H, "lr": step["lr"], "mom": step["mom"], "nesterov": step["nesterov"],
            "family": step["family"], "outer": step["outer"], "sets": list(extra), "inner_lr": inner_lr,
            "paper": None}


DP_STEP = {"outer": "", "lr": 1.0, "mom": 0.0, "nesterov": True, "family": "dp"}


class Study:
    """Runs (or finds recorded) one row on one seed at a time; the stages decide what to run next."""

    def __init__(self, args, scaling):
        self.a, self.s = args, scaling
        self.code = code_fingerprint()
        self.cache_path = RESULTS / f"{args.out}-runs.jsonl"
        self.cache = {} if args.fresh or not self.cache_path.exists() else \
            {(e := json.loads(line))["key"]: e["result"] for line in self.cache_path.read_text().splitlines()}
        self.before = set(self.cache)
        self.lock = threading.Lock()
        self.base = Path(tempfile.mkdtemp(prefix="edt-scaling-"))
        self.results: dict[tuple[str, float, int], dict] = {}
        self.skipped: list[str] = []

    def key(self, r: dict, seed: int) -> str:
        return self.s.run_key(self.sets(r, seed), self.code)

    def sets(self, r: dict, seed: int) -> list[str]:
        return self.s.overrides(self.a, r, seed)

    def one(self, job: tuple[dict, int]) -> None:
        r, seed = job
        key = self.key(r, seed)
        if key not in self.cache:
            if self.a.report:
                self.skipped.append(f"{r['name']} @ {r['inner_lr']:g} seed {seed}")
                return
            threads = max(1, (os.cpu_count() or 1) // (self.a.jobs * max(r["M"], 1)))
            tag = f"r{abs(hash(key)) % 10 ** 8}"
            res = self.s.run(self.base, tag, self.sets(r, seed), threads, self.a.timeout)
            with self.lock:
                self.cache[key] = res
                with self.cache_path.open("a") as f:
                    f.write(json.dumps({"key": key, "result": res}) + "\n")
        res = self.cache[key]
        self.results[(r["name"], r["inner_lr"], seed)] = res
        print(f"  {r['name']} @ inner lr {r['inner_lr']:g}, seed {seed}: eval loss {res['eval_loss']:.4f} "
              f"({res['seconds']:.0f}s)", flush=True)

    def run_all(self, jobs: list[tuple[dict, int]]) -> None:
        # the largest M first: they take longest, so the pool's two slots end together
        jobs = sorted(jobs, key=lambda j: -max(j[0]["M"], 1) * (1 + 2 * (j[0]["H"] == 10)))
        with ThreadPoolExecutor(self.a.jobs) as pool:
            list(pool.map(self.one, jobs))

    def loss(self, r: dict, seed: int) -> float | None:
        res = self.results.get((r["name"], r["inner_lr"], seed))
        return None if res is None else res["eval_loss"]

    def mean(self, r: dict, seeds: list[int]) -> float:
        xs = [x for s in seeds if (x := self.loss(r, s)) is not None]
        return statistics.mean(xs) if xs else float("inf")


def study(args, scaling) -> None:
    st = Study(args, scaling)
    RESULTS.mkdir(parents=True, exist_ok=True)
    seeds, s0 = args.seeds, args.seeds[0]
    t0 = time.perf_counter()
    try:
        # 1. DP's inner lr
        dps = [row(0, args.steps, DP_STEP, lr) for lr in args.lrs]
        print(f"stage 1/6: DP at inner lr {', '.join(f'{x:g}' for x in args.lrs)} (seed {s0})", flush=True)
        st.run_all([(r, s0) for r in dps])
        dp = min(dps, key=lambda r: st.mean(r, [s0]))
        lr0 = dp["inner_lr"]
        # 2. the outer step at H = 30, at DP's inner lr
        sweep = {M: [row(M, 30, o, lr0) for o in outer_steps(M, args.quick)] for M in args.M}
        print(f"stage 2/6: the outer step at H = 30 for M = {args.M} at inner lr {lr0:g} (seed {s0})", flush=True)
        st.run_all([(r, s0) for M in args.M for r in sweep[M]])
        # 3. the inner lr of the best Nesterov step and of averaging, per M
        chosen: dict[int, list[dict]] = {}
        for M in args.M:
            fams = [f for f in ("nesterov", "averaging") if any(r["family"] == f for r in sweep[M])]
            best = [min((r for r in sweep[M] if r["family"] == f), key=lambda r: st.mean(r, [s0])) for f in fams]
            chosen[M] = best
        retune = [dict(r, inner_lr=lr) for M in args.M for r in chosen[M] for lr in args.lrs if lr != lr0]
        print(f"stage 3/6: {len(retune)} runs: the inner lr of the best Nesterov step and of averaging (seed {s0})",
              flush=True)
        st.run_all([(r, s0) for r in retune])
        for M in args.M:
            chosen[M] = [min([r] + [x for x in retune if x["name"] == r["name"]], key=lambda x: st.mean(x, [s0]))
                         for r in chosen[M]]
        # 4. every seed
        final = [dp] + [r for M in args.M for r in chosen[M]]
        print(f"stage 4/6: DP and {len(final) - 1} tuned rows on seeds {seeds}", flush=True)
        st.run_all([(r, s) for r in final for s in seeds])
        better = {M: min(chosen[M], key=lambda r: st.mean(r, seeds)) for M in args.M}
        # 5. H = 10 and 100 at equal tokens
        hrows = [dict(better[M], name=better[M]["name"].replace("H=30", f"H={H}"), H=H)
                 for H in args.H if H != 30 for M in args.M]
        print(f"stage 5/6: H = {[h for h in args.H if h != 30]} for the better outer step of each M, seeds {seeds}",
              flush=True)
        st.run_all([(r, s) for r in hrows for s in seeds])
        # 6. beyond the paper, at the largest M
        big = max(args.M)
        b = better[big]
        step = {k: b[k] for k in ("outer", "lr", "mom", "nesterov", "family")}
        extra = []
        if not args.core_only:
            for rule in ("delayed", "eager"):
                extra.append(row(big, 30, step, b["inner_lr"], (f"outer.overlap={rule}", "outer.overlap_steps=30"),
                                 f"{rule} outer step"))
            muon = ("inner.optimizer=muon",)
            extra.append(dict(row(0, args.steps, DP_STEP, lr0, muon), name="DP, Muon"))
            extra.append(row(big, 30, step, b["inner_lr"], muon))
            if big > 1:
                for what in ("paper", "tuned"):
                    label, chunk, lr = TOPK[what]
                    extra.append(dict(row(big, 30, {"outer": label, "lr": lr, "mom": 0.0, "nesterov": True,
                                                    "family": "topk"}, b["inner_lr"],
                                          ("outer.compression=topk", f"outer.chunk_size={chunk}"))))
        few = seeds[:args.beyond_seeds]
        for r in extra:
            r["seeds"] = few
        print(f"stage 6/6: {len(extra)} rows beyond the paper at M = {big}, H = 30, seeds {few}", flush=True)
        st.run_all([(r, s) for r in extra for s in few])
    finally:
        shutil.rmtree(st.base, ignore_errors=True)
    wall = time.perf_counter() - t0
    report(args, scaling, st, dp, sweep, retune, final, hrows, extra, wall)


def report(args, scaling, st: Study, dp, sweep, retune, final, hrows, extra, wall) -> None:
    seeds, s0 = args.seeds, args.seeds[0]
    dp_loss = {s: st.loss(dp, s) for s in seeds}

    def vs(r: dict) -> list[float]:
        return [(st.loss(r, s) / dp_loss[s] - 1) * 100 for s in r.get("seeds", seeds)
                if st.loss(r, s) is not None and dp_loss[s] is not None]

    def line(r: dict, many: bool = True) -> list:
        use = r.get("seeds", seeds) if many else [s0]
        losses = [st.loss(r, s) for s in use]
        if any(x is None for x in losses):
            return [r["name"], r["inner_lr"], "not run", "", "", "", ""]
        d = [(st.loss(r, s) / dp_loss[s] - 1) * 100 for s in use if dp_loss[s] is not None]
        paper = scaling.PAPER.get(r["M"]) if r["H"] == 30 and r["family"] in ("nesterov", "averaging") else None
        judged = scaling.verdict(d, paper) if (paper is not None and many and d) else ""
        return [r["name"], f"{r['inner_lr']:g}", f"{statistics.mean(losses):.4f}",
                " ".join(f"{x:.4f}" for x in losses),
                "—" if r is dp else " ".join(f"{x:+.2f}%" for x in d),
                "—" if r is dp or not d else f"{statistics.mean(d):+.2f}%",
                "" if paper is None else f"{paper:+.1f}%" + (f": {judged}" if judged else "")]

    head = ["run", "inner lr", "eval loss", "per seed", "vs DP (per seed)", "vs DP", "paper (35M, C4, H = 30)"]
    main = [line(r) for r in final + hrows + extra]
    every = [line(dict(dp, inner_lr=lr), False) for lr in args.lrs] + \
            [line(r, False) for M in args.M for r in sweep[M]] + [line(r, False) for r in retune]
    res0 = next(iter(st.results.values()), None)
    tokens = res0["tokens"] if res0 else 0
    corpus = res0["corpus_tokens"] if res0 else 0
    n_train = corpus - int(corpus * 0.05)
    total, emb = scaling.params(args.model)
    run_s = sum(v["seconds"] for v in st.results.values())
    reused = sum(1 for k in st.cache if k in st.before and any(k == st.key(r, s) for r in final for s in seeds))
    summary = (f"{args.model}: {total:,} parameters ({total - emb:,} without the embedding); T = {args.steps} inner "
               f"steps of a global batch of {args.batch} x {args.seq} tokens = {tokens / 1e6:.3f}M tokens "
               f"({tokens / max(n_train, 1):.2f} epochs of {n_train / 1e6:.3f}M training tokens); H = 30 is "
               f"{args.steps // 30} outer steps; seeds {' '.join(map(str, seeds))}; {len(st.results)} runs took "
               f"{run_s / 60:.0f} min summed, this invocation {wall / 60:.1f} min wall; code {st.code}")
    checks = []
    for r in final[1:]:
        p = scaling.PAPER.get(r["M"])
        d = vs(r)
        if p is not None and len(d) == len(seeds):
            checks.append(f"{r['name']} vs DP {statistics.mean(d):+.2f}% against the paper's {p:+.1f}%: "
                          f"{scaling.verdict(d, p)}")
    if st.skipped:
        checks.append(f"not run (--report): {len(st.skipped)} runs, e.g. {st.skipped[0]}")

    def md(rows: list[list], header: list[str]) -> list[str]:
        return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                *["| " + " | ".join(str(c) for c in x) + " |" for x in rows]]

    text = "\n".join([summary, "", f"seeds {', '.join(map(str, seeds))} (the rows beyond the paper: the first "
                                    f"{args.beyond_seeds}), each row at its tuned inner lr:", "",
                      *md(main, head), "", f"the tuning runs (seed {s0}):", "", *md(every, head), "",
                      *[f"- {c}" for c in checks]])
    print("\n" + summary + "\n" + table(main, head) + f"\n\ntuning runs (seed {s0}):\n" + table(every, head)
          + "\n\n" + "\n".join(checks))
    (RESULTS / f"{args.out}.md").write_text(text + "\n")
    plot(st, dp, final, hrows, seeds, RESULTS / f"{args.out}.png")
    save_result(args.out, {"args": {k: v for k, v in vars(args).items()}, "params": total, "tokens": tokens,
                           "train_tokens": n_train, "wall_s": wall, "run_s": run_s, "reused": reused,
                           "code": st.code, "checks": checks,
                           "rows": [{"name": r["name"], "inner_lr": r["inner_lr"], "M": r["M"], "H": r["H"],
                                     "seeds": r.get("seeds", seeds),
                                     "losses": [st.loss(r, s) for s in r.get("seeds", seeds)], "vs_dp": vs(r)}
                                    for r in final + hrows + extra],
                           "tuning": [{"name": r["name"], "inner_lr": r["inner_lr"], "loss": st.loss(r, s0)}
                                      for r in [dict(dp, inner_lr=lr) for lr in args.lrs]
                                      + [r for M in args.M for r in sweep[M]] + retune]})


def plot(st: Study, dp: dict, final: list[dict], hrows: list[dict], seeds: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.axhline(st.mean(dp, seeds), color="k", ls="--", label=f"DP ({st.mean(dp, seeds):.3f})")
    series: dict[str, list[dict]] = {}
    for r in final[1:] + hrows:
        series.setdefault(f"H={r['H']}, {r['family']}", []).append(r)
    for label, rs in series.items():
        rs = [r for r in rs if all(st.loss(r, s) is not None for s in seeds)]
        if not rs:
            continue
        xs, ys = [r["M"] for r in rs], [st.mean(r, seeds) for r in rs]
        lo = [y - min(st.loss(r, s) for s in seeds) for r, y in zip(rs, ys)]
        hi = [max(st.loss(r, s) for s in seeds) - y for r, y in zip(rs, ys)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ms = sorted({r["M"] for r in final[1:]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("DiLoCo workers M (global batch fixed)")
    ax.set_ylabel("held-out eval loss (mean over seeds; bars: min-max)")
    ax.set_title(f"DiLoCo vs DP at equal tokens, {st.a.steps} inner steps (H=30: {st.a.steps // 30} outer steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
