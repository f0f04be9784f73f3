"""Task fitness: exact match by greedy batched generation, held-out SFT loss, fixed items, the weighted sum."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import pin_threads
from train.config import ConfigError
from train.evomerge.sft import SFTMixture, train_sft
from train.evomerge.task_eval import (TaskSpec, eval_exact_match, eval_sft_loss, evaluate_tasks, exact_match_score,
                                      fixed_items, generate_answers)
from train.evomerge.tasks import task_items

REPO = Path(__file__).resolve().parents[2]


# Trained until the mean answer-token loss on the 4 items is below this. Then no greedy answer can depend on the
# CPU's float kernels: the items have 36 answer tokens (EOS included), so a mean < 0.005 puts every answer token's
# -log p below 36 * 0.005 = 0.18, i.e. p > 0.83 against < 0.17 for any other token (a logit gap > 1.6, where kernel
# differences move logits by ~1e-5). A fixed step count is not enough: 150 steps end at loss 0.17 on some CPUs.
MEMORISED_LOSS = 0.005


@pytest.fixture(scope="module")
def memorised(tok):
    """A micro Llama trained until it answers 4 fixed items (of different lengths) by heart."""
    from transformers import AutoConfig, AutoModelForCausalLM
    pin_threads()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(REPO / "configs" / "micro-llama.json")))
    by_len = {}
    for it in task_items("sort", 100, "eval"):  # one list of each length 3..6: prompts of 4 different lengths
        by_len.setdefault(len(it["prompt"]), it)
    items = [by_len[k] for k in sorted(by_len)]
    assert len(items) == 4
    mix = SFTMixture({"m": items}, {"m": 1.0}, tok, 64, seed=0)
    state, steps, loss = None, 0, float("inf")
    while loss >= MEMORISED_LOSS and steps < 1000:  # ~200 steps (about 4 s) here
        res = train_sft(model, mix, 50, 2e-2, batch_size=8, warmup=5 if steps == 0 else 0, min_lr_ratio=1.0,
                        optimizer_state=state)
        state, steps, loss = res["optimizer_state"], steps + 50, eval_sft_loss(model, tok, items)
    assert loss < MEMORISED_LOSS, f"not memorised after {steps} steps: answer loss {loss:.4f}"
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
    # The same call again: the same answers. (Not another batch size: on this untrained model two top logits can be
    # closer than float rounding, and other padding may then flip the argmax on some CPU.
    # test_memorised_items_score_100_percent checks that batching changes no answer, on a model with a wide margin.)
    assert a == generate_answers(model, tok, items, max_new_tokens=3, batch_size=4)
    assert all(len(tok(g, add_special_tokens=False)["input_ids"]) <= 3 for g in a)
    model.train()  # the train/eval mode is restored after generating
    generate_answers(model, tok, items[:1], max_new_tokens=1)
    assert model.training


def test_fixed_items_and_fitness_sign_rule(memorised, tok):
    model, _ = memorised
    specs = [TaskSpec("sort", "task:sort", "exact_match", weight=2.0, items=8),
             TaskSpec("sort_loss", "task:sort", "sft_loss", weight=0.5, items=8),
             TaskSpec("custom", "task:addition", "train.evomerge.task_eval:eval_sft_loss", weight=1.0, items=4)]
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
