"""EvoMerge fitness: pluggable task evaluators on FIXED held-out items.

Every member is scored on exactly the same items: `fixed_items` draws them from the 'eval' split with a fixed seed
(the prototype sampled new questions at temperature 0.6 for every member, so its fitness was mostly noise).

Metrics (a `TaskSpec.metric`):
    exact_match      greedy generation (batched, left padding, stop at end of turn, capped), the text after the
                     generation prompt compared with the answer after strip(); the fraction right (higher is better)
    sft_loss         mean cross-entropy on the answer tokens, as in training (lower is better)
    module:function  your own: function(model, tokenizer, items) -> float, higher is better

Sign rule: `scores` hold the raw values; `fitness` = sum over tasks of weight * signed score, where sft_loss enters
as -loss (every term is higher-is-better, so fitness is maximised).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from train.core.plugins import import_attr
from train.config import ConfigError
from train.evomerge.sft import IGNORE, encode_prompt, encode_sft, pad_batch, pad_id_of, sft_loss
from train.evomerge.tasks import load_items, prompt_and_answer

BUILTIN_METRICS = ("exact_match", "sft_loss")


@dataclass
class TaskSpec:
    """One evaluation task of the fitness."""
    name: str  # the score's name in reports
    data: str  # a load_items spec: "task:addition", a .jsonl/.json file, a hub dataset name
    metric: str = "exact_match"  # exact_match | sft_loss | module:function
    weight: float = 1.0  # weight of the (signed) score in the fitness sum
    items: int = 64  # held-out items (the same for every member)
    max_new_tokens: int = 16  # exact_match: generation cap
    max_length: int = 256  # tokens per item (prompt + answer); longer ones are cut

    def __post_init__(self):
        where = f"task {self.name!r}"
        if self.metric not in BUILTIN_METRICS and ":" not in self.metric:
            raise ConfigError(f"{where}: metric {self.metric!r} unknown; use {BUILTIN_METRICS} or 'module:function'")
        if not (isinstance(self.items, int) and self.items > 0):
            raise ConfigError(f"{where}: items = {self.items!r}; need a positive item count")
        if not (isinstance(self.weight, (int, float)) and self.weight == self.weight):
            raise ConfigError(f"{where}: weight = {self.weight!r}; need a number")
        if self.max_new_tokens < 1 or self.max_length < 2:
            raise ConfigError(f"{where}: max_new_tokens >= 1 and max_length >= 2 needed")


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def eval_sft_loss(model, tokenizer, items: list[dict], batch_size: int = 32, max_length: int = 256) -> float:
    """Mean cross-entropy over all answer tokens of `items` (token-weighted, as in training)."""
    was_training, device = model.training, _device_of(model)
    model.eval()
    total, count = 0.0, 0
    pad = pad_id_of(tokenizer)
    try:
        for i in range(0, len(items), batch_size):
            batch = pad_batch([encode_sft(tokenizer, it, max_length) for it in items[i: i + batch_size]], pad)
            batch = {k: v.to(device) for k, v in batch.items()}
            n = int((batch["labels"][:, 1:] != IGNORE).sum())
            if n:
                total += sft_loss(model, batch, reduction="sum").item()
                count += n
    finally:
        model.train(was_training)
    return total / count if count else float("nan")


def _stop_ids(model, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return {i for i in ids if i is not None}


@torch.no_grad()
def generate_answers(model, tokenizer, items: list[dict], max_new_tokens: int = 16, batch_size: int = 32,
                     max_length: int = 256) -> list[str]:
    """Greedy completions of each item's prompt (chat template + generation prompt), cut at the first end-of-turn
    token, special tokens dropped. Batched with left padding and an attention mask; a KV-cached loop of argmax
    steps, so the result does not depend on the batch an item lands in (up to float rounding)."""
    was_training, device = model.training, _device_of(model)
    model.eval()
    pad, stops = pad_id_of(tokenizer), _stop_ids(model, tokenizer)
    out: list[str] = []
    try:
        for i in range(0, len(items), batch_size):
            prompts = [encode_prompt(tokenizer, prompt_and_answer(it)[0])[-max_length:]
                       for it in items[i: i + batch_size]]
            width = max(map(len, prompts))
            ids = torch.full((len(prompts), width), pad, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for r, p in enumerate(prompts):  # left padding: every prompt ends at the last column
                ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[r, width - len(p):] = 1
            ids, mask = ids.to(device), mask.to(device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            new = torch.empty((len(prompts), 0), dtype=torch.long, device=device)
            done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
            cache, step_ids, step_pos = None, ids, positions
            for _ in range(max_new_tokens):
                res = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                            use_cache=True)
                cache = res.past_key_values
                nxt = res.logits[:, -1].argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                new = torch.cat([new, nxt[:, None]], dim=1)
                done |= torch.isin(nxt, torch.tensor(sorted(stops), device=device))
                if bool(done.all()):
                    break
                step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            for row in new.tolist():
                cut = next((j for j, t in enumerate(row) if t in stops), len(row))
                out.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def exact_match_score(generations: list[str], answers: list[str]) -> float:
    """Fraction of generations equal to their answer after strip()."""
    if len(generations) != len(answers):
        raise ValueError(f"{len(generations)} generations for {len(answers)} answers")
    if not answers:
        return float("nan")
    return sum(g.strip() == a.strip() for g, a in zip(generations, answers)) / len(answers)


def eval_exact_match(model, tokenizer, items: list[dict], max_new_tokens: int = 16, batch_size: int = 32,
                     max_length: int = 256) -> float:
    gens = generate_answers(model, tokenizer, items, max_new_tokens, batch_size, max_length)
    return exact_match_score(gens, [prompt_and_answer(it)[1] for it in items])


def fixed_items(specs: list[TaskSpec], seed: int = 0) -> dict[str, list[dict]]:
    """The held-out items of each task: split 'eval', a fixed seed, so every call (every member) gets the same."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"evaluation tasks need distinct names; got {names}")
    return {s.name: load_items(s.data, s.items, "eval", seed) for s in specs}


def _custom_metric(spec: TaskSpec):
    try:
        return import_attr(spec.metric)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"task {spec.name!r}: metric {spec.metric!r} is not an importable module:function "
                          f"({type(e).__name__}: {e})") from e


def evaluate_tasks(model, tokenizer, specs: list[TaskSpec], seed: int = 0, batch_size: int = 32,
                   items: dict[str, list[dict]] | None = None) -> dict:
    """Score `model` on every task. `items`: a `fixed_items(specs, seed)` result to reuse (loading a hub set once).
    Returns {"scores": {name: raw value}, "fitness": sum of weight * signed score (sft_loss as -loss),
    "items": {name: count}, "seconds": wall time}."""
    t0 = time.perf_counter()
    items = items if items is not None else fixed_items(specs, seed)
    scores, fitness = {}, 0.0
    for spec in specs:
        its = items[spec.name]
        if spec.metric == "exact_match":
            value = eval_exact_match(model, tokenizer, its, spec.max_new_tokens, batch_size, spec.max_length)
            signed = value
        elif spec.metric == "sft_loss":
            value = eval_sft_loss(model, tokenizer, its, batch_size, spec.max_length)
            signed = -value
        else:
            value = float(_custom_metric(spec)(model, tokenizer, its))
            signed = value
        scores[spec.name] = value
        fitness += spec.weight * signed
    return {"scores": scores, "fitness": fitness, "items": {k: len(v) for k, v in items.items()},
            "seconds": time.perf_counter() - t0}
