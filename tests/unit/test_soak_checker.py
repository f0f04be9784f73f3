"""bench/soak.py's live checker can fail: a θ that is not the replay of its committed deltas and a rewritten commit
marker are violations; the true replay is not."""
from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
from soak import Checker  # noqa: E402


def _round(run, r, theta, deltas=None, tokens=None, workers=()):
    d = run / "rounds" / f"r{r:06d}"
    (d / "global").mkdir(parents=True)
    save_file(theta, str(d / "global" / "model.safetensors"))
    for w, delta in (deltas or {}).items():
        (d / "deltas").mkdir(exist_ok=True)
        save_file(delta, str(d / "deltas" / f"w{w:03d}.safetensors"))
        (d / "deltas" / f"w{w:03d}.json").write_text(json.dumps({"tokens": tokens[w]}))
    return d


def _commit(d, workers):
    (d / "COMMITTED").write_text(json.dumps({"workers": list(workers), "late": {}}))


def test_replay_passes_and_tampering_fails(tmp_path):
    g = torch.Generator().manual_seed(0)
    theta0 = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}
    deltas = {w: {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in theta0.items()} for w in (0, 1, 2)}
    tokens = {0: 100, 1: 300, 2: 50}
    used = (0, 2)  # worker 1 screened out: it must not be in the replay
    mean = {k: sum(deltas[w][k].double() * tokens[w] for w in used) / sum(tokens[w] for w in used)
            for k in theta0}
    theta1 = {k: theta0[k] - mean[k].float() for k in theta0}

    run = tmp_path / "good"
    _commit(_round(run, 0, theta0, deltas, tokens), [])
    _commit(_round(run, 1, theta1), used)
    ok = Checker(run)
    ok.poll()
    assert ok.checked == [1] and not ok.violations

    run = tmp_path / "bad"
    _commit(_round(run, 0, theta0, deltas, tokens), [])
    _commit(_round(run, 1, theta1), (0, 1, 2))  # the record says worker 1 was averaged in: θ does not match
    bad = Checker(run)
    bad.poll()
    assert bad.violations and "differs from the replay" in bad.violations[0]

    (run / "rounds" / "r000001" / "COMMITTED").write_text(json.dumps({"workers": [0], "late": {}}))
    bad.poll()
    assert any("rewritten" in v for v in bad.violations)


def test_the_soak_worker_passes_on_whatever_the_worker_gives_write_delta(monkeypatch):
    """bench/soak_worker.py wraps the worker's write_delta: every parameter the real one takes reaches it (a wrapper
    that lagged behind a new keyword made every soak worker exit at its first delta)."""
    import importlib
    import inspect

    import train.diloco.worker as worker_mod

    real = worker_mod.write_delta
    monkeypatch.setattr(worker_mod, "write_delta", real)  # importing soak_worker replaces it: put back after
    monkeypatch.delenv("SOAK_BAD_DELTAS", raising=False)
    sw = importlib.import_module("soak_worker")
    seen = {}
    monkeypatch.setattr(sw, "_write_delta", lambda *a, **k: seen.update(args=a, kwargs=k) or "written")
    extra = {name: object() for name in list(inspect.signature(real).parameters)[7:]}  # after (path, ..., r, w)
    assert extra and sw.write_delta("p", ["a"], {}, {}, "codec", 3, 1, **extra) == "written"
    assert seen["args"] == ("p", ["a"], {}, {}, "codec", 3, 1) and seen["kwargs"] == extra
