"""Logging and metric loggers.

Processes log to stderr (the simulator and the launcher redirect each process's stderr to logs/<name>.log under
the run folder). Metric loggers are null objects with one interface, so training code never branches on them:
jsonl (default), dummy (nothing), wandb and tensorboard (only when installed; never required, no keys in code:
wandb reads WANDB_API_KEY from the environment as it always does).
"""
from __future__ import annotations

import math
from pathlib import Path

from train.core.errors import EnvironmentProblem
from train.core.store import append_jsonl


def _clean(record: dict) -> dict:
    """JSON cannot hold NaN/inf portably: write them as null."""
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        elif isinstance(v, dict):
            v = _clean(v)
        out[k] = v
    return out


class MetricLogger:
    """The interface (and the dummy): log a dict of metrics; close at the end."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger(MetricLogger):
    def __init__(self, path: Path):
        self.path = path

    def log(self, record: dict) -> None:
        append_jsonl(self.path, _clean(record))


class WandbLogger(MetricLogger):
    def __init__(self, project: str, config: dict, resume_id: str):
        import wandb  # optional dependency

        self._run = wandb.init(project=project, config=config, id=resume_id, resume="allow")

    def log(self, record: dict) -> None:
        flat = {k: v for k, v in _clean(record).items() if isinstance(v, (int, float)) and v is not None}
        self._run.log(flat, step=int(record.get("round", record.get("generation", 0))))

    def close(self) -> None:
        self._run.finish()


class TensorBoardLogger(MetricLogger):
    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._w = SummaryWriter(str(logdir))

    def log(self, record: dict) -> None:
        step = int(record.get("round", record.get("generation", 0)))
        for k, v in _clean(record).items():
            if isinstance(v, (int, float)) and v is not None and not isinstance(v, bool):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class TeeLogger(MetricLogger):
    """jsonl always (resume, plots and `status` read it) plus an optional second logger."""

    def __init__(self, *loggers: MetricLogger):
        self.loggers = loggers

    def log(self, record: dict) -> None:
        for lg in self.loggers:
            lg.log(record)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


OPTIONAL_LOGGERS = {"wandb": "wandb", "tensorboard": "tensorboard"}  # logging.metrics -> the package it needs


def check_metric_logger(kind: str) -> None:
    """Fail before a run starts when logging.metrics names a logger whose package is not installed."""
    import importlib.util
    pkg = OPTIONAL_LOGGERS.get(kind)
    if pkg and importlib.util.find_spec(pkg) is None:
        raise EnvironmentProblem(f"logging.metrics = {kind!r} needs the package {pkg!r}, which is not installed: "
                                 f"`pip install {pkg}`, or set logging.metrics to jsonl")


def make_metric_logger(kind: str, run_dir: Path, project: str, config: dict) -> MetricLogger:
    jsonl = JsonlLogger(run_dir / "metrics.jsonl")
    if kind in ("jsonl", "dummy"):
        return jsonl  # metrics.jsonl is part of the run's state (plots, status); dummy adds nothing to it
    try:
        extra = WandbLogger(project, config, resume_id=project) if kind == "wandb" else \
            TensorBoardLogger(run_dir / "tensorboard")
    except ImportError as e:
        raise EnvironmentProblem(f"logging.metrics = {kind!r} needs the package {e.name!r}, which is not installed: "
                                 f"`pip install {e.name}`, or set logging.metrics to jsonl") from None
    return TeeLogger(jsonl, extra)

