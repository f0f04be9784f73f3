"""Command-line plumbing shared by the top-level scripts: config + overrides, friendly errors."""
from __future__ import annotations

import argparse
from typing import Callable

from train.config import DEFAULT_CONFIG, RunConfig, config_path, load_config

# shortcut flag -> config key
SHORTCUTS = {"workers": "outer.num_workers", "rounds": "outer.rounds", "local_steps": "outer.local_steps",
             "project": "project_name", "base_dir": "base_dir", "outer_lr": "outer.lr",
             "outer_momentum": "outer.momentum", "generations": "edt.max_generations",
             "population": "edt.population_size", "device": "inner.device", "model": "model.name",
             "dataset": "data.dataset"}


def add_config_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=DEFAULT_CONFIG,
                    help="the run's evolution.json (default: %(default)s here, else the repo's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set outer.lr=1.0 --set inner.precision=bf16 (repeatable)")
    g = ap.add_argument_group("shortcuts for common overrides")
    g.add_argument("--workers", type=int, help="outer.num_workers")
    g.add_argument("--rounds", type=int, help="outer.rounds")
    g.add_argument("--local-steps", type=int, help="outer.local_steps (H)")
    g.add_argument("--outer-lr", type=float, help="outer.lr")
    g.add_argument("--outer-momentum", type=float, help="outer.momentum")
    g.add_argument("--project", help="project_name")
    g.add_argument("--base-dir", help="base_dir")
    g.add_argument("--model", help="model.name")
    g.add_argument("--dataset", help="data.dataset")
    g.add_argument("--device", help="inner.device")
    g.add_argument("--fake-data", action="store_true", help="data.fake_data = true")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_edt_args(ap: argparse.ArgumentParser) -> None:
    """Config flags plus the EDT shortcuts (--generations, --population map to edt.* keys)."""
    add_config_args(ap)
    ap.add_argument("--generations", type=int, help="edt.max_generations")
    ap.add_argument("--population", type=int, help="edt.population_size (0 = one member per worker)")


ARGS = {"diloco": add_config_args, "edt": add_edt_args}  # each strategy's config flags


def overrides_from(args: argparse.Namespace) -> list[str]:
    import json
    out = []
    for flag, key in SHORTCUTS.items():
        v = getattr(args, flag, None)
        if v is not None:
            out.append(f"{key}={json.dumps(v)}")
    if getattr(args, "fake_data", False):
        out.append("data.fake_data=true")
    if getattr(args, "no_progress", False):
        out.append("logging.progress=false")
    return out + list(args.set)


def preflight(cfg: RunConfig, strategy: str = "diloco") -> None:
    """Checks that fail in one line before any process starts or any file is written: the device, optional
    packages the config asks for, and user plugins (edt.fitness). Workers on other hosts repeat the device check."""
    from train.core.logs import check_metric_logger

    for value in (cfg.model.name, cfg.model.tokenizer, cfg.data.dataset):  # a missing shipped default, a typo
        cfg.resolve_path(value)
    if cfg.inner.device != "cpu":  # cpu is always there: no torch import in a simulator that only starts processes
        from train.core.model import pick_device
        pick_device(cfg.inner.device)
    check_metric_logger(cfg.logging.metrics)
    check_run_kind(cfg, strategy)
    if strategy == "edt":
        from train.edt.genes import fitness_function
        fitness_function(cfg.edt.fitness)


def check_run_kind(cfg: RunConfig, strategy: str) -> None:
    """A run folder that holds a run of another strategy is refused before anything starts (its workers would
    write their heartbeats into it first). On an s3:// BASE_DIR this is also where the bucket is first reached
    (its name, the credentials, the endpoint: one line each)."""
    from train.core import objstore, sharedfs
    from train.core.errors import ConfigError
    from train.core.store import read_json

    run_dir = cfg.run_dir
    if (store := objstore.store_for(run_dir)) is not None:
        store.check()
    if strategy not in ("diloco", "edt") or not sharedfs.exists(run_dir / "run.json"):
        return
    ident = read_json(run_dir / "run.json").get("identity") or {}
    kind = ident.get("strategy") or ("diloco_optimizer" if ident.get("kind") else "diloco")
    if kind != strategy:
        names = {"diloco": "a DiLoCo run (diloco.py)", "edt": "an EDT run (edt.py)",
                 "diloco_optimizer": "a DiLoCoOptimizer run"}
        raise ConfigError(f"{objstore.url_of(run_dir)} holds {names.get(kind, kind)}, not {names[strategy]}: give "
                          f"this run another project_name (or --base-dir)")


def load_from_args(args: argparse.Namespace, strategy: str = "diloco") -> tuple[RunConfig, list[str]]:
    """The config and the overrides to hand to the run's other processes: the user's, plus what the strategy
    decided for them (its default project, `<strategy>-shakespeare`), so that workers agree with this process."""
    args.config = config_path(args.config)
    ovs = overrides_from(args)
    cfg = load_config(args.config, ovs, strategy=strategy)
    from train.core import sharedfs
    sharedfs.configure_from(cfg.outer)  # this process's BASE_DIR policy (io_retry_s, disk_full_wait_s)
    return cfg, ovs + cfg.default_overrides()


def coordinator_main(strategy: str, description: str,
                     add_args: Callable[[argparse.ArgumentParser], None] = add_config_args) -> int:
    """The body of `python -m diloco` / `python -m edt`: parse, check, run the strategy's coordinator."""
    import logging

    from train.core.model import quiet_transformers
    from train.launch.registry import RUNS

    ap = argparse.ArgumentParser(description=description)
    add_args(ap)
    args = ap.parse_args()
    cfg, _ = load_from_args(args, strategy=strategy)
    quiet_transformers()
    preflight(cfg, strategy)
    logging.getLogger(f"{strategy}-coordinator").info("%s", RUNS[strategy].summary(cfg))
    RUNS[strategy].coordinator(cfg).run()
    return 0
