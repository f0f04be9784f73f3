"""What the entry points run for each strategy, as a static table (the imports are real, so the structure test
sees them): the coordinator class and the one-line summary a run starts with. The process-level facts (which
module runs a worker, whether a worker may be a torchrun group) are in train/config/strategies.py, which the workers'
own entry point reads without importing any strategy."""
from __future__ import annotations

from typing import Callable, NamedTuple

from train.diloco.coordinator import Coordinator, config_summary as diloco_summary
from train.edt.coordinator import EDTCoordinator, config_summary as edt_summary


class Runs(NamedTuple):
    coordinator: type          # Coordinator(cfg).run() commits rounds / generations
    summary: Callable          # summary(cfg) -> the one line a run starts with


RUNS: dict[str, Runs] = {
    "diloco": Runs(Coordinator, diloco_summary),
    "edt": Runs(EDTCoordinator, edt_summary),
}
