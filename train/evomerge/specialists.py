"""The offline EvoMerge demo's parents: one base model and one specialist per synthetic task, all from one init.

    base        the embedded tiny Llama (random init from its config), SFT for `base_steps` on an equal mix of all
                tasks: it knows the chat format and a little of every task
    <task>      the base, SFT for `steps` more on its own task only: good at it, and it forgets some of the others

All specialists share the base's weights as their starting point, which is what weight merging (task arithmetic,
ties, slerp, ...) needs to combine them. Each model is a HF model directory (with the tokenizer and its chat
template) written atomically with a manifest; a finished one is skipped, so rerunning resumes. `accuracy.json` and
`accuracy.md` hold the exact-match accuracy of every model on every task's fixed held-out items.

Defaults, measured on the tiny Llama (configs/tiny-llama.json, 1 thread per process): base 400 steps at lr 3e-3,
specialists 250 steps each at lr 1e-3, batch 64, cosine to 0.3x (a higher lr, 5e-3 or 1e-2, stalls; batch 32 or a
full cosine decay within 400 steps left addition near 10%). About 5.5 CPU-minutes in all; held-out exact match
(addition / reverse / sort): base 6 / 46 / 52%, specialists 93% / 89% / 94% on their own task, 0-2% on the others.
A weaker base (150 steps) with longer specialists (600 steps at 3e-3) reached 98 / 69 / 100% but took 8 CPU-minutes,
and its task vectors were so large that every plain merge (average, task arithmetic) scored 0% everywhere.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from train.core.errors import ConfigError, NotFound
from train.evomerge.sft import SFTMixture, ensure_chat_template, train_sft
from train.core.model import save_model_dir
from train.core.store import ProtocolError, atomic_write_bytes, atomic_write_json, read_json, verify_manifest
from train.evomerge.task_eval import TaskSpec, evaluate_tasks, fixed_items
from train.evomerge.tasks import TASKS, task_items

REPO = Path(__file__).resolve().parents[2]


def _finished(d: Path) -> bool:
    try:
        verify_manifest(d, check_hashes=False)
        return (d / "train.json").is_file()
    except (ProtocolError, OSError, ValueError):
        return False


@dataclass
class SFTPlan:
    """Hyperparameters of one demo fine-tune (the defaults: measured on the tiny Llama, see make_specialists)."""
    steps: int
    lr: float = 3e-3
    batch_size: int = 64
    min_lr_ratio: float = 0.3  # cosine to lr * 0.3: the tasks are learnt late (a phase change), so keep lr up
    max_length: int = 48
    seed: int = 0


def _sft_phase(model, tokenizer, sources: dict, plan: SFTPlan, desc: str, progress: bool, bar_pos: int = 0) -> dict:
    from tqdm import tqdm

    mixture = SFTMixture(sources, {n: 1.0 for n in sources}, tokenizer, plan.max_length, seed=plan.seed)
    with tqdm(total=plan.steps, desc=desc, unit="step", disable=not progress, dynamic_ncols=True,
              position=bar_pos) as bar:
        def on_step(i: int, loss: float) -> None:
            bar.update(1)
            if i % 10 == 0 or i == plan.steps - 1:
                bar.set_postfix(loss=f"{loss:.3f}")
        stats = train_sft(model, mixture, plan.steps, plan.lr, batch_size=plan.batch_size,
                          warmup=max(1, plan.steps // 20), min_lr_ratio=plan.min_lr_ratio, on_step=on_step)
    stats.pop("optimizer_state", None)
    return {**asdict(plan), **stats}


def _train_specialist(base_dir: Path, out: Path, task: str, items: list[dict], plan: SFTPlan, progress: bool,
                      bar_pos: int = 0, threads: int = 0) -> None:
    """One specialist: the base, fine-tuned on `task` only. A top-level function, so a process pool can run it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(plan.seed)
    tokenizer = ensure_chat_template(AutoTokenizer.from_pretrained(str(base_dir)))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    stats = _sft_phase(model, tokenizer, {task: items}, plan, f"specialist {task}", progress, bar_pos)
    save_model_dir(model, out, tokenizer, {"train.json": {"role": "specialist", "task": task, "from": "base", **stats}})


def make_specialists(out_dir: str | Path, tasks: tuple[str, ...] | list[str] = tuple(TASKS), *,
                     base_steps: int = 400, steps: int = 250, batch_size: int = 64, lr: float = 3e-3,
                     specialist_lr: float | None = 1e-3,
                     min_lr_ratio: float = 0.3, train_items: int = 4000, eval_items: int = 100,
                     max_length: int = 48, seed: int = 0, model_config: str | Path | None = None,
                     tokenizer_dir: str | Path | None = None, jobs: int = 1, progress: bool = True,
                     evaluate: bool = True) -> dict[str, Path]:
    """Build (or resume) `out_dir/base` and `out_dir/<task>` for each task; returns {"base": path, task: path}.
    `lr` is the base's peak learning rate and the specialists' unless `specialist_lr` is given.
    `jobs` > 1 trains that many specialists at once in separate processes (1 torch thread each).
    With `evaluate`, also writes out_dir/accuracy.json and accuracy.md (see `accuracy_table`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"tasks {list(tasks)}: need known synthetic tasks from {sorted(TASKS)}")
    model_config = Path(model_config or REPO / "configs" / "tiny-llama.json")
    if not model_config.is_file():
        raise NotFound(f"model config {model_config}: no such file (an HF config JSON for the base model)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_chat_template(AutoTokenizer.from_pretrained(str(tokenizer_dir or REPO / "data" / "tokenizer")))
    sources = {t: task_items(t, train_items, "train", seed) for t in tasks}
    paths = {"base": out / "base", **{t: out / t for t in tasks}}
    plan = dict(lr=lr, batch_size=batch_size, min_lr_ratio=min_lr_ratio, max_length=max_length)

    if not _finished(paths["base"]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_config)), dtype=torch.float32)
        stats = _sft_phase(model, tokenizer, sources, SFTPlan(base_steps, seed=seed, **plan), "base (all tasks)",
                           progress)
        save_model_dir(model, paths["base"], tokenizer, {"train.json": {"role": "base", "tasks": list(tasks), **stats}})
    todo = [(k, t) for k, t in enumerate(tasks) if not _finished(paths[t])]
    plan["lr"] = specialist_lr or lr
    args = [(paths["base"], paths[t], t, sources[t], SFTPlan(steps, seed=seed + 1 + k, **plan), progress)
            for k, t in todo]
    if jobs > 1 and len(todo) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=mp.get_context("spawn")) as pool:
            for fut in [pool.submit(_train_specialist, *a, bar_pos=i % jobs, threads=1) for i, a in enumerate(args)]:
                fut.result()
    else:
        for a in args:
            _train_specialist(*a)
    if evaluate:
        accuracy_table(paths, tasks, eval_items, seed, out, tokenizer, progress)
    return paths


def accuracy_table(paths: dict[str, Path], tasks, eval_items: int, seed: int, out: Path, tokenizer=None,
                   progress: bool = True) -> dict:
    """Exact-match accuracy of every model on every task's fixed held-out items -> accuracy.json + accuracy.md."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    specs = [TaskSpec(t, f"task:{t}", "exact_match", items=eval_items, max_new_tokens=16) for t in tasks]
    items = fixed_items(specs, seed)
    acc = {}
    for name, d in tqdm(paths.items(), desc="accuracy", unit="model", disable=not progress):
        tok = tokenizer or ensure_chat_template(AutoTokenizer.from_pretrained(str(d)))
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        acc[name] = evaluate_tasks(model, tok, specs, seed=seed, items=items)["scores"]
    train = {name: read_json(d / "train.json") for name, d in paths.items() if (d / "train.json").is_file()}
    result = {"tasks": list(tasks), "eval_items": eval_items, "seed": seed, "metric": "exact_match (greedy)",
              "accuracy": acc, "train": train}
    atomic_write_json(out / "accuracy.json", result)
    atomic_write_bytes(out / "accuracy.md", markdown_table(result).encode())
    return result


def markdown_table(result: dict) -> str:
    tasks = result["tasks"]
    lines = [f"Exact-match accuracy on {result['eval_items']} fixed held-out items per task (greedy, seed "
             f"{result['seed']})", "", "| model | " + " | ".join(tasks) + " | mean |",
             "|---|" + "---:|" * (len(tasks) + 1)]
    acc = result["accuracy"]
    order = [m for m in ("base", *tasks) if m in acc] + sorted(m for m in acc if m not in ("base", *tasks))
    for name, scores in ((m, acc[m]) for m in order):
        vals = [scores[t] for t in tasks]
        lines.append(f"| {name} | " + " | ".join(f"{v:.1%}" for v in vals) + f" | {sum(vals) / len(vals):.1%} |")
    return "\n".join(lines) + "\n"
