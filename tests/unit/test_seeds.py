"""The inputs of the systems we replace work as written: every torchrun / run_training.sh command line of the
OpenDiLoCo READMEs (seeds 002 and 004) goes through train/launch/train_fsdp.py's parser and planner (nothing
trains), and
the EDT prototypes' evolution.json files (seeds 000 and 001, and the prototypes' own files) load with their
meaning. The command lines below are copied verbatim from the seed documents, shell continuations included."""
from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest

from train.launch import train_fsdp
from train.config import ConfigError, load_config

PEER = "/ip4/192.168.100.20/tcp/30001/p2p/Qmbh7opLJxFCtY22XqwETuo6bnWqijs76YXz7D69MBWEuZ"
ENV = {"PEER": PEER, "PEER_ADDRESS": "/ip4/MACHINE1_IP/tcp/30001/p2p/PEER_ID", "WORLD_RANK": "0",
       "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}

# seed 002 (Distributed-Multicluster instructions)
BASIC = r"""torchrun --standalone --nproc_per_node=2 train_fsdp.py \
    --per-device-train-batch-size 4 \
    --total-batch-size 16 \
    --lr 1e-2 \
    --path-model ../tests/models/llama-2m-fresh \
    --metric-logger-type dummy \
    --no-torch-compile \
    --fake-data \
    --max-steps 5"""
GPUS_6_7 = "CUDA_VISIBLE_DEVICES=6,7 " + BASIC  # "Training on Specific GPUs"
ADVANCED = r"""torchrun --standalone --nproc_per_node=4 train_fsdp.py \
    --per-device-train-batch-size 8 \
    --total-batch-size 64 \
    --lr 4e-4 \
    --path-model ../tests/models/llama-2m-fresh \
    --metric-logger-type wandb \
    --torch-compile \
    --max-steps 1000 \
    --seq-length 1024 \
    --precision fp16-mixed"""
MULTI_NODE = r"""torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT train_fsdp.py \
    --per-device-train-batch-size 4 \
    --total-batch-size 16 \
    --lr 1e-2 \
    --path-model ../tests/models/llama-2m-fresh \
    --metric-logger-type dummy \
    --no-torch-compile \
    --fake-data \
    --max-steps 5"""  # noqa: E501  (verbatim; the same line on the master and on the worker node)
HIVEMIND = r"""CUDA_VISIBLE_DEVICES=6,7 torchrun --standalone --nproc_per_node=2 train_fsdp.py \
    --per-device-train-batch-size 4 \
    --total-batch-size 16 \
    --lr 1e-2 \
    --path-model ../tests/models/llama-2m-fresh \
    --metric-logger-type dummy \
    --no-torch-compile \
    --fake-data \
    --max-steps 5 \
    --hv.initial-peers /ip4/127.0.0.1/tcp/30001/p2p/Qmd5gRA2PYYQB8gZNBau6APQTCGqEGsCggmpxay66h4sUJ \
    --hv.galaxy-size 1 \
    --hv.world-rank 0 \
    --hv.local-steps 2"""
HIVEMIND_MACHINE = r"""CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node=2 train_fsdp.py \
    --per-device-train-batch-size 4 \
    --total-batch-size 16 \
    --lr 1e-2 \
    --path-model ../tests/models/llama-2m-fresh \
    --metric-logger-type dummy \
    --no-torch-compile \
    --fake-data \
    --max-steps 5 \
    --hv.initial-peers $PEER_ADDRESS \
    --hv.galaxy-size 2 \
    --hv.world-rank $WORLD_RANK \
    --hv.local-steps 2"""

# seed 004 (OpenDiLoCo README)
DDP_150M = r"""torchrun --nproc_per_node=8 \
    train_fsdp.py \
    --sharding-strategy NO_SHARD \
    --per-device-train-batch-size 32 \
    --precision bf16-mixed \
    --total-batch-size 512 \
    --total-steps 88_000 \
    --project OpenDiLoCo \
    --lr 4e-4 \
    --path_model PrimeIntellect/llama-150m-fresh \
    --log-activations-steps 200 \
    --ckpt.interval 8000 \
    --ckpt.path 150_ckpt"""
DILOCO_150M_500 = r"""./run_training.sh 8 1 $PEER \
    --sharding-strategy NO_SHARD \
    --per-device-train-batch-size 8 \
    --precision bf16-mixed \
    --total-batch-size 512 \
    --hv.local-steps 500 \
    --total-steps 88_000 \
    --project OpenDiLoCo \
    --hv.skip_load_from_peers \
    --lr 4e-4 \
    --path-model PrimeIntellect/llama-150m-fresh \
    --log-activations-steps 250 \
    --ckpt.interval 4975  \
    --ckpt.path 150_ckpt"""
DILOCO_150M_50 = r"""./run_training.sh 8 1 $PEER \
    --sharding-strategy NO_SHARD \
    --per-device-train-batch-size 8 \
    --total-batch-size 512 \
    --precision bf16-mixed \
    --hv.local-steps 50 \
    --total-steps 88_000 \
    --project OpenDiLoCo \
    --hv.skip_load_from_peers \
    --lr 4e-4 \
    --path-model PrimeIntellect/llama-150m-fresh \
    --log-activations-steps 250 \
    --ckpt.interval 4975  \
    --ckpt.path 150_ckpt"""
BASELINE_1B = r"""torchrun --nproc_per_node=8 \
    train_fsdp.py \
    --sharding-strategy _HYBRID_SHARD_ZERO2 \
    --per-device-train-batch-size 16 \
    --total-batch-size 8192 \
    --precision bf16-mixed \
    --total-steps 88_000 \
    --project OpenDiLoCo \
    --lr 4e-4 \
    --path_model PrimeIntellect/llama-1b-fresh \
    --ckpt.path 1b_ckpt \
    --ckpt.interval 500"""
DILOCO_1B = r"""torchrun --nproc_per_node=8 \
    train_fsdp.py \
    --per-device-train-batch-size 16 \
    --total-batch-size 2048 \
    --precision bf16-mixed \
    --total-steps 88_000 \
    --hv.local_steps 500  \
    --project OpenDiLoCo \
    --lr 4e-4 \
    --path_model PrimeIntellect/llama-1b-fresh \
    --warmup-steps 1000 \
    --hv.averaging_timeout 1800 \
    --hv.skip_load_from_peers \
    --hv.local_steps {H} \
    --hv.initial-peers $PEER \
    --hv.galaxy-size 4 \
    --hv.world-rank $WORLD_RANK \
    --checkpoint_interval 500 \
    --ckpt.path 1b_diloco_ckpt"""
RESUME = r"""torchrun --nproc_per_node=8 \
    train_fsdp.py \
    ...
    --resume-from-checkpoint checkpoints_1b/2024-06-20/hivemind_1b/bm5zjkzr/model_step_6000"""


def invocations(line: str) -> list[tuple[list[str], int]]:
    """The train_fsdp.py argument lists a seed line runs, each with its torchrun group size (processes per
    worker). run_training.sh N NUM_GPU PEER ARGS... runs N workers of NUM_GPU processes with `--hv.initial-peers PEER
    ARGS --hv.world-rank i --hv.galaxy-size N` (OpenDiLoCo's open_diloco/run_training.sh)."""
    words = shlex.split(line.replace("\\\n", " "))
    words = [w for w in words if w != "..."]  # the README's elision
    for k, v in ENV.items():
        words = [w.replace("$" + k, v) for w in words]
    if words[0] == "./run_training.sh":
        n, gpus, peer, rest = int(words[1]), int(words[2]), words[3], words[4:]
        return [(["--hv.initial-peers", peer, *rest, "--hv.world-rank", str(i), "--hv.galaxy-size", str(n)], gpus)
                for i in range(n)]
    cut = words.index("train_fsdp.py")
    torchrun = dict(w[2:].split("=", 1) for w in words[:cut] if w.startswith("--") and "=" in w)
    for i, w in enumerate(words[:cut]):  # `--nproc_per_node 8`
        if w.startswith("--") and "=" not in w and i + 1 < cut and not words[i + 1].startswith("-"):
            torchrun[w[2:]] = words[i + 1]
    world = int(torchrun.get("nproc_per_node", 1)) * int(torchrun.get("nnodes", 1))
    return [(words[cut + 1:], world)]


# seed line -> what it must plan to: (outer.rounds, outer.local_steps, outer.num_workers, inner.parallel,
# --ckpt.interval after rounding, notes that must be logged)
CASES = {
    "002 basic": (BASIC, (1, 5, 1, "ddp", None), []),
    "002 specific GPUs": (GPUS_6_7, (1, 5, 1, "ddp", None), []),
    "002 advanced": (ADVANCED, (20, 50, 1, "ddp", None), []),
    "002 multi-node": (MULTI_NODE, (1, 5, 1, "ddp", None), []),
    "002 hivemind": (HIVEMIND, (3, 2, 1, "ddp", None), ["--hv.initial-peers /ip4/127.0.0.1/tcp/30001/p2p/Qmd5"]),
    "002 hivemind machine": (HIVEMIND_MACHINE, (3, 2, 2, "ddp", None), ["there is no DHT here"]),
    "004 150m DDP": (DDP_150M, (1760, 50, 1, "ddp", 8000),
                     ["--total-steps 88000 without --max-steps: the run is 1760 rounds x 50 local steps",
                      "--log-activations-steps 200: accepted, not used"]),
    "004 150m DiLoCo H=500": (DILOCO_150M_500, (176, 500, 8, "ddp", 5000),
                              ["--ckpt.interval 4975 is not a multiple of the local steps (500)",
                               "--hv.skip-load-from-peers: accepted, not used", "176 rounds x 500 local steps",
                               "outer optimizer: SGD lr 1, momentum 0, Nesterov (from evolution.json); OpenDiLoCo's "
                               "is lr 0.7 (--hv.outer-lr) with Nesterov momentum 0.9"]),
    "004 150m DiLoCo H=50": (DILOCO_150M_50, (1760, 50, 8, "ddp", 5000),
                             ["--ckpt.interval 4975 is not a multiple of the local steps (50)"]),
    "004 1b baseline": (BASELINE_1B, (1760, 50, 1, "fsdp", 500), ["--sharding-strategy _HYBRID_SHARD_ZERO2"]),
    "004 1b DiLoCo H=500": (DILOCO_1B.replace("{H}", "500"), (176, 500, 4, "ddp", 500), []),
    "004 1b DiLoCo H=125": (DILOCO_1B.replace("{H}", "125"), (704, 125, 4, "ddp", 500),
                            ["--hv.local-steps is given 2 times (500, 125): the last one, 125, is used"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_seed_command_line_plans(name, tmp_path, monkeypatch, caplog):
    line, (rounds, H, workers, parallel, ckpt), notes = CASES[name]
    monkeypatch.chdir(tmp_path)  # relative --ckpt.path lands here; the base config is the repo's evolution.json
    for argv, world in invocations(line):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            args, path, ovs, cfg = train_fsdp.plan(argv, world)
        got = (cfg.outer.rounds, cfg.outer.local_steps, cfg.outer.num_workers, cfg.inner.parallel,
               args.ckpt_interval)
        assert got == (rounds, H, workers, parallel, ckpt), (name, argv)
        assert cfg.inner.nproc_per_node == world and 0 <= args.world_rank < workers
        assert cfg.inner.total_batch_size % (cfg.inner.per_device_batch_size * world) == 0
        for note in notes:
            assert note in caplog.text, (name, note, caplog.text)
        assert not any(r.levelno >= logging.ERROR for r in caplog.records)
        assert ("OpenDiLoCo's is lr 0.7" in caplog.text) == ("--hv." in line or "run_training.sh" in line)
    if "OpenDiLoCo" in line:
        assert cfg.project_name == "OpenDiLoCo" and cfg.inner.total_steps == 88_000
        assert cfg.inner.precision == "bf16-mixed" and cfg.model.name.startswith("PrimeIntellect/llama-")
        assert cfg.run_dir.parent == tmp_path.resolve() / line.split("--ckpt.path ")[1].split()[0]
    assert list(tmp_path.iterdir()) == []  # planning writes nothing


def test_run_training_sh_makes_every_world_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = invocations(DILOCO_150M_500)
    assert len(runs) == 8 and {w for _, w in runs} == {1}
    assert [train_fsdp.plan(argv, w)[0].world_rank for argv, w in runs] == list(range(8))


def test_seed_resume_example_is_refused_clearly(tmp_path, monkeypatch):
    """An OpenDiLoCo checkpoint folder is not a run folder of ours: refused with what to do, not ignored."""
    monkeypatch.chdir(tmp_path)
    (argv, world), = invocations(RESUME)  # "..." stands for the run's flags: those of the 1b baseline here
    (run, _), = invocations(BASELINE_1B)
    with pytest.raises(ConfigError, match="--resume-from-checkpoint checkpoints_1b/2024-06-20/hivemind_1b/bm5zjkzr/"
                                          "model_step_6000: workers resume from their run folder"):
        train_fsdp.plan(run + argv, world)


def test_a_wandb_run_needs_wandb_installed_only_to_run(tmp_path, monkeypatch):
    """Seed 002's advanced line plans anywhere; running it checks that wandb is importable (one clear line)."""
    import importlib.util

    monkeypatch.chdir(tmp_path)
    (argv, world), = invocations(ADVANCED)
    _, _, _, cfg = train_fsdp.plan(argv, world)
    assert cfg.logging.metrics == "wandb" and cfg.inner.compile is True and cfg.data.seq_length == 1024
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="--metric-logger-type wandb: `pip install wandb` first"):
            train_fsdp.check_environment(cfg)


# -- the EDT prototypes' evolution.json ---------------------------------------------------------------------------
SEED_SNIPPET = {"BASE_DIR": "/mnt/shared/edt_run", "population_size": 8}  # seeds 000 and 001, "..." left out
# the prototypes' own files (EDT_EVOMERGE/ and EDT_LM/evolution.json; BASE_DIR set to the seed README's folder)
EVOMERGE_PROTOTYPE = {
    "PROJECT_NAME": "LM_EDT_EvoMerge2", "BASE_DIR": "/mnt/shared/edt_run", "LOCAL_PACKAGE": "./train",
    "INITIAL_POPULATION": ["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "Orion-zhen/Meissa-Qwen2.5-7B-Instruct",
                           "fblgit/cybertron-v4-qw7B-UNAMGS", "nvidia/OpenCodeReasoning-Nemotron-7B",
                           "nvidia/AceMath-RL-Nemotron-7B", "Xiaojian9992024/Qwen2.5-Dyanka-7B-Preview"],
    "POPULATION_SIZE": 4, "MAX_GENERATIONS": 10, "EVAL_BATCH_SIZE": 16, "MUTATION_PROBABILITY": 0.5,
    "MUTATION_STRENGTH": 4, "ELITISM": 1}
LM_PROTOTYPE = {
    "PROJECT_NAME": "Smol_Baseline", "BASE_DIR": "", "LOCAL_PACKAGE": "./train",
    "INITIAL_POPULATION": ["HuggingFaceTB/SmolLM2-135M"], "MAX_GENERATIONS": 32, "EVAL_BATCH_SIZE": 8,
    "MUTATION_PROBABILITY": 0.0, "MUTATION_STRENGTH": 0, "ELITISM": 0}


def _load(tmp_path: Path, raw: dict, caplog, strategy: str = "edt"):
    path = tmp_path / "evolution.json"
    path.write_text(json.dumps(raw))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="config"):
        cfg = load_config(path, strategy=strategy)
    return cfg, [r.getMessage() for r in caplog.records if r.name == "config"]


def test_seed_readme_snippet(tmp_path, caplog):
    cfg, notes = _load(tmp_path, SEED_SNIPPET, caplog)
    assert cfg.edt.population_size == 8 and cfg.edt.mode == "pretrain" and notes == []
    assert cfg.run_dir == Path("/mnt/shared/edt_run/edt-shakespeare")


def test_evomerge_prototype_config_selects_evomerge(tmp_path, caplog):
    with pytest.raises(ConfigError) as ei:
        _load(tmp_path, EVOMERGE_PROTOTYPE, caplog)
    msg = str(ei.value)  # its fitness items were fixed in its code: ours must be named
    assert "evomerge.tasks = []: INITIAL_POPULATION lists 6 different models, so this is an EvoMerge config" in msg
    assert msg.startswith(str(tmp_path / "evolution.json")) and len(msg.splitlines()) == 1
    tasks = [{"name": "gsm8k", "data": "gsm8k.jsonl", "metric": "exact_match"}]
    cfg, notes = _load(tmp_path, {**EVOMERGE_PROTOTYPE, "evomerge": {"tasks": tasks}}, caplog)
    assert cfg.edt.mode == "evomerge" and cfg.edt.initial_population == EVOMERGE_PROTOTYPE["INITIAL_POPULATION"]
    assert (cfg.edt.population_size, cfg.edt.max_generations, cfg.eval.batch_size, cfg.edt.elitism) == (4, 10, 16, 1)
    assert (cfg.edt.mutation_probability, cfg.edt.mutation_strength) == (0.5, 4.0)
    assert cfg.run_dir == Path("/mnt/shared/edt_run/LM_EDT_EvoMerge2")
    assert len(notes) == 3 and all(n.startswith(str(tmp_path / "evolution.json") + ": ") for n in notes)
    assert any('LOCAL_PACKAGE = "./train" is ignored' in n for n in notes)
    assert any("INITIAL_POPULATION lists 6 different models: as in the EvoMerge prototype" in n for n in notes)
    assert any("MUTATION_STRENGTH = 4 is edt.mutation_strength" in n for n in notes)
    # an explicit mode wins over the prototype's convention
    cfg, notes = _load(tmp_path, {**EVOMERGE_PROTOTYPE, "edt": {"mode": "pretrain"}}, caplog)
    assert cfg.edt.mode == "pretrain" and not any("INITIAL_POPULATION lists" in n for n in notes)


def test_pretrain_prototype_config(tmp_path, caplog):
    with pytest.raises(ConfigError, match='base_dir = "": must be a folder path: the folder runs live in'):
        _load(tmp_path, LM_PROTOTYPE, caplog)
    cfg, notes = _load(tmp_path, {**LM_PROTOTYPE, "BASE_DIR": "/mnt/shared/edt_run"}, caplog)
    assert cfg.edt.mode == "pretrain" and cfg.edt.initial_population == ["HuggingFaceTB/SmolLM2-135M"]
    assert (cfg.edt.max_generations, cfg.eval.batch_size, cfg.edt.elitism, cfg.project_name) == \
        (32, 8, 0, "Smol_Baseline")
    assert len(notes) == 1 and "LOCAL_PACKAGE" in notes[0]


@pytest.mark.parametrize("alias", ["POPULATION_SIZE", "population_size"])
def test_a_prototype_population_of_zero_is_refused_not_replaced(tmp_path, caplog, alias):
    """Issue #25: the prototypes' population_size counts the members (seeds 000 and 001: 8 is 8 members). Our
    edt.population_size = 0 means one member per worker, which the prototype's 0 never meant: under a prototype's
    name 0 is refused, naming the key as written, instead of quietly running outer.num_workers members."""
    with pytest.raises(ConfigError) as ei:
        _load(tmp_path, {"BASE_DIR": "/mnt/shared/edt_run", alias: 0}, caplog)
    msg = str(ei.value)
    assert msg.startswith(f"{tmp_path / 'evolution.json'}: {alias}: edt.population_size = 0: must be >= 1"), msg
    assert "edt.population_size = 0" in msg.split("leave it out or set ")[1] and len(msg.splitlines()) == 1
    cfg, _ = _load(tmp_path, {"BASE_DIR": "/mnt/shared/edt_run", "edt": {"population_size": 0}}, caplog)
    assert cfg.edt.population_size == 0  # the structured key keeps its meaning: outer.num_workers members


def test_every_prototype_sentinel_is_refused_under_every_alias_of_its_key():
    """A value our key reads as "derive it" (PROTOTYPE_SENTINELS) is refused under each prototype alias of the key
    and accepted under the key itself."""
    from train.config import LEGACY_KEYS, PROTOTYPE_SENTINELS, build_config

    for key, (value, _) in PROTOTYPE_SENTINELS.items():
        aliases = [a for a, k in LEGACY_KEYS.items() if k == key]
        assert aliases, key
        for alias in aliases:
            with pytest.raises(ConfigError, match=re.escape(f"<defaults>: {alias}: {key} = {json.dumps(value)}: ")):
                build_config({alias: value})
            with pytest.raises(ConfigError, match=re.escape(f"<defaults>: {alias}: {key} = ")):
                build_config({}, [f"{alias}={json.dumps(value)}"])
        *section, leaf = key.split(".")
        build_config({section[0]: {leaf: value}} if section else {leaf: value})
