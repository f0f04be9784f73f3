"""The screen (outer.screen, train/exchange/screen.py): a well-formed but bad delta — scaled x100, sign-flipped —
among 4 workers' is rejected with its reason in metrics.jsonl and the commit record, never averaged, whatever the
codec; every copy of θ (a fresh replay from the commit records) is bit-identical to the coordinator's. A worker
screened out 3 rounds in a row is said in one line and listed in the round's record. The loss screen
(outer.screen_loss, train/exchange/loss_screen.py) evaluates θ_r − Δ as the coordinator decoded it, whatever the codec
and with fragments, and rejects same-norm noise among 2 workers' deltas trained for real; with real processes:
test_two_workers_one_publishing_noise."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_config
from train.config import build_config
from train.core.store import read_json, read_jsonl
from train.diloco.coordinator import Coordinator
from train.exchange.outer import diloco_round
from train.exchange.protocol import delta_sidecar, publish_sidecar, write_delta
from train.exchange.theta import GlobalTheta, theta_checksum

W = 4


def _coordinator(tmp_path, compression="none", workers=W, corpus=False, **outer):
    """In process, set up at round 0; `corpus`: the shipped corpus (deltas that learn something), else fake data."""
    over = {"num_workers": workers, "min_workers": min(2, workers - 1), "round_timeout_s": 0.5, "rounds": 5, **outer}
    if compression != "none":
        over["compression"] = compression
        if compression == "topk":
            over.update(density=0.05, chunk_size=100)
    data = {} if corpus else {"data": {"fake_data": True, "fake_tokens": 20000}}
    cfg = build_config(tiny_config(tmp_path, outer=over, logging={"progress": False}, **data))
    co = Coordinator(cfg, progress=False)
    co.setup()
    return co


def _deltas(theta, r: int, bad: str | None, bad_worker: int = 2) -> dict[int, dict]:
    """Healthy deltas share a direction (as real workers' do), each with its own noise; one may be bad."""
    g = torch.Generator().manual_seed(100 + r)
    common = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    out = {}
    for w in range(W):
        d = {k: (0.8 * common[k] + 0.6 * torch.randn(v.shape, generator=g)) * 1e-3 for k, v in theta.items()}
        if w == bad_worker and bad == "x100":
            d = {k: 100 * v for k, v in d.items()}
        elif w == bad_worker and bad == "flipped":
            d = {k: -v for k, v in d.items()}
        elif w == bad_worker and bad == "noise":  # the same norm, another direction
            n = {k: torch.randn(v.shape, generator=g) for k, v in d.items()}
            scale = (sum(v.pow(2).sum() for v in d.values()) / sum(v.pow(2).sum() for v in n.values())).sqrt()
            d = {k: v * scale for k, v in n.items()}
        out[w] = d
    return out


def _publish(co, r: int, w: int, delta: dict) -> None:
    theta = co.master.theta.tensors
    params = {k: theta[k] - delta[k] for k in theta}  # the worker's model: Δ = θ_r − θ_w
    frags = co.master.frags  # (streaming DiLoCo: round r's fragment alone)
    file = write_delta(co.paths.delta_file(r, w), frags.pieces(r), frags.view(r, theta), frags.view(r, params),
                       co.master.delta_codec, r, w)
    side = delta_sidecar(r, w, file, inner_steps=5, tokens=1000 * (w + 1), loss=3.0)
    off, n = co.layout.slice(r, w)
    side["data"] = {"segment": 0, "offset": off, "windows": n, "read": n}
    publish_sidecar(co.paths, side)


@pytest.mark.parametrize("compression", ["none", "int8", "topk"])
@pytest.mark.parametrize("bad,reason", [("x100", "screen: norm"), ("flipped", "screen: cosine")])
def test_a_bad_delta_is_screened_out_and_every_copy_of_theta_agrees(tmp_path, compression, bad, reason):
    # topk's sparse deltas overlap less: healthy cosines with the others' mean measure 0.18-0.53 (dense: 0.63-0.87),
    # so a flipped one sits near -0.3, above the default -0.5; docs/protocol.md advises -0.1 for topk runs
    extra = {"screen_min_cosine": -0.1} if compression == "topk" and bad == "flipped" else {}
    co = _coordinator(tmp_path, compression, **extra)
    theta0 = {k: v.clone() for k, v in co.master.theta.tensors.items()}
    deltas = _deltas(theta0, 0, bad)
    for w, d in deltas.items():
        _publish(co, 0, w, d)
    rec = co.run_round(0)
    co.evals.join()
    assert rec["workers_used"] == [0, 1, 3], rec
    assert reason in rec["rejected"]["w002"] and "outer.screen_" in rec["rejected"]["w002"], rec["rejected"]
    committed = read_json(co.paths.committed(1))
    assert committed["workers"] == [0, 1, 3] and reason in committed["rejected"]["w002"]
    logged = read_jsonl(co.paths.metrics)[-1]
    assert reason in logged["rejected"]["w002"] and set(logged["screen"]) == {"w000", "w001", "w002", "w003"}
    # a fresh copy of θ, built from the run's files as a worker does, is the coordinator's, bit for bit
    copy = GlobalTheta(co.paths, co.master.theta.codec)
    copy.advance_to(1)
    assert theta_checksum(copy.tensors, co.names) == theta_checksum(co.master.theta.tensors, co.names)
    if compression == "none":  # and it is the outer step over the accepted deltas only (tokens 1000:2000:4000)
        want, _ = diloco_round(theta0, [deltas[w] for w in (0, 1, 3)], [1000, 2000, 4000], None, co.cfg.outer.lr,
                               co.cfg.outer.momentum, co.cfg.outer.nesterov)
        for k in theta0:
            torch.testing.assert_close(co.master.theta.tensors[k], want[k], rtol=1e-6, atol=1e-7)
    else:  # the bad delta is not in θ_1: with it averaged in, θ_1 would be far away
        moved = sum((co.master.theta.tensors[k] - theta0[k]).norm() ** 2 for k in theta0).sqrt()
        healthy = sum(deltas[0][k].norm() ** 2 for k in theta0).sqrt()
        assert moved < 3 * healthy * co.cfg.outer.lr


def test_healthy_rounds_pass_and_same_norm_noise_is_at_the_noise_floor(tmp_path):
    """Healthy deltas pass; noise of the same norm (cosine about 0 while the others' are about 0.8) is rejected by the
    noise floor with its figures, without the loss screen (off here)."""
    co = _coordinator(tmp_path, screen_loss="off")
    for r, bad in [(0, None), (1, "noise")]:
        for w, d in _deltas(co.master.theta.tensors, r, bad).items():
            _publish(co, r, w, d)
        rec = co.run_round(r)
        if bad is None:
            assert rec["rejected"] == {} and rec["workers_used"] == list(range(W)), rec
        else:
            assert list(rec["rejected"]) == ["w002"] and "noise floor" in rec["rejected"]["w002"], rec
            assert rec["workers_used"] == [0, 1, 3], rec


def test_screen_off_averages_everything(tmp_path):
    co = _coordinator(tmp_path, screen=False)
    for w, d in _deltas(co.master.theta.tensors, 0, "x100").items():
        _publish(co, 0, w, d)
    rec = co.run_round(0)
    assert rec["workers_used"] == list(range(W)) and rec["rejected"] == {} and "screen" not in rec


def test_a_worker_screened_out_three_rounds_in_a_row_is_reported_once(tmp_path, caplog):
    co = _coordinator(tmp_path)
    recs = []
    with caplog.at_level("ERROR", logger="coordinator"):
        for r in range(4):
            for w, d in _deltas(co.master.theta.tensors, r, "x100", bad_worker=1).items():
                _publish(co, r, w, d)
            recs.append(co.run_round(r))
    co.evals.join()
    said = [m for m in (rec.getMessage() for rec in caplog.records) if "rounds in a row" in m]
    assert len(said) == 1 and said[0].startswith("worker 1: its delta was screened out 3 rounds in a row"), said
    assert [r.get("screened_out_in_a_row") for r in recs] == [None, None, {"w001": 3}, {"w001": 4}]
    assert all("w001" in r["rejected"] for r in recs)


def _evaluate(co, theta) -> float:
    from train.core.inner import evaluate
    from train.core.model import params_of

    ls = co.loss_screen
    p = params_of(ls.model)
    with torch.no_grad():
        for k in co.names:
            p[k].copy_(theta[k])
    return evaluate(ls.model, ls.batch, ls.batch_size, ls.device, ls.precision)


@pytest.mark.parametrize("compression,fragments", [("none", 1), ("int8", 1), ("topk", 1), ("none", 2)])
def test_the_loss_screen_evaluates_theta_r_minus_each_decoded_delta(tmp_path, compression, fragments):
    """Each delta's loss is that of θ_r − Δ (decoded: what the sum gets; with fragments, the round's fragment of it
    on the rest of θ_r), taken while the accumulator (or the step, for the last one) reads it; θ_r's loss too."""
    co = _coordinator(tmp_path, compression, **({"fragments": fragments, "local_steps": 4} if fragments > 1 else {}))
    assert co.loss_screen is not None
    theta0 = {k: v.clone() for k, v in co.master.theta.tensors.items()}
    deltas = _deltas(theta0, 0, None)
    piece_names = set(co.master.frags.pieces(0))  # with fragments: the round's fragment alone is published
    for w, d in deltas.items():
        _publish(co, 0, w, d)
    rec = co.run_round(0)
    co.evals.join()
    ls = co.loss_screen
    assert rec["rejected"] == {} and set(ls.losses) == set(range(W)), rec
    assert ls.base_loss == pytest.approx(_evaluate(co, theta0), abs=1e-6)
    for w, d in deltas.items():
        cand = {}
        for k in theta0:
            part = {k} & piece_names if fragments == 1 else {p for p in piece_names if p.split("[")[0] == k}
            cand[k] = theta0[k].clone()
            if fragments == 1 and part:
                cand[k] = theta0[k] - d[k]
            for p in part if fragments > 1 else ():
                rows = p[len(k):].strip("[]").split(":") if "[" in p else None
                if rows:
                    a, e = int(rows[0]), int(rows[1])
                    cand[k][a:e] = theta0[k][a:e] - d[k][a:e]
                else:
                    cand[k] = theta0[k] - d[k]
        want = _evaluate(co, cand)
        # int8 / topk: the decoded delta differs from Δ by its quantisation (topk: the values it did not send)
        tol = 1e-6 if compression == "none" else 5e-3
        assert ls.losses[w] == pytest.approx(want, abs=tol), (w, ls.losses[w], want)
        assert rec["screen"][f"w{w:03d}"]["loss"] == pytest.approx(ls.losses[w], abs=1e-5)
    assert rec["screen_loss_base"] == pytest.approx(ls.base_loss, abs=1e-5)


def _trained(co, theta, w: int, r: int, steps: int = 10) -> dict:
    """A real worker's delta: `steps` AdamW steps from θ_r on windows of worker w's part of the training stream."""
    import copy

    from train.core.inner import lm_loss
    from train.core.model import params_of

    model = copy.deepcopy(co.loss_screen.model)
    p = params_of(model)
    with torch.no_grad():
        for k in co.names:
            p[k].copy_(theta[k])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    lo = (w * 997 + r * 131) % max(1, co.data.n_train_windows - 8 * steps)
    for s in range(steps):
        batch = torch.stack([torch.from_numpy(co.data.window((lo + s * 8 + i) * co.data.seq_length))
                             for i in range(8)])
        opt.zero_grad()
        lm_loss(model, batch).backward()
        opt.step()
    return {k: theta[k] - p[k].detach() for k in co.names}


def test_the_loss_screen_rejects_noise_among_two_trained_deltas(tmp_path):
    """2 workers, deltas trained for real; worker 1's of round 1 is noise of its norm: rejected by the loss screen
    with its figures, θ_2 is the outer step of worker 0's delta alone; the healthy rounds reject nothing."""
    co = _coordinator(tmp_path, workers=2, corpus=True, lr=1.0, momentum=0.0, screen_loss_margin=0.01)
    for r in range(3):
        theta = {k: v.clone() for k, v in co.master.theta.tensors.items()}
        ds = {w: _trained(co, theta, w, r) for w in range(2)}
        if r == 1:
            g = torch.Generator().manual_seed(7)
            n = {k: torch.randn(v.shape, generator=g) for k, v in ds[1].items()}
            scale = (sum(v.pow(2).sum() for v in ds[1].values()) / sum(v.pow(2).sum() for v in n.values())).sqrt()
            ds[1] = {k: v * scale for k, v in n.items()}
        for w, d in ds.items():
            _publish(co, r, w, d)
        rec = co.run_round(r)
        if r != 1:
            assert rec["rejected"] == {} and rec["workers_used"] == [0, 1], rec
            continue
        assert rec["workers_used"] == [0], rec
        why = rec["rejected"]["w001"]
        assert why.startswith("screen: loss of θ_r − Δ") and "outer.screen_loss_margin" in why, why
        info = rec["screen"]["w001"]
        assert info["loss_gain"] < info["loss_bar"] < rec["screen"]["w000"]["loss_gain"], rec["screen"]
        for k in theta:  # lr 1, momentum 0: θ_2 = θ_1 − Δ_0
            assert torch.equal(co.master.theta.tensors[k], theta[k] - ds[0][k]), k
    co.evals.join()


def test_two_workers_one_publishing_noise(tmp_path, monkeypatch):
    """The real processes (diloco.py and two workers, worker 1 bench/soak_worker.py publishing noise of its delta's
    norm in round 1, as silent data corruption would): the loss screen rejects that delta with its figures, the run
    finishes, θ_2 is the outer step of worker 0's delta alone (lr 1, momentum 0: θ_1 − Δ_0), and the healthy rounds
    reject nothing."""
    import json

    from safetensors.torch import load_file

    from tests.helpers import REPO, TEST_THREADS
    from tests.helpers.proc import kill_all, start_script
    from train.exchange.store import DiLoCoPaths

    raw = tiny_config(tmp_path / "runs", outer={"num_workers": 2, "min_workers": 1, "rounds": 3, "local_steps": 8,
                                               "lr": 1.0, "momentum": 0.0, "keep_rounds": 10})
    cfg = tmp_path / "evolution.json"
    cfg.write_text(json.dumps(raw))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "w001-r000001.json").write_text(json.dumps({"kind": "noise"}))
    monkeypatch.setenv("SOAK_BAD_DELTAS", str(bad))
    paths = DiLoCoPaths(tmp_path / "runs" / "t")
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [start_script([str(REPO / "diloco.py"), "--config", str(cfg), "--no-progress"], logs / "coordinator.log")]
    procs += [start_script([str(REPO / "bench" / "soak_worker.py"), "--config", str(cfg), "--worker", str(w),
                            "--threads", str(TEST_THREADS)], logs / f"w{w}.log") for w in (0, 1)]
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        kill_all(procs)
    said = (logs / "coordinator.log").read_text()
    assert [p.returncode for p in procs] == [0, 0, 0], said
    assert "outer.screen_loss (auto): on" in said
    rows = {row["round"]: row for row in read_jsonl(paths.metrics)}
    assert "publishing a bad delta on purpose (noise)" in (logs / "w1.log").read_text()
    why = rows[2]["rejected"]["w001"]
    assert why.startswith("screen: loss of θ_r − Δ") and "outer.screen_loss_margin" in why, why
    assert rows[2]["workers_used"] == [0] and read_json(paths.committed(2))["workers"] == [0]
    assert all(rows[k]["rejected"] == {} and rows[k]["workers_used"] == [0, 1] for k in (1, 3)), rows
    theta1 = load_file(str(paths.global_dir(1) / "model.safetensors"))
    theta2 = load_file(str(paths.global_dir(2) / "model.safetensors"))
    delta0 = load_file(str(paths.delta_file(1, 0)))
    for k in theta1:
        assert torch.equal(theta2[k], theta1[k] - delta0[k]), k
    assert (paths.final / "model.safetensors").is_file()
