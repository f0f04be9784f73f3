"""Typed, documented, validated configuration of a run: `evolution.json` (machines.json: train/launch/machines.py).

Every field has a default and a one-line doc (`field_doc`); `python -m train.core.config --markdown` prints the
reference table that the README embeds. Loading rejects unknown keys (suggesting the closest one), wrong types and
out-of-range values with `ConfigError: <file>: <field> = <value>: <what is allowed>`.

The research prototype's flat upper-case keys (PROJECT_NAME, OUTER_LR, ...) are accepted as aliases of the
structured ones (see LEGACY_KEYS). Nothing here touches the disk at import time.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core.errors import ConfigError  # noqa: F401  (raised here; importers keep train.core.config.ConfigError)
from train.core.strategies import STRATEGIES  # what load_config's `strategy` may be (it names the default project)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "evolution.json"
log = logging.getLogger("config")


def doc(default: Any, text: str, **kw: Any) -> Any:
    """A dataclass field with a default and a doc string (lists/dicts are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata={"doc": text, **kw})
    return field(default=default, metadata={"doc": text, **kw})


def bad_value(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{name} = {json.dumps(value)}: {allowed}")


def _check_range(obj: Any, prefix: str, name: str, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    v = getattr(obj, name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad_value(f"{prefix}{name}", v, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v > hi:
        raise bad_value(f"{prefix}{name}", v, f"must be <= {hi}")


def _check_choice(obj: Any, prefix: str, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    if v not in choices:
        raise bad_value(f"{prefix}{name}", v, f"must be one of {', '.join(choices)}")


@dataclass(kw_only=True)
class ModelConfig:
    name: str = doc("configs/tiny-llama.json",
                    "What to train: a Hugging Face hub id (e.g. HuggingFaceTB/SmolLM2-135M), a local HF model "
                    "directory, or a model config JSON (random init from `seed`). Relative paths: from the config "
                    "file's folder, then the repo.")
    tokenizer: str = doc("data/tokenizer",
                         "Tokenizer: hub id or local directory; empty = the model's own.")
    revision: str | None = doc(None, "Hub revision (branch, tag or commit) for `name` and `tokenizer`.")
    trust_remote_code: bool = doc(False, "Allow custom modelling code from the hub (off: it runs arbitrary code).")

    def validate(self, p: str) -> None:
        if not self.name:
            raise bad_value(p + "name", self.name, "must name a hub id, a model directory or a config JSON")


@dataclass(kw_only=True)
class DataConfig:
    dataset: str = doc("data/corpus",
                       "Training text: a local folder / file / glob of .txt, .jsonl, .json or .parquet files, a "
                       "`datasets` hub name, or `fake` for random tokens.")
    dataset_config: str | None = doc(None, "`datasets` configuration name (hub datasets only).")
    split: str = doc("train", "`datasets` split to read.")
    text_field: str = doc("text", "Column holding the text in json/jsonl/parquet/hub data.")
    seq_length: int = doc(128, "Tokens per training window (the context length used in training).")
    eval_fraction: float = doc(0.02, "Fraction of the tokens (the tail) held out for evaluation.")
    max_tokens: int = doc(0, "Stop tokenizing after this many tokens; 0 = all (hub datasets stream until it).")
    fake_data: bool = doc(False, "Random tokens instead of a dataset (smoke tests; like OpenDiLoCo's --fake-data).")
    fake_tokens: int = doc(1_000_000, "How many random tokens `fake_data` generates.")

    def validate(self, p: str) -> None:
        _check_range(self, p, "seq_length", 2)
        _check_range(self, p, "eval_fraction", 0.0, 0.5, lo_open=True)
        _check_range(self, p, "max_tokens", 0)
        _check_range(self, p, "fake_tokens", 1000)
        if not self.dataset and not self.fake_data:
            raise bad_value(p + "dataset", self.dataset, "must name a dataset, or set data.fake_data = true")


PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
PRECISION_ALIASES = {"fp32": "fp32", "32": "fp32", "float32": "fp32", "bf16": "bf16-mixed",
                     "bf16-mixed": "bf16-mixed", "bfloat16": "bf16-mixed", "fp16": "fp16-mixed",
                     "fp16-mixed": "fp16-mixed", "16-mixed": "fp16-mixed", "float16": "fp16-mixed"}


@dataclass(kw_only=True)
class InnerConfig:
    lr: float = doc(4e-4, "Peak AdamW learning rate of the inner loop (OpenDiLoCo default).")
    beta1: float = doc(0.9, "AdamW beta1.")
    beta2: float = doc(0.95, "AdamW beta2.")
    eps: float = doc(1e-8, "AdamW epsilon.")
    weight_decay: float = doc(0.1, "AdamW decoupled weight decay λ (each step θ ← θ − lr_t·λ·θ); also Muon's.")
    weight_decay_mode: str = doc("fixed", "fixed (`weight_decay` as given) or inverse_steps (Charles et al. 2025: "
                                          "independent weight decay 1/T, i.e. λ = 1 / (T·lr) with T = the schedule's "
                                          "total inner steps, so each step at the peak lr decays by 1/T; "
                                          "`weight_decay` is then unused). EvoMerge's SFT mutation always uses "
                                          "`weight_decay`.")
    warmup_steps: int = doc(20, "Linear warmup steps of the inner schedule.")
    total_steps: int = doc(0, "Length of the cosine schedule in inner steps; 0 = rounds x local_steps (the sum of "
                              "the rounds' H with outer.local_steps_schedule).")
    min_lr_ratio: float = doc(0.1, "Cosine floor as a fraction of `lr`.")
    per_device_batch_size: int = doc(16, "Windows per forward/backward pass.")
    total_batch_size: int = doc(16, "Windows per optimizer step (per worker); a multiple of per_device_batch_size "
                                    "(the ratio is the gradient accumulation).")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this; 0 = off.")
    precision: str = doc("auto", "auto (bf16-mixed on a CUDA device with bf16, else fp32), fp32, bf16-mixed or "
                                 "fp16-mixed (autocast; fp16 uses a grad scaler). Master weights stay fp32.")
    compile: Any = doc("auto", "torch.compile the model and the loss for the inner loop: true, false or auto (on "
                               "CUDA, off on CPU).")
    loss_chunk: Any = doc("auto", "Memory-lean loss: the cross entropy over this many tokens at a time, each "
                                  "chunk recomputed in the backward pass, so no fp32 copy of the logits and no "
                                  "full log-probabilities are kept; 0 = in one piece; auto = 4096 on CUDA without "
                                  "compile (compiled, the loss is fused instead), 0 on CPU.")
    log_every: int = doc(10, "Read the training loss back from the device every this many steps (for the "
                             "heartbeat); no step waits for the device in between. Round statistics are exact "
                             "whatever the value.")
    optimizer: str = doc("adamw", "adamw, or muon (torch.optim.Muon for the 2-D weight matrices of the hidden "
                                  "layers; embeddings, output head, norms and biases stay on AdamW, as in MuLoCo).")
    muon_lr: float = doc(0.02, "Peak Muon learning rate (same warmup + cosine as `lr`; Keller Jordan's scaling "
                               "by sqrt(max(1, rows/cols))).")
    muon_momentum: float = doc(0.95, "Muon momentum (Nesterov).")
    reset_state: bool = doc(False, "Reset the inner optimizer state (AdamW moments, Muon momentum) at the start "
                                   "of every round; false keeps it across rounds, as DiLoCo does.")
    device: str = doc("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N.")
    threads: int = doc(0, "torch CPU threads per worker process; 0 = let torch decide.")
    nproc_per_node: int = doc(1, "Processes per worker: > 1 starts each worker as a torchrun group (one process per "
                                 "GPU; gloo on CPU) that splits total_batch_size over its processes.")
    parallel: str = doc("ddp", "How a multi-process worker holds the model: ddp (a copy per process) or fsdp (FSDP2 "
                               "fully_shard: parameters, gradients and AdamW state sharded over the processes).")

    def validate(self, p: str) -> None:
        _check_range(self, p, "lr", 0.0, lo_open=True)
        for b in ("beta1", "beta2"):
            _check_range(self, p, b, 0.0, 1.0)
        _check_range(self, p, "weight_decay", 0.0)
        _check_choice(self, p, "weight_decay_mode", ("fixed", "inverse_steps"))
        _check_range(self, p, "warmup_steps", 0)
        _check_range(self, p, "total_steps", 0)
        _check_range(self, p, "min_lr_ratio", 0.0, 1.0)
        _check_range(self, p, "per_device_batch_size", 1)
        _check_range(self, p, "total_batch_size", 1)
        _check_range(self, p, "grad_clip", 0.0)
        _check_range(self, p, "threads", 0)
        _check_range(self, p, "nproc_per_node", 1)
        _check_choice(self, p, "parallel", ("ddp", "fsdp"))
        if self.total_batch_size % self.per_device_batch_size:
            raise bad_value(p + "total_batch_size", self.total_batch_size,
                       f"must be a multiple of {p}per_device_batch_size ({self.per_device_batch_size})")
        if self.total_batch_size % (self.per_device_batch_size * self.nproc_per_node):
            raise bad_value(p + "total_batch_size", self.total_batch_size,
                       f"must split over {p}nproc_per_node = {self.nproc_per_node} processes: a multiple of "
                       f"{self.per_device_batch_size * self.nproc_per_node} ({p}per_device_batch_size x nproc)")
        if str(self.precision) not in PRECISION_ALIASES and self.precision != "auto":
            raise bad_value(p + "precision", self.precision, f"must be one of {', '.join(PRECISIONS)} or auto")
        self.precision = PRECISION_ALIASES.get(str(self.precision), self.precision)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise bad_value(p + "device", self.device, "must be auto, cpu, cuda or cuda:N")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise bad_value(p + "compile", self.compile, "must be true, false or \"auto\"")
        lc = self.loss_chunk
        if lc != "auto" and (isinstance(lc, bool) or not isinstance(lc, int) or lc < 0):
            raise bad_value(p + "loss_chunk", lc, "must be a number of tokens >= 0 (0 = the loss in one piece) or "
                                                  "\"auto\"")
        _check_range(self, p, "log_every", 1)
        _check_choice(self, p, "optimizer", ("adamw", "muon"))
        _check_range(self, p, "muon_lr", 0.0, lo_open=True)
        _check_range(self, p, "muon_momentum", 0.0, 1.0)
        if self.optimizer == "muon" and self.nproc_per_node > 1 and self.parallel == "fsdp":
            raise bad_value(p + "optimizer", "muon", f"does not work with {p}parallel = \"fsdp\": Muon "
                                                     f"orthogonalises whole weight matrices and FSDP2 holds shards; "
                                                     f"use {p}parallel = \"ddp\" or {p}optimizer = \"adamw\"")
        if self.device == "cpu":  # `auto` settles here when it can; on auto / cuda devices the trainer settles it
            self.precision = "fp32" if self.precision == "auto" else self.precision
            self.compile = False if self.compile == "auto" else self.compile
            self.loss_chunk = 0 if self.loss_chunk == "auto" else self.loss_chunk

    @property
    def grad_accum(self) -> int:
        return self.total_batch_size // self.per_device_batch_size


@dataclass(kw_only=True)
class OuterConfig:
    num_workers: int = doc(2, "Workers (DiLoCo replicas); the prototype's NUM_MACHINES.")
    rounds: int = doc(10, "Outer rounds (DiLoCo) to run.")
    local_steps: int = doc(50, "H: inner optimizer steps per worker between outer steps.")
    local_steps_schedule: list = doc([], "An H schedule: [[from_round, H], ...] with increasing from_round; H of "
                                         "round r is that of the last entry with from_round <= r (local_steps "
                                         "before the first). E.g. [[0, 10], [10, 30]]: H = 10 for rounds 0-9, then "
                                         "30. The DiLoCo file protocol (diloco.py, diloco_sim.py, the launcher); "
                                         "EDT and DiLoCoOptimizer use local_steps.")
    lr: float = doc(1.0, "Outer SGD learning rate. 1.0 with momentum 0 (parameter averaging) was best in our "
                         "sweep at the embedded scale (docs/benchmarks.md); the DiLoCo paper uses 0.7.")
    momentum: float = doc(0.0, "Outer SGD momentum; the DiLoCo paper uses 0.9 (Nesterov) at larger scale and H.")
    nesterov: bool = doc(True, "Nesterov momentum for the outer step.")
    min_workers: int = doc(1, "After `round_timeout_s`, commit the round if at least this many deltas arrived.")
    round_timeout_s: float = doc(1800.0, "Seconds the reducer waits for all deltas before going on without the "
                                         "missing workers.")
    dead_after_s: float = doc(10.0, "A worker whose heartbeat lease (rewritten every second) has not changed for "
                                    "this long is dead: the round goes on without it (at once when it exited or "
                                    "left, or its process is gone on the coordinator's host). docs/elastic.md.")
    startup_grace_s: float = doc(120.0, "Extra seconds, on top of dead_after_s, that a worker without a fresh "
                                        "heartbeat gets when the coordinator starts or resumes (workers import "
                                        "torch, read the data and load the model first).")
    straggler_factor: float = doc(3.0, "Once a quorum (max(min_workers, half the workers)) arrived, wait at most "
                                       "this x the median recent time-to-quorum (never less than dead_after_s) for "
                                       "the rest (a worker whose process (re)started less than dead_after_s + "
                                       "startup_grace_s ago and has delivered no delta yet is waited for that "
                                       "long); 0 = off (wait for every live worker).")
    max_restarts: int = doc(3, "Restarts of a worker process that dies (simulators and the launcher's hosts; "
                               "backoff 1 s, 2 s, 4 s, ...); the simulators' --max-restarts overrides it.")
    poll_interval_s: float = doc(0.2, "How often processes look at BASE_DIR for new files (by listing folders, "
                                      "so an NFS client's lookup cache never delays a round: docs/protocol.md).")
    io_retry_s: float = doc(120.0, "How long one call on BASE_DIR (read, write, fsync, rename, listing, stat) is "
                                   "retried after a transient error (EIO, ESTALE, ETIMEDOUT, EAGAIN, ENOLCK: a soft "
                                   "NFS mount) before the process stops with a one-line error (exit 2; its "
                                   "supervisor restarts it).")
    delta_dtype: str = doc("float32", "dtype of published pseudo-gradients: float32, bfloat16 or float16.")
    keep_rounds: int = doc(2, "Committed rounds kept on disk (older global models and deltas are deleted).")
    token_weighted: bool = doc(True, "Weight each delta by its tokens (equal weights when off).")
    compression: str = doc("none", "Codec of the exchange, both ways (docs/compression.md): none (fp32 deltas in "
                                   "`delta_dtype`, the full global model every round), int8 or int4 (block-wise "
                                   "absmax), bfloat16 or float16; with a codec, workers send encoded deltas with "
                                   "error feedback and the coordinator publishes the encoded update θ_{r+1} − θ_r "
                                   "(with its own error feedback) that every copy of θ applies.")
    overlap: str = doc("none", "none (a worker waits for θ_{r+1} after publishing), delayed or eager (it goes on "
                               "training at once and folds θ_{r+1} in one round late; the next segment starts from "
                               "θ_r + its own progress since its delta (delayed), or θ_r + that progress at the "
                               "weight the outer step gives one worker, η (1 + μ) / M (eager, Kale et al. 2025); "
                               "docs/overlap.md). Not with torchrun workers.")
    overlap_steps: int = doc(0, "With overlap: when a segment folds the new global model in (docs/overlap.md): "
                                "0 = adaptive, at the first step boundary after θ_{r+1} is committed and read (never "
                                "waits; runs are not bit-reproducible run to run, a restart still replays exactly); "
                                "τ = after τ steps, waiting there for the commit if needed (Streaming DiLoCo's τ; "
                                "reproducible); >= local_steps: at the segment's end (one round late). The worker "
                                "keeps the progress since the segment's start and takes its delta against θ_{r+1}.")
    block_size: int = doc(128, "Values per scale of the int8 / int4 codecs (bench/compression.py measures the "
                               "error against block size).")
    checkpoint_every: int = doc(20, "With compression: an fp32 global model directory (HF-loadable) and the outer "
                                    "state every this many rounds (and after the last); processes that start or "
                                    "restart load the last one and apply the logged updates since.")
    state_dir: str = doc("", "Where each worker keeps its private resume state (inner optimizer moments, error-"
                             "feedback residual): empty = its directory on BASE_DIR (a restart on any host resumes "
                             "exactly); a host-local path (`~` and {worker} allowed) keeps it off the shared disk (a "
                             "restart on the same host resumes exactly; on another host it resumes with fresh "
                             "moments and no residual, and logs that).")
    lr_schedule: str = doc("constant", "Outer learning rate over the rounds (train/core/outer.py outer_lr_at): "
                                       "constant (`lr` every round) or warmup (linear from lr / W to lr over the "
                                       "first W = `lr_warmup_rounds` rounds, then `lr`).")
    lr_warmup_rounds: int = doc(0, "W: rounds of outer-lr warmup when lr_schedule = warmup.")
    late_weight: float = doc(0.5, "A delta of round r that arrives after round r closed (a straggler past its "
                                  "deadline): 0 = dropped; w > 0 = folded into round r + 1 with w x its tokens as "
                                  "its weight (a staleness weight; 0.5 was best in bench/elastic.py --late).")

    def local_steps_at(self, r: int) -> int:
        """H of round r (local_steps_schedule, else local_steps)."""
        H = self.local_steps
        for start, h in self.local_steps_schedule:
            if start <= r:
                H = h
        return H

    def validate(self, p: str) -> None:
        _check_range(self, p, "num_workers", 1)
        sched = self.local_steps_schedule
        if not isinstance(sched, list) or not all(
                isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
                and e[0] >= 0 and e[1] >= 1 for e in sched):
            raise bad_value(p + "local_steps_schedule", sched, "must be a list of [from_round, H] pairs of integers "
                                                               "(from_round >= 0, H >= 1), e.g. [[0, 10], [10, 30]]")
        if any(b[0] <= a[0] for a, b in zip(sched, sched[1:])):
            raise bad_value(p + "local_steps_schedule", sched, "from_round must increase from entry to entry")
        _check_choice(self, p, "lr_schedule", ("constant", "warmup"))
        _check_range(self, p, "lr_warmup_rounds", 0)
        if self.lr_schedule == "warmup" and self.lr_warmup_rounds < 1:
            raise bad_value(p + "lr_warmup_rounds", self.lr_warmup_rounds,
                            f"must be >= 1 with {p}lr_schedule = \"warmup\" (or use \"constant\")")
        _check_range(self, p, "rounds", 1)
        _check_range(self, p, "local_steps", 1)
        _check_range(self, p, "lr", 0.0, lo_open=True)
        _check_range(self, p, "momentum", 0.0, 1.0)
        _check_range(self, p, "min_workers", 1, self.num_workers)
        _check_range(self, p, "round_timeout_s", 0.0, lo_open=True)
        _check_range(self, p, "dead_after_s", 2.0)  # > 1 s: at least two lease periods (train/core/heartbeat.py)
        _check_range(self, p, "startup_grace_s", 0.0)
        _check_range(self, p, "straggler_factor", 0.0)
        _check_range(self, p, "late_weight", 0.0, 1.0)
        _check_range(self, p, "max_restarts", 0)
        _check_range(self, p, "poll_interval_s", 0.0, lo_open=True)
        _check_range(self, p, "io_retry_s", 0.0)
        _check_range(self, p, "keep_rounds", 1)
        _check_choice(self, p, "delta_dtype", ("float32", "bfloat16", "float16"))
        _check_choice(self, p, "compression", ("none", "int8", "int4", "bfloat16", "float16"))
        _check_choice(self, p, "overlap", ("none", "delayed", "eager"))
        _check_range(self, p, "overlap_steps", 0)
        _check_range(self, p, "block_size", 8, 1 << 20)
        _check_range(self, p, "checkpoint_every", 1)
        if self.block_size % 2:
            raise bad_value(p + "block_size", self.block_size, "must be even (int4 packs two codes per byte)")


@dataclass(kw_only=True)
class EvalConfig:
    batch_size: int = doc(16, "Windows per evaluation batch; the prototype's EVAL_BATCH_SIZE.")
    batches: int = doc(8, "Evaluation batches; the same held-out windows are used every time.")
    every: int = doc(1, "Evaluate the global model every this many rounds (and always after the last).")

    def validate(self, p: str) -> None:
        _check_range(self, p, "batch_size", 1)
        _check_range(self, p, "batches", 1)
        _check_range(self, p, "every", 1)


@dataclass(kw_only=True)
class EDTConfig:
    population_size: int = doc(0, "Members per generation; 0 = outer.num_workers.")
    initial_population: list = doc([], "Models of generation 0 (hub ids, local dirs or config JSONs); filled by "
                                        "random choice when shorter; empty = model.name.")
    max_generations: int = doc(10, "Generations to run; the prototype's MAX_GENERATIONS.")
    mutation_probability: float = doc(0.1, "Chance that each DNA gene is perturbed when a child is made.")
    mutation_strength: float = doc(0.1, "Standard deviation of a gene perturbation (genes live in [0, 1]).")
    elitism: int = doc(1, "Best members carried to the next generation (paired with themselves).")
    tournament_size: int = doc(3, "Contestants per tournament in parent selection.")
    selection: str = doc("tournament", "tournament or rank.")
    mode: str = doc("pretrain", "pretrain (evolutionary pretraining on data.*) or evomerge (post-training: evolve "
                                "merges of the fine-tunes in initial_population, mutate by SFT, fitness from "
                                "evomerge.tasks; see docs/evomerge.md).")
    crossover: str = doc("outer_sgd", "outer_sgd (pairwise outer step), linear or slerp (pretrain mode; evomerge "
                                      "evolves its merge method in the DNA).")
    mutation_steps: int = doc(0, "Inner AdamW steps of one mutation (per member and generation); 0 = "
                                 "outer.local_steps.")
    fitness: str = doc("inverse_loss", "Fitness of a member from its eval loss: inverse_loss (1/loss, the "
                                       "prototype's), neg_loss, tasks (evomerge: the weighted task score), or "
                                       "`module:function` (called with the member's result dict, returns a float; "
                                       "higher is fitter).")
    genes: dict = doc({"inner_lr": [0.5, 2.0], "outer_lr": [0.5, 1.0], "outer_momentum": [0.0, 0.9],
                       "data_mix": [0.0, 0.25]},
                      "The DNA: gene -> [low, high]. inner_lr multiplies inner.lr (log scale); outer_lr and "
                      "outer_momentum drive the outer_sgd crossover that makes a child; data_mix is the fraction of "
                      "windows drawn from the whole corpus instead of the member's shard. Genes left out use the "
                      "config value; {} = no DNA.")
    t_curves: dict = doc({"default": 0.5},
                         "Interpolation t of linear / slerp per tensor (mergekit gradients): {filter: t or [t, ...]}"
                         "; a filter (e.g. self_attn, mlp) matches tensor names containing it, `default` the rest; "
                         "layer i of N reads the curve at i/(N-1), non-layer tensors its first value.")
    keep_generations: int = doc(2, "Generations kept whole on disk (>= 2: resume and selection need the last two); "
                                   "older ones keep only their best member.")
    inherit_optimizer: bool = doc(True, "A child resumes its first parent's inner AdamW state (false: fresh AdamW "
                                        "every mutation, as the prototype).")
    job_lease_s: float = doc(120.0, "A claimed job whose worker has not renewed its lease for this long is "
                                    "re-queued for another worker.")
    max_attempts: int = doc(3, "Claims of one job (a job whose workers keep dying) before its slot is refilled by "
                               "selection: a copy of a finished member of the same generation (docs/elastic.md).")

    # gene name -> (lowest allowed, highest allowed); see train/core/evolution.py GENES for what each one drives.
    GENE_LIMITS: typing.ClassVar[dict] = {"inner_lr": (1e-6, 1e3), "outer_lr": (1e-6, 10.0),
                                          "outer_momentum": (0.0, 0.999), "data_mix": (0.0, 1.0)}

    def validate(self, p: str) -> None:
        _check_range(self, p, "population_size", 0)
        _check_range(self, p, "max_generations", 1)
        _check_range(self, p, "mutation_probability", 0.0, 1.0)
        _check_range(self, p, "mutation_strength", 0.0)
        _check_range(self, p, "elitism", 0)
        _check_range(self, p, "tournament_size", 1)
        _check_range(self, p, "mutation_steps", 0)
        _check_range(self, p, "keep_generations", 2)
        _check_range(self, p, "job_lease_s", 0.0, lo_open=True)
        _check_range(self, p, "max_attempts", 1)
        _check_choice(self, p, "selection", ("tournament", "rank"))
        _check_choice(self, p, "crossover", ("outer_sgd", "linear", "slerp"))
        _check_choice(self, p, "mode", ("pretrain", "evomerge"))
        if self.fitness not in ("inverse_loss", "neg_loss", "tasks") and not (
                self.fitness.count(":") == 1 and all(self.fitness.split(":"))):
            raise bad_value(p + "fitness", self.fitness, "must be inverse_loss, neg_loss, tasks or module:function")
        for i, m in enumerate(self.initial_population):
            if not isinstance(m, str) or not m:
                raise bad_value(f"{p}initial_population[{i}]", m, "must be a non-empty string (hub id or path)")
        for name, rng in self.genes.items():
            if name not in self.GENE_LIMITS:
                raise bad_value(f"{p}genes.{name}", rng, f"unknown gene; the genes are {', '.join(self.GENE_LIMITS)}")
            lo_ok, hi_ok = self.GENE_LIMITS[name]
            if (not isinstance(rng, list) or len(rng) != 2 or
                    any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in rng)):
                raise bad_value(f"{p}genes.{name}", rng, "must be [low, high] (two numbers)")
            if not lo_ok <= rng[0] <= rng[1] <= hi_ok:
                raise bad_value(f"{p}genes.{name}", rng, f"needs {lo_ok} <= low <= high <= {hi_ok}")
        for filt, curve in self.t_curves.items():
            vals = curve if isinstance(curve, list) else [curve]
            if not vals or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
                               for v in vals):
                raise bad_value(f"{p}t_curves.{filt}", curve, "must be a number in [0, 1] or a non-empty list of them")


MERGE_METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties")
BASE_METHODS = ("task_arithmetic", "ties", "dare_linear", "dare_ties")  # need evomerge.base_model (task vectors)


def _check_span(obj: Any, prefix: str, name: str, lo: float, hi: float) -> None:
    v = getattr(obj, name)
    if (not isinstance(v, list) or len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                       for x in v) or not lo <= v[0] <= v[1] <= hi):
        raise bad_value(prefix + name, v, f"must be [low, high] with {lo} <= low <= high <= {hi}")


@dataclass(kw_only=True)
class EvoMergeConfig:
    base_model: str = doc("", "The model the fine-tunes started from (hub id or directory): task_arithmetic, ties "
                              "and dare merge the task vectors (model - base). Empty: only linear and slerp.")
    methods: list = doc([], "Merge methods the `method` gene chooses from (linear, slerp, task_arithmetic, ties, "
                            "dare_linear, dare_ties); empty = linear and slerp, plus the task-vector methods when "
                            "base_model is set.")
    curve_points: int = doc(5, "Points of each evolved slerp t-curve (self_attn, mlp; the prototype's fixed curves "
                               "had 5); the rest of the tensors get one evolved t.")
    weight: list = doc([0.2, 0.8], "Range of the `weight` gene: the first parent's weight w (the second's 1 - w) "
                                   "in linear / task-vector merges.")
    density: list = doc([0.3, 1.0], "Range of the `density` gene: fraction of each task vector kept by ties / dare.")
    consensus_method: str = doc("sum", "Sign election of ties / dare_ties (mergekit's consensus_method): sum = the "
                                       "sign of the weighted sum (TIES), count = the majority of the models' signs.")
    scale: list = doc([0.5, 1.5], "Range of the `scale` gene: lambda, the factor on the merged task vector.")
    datasets: dict = doc({}, "SFT data of the mutation: {name: source}, a source being task:addition / "
                             "task:reverse / task:sort, a .jsonl/.json file of chat `messages` or prompt/answer rows, "
                             "or a `datasets` hub name; the DNA has one mix gene per name.")
    tasks: list = doc([], "Fitness: [{name, data, metric, weight, items}], metric = exact_match (greedy), sft_loss "
                          "or module:function; fitness = the weighted sum (sft_loss counts negatively).")
    sft_items: int = doc(2000, "Training items read per SFT dataset.")
    max_length: int = doc(64, "Token limit of one SFT example (prompt + answer).")
    max_new_tokens: int = doc(16, "Greedy generation limit of exact_match evaluation.")
    lora: dict = doc({}, "LoRA for the SFT mutation (needs peft), e.g. {\"r\": 8, \"alpha\": 16}; merged into the "
                         "weights after each mutation. {} = full fine-tuning (the default for small models).")
    train_initial: bool = doc(False, "Also mutate (SFT) generation 0; off: the fine-tunes are evaluated as given, "
                                     "so the first generation is the baseline the merges are measured against.")

    def validate(self, p: str) -> None:
        for i, m in enumerate(self.methods):
            if m not in MERGE_METHODS:
                raise bad_value(f"{p}methods[{i}]", m, f"must be one of {', '.join(MERGE_METHODS)}")
            if m in BASE_METHODS and not self.base_model:
                raise bad_value(f"{p}methods[{i}]", m, f"merges task vectors: set {p}base_model to the model the "
                                                  "fine-tunes started from")
        _check_range(self, p, "curve_points", 1)
        _check_span(self, p, "weight", 0.0, 1.0)
        _check_span(self, p, "density", 0.0, 1.0)
        if self.density[0] <= 0:
            raise bad_value(p + "density", self.density, "low must be > 0 (density 0 keeps nothing)")
        _check_span(self, p, "scale", 0.0, 10.0)
        _check_choice(self, p, "consensus_method", ("sum", "count"))
        for name, src in self.datasets.items():
            if not name.replace("_", "a").replace("-", "a").isalnum() or not isinstance(src, str) or not src:
                raise bad_value(f"{p}datasets.{name}", src,
                                "names must be [A-Za-z0-9_-]+ and sources non-empty strings")
        for i, t in enumerate(self.tasks):
            where = f"{p}tasks[{i}]"
            if not isinstance(t, dict) or not {"name", "data"} <= set(t):
                raise bad_value(where, t, "must be an object with at least name and data, e.g. {\"name\": \"add\", "
                                     "\"data\": \"task:addition\", \"metric\": \"exact_match\"}")
            unknown = set(t) - {"name", "data", "metric", "weight", "items"}
            if unknown:
                raise bad_value(where, t, f"unknown key {sorted(unknown)[0]!r}; allowed: name, data, metric, weight, "
                                     "items")
            metric = t.get("metric", "exact_match")
            if metric not in ("exact_match", "sft_loss") and not (metric.count(":") == 1 and all(metric.split(":"))):
                raise bad_value(where + ".metric", metric, "must be exact_match, sft_loss or module:function")
            if isinstance(t.get("weight", 1.0), bool) or not isinstance(t.get("weight", 1.0), (int, float)):
                raise bad_value(where + ".weight", t.get("weight"), "must be a number")
            if not isinstance(t.get("items", 64), int) or t.get("items", 64) < 1:
                raise bad_value(where + ".items", t.get("items"), "must be an integer >= 1")
        _check_range(self, p, "sft_items", 1)
        _check_range(self, p, "max_length", 8)
        _check_range(self, p, "max_new_tokens", 1)
        unknown = set(self.lora) - {"r", "alpha", "dropout", "target_modules"}
        if unknown:
            raise bad_value(p + "lora", self.lora, f"unknown key {sorted(unknown)[0]!r}; allowed: r, alpha, dropout, "
                                              "target_modules")

    @property
    def merge_methods(self) -> list[str]:
        if self.methods:
            return list(self.methods)
        return ["linear", "slerp"] + (list(BASE_METHODS) if self.base_model else [])


@dataclass(kw_only=True)
class LoggingConfig:
    metrics: str = doc("jsonl", "Metric logger: jsonl (BASE_DIR/<project>/metrics.jsonl), dummy, wandb or "
                                "tensorboard (the last two only when installed).")
    progress: bool = doc(True, "Progress bars on the terminal.")
    plot: bool = doc(True, "Write loss.png into the run folder at the end.")

    def validate(self, p: str) -> None:
        _check_choice(self, p, "metrics", ("jsonl", "dummy", "wandb", "tensorboard"))


@dataclass(kw_only=True)
class RunConfig:
    project_name: str | None = doc(None, "Run name: everything lives in BASE_DIR/<project_name>/. null = "
                                         "<strategy>-shakespeare (diloco-shakespeare for DiLoCo, edt-shakespeare "
                                         "for EDT), so the two default runs never share a folder.")
    base_dir: str = doc("runs", "Shared folder (NFS on a cluster); relative = next to the config file.")
    seed: int = doc(0, "Seed for model init, data order and evaluation windows.")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    edt: EDTConfig = field(default_factory=EDTConfig)
    evomerge: EvoMergeConfig = field(default_factory=EvoMergeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Where the config came from (not a key in the file): relative paths resolve against it.
    source: str = field(default="<defaults>", metadata={"internal": True})
    # The dotted keys the user gave (file or overrides), as opposed to defaults: set by build_config.
    user_keys: typing.ClassVar[frozenset] = frozenset()

    def validate(self) -> None:
        if not self.project_name or "/" in self.project_name or self.project_name in (".", ".."):
            raise bad_value("project_name", self.project_name, "must be a plain folder name (no '/')")
        if not self.base_dir:
            raise bad_value("base_dir", self.base_dir,
                            "must be a folder path: the folder runs live in, on a disk every machine sees (e.g. "
                            "/mnt/shared/edt_run), or \".\" for the config file's folder")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                sub.validate(f.name + ".")
        if self.outer.overlap != "none" and self.inner.nproc_per_node > 1:
            raise bad_value("outer.overlap", self.outer.overlap,
                            f"does not work with torchrun workers (inner.nproc_per_node = "
                            f"{self.inner.nproc_per_node}) yet: use overlap none, or one process per worker")
        population = self.edt.population_size or self.outer.num_workers
        if self.edt.elitism > population:
            why = "edt.population_size" if self.edt.population_size else "edt.population_size = 0: outer.num_workers"
            raise bad_value("edt.elitism", self.edt.elitism,
                       f"must be <= the population, {population} ({why}): elites are members of the next "
                       f"generation; lower edt.elitism or raise edt.population_size")
        if self.edt.mode == "evomerge":
            if not self.edt.initial_population:
                raise bad_value("edt.initial_population", [], "evomerge needs the fine-tuned models to merge (hub ids "
                                                         "or directories), at least 2")
            if not self.evomerge.tasks:
                raise bad_value("evomerge.tasks", [], "evomerge needs fitness tasks, e.g. [{\"name\": \"add\", "
                                                 "\"data\": \"task:addition\", \"metric\": \"exact_match\"}]")

    # -- derived values -------------------------------------------------------------------------------------------
    @property
    def config_dir(self) -> Path:
        return Path(self.source).resolve().parent if self.source != "<defaults>" else REPO_ROOT

    def resolve_path(self, value: str) -> str:
        """A relative path that exists next to the config (or in the repo) becomes absolute; else unchanged."""
        if not value or os.path.isabs(value):
            return value
        for root in (self.config_dir, REPO_ROOT):
            cand = root / value
            if cand.exists() or any(ch in value for ch in "*?["):
                return str(cand)
        return value

    @property
    def run_dir(self) -> Path:
        base = Path(os.path.expanduser(self.base_dir))
        if not base.is_absolute():
            base = Path(os.path.normpath(self.config_dir / base))  # configs/../runs -> runs
        return base / self.project_name

    def default_overrides(self) -> list[str]:
        """Values derived from the strategy rather than given by the user, as overrides: pass them to every process
        of the run (workers, remote helpers) so that they agree whatever strategy they load the config with."""
        return [] if "project_name" in self.user_keys else [f"project_name={self.project_name}"]

    @property
    def total_inner_steps(self) -> int:
        return self.inner.total_steps or sum(self.outer.local_steps_at(r) for r in range(self.outer.rounds))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


# The research prototype's flat keys -> our dotted names.
LEGACY_KEYS = {
    "PROJECT_NAME": "project_name", "BASE_DIR": "base_dir", "INITIAL_POPULATION": "edt.initial_population",
    "MAX_GENERATIONS": "edt.max_generations", "EVAL_BATCH_SIZE": "eval.batch_size",
    "MUTATION_PROBABILITY": "edt.mutation_probability", "MUTATION_STRENGTH": "edt.mutation_strength",
    "ELITISM": "edt.elitism", "OUTER_LR": "outer.lr", "OUTER_MOMENTUM": "outer.momentum",
    "OUTER_NESTEROV": "outer.nesterov", "NUM_MACHINES": "outer.num_workers",
    "POPULATION_SIZE": "edt.population_size", "population_size": "edt.population_size",  # EvoMerge / seed README
}
# The prototype's keys that no longer mean anything, and why: accepted, with a one-line note, never used.
IGNORED_KEYS = {
    "LOCAL_PACKAGE": "the prototype copied this folder to every machine before a run; here every machine runs the "
                     "installed package of its checkout (machines.json `workdir`, `pip install -e .`), so there is "
                     "nothing to copy",
}


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out += _all_keys(t, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _suggest(key: str, known: list[str]) -> str:
    pool = known + list(LEGACY_KEYS)
    leaf = {k.rsplit(".", 1)[-1]: k for k in known}
    close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if not close:
        close = [leaf[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaf), n=1, cutoff=0.75)]
    return f"; did you mean {close[0]!r}?" if close else ""


def coerce_value(name: str, value: Any, typ: Any) -> Any:
    """Check `value` against the annotation `typ` (int accepted for float; bool never for numbers)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce_value(name, value, inner[0])
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise bad_value(name, value, "must be true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad_value(name, value, "must be an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad_value(name, value, "must be a number")
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad_value(name, value, "must be a string")
    if typ is list or origin is list:
        if isinstance(value, list):
            return value
        raise bad_value(name, value, "must be a list")
    if typ is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise bad_value(name, value, "must be an object")
    return value


def _flatten(raw: dict, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"outer": {"lr": 1}} -> {"outer.lr": 1}; legacy upper-case keys are mapped on the way."""
    out = {} if out is None else out  # one dict for all levels: a key given twice is caught in any order
    for k, v in raw.items():
        if not isinstance(k, str):
            raise ConfigError(f"key {k!r} must be a string")
        key = LEGACY_KEYS.get(k, k) if not prefix else prefix + k
        if isinstance(v, dict) and key in _SECTIONS:
            _flatten(v, key + ".", out)
        else:
            if key in out:
                raise ConfigError(f"{key} is given twice (once under a legacy name such as "
                                  f"{[a for a, b in LEGACY_KEYS.items() if b == key]})")
            out[key] = v
    return out


_SECTIONS = {f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.type) or
             f.name in ("model", "data", "inner", "outer", "eval", "edt", "evomerge", "logging")}


def parse_override(text: str) -> tuple[str, Any]:
    """`outer.lr=1.0` -> ("outer.lr", 1.0). The value is JSON when it parses as JSON, else a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. outer.lr=1.0")
    key, _, val = text.partition("=")
    try:
        parsed = json.loads(val)
    except json.JSONDecodeError:
        parsed = val
    return LEGACY_KEYS.get(key.strip(), key.strip()), parsed


def _prototype_evomerge(raw: dict, flat: dict[str, Any], notes: list[str]) -> int:
    """The EvoMerge prototype had no mode key: its evolution.json listed the fine-tunes to merge in
    INITIAL_POPULATION (the pretraining prototype: the one model every member starts from). So a prototype-style
    INITIAL_POPULATION of >= 2 different models, with no edt.mode given, means edt.mode = evomerge (with a note).
    Returns how many models it lists when that applied, else 0."""
    models = raw.get("INITIAL_POPULATION")
    if "edt.mode" in flat or not isinstance(models, list) or len({json.dumps(m) for m in models}) < 2:
        return 0
    n = len({json.dumps(m) for m in models})
    flat["edt.mode"] = "evomerge"
    notes.append(f"INITIAL_POPULATION lists {n} different models: as in the EvoMerge prototype they are merged and "
                 f"evolved (edt.mode = \"evomerge\"); set edt.mode = \"pretrain\" to pretrain them instead")
    return n


def _legacy_notes(raw: dict, notes: list[str]) -> None:
    v = raw.get("MUTATION_STRENGTH")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1:
        notes.append(f"MUTATION_STRENGTH = {v} is edt.mutation_strength, the standard deviation of a gene "
                     f"perturbation on genes in [0, 1] (the EvoMerge prototype drew integers in [-{v}, {v}] for "
                     f"genes in 1..10): above 1 a mutated gene is redrawn almost at random; 0.05-0.5 is usual")


def build_config(raw: dict, overrides: list[str] | None = None, source: str = "<defaults>",
                 strategy: str = "diloco", defaults: dict[str, Any] | None = None) -> RunConfig:
    """Build and validate a RunConfig from a JSON object plus KEY=VALUE overrides.

    `strategy` (diloco or edt) names the default project (project_name null: "<strategy>-shakespeare").
    `defaults`: dotted key -> value used where neither the file nor an override gives the key (e.g. the launcher's
    one worker per machine); they do not count as the user's (`cfg.user_keys`). Notes about accepted prototype
    keys are logged once per call (logger "config")."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r}: must be one of {', '.join(STRATEGIES)}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    notes: list[str] = []
    try:
        flat = _flatten(raw)
        for ov in overrides or []:
            k, v = parse_override(ov)
            flat[k] = v
        for key in [k for k in flat if k in IGNORED_KEYS]:
            notes.append(f"{key} = {json.dumps(flat.pop(key))} is ignored: {IGNORED_KEYS[key]}")
        _legacy_notes(raw, notes)
        merged = _prototype_evomerge(raw, flat, notes)
        known = _all_keys(RunConfig)
        for key in flat:
            if key not in known:
                raise ConfigError(f"unknown key {key!r}{_suggest(key, known)} (see docs/config.md)")
        user = frozenset(k for k, v in flat.items() if not (k == "project_name" and v is None))
        for key, value in (defaults or {}).items():
            if key not in known:
                raise ValueError(f"defaults: unknown key {key!r}")
            flat.setdefault(key, value)
        cfg = RunConfig(source=source)
        hints_cache: dict[type, dict] = {}
        for key, value in flat.items():
            obj = cfg
            parts = key.split(".")
            for part in parts[:-1]:
                obj = getattr(obj, part)
            hints = hints_cache.setdefault(type(obj), field_types(type(obj)))
            setattr(obj, parts[-1], coerce_value(key, value, hints[parts[-1]]))
        cfg.user_keys = user
        if cfg.project_name is None:
            cfg.project_name = f"{strategy}-shakespeare"
        if merged and not cfg.evomerge.tasks:
            raise ConfigError(
                f"evomerge.tasks = []: INITIAL_POPULATION lists {merged} different models, so this is an EvoMerge "
                f"config (edt.mode = \"evomerge\", as in the EvoMerge prototype, whose fitness items were fixed in "
                f"its code); name the tasks members are scored on, e.g. \"evomerge\": {{\"tasks\": [{{\"name\": "
                f"\"gsm8k\", \"data\": \"gsm8k.jsonl\", \"metric\": \"exact_match\"}}]}} (docs/evomerge.md), or "
                f"set \"edt\": {{\"mode\": \"pretrain\"}}")
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    for note in notes:
        log.info("%s: %s", source, note)
    return cfg


def config_path(given: str) -> str:
    """The config file as an absolute path, so that it means the same file in every process of the run whatever
    folder each starts in (the simulators start workers in the repo; the launcher on other hosts). A relative
    `--config` is relative to the folder the command was run in; relative paths *inside* the config are relative
    to the config file's folder (then to the repo, for the shipped data and configs: RunConfig.resolve_path).
    The default `evolution.json` falls back to the repo's when the current folder has none."""
    p = os.path.abspath(os.path.expanduser(given))
    if given == DEFAULT_CONFIG and not os.path.exists(p) and (REPO_ROOT / DEFAULT_CONFIG).is_file():
        log.info("no %s in %s: using the repo's %s", given, os.getcwd(),
                                         REPO_ROOT / DEFAULT_CONFIG)
        return str(REPO_ROOT / DEFAULT_CONFIG)
    return p


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                strategy: str = "diloco", defaults: dict[str, Any] | None = None) -> RunConfig:
    """Load `evolution.json` (or defaults when `path` is None) and apply overrides (see build_config)."""
    if path is None:
        return build_config({}, overrides, strategy=strategy, defaults=defaults)
    p = Path(path)
    raw = read_json_file(p, "no such config file (copy evolution.json from the repo and edit it)")
    return build_config(raw, overrides, source=str(p), strategy=strategy, defaults=defaults)


def read_json_file(p: Path, missing: str) -> Any:
    """A JSON file's contents; ConfigError naming the file when it is missing (`missing` says what to do) or
    not valid JSON (line and column)."""
    if not p.is_file():
        raise ConfigError(f"{p}: {missing}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None


# ---------------------------------------------------------------------------------------------------------------
# reference docs
# ---------------------------------------------------------------------------------------------------------------
def reference_markdown() -> str:
    """The configuration reference table (README)."""
    rows = ["| key | default | legacy name | meaning |", "|---|---|---|---|"]
    legacy: dict[str, str] = {}
    for k, v in LEGACY_KEYS.items():
        legacy[v] = f"{legacy[v]}, {k}" if v in legacy else k

    def walk(cls: type, prefix: str) -> None:
        hints = field_types(cls)
        inst = cls()
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
                continue
            key = prefix + f.name
            rows.append(f"| `{key}` | `{json.dumps(getattr(inst, f.name))}` | {legacy.get(key, '')} | "
                        f"{f.metadata.get('doc', '')} |")

    walk(RunConfig, "")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys
    if "--markdown" in sys.argv:
        print(reference_markdown())
    else:
        cfg = load_config(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2:])
        print(json.dumps(cfg.to_dict(), indent=2))
