"""Task fitness: exact match by greedy batched generation, held-out SFT loss, fixed items, the weighted sum."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.config import ConfigError
from train.sft import SFTMixture, train_sft
from train.task_eval import (TaskSpec, eval_exact_match, eval_sft_loss, evaluate_tasks, exact_match_score,
                             fixed_items, generate_answers)
from train.tasks import task_items

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def memorised(tok):
    """A micro Llama trained until it answers 4 fixed items (of different lengths) by heart."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(REPO / "configs" / "micro-llama.json")))
    by_len = {}
    for it in task_items("sort", 100, "eval"):  # one list of each length 3..6: prompts of 4 different lengths
        by_len.setdefault(len(it["prompt"]), it)
    items = [by_len[k] for k in sorted(by_len)]
    assert len(items) == 4
    mix = SFTMixture({"m": items}, {"m": 1.0}, tok, 64, seed=0)
    train_sft(model, mix, 150, 2e-2, batch_size=8, warmup=5)
    return model, items


def test_exact_match_score_on_given_generations():
    assert exact_match_score(["42", " 1 2 3\n", "x"], ["42", "1 2 3", "y"]) == pytest.approx(2 / 3)
    assert exact_match_score(["4"], ["42"]) == 0.0
    with pytest.raises(ValueError):
        exact_match_score(["a"], ["a", "b"])


def test_memorised_items_score_100_percent(memorised, tok):
    model, items = memorised
    assert len({len(it["prompt"]) for it in items}) > 1  # prompts of different lengths: left padding matters
    gens = generate_answers(model, tok, items, max_new_tokens=16, batch_size=4)
    assert gens == [it["answer"] for it in items]
    assert eval_exact_match(model, tok, items, batch_size=3) == 1.0
    # batching (and so the amount of left padding) does not change any answer
    assert [generate_answers(model, tok, [it])[0] for it in items] == gens
    other = task_items("sort", 4, "train")
    assert eval_exact_match(model, tok, other, max_new_tokens=16) < 1.0  # it learnt 4 items, not sorting
    assert eval_sft_loss(model, tok, items) < 0.5 < eval_sft_loss(model, tok, other)


def test_generation_is_capped_and_deterministic(tok):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(REPO / "configs" / "micro-llama.json")))
    items = task_items("reverse", 6, "eval")
    a = generate_answers(model, tok, items, max_new_tokens=3, batch_size=4)
    assert a == generate_answers(model, tok, items, max_new_tokens=3, batch_size=6)
    assert all(len(tok(g, add_special_tokens=False)["input_ids"]) <= 3 for g in a)
    model.train()  # the train/eval mode is restored after generating
    generate_answers(model, tok, items[:1], max_new_tokens=1)
    assert model.training


def test_fixed_items_and_fitness_sign_rule(memorised, tok):
    model, _ = memorised
    specs = [TaskSpec("sort", "task:sort", "exact_match", weight=2.0, items=8),
             TaskSpec("sort_loss", "task:sort", "sft_loss", weight=0.5, items=8),
             TaskSpec("custom", "task:addition", "train.task_eval:eval_sft_loss", weight=1.0, items=4)]
    first = fixed_items(specs, seed=0)
    assert first == fixed_items(specs, seed=0)  # every member sees exactly these items
    assert first["sort"] == task_items("sort", 8, "eval", seed=0)
    res = evaluate_tasks(model, tok, specs, seed=0)
    again = evaluate_tasks(model, tok, specs, seed=0, items=first)
    assert res["scores"] == again["scores"] and res["items"] == {"sort": 8, "sort_loss": 8, "custom": 4}
    s = res["scores"]
    assert s["sort_loss"] > 0 and s["custom"] > 0
    assert res["fitness"] == pytest.approx(2.0 * s["sort"] - 0.5 * s["sort_loss"] + s["custom"])


def test_spec_validation():
    with pytest.raises(ConfigError, match="metric"):
        TaskSpec("a", "task:sort", "accuracy")
    with pytest.raises(ConfigError, match="items"):
        TaskSpec("a", "task:sort", items=0)
    with pytest.raises(ConfigError, match="distinct"):
        fixed_items([TaskSpec("a", "task:sort"), TaskSpec("a", "task:reverse")])
    with pytest.raises(ConfigError, match="importable"):
        evaluate_tasks(None, None, [TaskSpec("a", "task:sort", "no_such_module:f", items=1)])
