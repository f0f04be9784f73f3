"""An OpenDiLoCo-style worker entry: the seed READMEs' `train_fsdp.py` flags, run on our BASE_DIR protocol.

    torchrun --standalone --nproc_per_node=2 train/launch/train_fsdp.py --per-device-train-batch-size 4 \\
        --total-batch-size 16 --lr 1e-2 --path-model configs/tiny-llama.json --metric-logger-type dummy \\
        --no-torch-compile --fake-data --max-steps 5 [--hv.local-steps 2 --hv.galaxy-size 2 --hv.world-rank 0]

One such command is one DiLoCo worker (`--hv.world-rank` of `--hv.galaxy-size`); its torchrun processes are the
worker's data-parallel group (train/core/dist.py). Hivemind is replaced by the shared BASE_DIR: the worker of world rank
0 also starts the coordinator (`python diloco.py`, logs/coordinator.log) unless `--no-coordinator` says that one
runs elsewhere. Each flag maps onto one config key (FLAG_TO_KEY; README "Multi-GPU workers (torchrun) and the
OpenDiLoCo-style CLI"). A seed flag whose job is done otherwise here is accepted with a one-line note saying how
(NOTED: hivemind peers, activation logging; nearest sharding strategy; checkpoint interval rounded to a round end);
one with no counterpart fails with what to use instead (UNSUPPORTED). `plan(argv, world)` does all of this without
training (tests/unit/test_seeds.py runs every seed command line through it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (torchrun train/launch/train_fsdp.py): import the package from the repo
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from train.config import REPO_ROOT, ConfigError, RunConfig, load_config, parse_override  # noqa: E402

log = logging.getLogger("train_fsdp")

# seed flag (dashes) -> our config key; the value is passed through as given (after PRECISION / SHARDING below)
FLAG_TO_KEY = {
    "per-device-train-batch-size": "inner.per_device_batch_size", "total-batch-size": "inner.total_batch_size",
    "lr": "inner.lr", "warmup-steps": "inner.warmup_steps", "total-steps": "inner.total_steps",
    "seq-length": "data.seq_length", "precision": "inner.precision", "path-model": "model.name",
    "metric-logger-type": "logging.metrics", "project": "project_name", "seed": "seed", "base-dir": "base_dir",
    "sharding-strategy": "inner.parallel", "hv.local-steps": "outer.local_steps", "hv.outer-lr": "outer.lr",
    "hv.galaxy-size": "outer.num_workers", "hv.averaging-timeout": "outer.round_timeout_s",
}
PRECISION = {"32-true": "fp32", "32": "fp32", "fp32": "fp32", "bf16-mixed": "bf16-mixed", "fp16-mixed": "fp16-mixed"}
# torch FSDP1 ShardingStrategy -> inner.parallel, and why when it is only the nearest. fsdp (FSDP2 fully_shard over
# the worker's processes) shards parameters, gradients and AdamW state: never more memory than the seed's choice.
SHARDING = {"NO_SHARD": ("ddp", ""), "FULL_SHARD": ("fsdp", "")}
for _s, _what in (("SHARD_GRAD_OP", "ZeRO-2: gradients and optimizer state sharded, parameters whole"),
                  ("HYBRID_SHARD", "FULL_SHARD within each node, replicated across nodes"),
                  ("_HYBRID_SHARD_ZERO2", "ZeRO-2 within each node, replicated across nodes")):
    SHARDING[_s] = ("fsdp", f"{_s} ({_what}) is not implemented; the nearest is inner.parallel = fsdp (FSDP2 "
                            f"fully_shard: parameters too are sharded, over all of the worker's processes), which "
                            f"needs no more memory per GPU")
# seed flags accepted for what they mean here: flag -> (takes a value, the one-line note logged when given)
NOTED = {
    "hv.initial-peers": (True, "there is no DHT here: workers meet in the run folder BASE_DIR/<project> on a shared "
                               "disk; every worker needs the same --ckpt.path (or --base-dir) and --project, on a "
                               "folder they all see"),
    "hv.skip-load-from-peers": (False, "there are no peers to load from: every worker loads the committed global "
                                       "model from BASE_DIR/<project> anyway"),
    "log-activations-steps": (True, "activation-norm logging is not implemented; loss, learning rate, tokens and "
                                    "timings are logged every round"),
}
UNSUPPORTED = {
    "hv.matchmaking-time": "there is no matchmaking: the coordinator waits up to --hv.averaging-timeout for deltas",
    "hv.fail-rank-drop": "a worker that misses a round is dropped from it (outer.min_workers); drop the flag",
    "dataset-name-or-paths": "use --set data.dataset=<folder, file, glob or hub name>",
}


def normalise(argv: list[str]) -> list[str]:
    """`--path_model x` and `--hv.local_steps=5` are the seed docs' spellings of `--path-model`, `--hv.local-steps`."""
    out = []
    for a in argv:
        if a.startswith("--") and a != "--":
            name, eq, val = a[2:].partition("=")
            a = "--" + name.replace("_", "-") + eq + val
        out.append(a)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node N train/launch/train_fsdp.py",
                                 description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--config", help="base evolution.json (default: ./evolution.json, else the repo's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config key")
    for flag, key in FLAG_TO_KEY.items():
        ap.add_argument("--" + flag, dest=flag, help=key)
    ap.add_argument("--max-steps", type=int, help="inner steps of this worker in all: outer.rounds = "
                                                  "ceil(max-steps / local steps)")
    ap.add_argument("--hv.world-rank", dest="world_rank", type=int, default=0, help="this worker's id (--worker)")
    ap.add_argument("--fake-data", action="store_true", help="data.fake_data = true")
    ap.add_argument("--torch-compile", dest="compile", action="store_true", default=None, help="inner.compile")
    ap.add_argument("--no-torch-compile", dest="compile", action="store_false", help="inner.compile = false")
    ap.add_argument("--ckpt.path", dest="ckpt_path", help="base_dir: the run's state lives in BASE_DIR/<project>")
    ap.add_argument("--ckpt.interval", "--checkpoint-interval", dest="ckpt_interval", type=int,
                    help="every round end is a checkpoint: rounded up to a multiple of the local steps (with a note)")
    ap.add_argument("--resume-from-checkpoint", dest="resume", help="the run folder (BASE_DIR/<project>): workers "
                                                                    "always resume from it")
    ap.add_argument("--no-coordinator", action="store_true", help="the coordinator (python diloco.py) runs "
                                                                  "elsewhere; world rank 0 does not start one")
    for flag, (takes_value, note) in NOTED.items():
        ap.add_argument("--" + flag, dest=flag, help="accepted, not used: " + note,
                        **({"action": "append"} if takes_value else {"action": "store_true"}))
    return ap


def overrides_from(args: argparse.Namespace, world: int) -> list[str]:
    """The --set overrides the flags mean (before the user's own --set, which wins)."""
    vals = {k: getattr(args, k) for k in FLAG_TO_KEY if getattr(args, k) is not None}
    if "precision" in vals:
        if vals["precision"] not in PRECISION:
            raise ConfigError(f"--precision {vals['precision']}: must be one of {', '.join(PRECISION)}")
        vals["precision"] = PRECISION[vals["precision"]]
    if "sharding-strategy" in vals:
        if vals["sharding-strategy"] not in SHARDING:
            raise ConfigError(f"--sharding-strategy {vals['sharding-strategy']}: must be one of {', '.join(SHARDING)}"
                              f" (NO_SHARD = DDP, inner.parallel = ddp; the others: FSDP2, inner.parallel = fsdp)")
        parallel, why = SHARDING[vals["sharding-strategy"]]
        if why:
            log.info("--sharding-strategy %s", why)
        vals["sharding-strategy"] = parallel
    if args.ckpt_path:
        if vals.get("base-dir") and Path(vals["base-dir"]).resolve() != Path(args.ckpt_path).resolve():
            raise ConfigError(f"--ckpt.path {args.ckpt_path} and --base-dir {vals['base-dir']} differ: checkpoints "
                              f"are the run folder BASE_DIR/<project>; give one of them")
        vals["base-dir"] = args.ckpt_path
    for k in ("path-model", "base-dir"):  # a path that exists here means this folder, not the config file's
        if k in vals and os.path.exists(os.path.expanduser(vals[k])):
            vals[k] = str(Path(vals[k]).expanduser().resolve())
    if "base-dir" in vals:
        vals["base-dir"] = str(Path(vals["base-dir"]).expanduser().resolve())
    vals.setdefault("hv.galaxy-size", 1)  # no --hv.*: one worker, the seed's plain torchrun run
    for k, v in vals.items():
        if isinstance(v, str) and re.fullmatch(r"\d[\d_]*", v):
            vals[k] = v.replace("_", "")  # 88_000, as the seed docs write it
    out = [f"{FLAG_TO_KEY[k]}={v}" for k, v in vals.items()]  # JSON when it parses (numbers), else a string
    if args.fake_data:
        out.append("data.fake_data=true")
    if args.compile is not None:
        out.append(f"inner.compile={json.dumps(args.compile)}")
    return out + [f"inner.nproc_per_node={world}"]


def _load_quietly(path: str, ovs: list[str]) -> RunConfig:
    """load_config without its notes (an intermediate load: the final one logs them once)."""
    cl = logging.getLogger("config")
    was, cl.disabled = cl.disabled, True
    try:
        return load_config(path, ovs)
    finally:
        cl.disabled = was


def _run_length(args: argparse.Namespace, path: str, ovs: list[str], cfg: RunConfig) -> None:
    """--max-steps, else --total-steps, is the length of the run (OpenDiLoCo trains until it; --total-steps is also
    the cosine schedule's length): outer.rounds = ceil(steps / local steps), appended to `ovs`."""
    flag = "max-steps" if args.max_steps is not None else "total-steps" if getattr(args, "total-steps") else None
    if flag is None:
        return
    steps = args.max_steps if flag == "max-steps" else cfg.inner.total_steps
    if steps < 1:
        raise ConfigError(f"--{flag} {steps}: must be >= 1")
    if any(parse_override(o)[0] == "outer.rounds" for o in args.set):
        if flag == "max-steps":
            raise ConfigError(f"--max-steps {steps} and --set outer.rounds={cfg.outer.rounds} both give the run "
                              f"length: drop one of them")
        log.info("--total-steps %d is the cosine schedule's length; the run is --set outer.rounds = %d rounds of %d "
                 "local steps", steps, cfg.outer.rounds, cfg.outer.local_steps)
        return
    H = cfg.outer.local_steps
    if H > steps:  # fewer steps than one round: one round of them
        if getattr(args, "hv.local-steps") is not None:
            log.warning("--%s %d < --hv.local-steps %d: one round of %d local steps", flag, steps, H, steps)
        ovs.append(f"outer.local_steps={steps}")
        H = steps
    rounds = math.ceil(steps / H)
    exact = rounds * H == steps
    if flag == "total-steps":
        log.info("--total-steps %d without --max-steps: the run is %d rounds x %d local steps = %d inner steps per "
                 "worker (outer.rounds = ceil(total steps / local steps)%s)", steps, rounds, H, rounds * H,
                 "" if exact else ": a round is never cut short")
    elif not exact:
        log.warning("--max-steps %d is not a multiple of the local steps %d: running %d rounds = %d inner steps "
                    "(a round is never cut short)", steps, H, rounds, rounds * H)
    ovs.append(f"outer.rounds={rounds}")


def resolve(args: argparse.Namespace, world: int) -> tuple[str, list[str], RunConfig]:
    """The config file, the overrides for the worker and the coordinator, and the config they make. Logs one line
    for every seed flag taken in a nearer meaning than its own; touches no file and imports no torch."""
    path = args.config or ("evolution.json" if Path("evolution.json").is_file() else str(REPO_ROOT / "evolution.json"))
    ovs = overrides_from(args, world) + list(args.set)
    _run_length(args, path, ovs, _load_quietly(path, ovs))
    cfg = load_config(path, ovs)
    H = cfg.outer.local_steps
    if args.ckpt_interval is not None:
        if args.ckpt_interval < 1:
            raise ConfigError(f"--ckpt.interval {args.ckpt_interval}: must be >= 1")
        if args.ckpt_interval % H:
            up = math.ceil(args.ckpt_interval / H) * H
            log.info("--ckpt.interval %d is not a multiple of the local steps (%d): checkpoints are taken at round "
                     "ends, so it is rounded up to %d; every round end is saved in %s anyway (a resume loses at most "
                     "one round)", args.ckpt_interval, H, up, cfg.run_dir)
            args.ckpt_interval = up
    given = {parse_override(o)[0] for o in args.set}
    hivemind = any(getattr(args, f) is not None for f in FLAG_TO_KEY if f.startswith("hv.")) or args.world_rank
    oc = cfg.outer
    if hivemind and not {"outer.lr", "outer.momentum"} & given and (oc.momentum, oc.nesterov) != (0.9, True):
        log.info("outer optimizer: SGD lr %g, momentum %g%s (from %s%s); OpenDiLoCo's is lr 0.7 (--hv.outer-lr) with "
                 "Nesterov momentum 0.9: add --set outer.momentum=0.9 (and --hv.outer-lr 0.7) for it", oc.lr,
                 oc.momentum, ", Nesterov" if oc.nesterov else "", Path(path).name,
                 ", --hv.outer-lr" if getattr(args, "hv.outer-lr") is not None else "")
    for flag, (_, note) in NOTED.items():
        value = getattr(args, flag)
        if value:
            log.info("--%s%s: accepted, not used: %s", flag,
                     "" if value is True else " " + " ".join(map(str, value)), note)
    if args.resume:
        want, run = Path(args.resume).expanduser().resolve(), cfg.run_dir.resolve()
        if not (want in (run, run.parent) or run in want.parents):  # BASE_DIR, the run folder or inside it
            raise ConfigError(f"--resume-from-checkpoint {args.resume}: workers resume from their run folder "
                              f"{cfg.run_dir} by themselves; point --base-dir (or --ckpt.path) / --project at the "
                              f"run to resume, or drop the flag")
        log.info("resuming from %s", run if run.exists() else f"{run} (nothing there yet: a new run)")
    if not 0 <= args.world_rank < cfg.outer.num_workers:
        raise ConfigError(f"--hv.world-rank {args.world_rank}: must be in 0..{cfg.outer.num_workers - 1} "
                          f"(--hv.galaxy-size {cfg.outer.num_workers})")
    return path, ovs, cfg


def check_environment(cfg: RunConfig) -> None:
    """What this machine must have for the run (not a question of the command line)."""
    if cfg.logging.metrics in ("wandb", "tensorboard"):
        mod = "wandb" if cfg.logging.metrics == "wandb" else "tensorboard"
        if importlib.util.find_spec(mod) is None:
            raise ConfigError(f"--metric-logger-type {cfg.logging.metrics}: `pip install {mod}` first, or use jsonl "
                              f"or dummy")


def _note_repeats(argv: list[str]) -> None:
    """A flag given twice with different values: argparse keeps the last one; say so."""
    seen: dict[str, list[str]] = {}
    for i, a in enumerate(argv):
        if not a.startswith("--") or a == "--":
            continue
        name, eq, val = a[2:].partition("=")
        if not eq:
            val = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        if name != "set" and name not in NOTED:  # --set and --hv.initial-peers add up; the others replace
            seen.setdefault(name, []).append(val)
    for name, vals in seen.items():
        if len(set(vals)) > 1:
            log.info("--%s is given %d times (%s): the last one, %s, is used", name, len(vals), ", ".join(vals),
                     vals[-1])


def plan(argv: list[str], world: int = 1) -> tuple[argparse.Namespace, str, list[str], RunConfig]:
    """The whole command line, checked and mapped, without training: (args, config path, overrides, config).
    `world` is the torchrun group size (processes of this worker). ConfigError for anything we cannot honour."""
    argv = normalise(list(argv))
    for a in argv:
        name = a[2:].partition("=")[0]
        if a.startswith("--") and name in UNSUPPORTED:
            raise ConfigError(f"--{name} is not supported: {UNSUPPORTED[name]}")
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        raise ConfigError(f"unsupported argument(s) {' '.join(unknown)}: see `train/launch/train_fsdp.py --help` "
                          f"for the flags we map, or set any config key with --set KEY=VALUE (docs/config.md)")
    _note_repeats(argv)
    return (args, *resolve(args, world))


def start_coordinator(path: str, ovs: list[str], cfg: RunConfig) -> subprocess.Popen:
    """`python -m diloco` with the same config, in its own process group, stopped with us (logs/coordinator.log)."""
    from train.launch.procs import die_with_parent
    from train.exchange.store import DiLoCoPaths
    from train.config.strategies import STRATEGIES

    logf = DiLoCoPaths(cfg.run_dir).logs / "coordinator.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", STRATEGIES["diloco"].coordinator_module, "--config", path,
           *[x for o in ovs for x in ("--set", o)], "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the coordinator is not part of our torchrun group
    with open(logf, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=REPO_ROOT, start_new_session=True, preexec_fn=die_with_parent())
    log.info("started the coordinator (pid %d, log %s)", proc.pid, logf)
    return proc


def main(argv: list[str] | None = None) -> int:
    from train.core.dist import get_dist_info
    from train.core.errors import ProtocolError, UserError, setup_logging
    from train.core.model import quiet_transformers
    from train.diloco.worker import Worker

    info = get_dist_info()
    setup_logging("train_fsdp", logging.INFO if info.main else logging.WARNING)
    quiet_transformers()
    coord = None
    try:
        args, path, ovs, cfg = plan(sys.argv[1:] if argv is None else argv, info.world)
        check_environment(cfg)
        if info.main and args.world_rank == 0 and not args.no_coordinator:
            coord = start_coordinator(path, ovs, cfg)
        worker = Worker(cfg, args.world_rank)

        watch = worker.monitor  # the worker's own watch (the coordinator's lease): kept, and run first

        def monitor() -> None:
            watch()
            if coord is not None and coord.poll() not in (None, 0):
                raise ProtocolError(f"the coordinator exited with status {coord.returncode}; see "
                                    f"{cfg.run_dir / 'logs' / 'coordinator.log'}")
        worker.monitor = monitor
        worker.run()
        if coord is not None:
            rc = coord.wait()  # it still writes the final model and plot after the last round
            if rc:
                raise ProtocolError(f"the coordinator exited with status {rc}; see {cfg.run_dir}/logs/coordinator.log")
    except UserError as e:  # one line and exit 2 (run_main does the same; tests call main() itself)
        if info.main:
            log.error("%s", " ".join(str(e).split("\n")))
        return 2
    finally:
        if coord is not None and coord.poll() is None:
            coord.terminate()
    return 0


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "train_fsdp")
