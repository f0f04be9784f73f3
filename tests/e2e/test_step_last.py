"""The round's last delta read inside the outer step (OuterMaster.step's `last`, issue #38): the real coordinator
on deltas published by hand. The committed θ_{r+1} and momentum are the same bytes as the ordinary way's (every
delta added, then the step) — when the last delta is good, bad (a NaN, a torn file), screened out after the step,
or when the step fails for another reason and falls back."""
from __future__ import annotations

import errno

import pytest
import torch

from tests.helpers import tiny_config
from tests.helpers.proc import wait_until
from train.config import build_config
from train.core.store import PROTOCOL_VERSION, atomic_write_json, read_jsonl
from train.core.tensorio import load_tensors, save_streaming
from train.diloco.coordinator import Coordinator
from train.exchange import master as master_mod

pytestmark = pytest.mark.timeout(300)


def _publish(co, r: int, w: int, scale: float = 1.0, nan: bool = False, torn: bool = False) -> None:
    """Worker w's delta of round r (seeded values, `scale`d; a NaN in its last tensor; its last byte flipped after
    the sidecar was written) and its sidecar, as a worker publishes them."""
    paths = co.paths
    theta = load_tensors(paths.global_dir(0) / "model.safetensors")
    g = torch.Generator().manual_seed(100 * r + w)
    d = {k: torch.randn(v.shape, generator=g) * 1e-3 * scale for k, v in theta.items()}
    if nan:
        d[list(d)[-1]].view(-1)[-1] = float("nan")
    f = paths.delta_file(r, w)
    sha = save_streaming(f, d)
    if torn:
        b = bytearray(f.read_bytes())
        b[-1] ^= 0xFF
        f.write_bytes(bytes(b))
    off, n = co.layout.slice(r, w)
    atomic_write_json(paths.delta_meta(r, w), {"protocol": PROTOCOL_VERSION, "round": r, "worker": w,
                                               "inner_steps": 5, "tokens": 100 + w, "loss": 1.0, "sha256": sha,
                                               "bytes": f.stat().st_size,
                                               "data": {"segment": 0, "offset": off, "windows": n, "read": n}})


def _run(tmp_path, monkeypatch, fused: bool, workers: int, rounds: list[dict], screen: bool = False,
         fail_once: bool = False) -> tuple[dict, dict, list[dict], list[str]]:
    """Rounds 0.. with the deltas `rounds[r]` ({w: _publish kwargs}); returns (θ of the last round, its momentum,
    the metrics records, which way each round was stepped)."""
    cfg = build_config(tiny_config(tmp_path, data={"fake_data": True, "fake_tokens": 20000},
                                   outer={"num_workers": workers, "rounds": len(rounds), "momentum": 0.9, "lr": 0.7,
                                          "screen": screen, "min_workers": 1}))
    ways: list[str] = []
    real_step = master_mod.OuterMaster.step

    def step(self, r, acc, lr=None, last=None):
        ways.append("last" if last is not None else "ordinary")
        return real_step(self, r, acc, lr, last)
    monkeypatch.setattr(master_mod.OuterMaster, "step", step)
    if not fused:
        monkeypatch.setattr(master_mod.OuterMaster, "can_take_last", lambda self, acc: False)
    if fail_once:  # the θ_{r+1} file's first stage write fails once, not transiently: the step falls back
        real_flush, calls = master_mod.StreamingWriter._flush_stage, []

        def flush(self):
            if self.path.name == "model.safetensors" and not calls:
                calls.append(1)
                raise OSError(errno.EPERM, "refused once")
            return real_flush(self)
        monkeypatch.setattr(master_mod.StreamingWriter, "_flush_stage", flush)
    co = Coordinator(cfg, progress=False)
    co.setup()
    try:
        for r, deltas in enumerate(rounds):
            for w, kw in deltas.items():
                _publish(co, r, w, **kw)
            co.run_round(r)
    finally:
        co.close()
    paths, last = co.paths, len(rounds)
    monkeypatch.undo()
    def logged() -> list[dict]:  # the rounds' records (not the eval lines), the last one once it is written
        return [rec for rec in read_jsonl(paths.metrics) if "workers_used" in rec] if paths.metrics.exists() else []
    wait_until(lambda: any(rec["round"] == last for rec in logged()), 60, f"round {last}'s record")
    rounds_logged = sorted(logged(), key=lambda rec: rec["round"])
    return (load_tensors(paths.global_dir(last) / "model.safetensors"), load_tensors(paths.outer_state(last)),
            rounds_logged, ways)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_last_delta_read_inside_the_step_gives_the_ordinary_bytes(tmp_path, monkeypatch):
    """Four rounds of two workers (every round after the first with an outer momentum): the last delta is read inside
    the step; in round 1 it has a NaN in its last tensor, in round 2 its file is torn — each is rejected after
    θ_{r+1} was computed with it, and what commits is θ and m as if it had been rejected on arrival; rounds 0 and 3
    are good."""
    rounds = [{0: {}, 1: {}}, {0: {}, 1: {"nan": True}}, {0: {}, 1: {"torn": True}}, {0: {}, 1: {}}]
    a = _run(tmp_path / "fused", monkeypatch, True, 2, rounds)
    b = _run(tmp_path / "ordinary", monkeypatch, False, 2, rounds)
    assert a[3] == ["last", "last", "ordinary", "last", "ordinary", "last"]  # a rejection: the step again
    assert b[3] == ["ordinary"] * 4
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    for ra, rb, good, why in zip(a[2], b[2], (True, False, False, True), (None, "non-finite", "checksum", None)):
        assert ra["workers_used"] == rb["workers_used"] == ([0, 1] if good else [0])
        assert ra.get("rejected") == rb.get("rejected")
        assert good or why in ra["rejected"]["w001"]


def test_a_delta_screened_out_after_the_step_undoes_it(tmp_path, monkeypatch):
    """Three workers, the last one's delta 100x the others': the screen sees it only after the step that added it;
    the step is undone and taken again without it — the same θ, momentum and screen record as the ordinary way."""
    rounds = [{0: {}, 1: {}, 2: {"scale": 100.0}}]
    a = _run(tmp_path / "fused", monkeypatch, True, 3, rounds, screen=True)
    b = _run(tmp_path / "ordinary", monkeypatch, False, 3, rounds, screen=True)
    assert a[3] == ["last", "ordinary"] and b[3] == ["ordinary"]
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    ra, rb = a[2][-1], b[2][-1]
    assert ra["workers_used"] == rb["workers_used"] == [0, 1] and "w002" in ra["rejected"]
    assert ra["screen"] == rb["screen"] and ra["screen"]["w002"]  # the same statistics, the same decision


def test_a_step_that_fails_otherwise_falls_back_to_the_ordinary_way(tmp_path, monkeypatch):
    """A write of θ_{r+1} refused once (not a transient error) inside the step that read the last delta: θ and m are
    read back from round r's files, the delta is added the ordinary way and the step taken again: the same bytes."""
    rounds = [{0: {}, 1: {}}, {0: {}, 1: {}}]
    a = _run(tmp_path / "fused", monkeypatch, True, 2, rounds, fail_once=True)
    b = _run(tmp_path / "ordinary", monkeypatch, False, 2, rounds)
    assert a[3] == ["last", "ordinary", "last"]
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    assert a[2][-1]["workers_used"] == [0, 1] and not a[2][-1].get("rejected")
