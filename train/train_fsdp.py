"""An OpenDiLoCo-style worker entry: the seed READMEs' `train_fsdp.py` flags, run on our BASE_DIR protocol.

    torchrun --standalone --nproc_per_node=2 train/train_fsdp.py --per-device-train-batch-size 4 \\
        --total-batch-size 16 --lr 1e-2 --path-model configs/tiny-llama.json --metric-logger-type dummy \\
        --no-torch-compile --fake-data --max-steps 5 [--hv.local-steps 2 --hv.galaxy-size 2 --hv.world-rank 0]

One such command is one DiLoCo worker (`--hv.world-rank` of `--hv.galaxy-size`); its torchrun processes are the
worker's data-parallel group (train/dist.py). Hivemind is replaced by the shared BASE_DIR: the worker of world rank
0 also starts the coordinator (`python diloco.py`, logs/coordinator.log) unless `--no-coordinator` says that one
runs elsewhere. Each flag maps onto one config key (FLAG_TO_KEY; README "Multi-GPU workers (torchrun) and the
OpenDiLoCo-style CLI"); a seed flag with no counterpart here fails with what to use instead (UNSUPPORTED).
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

if __package__ in (None, ""):  # run as a file (torchrun train/train_fsdp.py): import the package from the repo
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from train.config import REPO_ROOT, ConfigError, RunConfig, load_config  # noqa: E402

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
SHARDING = {"NO_SHARD": "ddp", "FULL_SHARD": "fsdp"}
UNSUPPORTED = {
    "hv.initial-peers": "there is no DHT: workers meet on the shared BASE_DIR; give every worker the same "
                        "--base-dir (or --ckpt.path) and --project",
    "hv.skip-load-from-peers": "workers always start from the committed global model on BASE_DIR; drop the flag",
    "hv.matchmaking-time": "there is no matchmaking: the coordinator waits up to --hv.averaging-timeout for deltas",
    "hv.fail-rank-drop": "a worker that misses a round is dropped from it (outer.min_workers); drop the flag",
    "log-activations-steps": "activation logging is not implemented; drop the flag",
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
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node N train/train_fsdp.py",
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
                    help="accepted when a multiple of the local steps (we checkpoint at every round end)")
    ap.add_argument("--resume-from-checkpoint", dest="resume", help="the run folder (BASE_DIR/<project>): workers "
                                                                    "always resume from it")
    ap.add_argument("--no-coordinator", action="store_true", help="the coordinator (python diloco.py) runs "
                                                                  "elsewhere; world rank 0 does not start one")
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
            raise ConfigError(f"--sharding-strategy {vals['sharding-strategy']}: supported are NO_SHARD (DDP) and "
                              f"FULL_SHARD (FSDP2 fully_shard, inner.parallel = fsdp); hybrid / ZeRO-2 sharding "
                              f"is not implemented")
        vals["sharding-strategy"] = SHARDING[vals["sharding-strategy"]]
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


def resolve(args: argparse.Namespace, world: int) -> tuple[str, list[str], RunConfig]:
    """The config file, the overrides for the worker and the coordinator, and the config they make."""
    path = args.config or ("evolution.json" if Path("evolution.json").is_file() else str(REPO_ROOT / "evolution.json"))
    ovs = overrides_from(args, world) + list(args.set)
    cfg = load_config(path, ovs)
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise ConfigError(f"--max-steps {args.max_steps}: must be >= 1")
        if cfg.outer.local_steps > args.max_steps:  # fewer steps than one round: one round of them
            if getattr(args, "hv.local-steps") is not None:
                log.warning("--max-steps %d < --hv.local-steps %d: one round of %d local steps", args.max_steps,
                            cfg.outer.local_steps, args.max_steps)
            ovs.append(f"outer.local_steps={args.max_steps}")
            cfg = load_config(path, ovs)
        rounds = math.ceil(args.max_steps / cfg.outer.local_steps)
        if rounds * cfg.outer.local_steps != args.max_steps:
            log.warning("--max-steps %d is not a multiple of the local steps %d: running %d rounds = %d inner steps "
                        "(a round is never cut short)", args.max_steps, cfg.outer.local_steps, rounds,
                        rounds * cfg.outer.local_steps)
        ovs.append(f"outer.rounds={rounds}")
        cfg = load_config(path, ovs)
    H = cfg.outer.local_steps
    if args.ckpt_interval is not None and (args.ckpt_interval < 1 or args.ckpt_interval % H):
        raise ConfigError(f"--ckpt.interval {args.ckpt_interval}: a worker checkpoints at the end of every round "
                          f"(every {H} local steps, --hv.local-steps); use a multiple of {H} or drop the flag")
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
    if cfg.logging.metrics in ("wandb", "tensorboard"):
        mod = "wandb" if cfg.logging.metrics == "wandb" else "tensorboard"
        if importlib.util.find_spec(mod) is None:
            raise ConfigError(f"--metric-logger-type {cfg.logging.metrics}: `pip install {mod}` first, or use jsonl "
                              f"or dummy")
    return path, ovs, cfg


def start_coordinator(path: str, ovs: list[str], cfg: RunConfig) -> subprocess.Popen:
    """`python diloco.py` with the same config, in its own process group, stopped with us (logs/coordinator.log)."""
    from train.procs import _die_with_parent
    from train.store import RunPaths

    logf = RunPaths(cfg.run_dir).logs / "coordinator.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO_ROOT / "diloco.py"), "--config", path, *[x for o in ovs for x in ("--set", o)],
           "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the coordinator is not part of our torchrun group
    with open(logf, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
    log.info("started the coordinator (pid %d, log %s)", proc.pid, logf)
    return proc


def main(argv: list[str] | None = None) -> int:
    from train.dist import get_dist_info
    from train.logs import setup_logging
    from train.model import quiet_transformers
    from train.store import ProtocolError
    from train.worker import Worker

    info = get_dist_info()
    setup_logging("train_fsdp", logging.INFO if info.main else logging.WARNING)
    argv = normalise(list(sys.argv[1:] if argv is None else argv))
    for a in argv:
        name = a[2:].partition("=")[0]
        if a.startswith("--") and name in UNSUPPORTED:
            if info.main:  # every rank fails the same way: one message is enough
                log.error("--%s is not supported: %s", name, UNSUPPORTED[name])
            return 2
    ap = build_parser()
    args, unknown = ap.parse_known_args(argv)
    if unknown:
        if info.main:
            log.error("unsupported argument(s) %s: see `train/train_fsdp.py --help` for the flags we map, or set "
                      "any config key with --set KEY=VALUE (README: configuration)", " ".join(unknown))
        return 2
    quiet_transformers()
    coord = None
    try:
        path, ovs, cfg = resolve(args, info.world)
        if info.main and args.world_rank == 0 and not args.no_coordinator:
            coord = start_coordinator(path, ovs, cfg)
        worker = Worker(cfg, args.world_rank)

        def monitor() -> None:
            if coord is not None and coord.poll() not in (None, 0):
                raise ProtocolError(f"the coordinator exited with status {coord.returncode}; see "
                                    f"{cfg.run_dir / 'logs' / 'coordinator.log'}")
        worker.monitor = monitor
        worker.run()
        if coord is not None:
            rc = coord.wait()  # it still writes the final model and plot after the last round
            if rc:
                raise ProtocolError(f"the coordinator exited with status {rc}; see {cfg.run_dir}/logs/coordinator.log")
    except (ConfigError, ProtocolError) as e:
        if info.main:
            log.error("%s", e)
        return 2
    finally:
        if coord is not None and coord.poll() is None:
            coord.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
