"""train/launch/train_fsdp.py: the seed READMEs' torchrun command lines map onto our config, run, and refuse what we
lack."""
from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys

import pytest

from tests.helpers import REPO
from train.launch import train_fsdp
from train.core.store import read_jsonl
from train.exchange.store import DiLoCoPaths

MODEL = str(REPO / "configs" / "micro-llama.json")


def seed_command(ckpt, galaxy: int = 4, **extra) -> list[str]:
    """The issue's OpenDiLoCo / Distributed-Multicluster command, at tiny sizes (model, sequence length, data)."""
    args = {"per-device-train-batch-size": 4, "total-batch-size": 16, "lr": "1e-2", "path-model": MODEL,
            "metric-logger-type": "dummy", "max-steps": 5, "seq-length": 32, "precision": "bf16-mixed",
            "warmup-steps": 1000, "total-steps": "88_000", "ckpt.interval": 500, "ckpt.path": str(ckpt),
            "resume-from-checkpoint": str(ckpt), "hv.local-steps": 500, "hv.outer-lr": 0.7,
            "hv.galaxy-size": galaxy, "hv.world-rank": 0, "hv.averaging-timeout": 1800, **extra}
    out = ["--no-torch-compile", "--fake-data"]
    for k, v in args.items():
        out += [f"--{k}", str(v)]
    return out + ["--set", "inner.threads=1", "--set", "data.fake_tokens=20000", "--set", "logging.progress=false"]


def resolve(argv: list[str], world: int = 2):
    args = train_fsdp.build_parser().parse_args(train_fsdp.normalise(argv))
    return args, *train_fsdp.resolve(args, world)


def test_seed_flags_map_onto_our_config(tmp_path):
    args, _, ovs, cfg = resolve(seed_command(tmp_path / "ck"))
    assert (cfg.inner.per_device_batch_size, cfg.inner.total_batch_size, cfg.inner.lr) == (4, 16, 1e-2)
    assert cfg.model.name == MODEL and cfg.logging.metrics == "dummy" and cfg.data.fake_data
    assert cfg.inner.compile is False and cfg.data.seq_length == 32 and cfg.inner.precision == "bf16-mixed"
    assert (cfg.inner.warmup_steps, cfg.inner.total_steps) == (1000, 88_000)
    assert cfg.base_dir == str((tmp_path / "ck").resolve()) and cfg.run_dir.parent == (tmp_path / "ck").resolve()
    assert (cfg.outer.lr, cfg.outer.num_workers, cfg.outer.round_timeout_s) == (0.7, 4, 1800.0)
    # --max-steps 5 is fewer than --hv.local-steps 500: one round of 5 inner steps
    assert (cfg.outer.local_steps, cfg.outer.rounds) == (5, 1) and args.world_rank == 0
    assert cfg.inner.nproc_per_node == 2 and cfg.inner.parallel == "ddp"


def test_seed_spellings_and_step_arithmetic(tmp_path):
    argv = ["--path_model", MODEL, "--hv.local_steps", "2", "--max-steps", "5", "--precision", "32-true",
            "--sharding-strategy", "FULL_SHARD", "--hv.galaxy_size=2", "--hv.world_rank", "1", "--project", "p",
            "--base-dir", str(tmp_path), "--per-device-train-batch-size", "2", "--total-batch-size", "8"]
    args, _, _, cfg = resolve(argv, world=2)
    assert cfg.model.name == MODEL and cfg.inner.precision == "fp32" and cfg.inner.parallel == "fsdp"
    assert (cfg.outer.local_steps, cfg.outer.rounds) == (2, 3)  # ceil(5 / 2): a round is never cut short
    assert cfg.outer.num_workers == 2 and args.world_rank == 1 and cfg.run_dir == tmp_path.resolve() / "p"
    _, _, _, plain = resolve(["--path-model", MODEL, "--max-steps", "5", "--base-dir", str(tmp_path)], world=1)
    assert (plain.outer.num_workers, plain.outer.local_steps, plain.outer.rounds) == (1, 5, 1)  # no --hv.*


def _main(argv, caplog) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rc = train_fsdp.main(argv)
    return rc, caplog.text


@pytest.mark.parametrize("extra,message", [
    (["--hv.matchmaking-time", "5"], "--hv.matchmaking-time is not supported: there is no matchmaking"),
    (["--hv.fail_rank_drop"], "--hv.fail-rank-drop is not supported"),
    (["--no-such-flag", "3"], "unsupported argument(s) --no-such-flag 3"),
    (["--sharding-strategy", "ZERO9"], "--sharding-strategy ZERO9: must be one of NO_SHARD, FULL_SHARD"),
    (["--ckpt.interval", "0"], "--ckpt.interval 0: must be >= 1"),
    (["--hv.world-rank", "4"], "--hv.world-rank 4: must be in 0..3"),
    (["--precision", "int8"], "--precision int8: must be one of"),
    (["--set", "inner.no_such_key=1"], "unknown key 'inner.no_such_key'"),
    (["--set", "outer.rounds=3"], "--max-steps 5 and --set outer.rounds=3 both give the run length"),
])
def test_unsupported_or_bad_flags_fail_clearly(tmp_path, caplog, extra, message):
    rc, text = _main(seed_command(tmp_path / "ck") + extra, caplog)
    assert rc == 2 and message in text, text
    assert not (tmp_path / "ck").exists()  # nothing started


def test_resume_from_another_folder_is_refused(tmp_path, caplog):
    argv = seed_command(tmp_path / "ck")
    argv[argv.index("--resume-from-checkpoint") + 1] = str(tmp_path / "elsewhere")
    rc, text = _main(argv, caplog)
    assert rc == 2 and "workers resume from their run folder" in text


def test_optional_metric_loggers_fail_early_when_missing(tmp_path, caplog):
    for kind in ("wandb", "tensorboard"):
        if importlib.util.find_spec(kind) is not None:
            continue
        rc, text = _main(seed_command(tmp_path / "ck", **{"metric-logger-type": kind}), caplog)
        assert rc == 2 and f"`pip install {kind}` first" in text


@pytest.mark.slow
@pytest.mark.timeout(300)  # real processes: start-ups, rounds, restarts on 2 busy cores
def test_seed_command_runs_as_a_two_process_torchrun_worker(tmp_path):
    """The issue's command line under torchrun (2 gloo processes), with world rank 0 starting the coordinator."""
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "train" / "launch" / "train_fsdp.py"), *seed_command(ck, galaxy=1), "--project", "seed"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    paths = DiLoCoPaths(ck / "seed")
    logs = out.stdout + out.stderr
    assert out.returncode == 0, logs[-4000:] + (paths.logs / "coordinator.log").read_text()[-2000:]
    assert "2 processes (ddp)" in logs and "round 0: 5 steps" in logs
    recs = read_jsonl(paths.metrics)
    assert [r["round"] for r in recs] == [0, 1] and recs[1]["tokens"] == 5 * 16 * 32
    assert (paths.final / "model.safetensors").is_file()
    state = json.loads(paths.worker_state(0).read_text())
    assert state["position"] == 5 * 16 and state["sidecar"]["processes"] == 2


# -- seed flags taken in their nearest meaning (plan only: nothing trains, nothing is written) ---------------------
def _plan(argv, caplog, world: int = 1):
    caplog.clear()
    with caplog.at_level(logging.INFO):
        args, _, _, cfg = train_fsdp.plan(argv, world)
    return args, cfg, caplog.text


def test_total_steps_without_max_steps_defines_the_run_length(tmp_path, caplog):
    base = ["--path-model", MODEL, "--base-dir", str(tmp_path)]
    _, cfg, text = _plan(base + ["--total-steps", "88_000", "--hv.local-steps", "500"], caplog)
    assert (cfg.inner.total_steps, cfg.outer.local_steps, cfg.outer.rounds) == (88_000, 500, 176)
    assert "--total-steps 88000 without --max-steps: the run is 176 rounds x 500 local steps = 88000 inner" in text
    _, cfg, text = _plan(base + ["--total-steps", "1000", "--hv.local-steps", "300"], caplog)
    assert cfg.outer.rounds == 4 and "4 rounds x 300 local steps = 1200" in text and "never cut short" in text
    _, cfg, _ = _plan(base + ["--total-steps", "20"], caplog)  # fewer than one round (H = 50 in evolution.json)
    assert (cfg.outer.local_steps, cfg.outer.rounds) == (20, 1)
    # --max-steps still wins the run length; --total-steps is then only the schedule
    _, cfg, _ = _plan(base + ["--total-steps", "1000", "--hv.local-steps", "10", "--max-steps", "30"], caplog)
    assert (cfg.inner.total_steps, cfg.outer.rounds) == (1000, 3)
    # an explicit --set outer.rounds is the user's run length: kept, and said
    _, cfg, text = _plan(base + ["--total-steps", "1000", "--set", "outer.rounds=3"], caplog)
    assert cfg.outer.rounds == 3 and "the run is --set outer.rounds = 3 rounds" in text
    assert list(tmp_path.iterdir()) == []


def test_seed_flags_are_accepted_with_a_note(tmp_path, caplog):
    argv = ["--path_model", MODEL, "--ckpt.path", str(tmp_path / "ck"), "--hv.local_steps", "500",
            "--hv.skip_load_from_peers", "--log-activations-steps", "250", "--ckpt.interval", "4975",
            "--hv.initial-peers", "/ip4/127.0.0.1/tcp/30001/p2p/Qmbh", "--sharding-strategy", "_HYBRID_SHARD_ZERO2",
            "--per-device-train-batch-size", "2", "--total-batch-size", "16", "--hv.galaxy-size", "2"]
    args, cfg, text = _plan(argv, caplog, world=8)
    assert cfg.inner.parallel == "fsdp" and cfg.inner.nproc_per_node == 8 and cfg.outer.num_workers == 2
    assert "--sharding-strategy _HYBRID_SHARD_ZERO2 (ZeRO-2 within each node" in text and "nearest is" in text
    assert args.ckpt_interval == 5000
    assert "--ckpt.interval 4975 is not a multiple of the local steps (500): checkpoints are taken at round ends, " \
           "so it is rounded up to 5000" in text
    assert "--hv.skip-load-from-peers: accepted, not used: there are no peers to load from" in text
    assert "--log-activations-steps 250: accepted, not used: activation-norm logging is not implemented" in text
    assert "--hv.initial-peers /ip4/127.0.0.1/tcp/30001/p2p/Qmbh: accepted, not used: there is no DHT" in text
    for note in ("skip-load-from-peers", "log-activations-steps", "--ckpt.interval 4975", "_HYBRID_SHARD_ZERO2"):
        assert text.count(note) == 1, note  # one line each
    assert not (tmp_path / "ck").exists()
    _, cfg, _ = _plan(["--path-model", MODEL, "--base-dir", str(tmp_path), "--sharding-strategy", "NO_SHARD"], caplog)
    assert cfg.inner.parallel == "ddp"


def test_a_flag_given_twice_says_which_value_is_used(tmp_path, caplog):
    argv = ["--path-model", MODEL, "--base-dir", str(tmp_path), "--hv.local_steps", "500", "--hv.local_steps", "125"]
    _, cfg, text = _plan(argv, caplog)
    assert cfg.outer.local_steps == 125
    assert "--hv.local-steps is given 2 times (500, 125): the last one, 125, is used" in text
