"""The schema of a run's configuration (`evolution.json`): keyword-only dataclasses, one per section, each field with
its default and a one-line doc (`doc(default, "...")`), each section with a `validate(prefix)` that raises a
FieldError naming the field, the value and what is allowed. RunConfig is the root; the sections of the training
loops (inner, outer) are in train/config/training.py, those of evolution (edt, evomerge) in
train/config/evolution.py. Loading a file into it: train/config/loader.py."""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Literal
from dataclasses import dataclass, field
from pathlib import Path

from train.config.evolution import EDTConfig, EvoMergeConfig
from train.config.fields import bad_value, check_choice, check_range, doc
from train.config.training import InnerConfig, OuterConfig

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (site-packages when installed from a wheel)
# A wheel carries the embedded default here (setup.py's build step), laid out as in the checkout: evolution.json,
# configs/, data/corpus/, data/tokenizer/. A checkout (or an editable install) has no such folder.
PACKAGED_DEFAULTS = Path(__file__).resolve().parents[1] / "_shipped"
# the shipped defaults a config names by relative path (a missing one is an incomplete install, not a hub id)
SHIPPED_DEFAULTS = ("configs/tiny-llama.json", "data/tokenizer", "data/corpus")


def shipped_root() -> Path:
    """The folder that holds the embedded default (evolution.json, configs/, data/): the wheel's copy inside the
    package when installed from one, else the checkout."""
    return PACKAGED_DEFAULTS if (PACKAGED_DEFAULTS / "evolution.json").is_file() else REPO_ROOT


def is_packaged_default(folder: Path) -> bool:
    """Whether `folder` is the installed package's copy of the defaults (read-only to a run: its relative BASE_DIR
    means the folder the command was run in, not site-packages)."""
    return folder == PACKAGED_DEFAULTS and PACKAGED_DEFAULTS.is_dir()


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
    cache_dir: str = doc("", "A folder of token caches shared by runs (~ expanded): a run whose data, tokenizer and "
                             "max_tokens match a cache there copies it instead of tokenizing again, and leaves its own "
                             "there for the next. Empty: each run tokenizes into its own data/ folder.")

    def validate(self, p: str) -> None:
        check_range(self, p, "seq_length", 2)
        check_range(self, p, "eval_fraction", 0.0, 0.5, lo_open=True)
        check_range(self, p, "max_tokens", 0)
        check_range(self, p, "fake_tokens", 1000)
        if not self.dataset and not self.fake_data:
            raise bad_value(p + "dataset", self.dataset, "must name a dataset, or set data.fake_data = true")




@dataclass(kw_only=True)
class EvalConfig:
    batch_size: int = doc(16, "Windows per evaluation batch; the prototype's EVAL_BATCH_SIZE.")
    batches: int = doc(8, "Evaluation batches; the same held-out windows are used every time.")
    every: int = doc(1, "Evaluate the global model every this many rounds (and always after the last).")

    def validate(self, p: str) -> None:
        check_range(self, p, "batch_size", 1)
        check_range(self, p, "batches", 1)
        check_range(self, p, "every", 1)




@dataclass(kw_only=True)
class LoggingConfig:
    metrics: Literal["jsonl", "dummy", "wandb", "tensorboard"] = doc(
        "jsonl", "Metric logger: jsonl (BASE_DIR/<project>/metrics.jsonl), dummy, wandb or "
        "tensorboard (the last two only when installed).")
    progress: bool = doc(True, "Progress bars on the terminal.")
    plot: bool = doc(True, "Write loss.png into the run folder at the end.")

    def validate(self, p: str) -> None:
        check_choice(self, p, "metrics")


@dataclass(kw_only=True)
class RunConfig:
    project_name: str | None = doc(None, "Run name: everything lives in BASE_DIR/<project_name>/. null = "
                                         "<strategy>-shakespeare (diloco-shakespeare for DiLoCo, edt-shakespeare "
                                         "for EDT), so the two default runs never share a folder.")
    base_dir: str = doc("runs", "Shared folder (NFS on a cluster), or an object store: s3://bucket/prefix "
                                "(docs/object-store.md); relative = next to the config file.")
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
        if self.evomerge.initial_recipe:  # a mergekit YAML's models, before the sections check them
            from train.evomerge.recipe import apply_initial_recipe  # EvoMerge's reader (the only wing config asks)
            apply_initial_recipe(self)
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                sub.validate(f.name + ".")
        if self.outer.streaming and self.inner.nproc_per_node > 1:
            raise bad_value("outer.fragments", self.outer.fragments,
                            f"streaming DiLoCo (outer.fragments / fragment_delay / fragment_mix) does not work with "
                            f"torchrun workers (inner.nproc_per_node = {self.inner.nproc_per_node}) yet: use one "
                            f"process per worker")
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
        if self.edt.fitness == "lm_eval" and (self.edt.mode != "evomerge" or not self.evomerge.lm_eval):
            raise bad_value("edt.fitness", "lm_eval", "ranks by lm-evaluation-harness tasks: needs edt.mode = "
                                                      "evomerge and evomerge.lm_eval.tasks (docs/evomerge.md)")
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
        return Path(self.source).resolve().parent if self.source != "<defaults>" else shipped_root()

    def resolve_path(self, value: str) -> str:
        """A relative path that exists next to the config (or in the shipped defaults: the repo, or the installed
        package's copy) becomes absolute; else unchanged (a hub id). A shipped default found in neither is a
        ConfigError naming it: the install lacks the embedded default."""
        if not value or os.path.isabs(value):
            return value
        roots = dict.fromkeys((self.config_dir, shipped_root()))
        for root in roots:
            cand = root / value
            if cand.exists() or any(ch in value for ch in "*?["):
                return str(cand)
        norm = Path(value).as_posix().removeprefix("./")
        where = " nor in ".join(map(str, roots))
        if norm in SHIPPED_DEFAULTS:
            from train.core.errors import ConfigError
            raise ConfigError(f"{value}: not found in {where}: it is part of the embedded default (evolution.json, "
                              f"configs/, data/corpus/, data/tokenizer/), which this install lacks; run from a "
                              f"checkout of the repo, or reinstall with `pip install .` from one, or point the "
                              f"config at your own model / tokenizer / data")
        if norm.startswith("configs/") and norm.endswith(".json"):  # a model config in the shipped folder's place
            from train.core.errors import ConfigError
            raise ConfigError(f"{value}: no such file in {where} (a relative path is read from the config file's "
                              f"folder, then from the shipped defaults'): fix the path or give an absolute one")
        return value

    @property
    def run_dir(self) -> Path:
        from train.core import objstore
        if objstore.is_url(self.base_dir):  # an object store: the run's local mirror (train/core/objstore.py)
            return objstore.attach(self.base_dir, check=False) / self.project_name
        base = Path(os.path.expanduser(self.base_dir))
        if not base.is_absolute():
            # the installed package's default config: a relative BASE_DIR is the current folder's (never
            # site-packages); default_overrides hands the absolute path to the run's other processes
            root = Path.cwd() if is_packaged_default(self.config_dir) else self.config_dir
            base = Path(os.path.normpath(root / base))  # configs/../runs -> runs
        return base / self.project_name

    def default_overrides(self) -> list[str]:
        """Values derived from the strategy rather than given by the user, as overrides: pass them to every process
        of the run (workers, remote helpers) so that they agree whatever strategy they load the config with (and
        wherever they start: the BASE_DIR of the installed package's default config is made absolute)."""
        out = [] if "project_name" in self.user_keys else [f"project_name={self.project_name}"]
        if is_packaged_default(self.config_dir) and not os.path.isabs(os.path.expanduser(self.base_dir)):
            out.append(f"base_dir={self.run_dir.parent}")
        return out

    @property
    def total_inner_steps(self) -> int:
        return self.inner.total_steps or sum(self.outer.round_steps_at(r) for r in range(self.outer.rounds))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d
