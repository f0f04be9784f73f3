"""bench/scaling.py's plan: which runs an invocation makes (the study itself is a benchmark, not a test)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import scaling  # noqa: E402


def args(**kw) -> argparse.Namespace:
    base = dict(M=[1, 2, 4], H=[10, 30, 100], steps=300, batch=24, seq=144, lr=1.6e-2, lrs=[1.6e-2], muon_lr=0.05,
                eval_batches=12, model="configs/scaling-llama.json", device="", set=[], outer=[], core_only=False,
                only=None)
    return argparse.Namespace(**{**base, **kw})


def test_lrs_run_every_adamw_row_at_each_lr_and_muon_rows_once():
    plan = scaling.rows(args(lrs=[0.012, 0.016], only=r"averaging \(lr|Mu"))
    names = [(r["name"], r["inner_lr"]) for r in plan]
    assert names[:2] == [("DP", 0.012), ("DP", 0.016)]  # DP always, at every lr
    avg = [n for n in names if "averaging (lr 1" in n[0]]
    assert len(avg) == 2 * 2 * 3  # M 2, 4 x H 10, 30, 100 x 2 lrs
    muon = [n for n in names if n[0].startswith(("MuLoCo", "DP, Muon"))]
    assert muon and all(lr == 0.016 for _, lr in muon)  # Muon rows keep --muon-lr (and --lr in their key)
    sets = scaling.overrides(args(), plan[0], seed=1)
    assert "inner.lr=0.012" in sets and "seed=1" in sets


def test_tuned_keeps_each_rows_best_lr_in_order():
    plan = [{"name": "DP", "mean": 5.0}, {"name": "DP", "mean": 4.9}, {"name": "A", "mean": 4.8},
            {"name": "A", "mean": 4.85}]
    best = scaling.tuned(plan)
    assert [(r["name"], r["mean"]) for r in best] == [("DP", 4.9), ("A", 4.8)]


def test_a_plan_without_lrs_keeps_the_recorded_run_keys():
    """Runs recorded before --lrs existed are found again: the key of a row at --lr is unchanged."""
    plan = scaling.rows(args(H=[30], M=[4]))
    row = next(r for r in plan if r["name"] == "DiLoCo M=4 H=30")
    sets = scaling.overrides(args(H=[30], M=[4]), row, seed=0)
    assert "inner.lr=0.016" in sets and "outer.lr=0.6" in sets and "outer.local_steps=30" in sets


def test_the_cache_key_fingerprints_the_training_code_not_the_docs(tmp_path, monkeypatch):
    """A cached run is reused only by the same code: the fingerprint moves with train/, the configs, the tokenizer
    and the corpus, and stays when only the docs, the tests or the benches change."""
    import common

    for f, text in {"train/core/inner.py": "lr = 1\n", "configs/m.json": "{}", "data/tokenizer/tokenizer.json": "{}",
                    "data/corpus/a.txt": "to be", "docs/x.md": "a", "tests/t.py": "", "bench/b.py": ""}.items():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(text)
    monkeypatch.setattr(common, "REPO", tmp_path)
    first = common.code_fingerprint()
    assert len(first) == 12
    for f in ("docs/x.md", "tests/t.py", "bench/b.py"):
        (tmp_path / f).write_text("changed")
    assert common.code_fingerprint() == first
    seen = {first}
    for f in ("train/core/inner.py", "configs/m.json", "data/tokenizer/tokenizer.json", "data/corpus/a.txt"):
        (tmp_path / f).write_text("changed")
        assert common.code_fingerprint() not in seen, f
        seen.add(common.code_fingerprint())


def test_a_target_is_met_or_missed_only_when_the_seeds_resolve_it():
    assert scaling.verdict([0.1, 0.3, 0.2, 0.2], 0.7).startswith("met (95% interval")
    assert scaling.verdict([3.0, 3.2, 2.9, 3.1], 2.0).startswith("not met (95% interval")
    # the four seeds of M = 4 against DP on 2026-11-24: the mean misses +2.0%, but the seeds do not resolve it
    v = scaling.verdict([5.24, -1.46, 4.79, 7.40], 2.0)
    assert v.startswith("not resolved by these seeds (95% interval -2.") and "over 4 seeds" in v
    assert scaling.verdict([1.0], 2.0) == "met (one seed: no interval)"


def test_only_and_the_averaging_rows_apply_without_h30():
    """--H without 30 still has the averaging rows and honours --only (it once ran every paper-recipe row instead)."""
    plan = scaling.rows(args(H=[1, 15], M=[2, 4], only=r"M=. H=(1|15), averaging \(lr"))
    assert [r["name"] for r in plan] == ["DP"] + [f"DiLoCo M={M} H={H}, averaging (lr 1, mom 0: project default)"
                                                  for H in (1, 15) for M in (2, 4)]
    assert [r["name"] for r in scaling.rows(args(H=[1], M=[4], core_only=True))] == ["DP", "DiLoCo M=4 H=1"]


def test_the_default_study_plans_the_same_rows_in_the_same_order():
    names = [r["name"] for r in scaling.rows(args())]
    assert names[:10] == ["DP"] + [f"DiLoCo M={M} H={H}" for H in (10, 30, 100) for M in (1, 2, 4)]
    assert names[10:13] == ["DP, Muon", "MuLoCo M=1 H=30", "MuLoCo M=4 H=30"] and len(names) == len(set(names)) == 30


def regime_args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(M=[1, 4], H=[10, 30], steps=60, batch=8, seq=64, lr=None, lrs=[0.006, 0.012, 0.024], muon_lr=0.05,
                eval_batches=2, model="configs/scaling-llama.json", device="", set=[], outer=[], core_only=False,
                only=None, seeds=[0, 1, 2], beyond_seeds=2, quick=False, jobs=1, timeout=60, report=False, fresh=False,
                out="regime-test")
    return argparse.Namespace(**{**base, **kw})


def fake_runs(monkeypatch, tmp_path) -> list[dict]:
    """The staged study's plan, with every run's loss a known function of its settings (no training): DP and every
    row are best at inner lr 0.012, the Nesterov step at outer lr 0.6, and averaging beats Nesterov at M = 4."""
    import math

    import scaling_regime

    monkeypatch.setattr(scaling_regime, "RESULTS", tmp_path)
    monkeypatch.setattr(scaling_regime, "save_result", lambda name, rec: None)
    done: list[dict] = []

    def run(base, name, sets, threads, timeout):
        kv = dict(s.split("=", 1) for s in sets)
        loss = 4.0 + abs(math.log(float(kv["inner.lr"]) / 0.012)) + 0.01 * int(kv["seed"])
        if float(kv["outer.momentum"]) > 0:
            loss += (float(kv["outer.lr"]) - 0.6) ** 2 + 0.05 * (kv["outer.nesterov"] == "false")
        if int(kv["outer.num_workers"]) == 4:
            loss += 0.02 if float(kv["outer.momentum"]) == 0 else 0.04
        done.append(kv)
        return {"eval_loss": loss, "tokens": 1000, "corpus_tokens": 10_000, "seconds": 1.0}

    monkeypatch.setattr(scaling, "run", run)
    return done


def test_the_staged_study_tunes_then_runs_the_chosen_rows_on_every_seed(monkeypatch, tmp_path, capsys):
    import scaling_regime

    done = fake_runs(monkeypatch, tmp_path)
    scaling_regime.study(regime_args(tmp_path), scaling)
    key = [(d["outer.num_workers"], d["outer.local_steps"], d["outer.lr"], d["outer.momentum"], d["inner.lr"],
            d["seed"], d.get("outer.compression", "none")) for d in done]
    assert len({tuple(sorted(d.items())) for d in done}) == len(done), "no run twice"
    # stage 1: DP at every inner lr, seed 0; stage 2: 5 outer steps for M = 1, 6 for M = 4, at DP's lr 0.012
    assert {k[4] for k in key if k[0] == "1" and k[1] == "60" and k[5] == "0"} == {"0.006", "0.012", "0.024"}
    assert sum(1 for k in key if k[0] == "4" and k[1] == "30" and k[4] == "0.012" and k[5] == "0"
               and k[6] == "none" and "outer.overlap" not in done[key.index(k)]) >= 6
    # the tuned rows (M = 1 Nesterov lr 0.6; M = 4 Nesterov lr 0.6 and averaging) at lr 0.012 on every seed
    for M, lr, mom in (("1", "0.6", "0.9"), ("4", "0.6", "0.9"), ("4", "1.0", "0.0")):
        assert {k[5] for k in key if k[:5] == (M, "30", lr, mom, "0.012") and k[6] == "none"} >= {"0", "1", "2"}
    # H = 10 at equal tokens with each M's better step: averaging for M = 4, Nesterov 0.6 for M = 1
    assert {k[5] for k in key if k[:4] == ("4", "10", "1.0", "0.0")} == {"0", "1", "2"}
    assert {k[5] for k in key if k[:4] == ("1", "10", "0.6", "0.9")} == {"0", "1", "2"}
    assert not any(k[:2] == ("4", "10") and k[3] == "0.9" for k in key)
    # beyond the paper, at M = 4 with its better step: topk with both recipes, the overlap rules, Muon
    assert {d.get("outer.chunk_size") for d in done if d.get("outer.compression") == "topk"} == {"4096", "128"}
    assert {d["outer.overlap"] for d in done if "outer.overlap" in d} == {"delayed", "eager"}
    assert any(d.get("inner.optimizer") == "muon" and d["outer.num_workers"] == "1" for d in done)  # DP, Muon
    assert {d["seed"] for d in done if d.get("outer.compression") == "topk"} == {"0", "1"}  # --beyond-seeds 2
    out = (tmp_path / "regime-test.md").read_text()
    assert "DiLoCo M=4 H=30, averaging (lr 1, momentum 0) | 0.012 |" in out and "the tuning runs (seed 0)" in out
    # a second invocation runs nothing: every run is recorded under the code's fingerprint
    n = len(done)
    scaling_regime.study(regime_args(tmp_path, report=True), scaling)
    assert len(done) == n


def test_the_quick_study_keeps_the_regime_with_fewer_rows():
    import scaling_regime

    assert [o["outer"] for o in scaling_regime.outer_steps(4, quick=True)] == [
        "Nesterov 0.9, lr 0.6", "Nesterov 0.9, lr 1", "averaging (lr 1, momentum 0)"]
    assert all(o["family"] != "averaging" for o in scaling_regime.outer_steps(1, quick=False))  # one worker: DP
    assert len(scaling_regime.outer_steps(2, quick=False)) == 6
