"""EvoMerge fitness from lm-evaluation-harness tasks (`evomerge.lm_eval`), run in-process on the candidate.

The config follows mergekit-evolve's task list (`tasks: [{name, weight, metric}]`, a bare string meaning
{"name": it}, metric "acc,none" by default):

    "evomerge": {"lm_eval": {"tasks": [{"name": "arc_easy", "weight": 1.0, "metric": "acc_norm"},
                                       {"name": "my_task", "metric": "word_perplexity"}],
                             "include_path": "my_tasks/", "limit": 200, "batch_size": 8}}

and `edt.fitness = "lm_eval"`. Each worker builds one `lm_eval.tasks.TaskManager` (the built-in tasks plus the
YAMLs under `include_path`), checks every name and metric once, then scores each member with
`lm_eval.simple_evaluate(model=HFLM(pretrained=<the member's model>, tokenizer=...))`: no model is written or read
again. A metric is a results key of the harness, `metric,filter` ("acc,none", "exact_match,strict-match"); one
without a comma gets ",none".

Sign rule, as for the built-in tasks: `scores` hold the raw values (key "task/metric", the filter kept only when it
is not "none"); fitness = sum of weight * value for a metric the harness marks higher-is-better (acc, acc_norm,
exact_match, ...) and weight * -value for a lower-is-better one (perplexity, word_perplexity, bits_per_byte, ...),
so every term is maximised. (mergekit-evolve adds raw values: there a perplexity needs a negative weight; here it
needs none.)

Offline: point `include_path` at local task YAMLs over local JSONL (`dataset_path: json`, `dataset_kwargs:
{data_files: {test: path}}`; tests/data/lm_eval/ has one), run with HF_DATASETS_OFFLINE=1.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from train.core.errors import ConfigError, NotFound, UserError, missing_package

log = logging.getLogger(__name__)

WHERE = "evomerge.lm_eval"
DEFAULT_METRIC = "acc,none"  # mergekit-evolve's default
KEYS = ("tasks", "include_path", "include_defaults", "limit", "num_fewshot", "batch_size", "apply_chat_template")
TASK_KEYS = ("name", "weight", "metric")


@dataclass(frozen=True)
class LMEvalTask:
    """One term of the fitness: `weight` x the (signed) `metric` of lm-eval task or group `name`."""
    name: str
    weight: float = 1.0
    metric: str = DEFAULT_METRIC  # a results key: metric,filter

    @property
    def key(self) -> str:
        """The score's name in reports: task/metric, the filter only when it is not "none"."""
        metric, _, filt = self.metric.partition(",")
        return f"{self.name}/{metric}" + (f",{filt}" if filt != "none" else "")


def parse_tasks(entries: list, where: str = WHERE + ".tasks") -> list[LMEvalTask]:
    """The task list of the config: strings or {name, weight, metric} objects (mergekit-evolve's shape)."""
    out = []
    for i, t in enumerate(entries):
        t = {"name": t} if isinstance(t, str) else t
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise ConfigError(f"{where}[{i}] = {t!r}: need a task name or {{\"name\": ..., \"weight\": ..., "
                              f"\"metric\": ...}}")
        unknown = sorted(set(t) - set(TASK_KEYS))
        if unknown:
            raise ConfigError(f"{where}[{i}]: unknown key {unknown[0]!r}; allowed: {', '.join(TASK_KEYS)}")
        weight, metric = t.get("weight", 1.0), t.get("metric", DEFAULT_METRIC)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{where}[{i}].weight = {weight!r}: need a finite number")
        if not isinstance(metric, str) or not metric or metric.count(",") > 1:
            raise ConfigError(f"{where}[{i}].metric = {metric!r}: need a metric name (acc) or metric,filter "
                              f"(acc,none)")
        out.append(LMEvalTask(t["name"], float(weight), metric if "," in metric else metric + ",none"))
    keys = [t.key for t in out]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup:
        raise ConfigError(f"{where}: {dup} is listed twice; give each task/metric once (weights add up)")
    return out


def produced_metrics(task_results: dict) -> list[str]:
    """The metric keys one task's results hold (no stderrs, no bookkeeping such as alias / sample_len)."""
    return sorted(k for k, v in task_results.items() if "," in k and "_stderr," not in k and
                  isinstance(v, (int, float)) and not isinstance(v, bool))


def combine(tasks: list[LMEvalTask], results: dict) -> tuple[dict[str, float], float]:
    """(scores, fitness) from a `simple_evaluate` result: raw values per task/metric, and the weighted sum with
    lower-is-better metrics counted negatively. A metric the task did not produce is a ConfigError naming the ones
    it did."""
    per_task, hib = results.get("results", {}), results.get("higher_is_better", {})
    scores, fitness = {}, 0.0
    for t in tasks:
        got = per_task.get(t.name)
        if got is None:
            raise ConfigError(f"{WHERE}: lm-eval returned no results for task {t.name!r} (it returned "
                              f"{sorted(per_task)})")
        value = got.get(t.metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{WHERE}: task {t.name!r} has no metric {t.metric!r}; it produced "
                              f"{', '.join(produced_metrics(got)) or 'none'}")
        higher = hib.get(t.name, {}).get(t.metric.split(",")[0], True)  # not stated: higher-is-better
        scores[t.key] = float(value)
        fitness += t.weight * (float(value) if higher else -float(value))
    return scores, fitness


def _expected_warning(record: logging.LogRecord) -> bool:
    """False for HFLM's two warnings about a model object passed in, which is how this module works."""
    msg = str(record.msg)
    return not msg.startswith(("`pretrained` model kwarg is not of type", "Passed an already-initialized model"))


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise missing_package("lm-eval", f"{WHERE} (lm-evaluation-harness fitness)", "lmeval") from None
    quiet = logging.getLogger("lm_eval")
    if quiet.level == logging.NOTSET:  # its per-call INFO lines (seeds, model, tasks) would fill every worker log
        quiet.setLevel(logging.WARNING)
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    if _expected_warning not in hf_log.filters:
        hf_log.addFilter(_expected_warning)
    return lm_eval, HFLM, TaskManager


@contextlib.contextmanager
def _rng_kept(model):
    """simple_evaluate seeds python's, numpy's and torch's global generators: keep the caller's streams."""
    import numpy as np
    import torch

    state, np_state = random.getstate(), np.random.get_state()
    dev = next(model.parameters()).device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)


class LMEvalFitness:
    """lm-eval tasks, checked once, then scored on each member: `fitness(model, tokenizer)`."""

    def __init__(self, tasks: list, include_path: str | list | None = None, include_defaults: bool = True,
                 limit: int | float | None = None, num_fewshot: int | None = None, batch_size: int = 8,
                 apply_chat_template: bool = False, seed: int = 0):
        self.tasks = parse_tasks(tasks)
        if not self.tasks:
            raise ConfigError(f"{WHERE}.tasks is empty: name at least one lm-eval task")
        self.lm_eval, self.HFLM, self._TaskManager = _import_lm_eval()
        paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
        for p in paths:
            if not Path(p).expanduser().is_dir():
                raise NotFound(f"{WHERE}.include_path = {p!r}: no such folder (the folder of your task YAMLs)")
        self.include_path = [str(Path(p).expanduser()) for p in paths]
        self.limit, self.num_fewshot, self.batch_size = limit, num_fewshot, batch_size
        self.apply_chat_template, self.seed = apply_chat_template, seed
        t0 = time.perf_counter()
        self.task_manager = self._TaskManager(include_path=self.include_path or None, include_defaults=include_defaults)
        log.info("lm-eval %s: %d tasks known (%.1f s)", getattr(self.lm_eval, "__version__", "?"),
                 len(self.task_manager.all_tasks), time.perf_counter() - t0)
        self._check_names()
        self._check_metrics()

    @classmethod
    def from_config(cls, cfg) -> "LMEvalFitness":
        """From a RunConfig: evomerge.lm_eval, include_path resolved against the config's folder, the batch size
        eval.batch_size unless given."""
        le = cfg.evomerge.lm_eval
        inc = le.get("include_path")
        inc = [cfg.resolve_path(p) for p in ([inc] if isinstance(inc, str) else inc or [])]
        return cls(le.get("tasks", []), inc, le.get("include_defaults", True), le.get("limit"),
                   le.get("num_fewshot"), le.get("batch_size") or cfg.eval.batch_size,
                   le.get("apply_chat_template", False), cfg.seed)

    def _check_names(self) -> None:
        known = set(self.task_manager.all_tasks)
        for i, t in enumerate(self.tasks):
            if t.name in known:
                continue
            close = difflib.get_close_matches(t.name, sorted(known), n=5, cutoff=0.6)
            local = sorted(self._local_tasks())
            raise ConfigError(
                f"{WHERE}.tasks[{i}].name = {t.name!r}: lm-eval knows no such task"
                + (f"; close: {', '.join(close)}" if close else "")
                + (f"; under include_path: {', '.join(local)}" if self.include_path else "; no include_path set")
                + f" ({len(known)} tasks in all: `lm-eval ls tasks"
                + "".join(f" --include_path {p}" for p in self.include_path) + "` lists them)")

    def _local_tasks(self) -> list[str]:
        """Names defined by the YAMLs under include_path (for the unknown-name message)."""
        if not self.include_path:
            return []
        if not hasattr(self, "_local"):
            self._local = self._TaskManager(include_path=self.include_path, include_defaults=False).all_tasks
        return self._local

    def _check_metrics(self) -> None:
        """Every metric of a plain task (not a group: its metrics are aggregates) against the task's own metric and
        filter lists, before any member is trained. Groups are checked on their first results (`combine`)."""
        names = sorted({t.name for t in self.tasks})
        try:
            loaded = self.task_manager.load(names)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (a task's data that does not load: one line naming the tasks)
            raise ConfigError(f"{WHERE}: lm-eval could not load {names} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:400]}); offline, point the task YAMLs at local files "
                              f"(dataset_path: json, dataset_kwargs.data_files)") from e
        plain = loaded.get("tasks", {})
        for i, t in enumerate(self.tasks):
            task = plain.get(t.name)
            filters = getattr(task, "_filters", None)
            if task is None or not filters:
                continue
            produced = sorted(f"{m},{f.name}" for m in task.higher_is_better() for f in filters)
            if t.metric not in produced:
                raise ConfigError(f"{WHERE}.tasks[{i}].metric = {t.metric!r}: task {t.name!r} produces "
                                  f"{', '.join(produced)}")

    def __call__(self, model, tokenizer) -> dict:
        """Score `model` (a transformers causal LM, on its device) on every task: {"scores": {task/metric: raw
        value}, "fitness": the signed weighted sum, "samples": {task: docs scored}, "seconds": wall time}. The model
        comes back in the train/eval mode it had; the global random streams are untouched."""
        t0, was_training = time.perf_counter(), model.training
        if getattr(self, "_tok", (None, None))[0] is not tokenizer:  # HFLM may set a missing pad token: on a copy
            self._tok = (tokenizer, copy.deepcopy(tokenizer))
        lm = self.HFLM(pretrained=model, tokenizer=self._tok[1], batch_size=self.batch_size)
        try:
            with _rng_kept(model):
                res = self.lm_eval.simple_evaluate(
                    model=lm, tasks=sorted({t.name for t in self.tasks}), task_manager=self.task_manager,
                    limit=self.limit, num_fewshot=self.num_fewshot, batch_size=self.batch_size,
                    apply_chat_template=self.apply_chat_template, log_samples=False, bootstrap_iters=0,
                    random_seed=self.seed, numpy_random_seed=self.seed, torch_random_seed=self.seed,
                    fewshot_random_seed=self.seed)
        finally:
            model.train(was_training)
        scores, fitness = combine(self.tasks, res)
        samples = {k: v.get("effective") for k, v in res.get("n-samples", {}).items() if isinstance(v, dict)}
        return {"scores": scores, "fitness": fitness, "samples": samples, "seconds": time.perf_counter() - t0}
