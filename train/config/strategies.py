"""The strategy registry: one table of what differs between DiLoCo and EDT for everything that starts them.

The simulators (diloco_sim.py, edt_sim.py), the SSH launcher (train/launch/launcher.py), the torchrun CLI
(train/launch/train_fsdp.py) and the coordinator scripts (diloco.py, edt.py) look a strategy up here instead of naming
its modules themselves. Every process is started as a module (`python -m <module>`), never by a file path.
It names modules only (the strings `python -m` takes) and imports nothing: train/config/loader.py and the
workers' entry point read it. What a strategy runs in-process (its coordinator class, its summary line) is the
static table of train/launch/registry.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    coordinator_module: str  # `python -m <module>` runs the coordinator (its CLI)
    worker_module: str       # `python -m <module> --config ... --worker i` runs worker i
    multi_process: bool      # a worker may be a torchrun group of several processes
    title: str               # for log lines: "round" / "generation"


STRATEGIES: dict[str, Strategy] = {
    "diloco": Strategy("diloco", coordinator_module="diloco",
                       worker_module="train.diloco.worker", multi_process=True, title="round"),
    "edt": Strategy("edt", coordinator_module="edt",
                    worker_module="train.edt.worker", multi_process=False, title="generation"),
}


def strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        from train.core.errors import ConfigError
        raise ConfigError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}") from None
