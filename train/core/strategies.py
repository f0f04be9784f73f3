"""The strategy registry: one table of what differs between DiLoCo and EDT for everything that starts them.

The simulators (diloco_sim.py, edt_sim.py), the SSH launcher (train/launch/launcher.py), the torchrun CLI
(train/launch/train_fsdp.py) and the coordinator scripts (diloco.py, edt.py) look a strategy up here instead of naming
its modules themselves. Every process is started as a module (`python -m <module>`), never by a file path.
Imports are lazy: reading the table costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Strategy:
    name: str
    coordinator_module: str  # `python -m <module>` runs the coordinator (its CLI)
    coordinator_class: str   # "module:Class": the coordinator the local runner starts in-process
    worker_module: str       # `python -m <module> --config ... --worker i` runs worker i
    multi_process: bool      # a worker may be a torchrun group of several processes
    title: str               # for log lines: "round" / "generation"

    def _attr(self, spec: str):
        from train.core.plugins import import_attr
        return import_attr(spec)

    @property
    def coordinator(self) -> type:
        return self._attr(self.coordinator_class)

    @property
    def summary(self) -> Callable:
        """config_summary(cfg) -> the one line a run starts with."""
        return self._attr(self.coordinator_class.split(":")[0] + ":config_summary")

    @property
    def identity(self) -> Callable:
        """run_identity(cfg) -> what may not change when the run is resumed."""
        return self._attr(self.coordinator_class.split(":")[0] + ":run_identity")


STRATEGIES: dict[str, Strategy] = {
    "diloco": Strategy("diloco", coordinator_module="diloco", coordinator_class="train.diloco.coordinator:Coordinator",
                       worker_module="train.diloco.worker", multi_process=True, title="round"),
    "edt": Strategy("edt", coordinator_module="edt", coordinator_class="train.edt.coordinator:EDTCoordinator",
                    worker_module="train.edt.worker", multi_process=False, title="generation"),
}


def strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        from train.core.errors import ConfigError
        raise ConfigError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}") from None
