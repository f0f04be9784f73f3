"""Workers as torchrun groups (train/core/dist.py): the batch split, and a 2-process gloo worker == a 1-process
worker."""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
import torch

from tests.helpers import tiny_config
from tests.helpers.proc import run_script
from train.core.data import ShardSampler, TokenData
from train.core.dist import DistInfo, RankBatches, all_mean, broadcast_json, get_dist_info
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import load_tensors


def _data(tmp_path, n_tokens=20_000, seq=8) -> TokenData:
    toks = np.random.default_rng(0).integers(0, 500, n_tokens).astype(np.uint16)
    return TokenData(toks, seq, 0.02)


@pytest.mark.parametrize("world,per_device,total", [(2, 4, 8), (2, 2, 8), (4, 1, 8), (3, 2, 6)])
def test_rank_slices_make_up_the_one_process_batch(tmp_path, world, per_device, total):
    data = _data(tmp_path)
    one = ShardSampler(data, 1, 2, seed=3)
    ranks = [RankBatches(ShardSampler(data, 1, 2, seed=3), DistInfo(k, world, k), total) for k in range(world)]
    for _ in range(5):  # steps
        step = one.next_batch(total)
        parts = [torch.cat([rb.next_batch(per_device) for _ in range(total // world // per_device)]) for rb in ranks]
        assert torch.equal(torch.cat(parts), step)
        assert all(rb.sampler.position == one.position for rb in ranks)  # rank 0 saves the same resume point


def test_one_process_is_rank_0_of_1_and_collectives_are_no_ops(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    info = get_dist_info()
    assert info == DistInfo(0, 1, 0) and info.main and not info.enabled
    assert broadcast_json({"a": 1}, info, torch.device("cpu")) == {"a": 1}
    t = torch.tensor([1.0, 3.0])
    assert all_mean(t, info) is t


def test_worker_refuses_a_group_size_other_than_the_config(write_config, monkeypatch):
    from train.config import ConfigError, load_config
    from train.core.dist import init_group

    cfg = load_config(write_config(inner={"nproc_per_node": 2, "per_device_batch_size": 4}))
    with pytest.raises(ConfigError, match="nproc_per_node = 2, but this worker runs as 1 process"):
        init_group(cfg)
    with pytest.raises(ConfigError, match="must split over inner.nproc_per_node = 2 processes: a multiple of 16"):
        load_config(write_config(inner={"nproc_per_node": 2, "total_batch_size": 8}))


def test_launcher_starts_torchrun_groups_on_gpu_groups(tmp_path):
    from train.config import ConfigError
    from train.launch.machines import load_machines
    from train.launch.launcher import Launcher
    from train.launch.ssh import SSHOptions

    (tmp_path / "machines.json").write_text(json.dumps([{"host": "a", "gpus": 4, "procs_per_worker": 2},
                                                        {"host": "b", "python": "py thon"}]))
    (tmp_path / "evolution.json").write_text(json.dumps(tiny_config(tmp_path / "runs", outer={"num_workers": 3})))
    ln = Launcher(load_machines(tmp_path / "machines.json"), str(tmp_path / "evolution.json"), [], SSHOptions())
    procs = ln.plan()
    assert [(p.machine.host, p.env.get("CUDA_VISIBLE_DEVICES")) for p in procs[1:]] == [("a", "0,1"), ("b", None),
                                                                                        ("a", "2,3")]
    w0, w1 = procs[1].argv, procs[2].argv
    assert w0[:8] == ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                      "train.diloco.worker"] and w0[-2:] == ["--set", "inner.nproc_per_node=2"]
    assert w1[:3] == ["py thon", "-m", "train.diloco.worker"] and "inner.nproc_per_node=2" not in w1
    line = ln.start_line(procs[1], 1.0)
    assert shlex.split(line)[shlex.split(line).index("--") + 1:] == w0  # every word quoted
    with pytest.raises(ConfigError, match="edt workers run as one process each"):
        ln.plan("edt")
    (tmp_path / "machines.json").write_text(json.dumps([{"host": "a", "gpus": 3, "procs_per_worker": 2}]))
    with pytest.raises(ConfigError, match="does not split into workers of procs_per_worker = 2"):
        load_machines(tmp_path / "machines.json")


def test_single_process_trainers_refuse_a_group_config(write_config):
    """EDT workers (and anything else that builds an InnerTrainer without a group) train in one process."""
    from train.config import ConfigError, load_config
    from train.core.inner import InnerTrainer

    cfg = load_config(write_config(inner={"nproc_per_node": 2, "per_device_batch_size": 4}))
    with pytest.raises(ConfigError, match="only DiLoCo workers, train.diloco.worker, run as torchrun groups"):
        InnerTrainer(cfg, torch.nn.Linear(2, 2), torch.device("cpu"))


def _run(tmp_path, name: str, rounds: int = 2, **inner) -> DiLoCoPaths:
    """diloco_sim.py with one worker of `inner.nproc_per_node` processes, `rounds` rounds of 3 steps (on a 6-step
    schedule, so a run stopped after round 1 and resumed is the same run), on fake tokens."""
    base = tmp_path / name
    base.mkdir(exist_ok=True)
    cfg = tiny_config(base / "runs", data={"fake_data": True, "fake_tokens": 20_000},
                      inner={"per_device_batch_size": 4, "total_batch_size": 8, "grad_clip": 0.5, "total_steps": 6,
                             **inner},
                      outer={"num_workers": 1, "rounds": 2, "local_steps": 3}, logging={"progress": False,
                                                                                       "plot": False})
    (base / "evolution.json").write_text(json.dumps(cfg))
    out = run_script("diloco_sim.py", "--config", str(base / "evolution.json"), "--rounds", str(rounds), timeout=300)
    paths = DiLoCoPaths(base / "runs" / "t")
    assert out.returncode == 0, out.stderr[-3000:] + paths.worker_log(0).read_text()[-3000:]
    return paths


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
# the long tier (python -m pytest -m long; CI runs it): a torchrun worker group: test_train_fsdp_cli.py's two-process
# worker is the default tier's
@pytest.mark.long
def test_two_process_gloo_worker_commits_the_same_model_as_one_process(tmp_path):
    one = _run(tmp_path, "one")
    ddp = _run(tmp_path, "ddp", nproc_per_node=2)
    # FSDP2, stopped after round 1 and resumed: the AdamW shards come back from rank 0's file by broadcast
    _run(tmp_path, "fsdp", rounds=1, nproc_per_node=2, parallel="fsdp")
    fsdp = _run(tmp_path, "fsdp", rounds=2, nproc_per_node=2, parallel="fsdp")
    assert "2 processes (ddp)" in ddp.worker_log(0).read_text()
    assert "2 processes (fsdp)" in fsdp.worker_log(0).read_text()
    resumed = "resumed worker state: last round done 0, optimizer state of round 0, inner step 3"
    assert resumed in fsdp.worker_log(0).read_text()
    ref = load_tensors(one.global_dir(2) / "model.safetensors")
    theta0 = load_tensors(one.global_dir(0) / "model.safetensors")
    assert max(float((ref[k] - theta0[k]).abs().max()) for k in ref) > 1e-3  # it trained
    for paths in (ddp, fsdp):
        got = load_tensors(paths.global_dir(2) / "model.safetensors")
        assert set(got) == set(ref)
        for k in ref:
            assert torch.allclose(got[k], ref[k], atol=1e-5), k
        # the inner AdamW state saved by rank 0 (gathered from the shards under FSDP2) and the data position too
        s1, s2 = (json.loads(p.worker_state(0).read_text()) for p in (one, paths))
        assert s2["position"] == s1["position"] == 2 * 3 * 8 and s2["step"] == s1["step"] == 6
        o1 = load_tensors(one.worker_dir(0) / s1["opt_file"])
        o2 = load_tensors(paths.worker_dir(0) / s2["opt_file"])
        assert set(o1) == set(o2) and all(torch.allclose(o1[k], o2[k], atol=1e-6) for k in o1)
