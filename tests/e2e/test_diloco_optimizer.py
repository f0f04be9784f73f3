"""DiLoCoOptimizer: the outer step equals the coordinator's, the grad-scaler path, resume, refusals, and (slow) two
worker processes in a user's own loop giving the coordinator-based run's global model on the same data."""
from __future__ import annotations

import json
import re
import subprocess
from functools import partial

import pytest
import torch

from tests.helpers import REPO, tiny_config
from tests.helpers.proc import script_cmd
from train.diloco.optimizer import DiLoCoOptimizer, load_global
from train.exchange.outer import outer_step
from train.core.store import ProtocolError, read_jsonl, verify_manifest
from train.exchange.store import DiLoCoPaths
from train.status.view import gather, render
from train.core.tensorio import load_tensors


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _opt(model, tmp_path, **kw) -> DiLoCoOptimizer:
    args = dict(base_dir=tmp_path, run_id="r", worker=0, num_workers=1, num_inner_steps=3, batch_size=4,
                inner_optimizer=partial(torch.optim.AdamW, lr=1e-2),
                outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                averaging_timeout=10, poll_interval=0.01)
    args.update(kw)
    return DiLoCoOptimizer(model, **args)


def _train(model, opt, steps: int, start: int = 0, scaler=None) -> None:
    for i in range(start, start + steps):
        x, y = _batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        opt.step(scaler=scaler, loss=loss.detach())
        opt.zero_grad()


def test_outer_step_is_the_coordinators_nesterov_sgd(tmp_path):
    """Two rounds (the momentum comes back from outer_state.safetensors) against train/exchange/outer.py, same Δ."""
    model = _model()
    opt = _opt(model, tmp_path, num_inner_steps=1000)  # we end the rounds ourselves to see θ_w
    paths = opt.paths
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = None
    for r in range(2):
        _train(model, opt, 3, start=3 * r)
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.sync()
        theta, momentum = outer_step(theta, {n: theta[n] - local[n] for n in theta}, momentum, 0.7, 0.9, True)
        got = load_tensors(paths.global_dir(r + 1) / "model.safetensors")
        mom = load_tensors(paths.outer_state(r + 1))
        for n in theta:
            torch.testing.assert_close(got[n], theta[n], rtol=0, atol=1e-7)
            torch.testing.assert_close(mom[n], momentum[n], rtol=0, atol=1e-7)
            assert torch.equal(dict(model.named_parameters())[n].detach(), got[n])  # continues from θ_{r+1}
        verify_manifest(paths.global_dir(r + 1))
    recs = read_jsonl(paths.metrics)
    assert [x["round"] for x in recs] == [1, 2] and recs[-1]["tokens"] == 2 * 3 * 4
    assert recs[0]["train_loss"] > 0 and recs[0]["workers_used"] == [0]


def test_one_worker_lr1_no_momentum_is_the_workers_model_and_the_scaler_path(tmp_path):
    """With one worker, outer lr 1 and no momentum the global model is the worker's; a GradScaler (power-of-two
    scale, exactly undone) gives the same steps as none, through step(scaler=...)."""
    sgd1 = partial(torch.optim.SGD, lr=1.0)
    plain, scaled = _model(), _model()
    o1 = _opt(plain, tmp_path / "a", outer_optimizer=sgd1, num_inner_steps=1000)
    o2 = _opt(scaled, tmp_path / "b", outer_optimizer=sgd1, num_inner_steps=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    _train(plain, o1, 4)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    o1.sync()
    _train(scaled, o2, 4, scaler=scaler)  # the 4th step syncs
    assert o2.round == 1 and o2.local_step == 0 and scaler.get_scale() == 2.0 ** 8
    r, glob = load_global(tmp_path / "b", "r")
    assert r == 1
    plain_glob = load_global(tmp_path / "a", "r")[1]
    for n, p in scaled.named_parameters():
        torch.testing.assert_close(glob[n], before[n], rtol=0, atol=1e-7)  # θ_0 − (θ_0 − θ_w): rounding only
        assert torch.equal(glob[n], plain_glob[n]) and torch.equal(p.detach(), glob[n]), n
    assert load_tensors(DiLoCoPaths(tmp_path / "b" / "r").outer_state(1)) == {}  # SGD without momentum: no state


def test_resume_continues_the_run_with_persisted_outer_state(tmp_path):
    """Adam as the outer optimizer (state under name::key): 2 rounds in one go == 1 round, a restart, 1 round."""
    adam = partial(torch.optim.Adam, lr=0.05)
    a = _model()
    oa = _opt(a, tmp_path / "a", outer_optimizer=adam)
    _train(a, oa, 6)
    b = _model()
    ob = _opt(b, tmp_path / "b", outer_optimizer=adam)
    _train(b, ob, 3)
    saved = ob.state_dict()
    ob.close()
    b2 = _model(seed=5)  # a fresh process: other initial weights, replaced by the committed round
    ob2 = _opt(b2, tmp_path / "b", outer_optimizer=adam)
    assert ob2.round == 1
    ob2.load_state_dict(saved)
    _train(b2, ob2, 3, start=3)
    ga, gb = load_global(tmp_path / "a", "r")[1], load_global(tmp_path / "b", "r")[1]
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    state = load_tensors(DiLoCoPaths(tmp_path / "b" / "r").outer_state(2))
    assert {k.split("::")[1] for k in state} == {"exp_avg", "exp_avg_sq", "step"}
    assert float(state["0.weight::step"]) == 2.0


def test_refusals(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="worker = 2 must be in 0..1"):
        _opt(model, tmp_path, worker=2, num_workers=2)
    with pytest.raises(ValueError, match="num_inner_steps = 0"):
        _opt(model, tmp_path, num_inner_steps=0)
    opt = _opt(model, tmp_path)
    with pytest.raises(ProtocolError, match="already running"):
        _opt(model, tmp_path)  # a second live copy of worker 0
    opt.close()
    with pytest.raises(ProtocolError, match="num_workers"):
        _opt(model, tmp_path, num_workers=2)  # the run was started with 1 worker
    with pytest.raises(ProtocolError, match="identity|parameters"):
        _opt(torch.nn.Linear(2, 2), tmp_path)  # another model
    coord_run = tmp_path / "c"
    coord_run.mkdir()
    (coord_run / "run.json").write_text(json.dumps({"protocol": 1, "identity": {"model": "x", "num_workers": 1}}))
    with pytest.raises(ProtocolError, match="coordinator run"):
        _opt(model, tmp_path, run_id="c")


def test_a_late_worker_is_left_out_then_rejoins_and_a_missing_reducer_times_out(tmp_path):
    """min_workers=1: the reducer goes on without worker 1 after averaging_timeout; worker 1's delta of that round
    is dropped and it continues from the committed round. A worker with no reducer fails with a clear timeout."""
    with pytest.raises(TimeoutError, match="no round 0 in .*is worker 0, the reducer, running"):
        _opt(_model(), tmp_path / "lonely", worker=1, num_workers=2, averaging_timeout=0.3)
    m0, m1 = _model(), _model(seed=3)
    o0 = _opt(m0, tmp_path, num_workers=2, min_workers=1, averaging_timeout=0.3)
    o1 = _opt(m1, tmp_path, worker=1, num_workers=2, averaging_timeout=0.3)
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))  # both start from θ_0
    _train(m0, o0, 3)  # waits 0.3 s for worker 1, then reduces its own delta alone
    rec = read_jsonl(o0.paths.metrics)[-1]
    assert rec["workers_used"] == [0] and rec["missing"] == [1]
    _train(m1, o1, 3)
    assert o1.round == 1 and not o1.paths.delta_meta(0, 1).exists()  # dropped, not published late
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    o0.close()
    o1.close()
    with pytest.raises(ProtocolError, match="reducer"):
        _opt(_model(), tmp_path, worker=1, num_workers=2, reducer=1)  # workers must agree on the reducer


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_two_worker_processes_match_the_coordinator_run(tmp_path):
    """The same micro Llama, data shards, AdamW schedule and clipping as `python -m train.diloco.worker`: the user loop
    of tests/helpers/diloco_opt_worker.py in two processes gives diloco_sim.py's global model of every kept round, bit
    for bit (same float operations in the same order: the shared reduce of train/exchange/reduce.py, torch SGD =
    outer.py)."""
    cfg = tmp_path / "evolution.json"
    cfg.write_text(json.dumps(tiny_config(tmp_path / "runs", data={"fake_data": True, "fake_tokens": 20000},
                                          outer={"rounds": 3, "local_steps": 4}, logging={"plot": False})))
    # Both runs at once (the optimizer's workers wait for the token cache the coordinator writes, then read it).
    # Threads pinned on both sides (script_cmd): the same float operations, bit for bit, on any machine.
    procs = [subprocess.Popen(script_cmd("tests/helpers/diloco_opt_worker.py", str(cfg), str(w), str(tmp_path / "opt")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO) for w in (0, 1)]
    try:
        ref = subprocess.run(script_cmd("diloco_sim.py", "--config", str(cfg)), capture_output=True, text=True,
                             timeout=300, cwd=REPO)
        assert ref.returncode == 0, ref.stdout + ref.stderr
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    ref_paths, opt_paths = DiLoCoPaths(tmp_path / "runs" / "t"), DiLoCoPaths(tmp_path / "opt" / "t")
    assert opt_paths.committed_rounds() == ref_paths.committed_rounds() == [0, 2, 3]  # keep_rounds = 2, θ_0 kept
    for r in (0, 2, 3):
        a = load_tensors(ref_paths.global_dir(r) / "model.safetensors")
        b = load_tensors(opt_paths.global_dir(r) / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(b[k], a[k]), f"round {r}: {k}: max diff {(b[k] - a[k]).abs().max().item():.3g}"
    ma, mb = load_tensors(ref_paths.outer_state(3)), load_tensors(opt_paths.outer_state(3))
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    ref_recs = read_jsonl(ref_paths.metrics)[1:]
    opt_recs = read_jsonl(opt_paths.metrics)
    assert [x["round"] for x in opt_recs] == [1, 2, 3]
    for x, y in zip(ref_recs, opt_recs):  # same per-worker mean training losses, same token counts
        assert y["tokens"] == x["tokens"]
        for w in ("w000", "w001"):
            assert y["worker_loss"][w] == pytest.approx(x["worker_loss"][w], rel=1e-5)
    # the workers' leases (train/core/heartbeat.py): `status` shows each one's last round, and who reduced
    shown = render(gather(opt_paths.root))  # what `python -m train.status RUN_DIR` prints
    assert "coordinator: none (a DiLoCoOptimizer run: worker 0 reduces)" in shown, shown
    assert "round 3 committed" in shown and "/0 committed" not in shown, shown
    for w in ("w000", "w001"):
        assert re.search(rf"^\s+{w}\s+exited\s", shown, re.M), shown


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_example_notebook_runs(tmp_path, monkeypatch):
    """examples/diloco_optimizer.ipynb, executed as a user would (a Jupyter kernel), with tiny sizes."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for k, v in {"EXAMPLE_ROUNDS": "2", "EXAMPLE_H": "8", "EXAMPLE_MAX_CHARS": "120000",
                 "EXAMPLE_BASE_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(str(REPO / "examples" / "diloco_optimizer.ipynb"), as_version=4)
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "examples")}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "worker 1: round 2 committed" in text and "held-out loss" in text
    assert DiLoCoPaths(tmp_path / "diloco-example").committed_rounds() == [0, 1, 2]
