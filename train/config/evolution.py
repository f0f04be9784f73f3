"""The schema of evolution: `edt` (population, selection, crossover, mutation of EDT in both modes) and `evomerge`
(EDT in post-training mode: merge methods, SFT mutation, fitness tasks). Part of RunConfig
(train/config/schema.py)."""
from __future__ import annotations

import typing
from typing import Literal
from dataclasses import dataclass

from train.config.fields import bad_value, check_choice, check_range, check_span, doc


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
    selection: Literal["tournament", "rank"] = doc("tournament", "tournament or rank.")
    mode: Literal["pretrain", "evomerge"] = doc(
        "pretrain", "pretrain (evolutionary pretraining on data.*) or evomerge (post-training: evolve "
        "merges of the fine-tunes in initial_population, mutate by SFT, fitness from "
        "evomerge.tasks; see docs/evomerge.md).")
    crossover: Literal["outer_sgd", "linear", "slerp"] = doc(
        "outer_sgd", "outer_sgd (pairwise outer step), linear or slerp (pretrain mode; evomerge "
        "evolves its merge method in the DNA).")
    mutation_steps: int = doc(0, "Inner AdamW steps of one mutation (per member and generation); 0 = "
                                 "outer.local_steps.")
    fitness: str = doc("inverse_loss", "Fitness of a member from its eval loss: inverse_loss (1/loss, the "
                                       "prototype's), neg_loss, tasks (evomerge: the weighted task score), lm_eval "
                                       "(evomerge: the weighted lm-evaluation-harness score, evomerge.lm_eval), or "
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

    # gene name -> (lowest allowed, highest allowed); see train/edt/genes.py GENES for what each one drives.
    GENE_LIMITS: typing.ClassVar[dict] = {"inner_lr": (1e-6, 1e3), "outer_lr": (1e-6, 10.0),
                                          "outer_momentum": (0.0, 0.999), "data_mix": (0.0, 1.0)}

    def validate(self, p: str) -> None:
        check_range(self, p, "population_size", 0)
        check_range(self, p, "max_generations", 1)
        check_range(self, p, "mutation_probability", 0.0, 1.0)
        check_range(self, p, "mutation_strength", 0.0)
        check_range(self, p, "elitism", 0)
        check_range(self, p, "tournament_size", 1)
        check_range(self, p, "mutation_steps", 0)
        check_range(self, p, "keep_generations", 2)
        check_range(self, p, "job_lease_s", 0.0, lo_open=True)
        check_range(self, p, "max_attempts", 1)
        check_choice(self, p, "selection")
        check_choice(self, p, "crossover")
        check_choice(self, p, "mode")
        if self.fitness not in ("inverse_loss", "neg_loss", "tasks", "lm_eval") and not (
                self.fitness.count(":") == 1 and all(self.fitness.split(":"))):
            raise bad_value(p + "fitness", self.fitness,
                            "must be inverse_loss, neg_loss, tasks, lm_eval or module:function")
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

# -- evomerge.lm_eval: the shape only (names and metrics are checked against lm-eval by the worker,
# train/evomerge/lm_eval_fitness.py)
LM_EVAL_KEYS = ("tasks", "include_path", "include_defaults", "limit", "num_fewshot", "batch_size",
                "apply_chat_template")


def check_lm_eval(le: dict, where: str) -> None:
    def is_int(v, lo: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    if not le:
        return
    unknown = sorted(set(le) - set(LM_EVAL_KEYS))
    if unknown:
        raise bad_value(where, le, f"unknown key {unknown[0]!r}; allowed: {', '.join(LM_EVAL_KEYS)}")
    tasks = le.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise bad_value(where + ".tasks", tasks, "must be a non-empty list of lm-eval tasks: names or {\"name\": "
                                                 "..., \"weight\": 1.0, \"metric\": \"acc,none\"}")
    for i, t in enumerate(tasks):
        t = {"name": t} if isinstance(t, str) else t
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"] or \
                set(t) - {"name", "weight", "metric"}:
            raise bad_value(f"{where}.tasks[{i}]", tasks[i], "must be a task name or an object with name and "
                                                              "optional weight and metric (no other keys)")
        w, m = t.get("weight", 1.0), t.get("metric", "acc,none")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or abs(w) == float("inf"):
            raise bad_value(f"{where}.tasks[{i}].weight", w, "must be a finite number")
        if not isinstance(m, str) or not m or m.count(",") > 1:
            raise bad_value(f"{where}.tasks[{i}].metric", m, "must be a metric (acc) or metric,filter (acc,none)")
    inc = le.get("include_path")
    if inc is not None and not (isinstance(inc, str) and inc) and not (
            isinstance(inc, list) and all(isinstance(x, str) and x for x in inc)):
        raise bad_value(where + ".include_path", inc, "must be a folder of task YAMLs (or a list of folders)")
    lim = le.get("limit")
    if lim is not None and not is_int(lim, 1) and not (isinstance(lim, float) and 0 < lim < 1):
        raise bad_value(where + ".limit", lim, "must be null, a document count >= 1 or a fraction in (0, 1)")
    for key, lo in (("num_fewshot", 0), ("batch_size", 1)):
        if le.get(key) is not None and not is_int(le[key], lo):
            raise bad_value(f"{where}.{key}", le[key], f"must be null or an integer >= {lo}")
    for key in ("include_defaults", "apply_chat_template"):
        if not isinstance(le.get(key, False), bool):
            raise bad_value(f"{where}.{key}", le[key], "must be true or false")


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
    consensus_method: Literal["sum", "count"] = doc(
        "sum", "Sign election of ties / dare_ties (mergekit's consensus_method): sum = the "
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
    # lm-evaluation-harness fitness (train/evomerge/lm_eval_fitness.py; needs pip install edt[lmeval])
    lm_eval: dict = doc({}, "lm-evaluation-harness tasks scored in-process on every member: {\"tasks\": [{name, "
                            "weight, metric}] (mergekit-evolve's shape; metric default acc,none), \"include_path\": "
                            "folder of local task YAMLs, \"include_defaults\", \"limit\", \"num_fewshot\", "
                            "\"batch_size\" (default eval.batch_size), \"apply_chat_template\"}; edt.fitness = "
                            "lm_eval ranks by their weighted sum (lower-is-better metrics such as perplexity count "
                            "negatively). {} = none.")
    train_initial: bool = doc(False, "Also mutate (SFT) generation 0; off: the fine-tunes are evaluated as given, "
                                     "so the first generation is the baseline the merges are measured against.")
    initial_recipe: str = doc("", "A mergekit YAML (path) whose merge_method and parameters seed generation 0's "
                                  "recipe genes; its two models become edt.initial_population and its base_model "
                                  "evomerge.base_model where those are empty (docs/evomerge.md).")

    def validate(self, p: str) -> None:
        for i, m in enumerate(self.methods):
            if m not in MERGE_METHODS:
                raise bad_value(f"{p}methods[{i}]", m, f"must be one of {', '.join(MERGE_METHODS)}")
            if m in BASE_METHODS and not self.base_model:
                raise bad_value(f"{p}methods[{i}]", m, f"merges task vectors: set {p}base_model to the model the "
                                                        "fine-tunes started from")
        check_range(self, p, "curve_points", 1)
        check_span(self, p, "weight", 0.0, 1.0)
        check_span(self, p, "density", 0.0, 1.0)
        if self.density[0] <= 0:
            raise bad_value(p + "density", self.density, "low must be > 0 (density 0 keeps nothing)")
        check_span(self, p, "scale", 0.0, 10.0)
        check_choice(self, p, "consensus_method")
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
        check_range(self, p, "sft_items", 1)
        check_range(self, p, "max_length", 8)
        check_range(self, p, "max_new_tokens", 1)
        check_lm_eval(self.lm_eval, p + "lm_eval")
        unknown = set(self.lora) - {"r", "alpha", "dropout", "target_modules"}
        if unknown:
            raise bad_value(p + "lora", self.lora, f"unknown key {sorted(unknown)[0]!r}; allowed: r, alpha, dropout, "
                                                   "target_modules")

    @property
    def merge_methods(self) -> list[str]:
        if self.methods:
            return list(self.methods)
        return ["linear", "slerp"] + (list(BASE_METHODS) if self.base_model else [])
