"""Synthetic tasks and item loaders: deterministic, split-disjoint, correct answers; chat files."""
from __future__ import annotations

import json
import re

import pytest

from train.config import ConfigError
from train.evomerge.tasks import TASKS, load_items, prompt_and_answer, split_of, task_items, to_messages


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_and_seeded(name):
    a = task_items(name, 50, "train", seed=3)
    assert a == task_items(name, 50, "train", seed=3)
    assert a != task_items(name, 50, "train", seed=4)
    assert len({it["prompt"] for it in a}) == 50  # distinct within a call


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_disjoint(name):
    train = {it["prompt"] for s in range(3) for it in task_items(name, 300, "train", seed=s)}
    held = {it["prompt"] for s in range(3) for it in task_items(name, 100, "eval", seed=s)}
    assert train and held and not (train & held)
    assert all(split_of(f"{name}|{p}") == "eval" for p in held)


def test_answers_are_correct():
    for it in task_items("addition", 200, "train"):
        a, b = map(int, re.fullmatch(r"(\d\d)\+(\d\d)=", it["prompt"]).groups())
        assert int(it["answer"]) == a + b
    for it in task_items("reverse", 200, "eval"):
        letters = it["prompt"].removeprefix("reverse: ").split(" ")
        assert 3 <= len(letters) <= 5 and all(len(c) == 1 and c.islower() for c in letters)
        assert it["answer"].split(" ") == letters[::-1]
    for it in task_items("sort", 200, "train"):
        nums = [int(x) for x in it["prompt"].removeprefix("sort: ").split(" ")]
        assert 3 <= len(nums) <= 6 and all(0 <= x <= 9 for x in nums)
        assert it["answer"] == " ".join(map(str, sorted(nums)))


def test_errors_name_the_problem():
    with pytest.raises(ConfigError, match="unknown synthetic task"):
        task_items("division", 3, "train")
    with pytest.raises(ConfigError, match="split"):
        task_items("sort", 3, "test")
    with pytest.raises(ValueError, match="distinct items"):
        task_items("addition", 5000, "eval")  # only ~1/8 of 8100 pairs are held out


def test_to_messages_and_prompt_answer():
    it = {"task": "t", "prompt": "p", "answer": "a"}
    assert to_messages(it) == [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}]
    chat = {"task": "c", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    assert prompt_and_answer(chat) == ([{"role": "user", "content": "q"}], "r")


def test_load_items_from_files(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(200)]
    rows.append({"conversations": None, "messages": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]})
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    train, held = load_items(str(f), None, "train"), load_items(str(f), None, "eval")
    assert len(train) + len(held) == 201 and held and train
    keys = lambda items: {json.dumps(to_messages(i)) for i in items}  # noqa: E731
    assert not keys(train) & keys(held)
    assert load_items(str(f), 5, "train", seed=1) == load_items(str(f), 5, "train", seed=1)
    assert any(to_messages(i)[0] == {"role": "user", "content": "x"} for i in train + held)  # ShareGPT roles mapped

    g = tmp_path / "pa.json"
    g.write_text(json.dumps([{"instruction": f"i{k}", "output": f"o{k}"} for k in range(40)]))
    items = load_items(str(g), None, "train", text_fields={"prompt": "instruction", "answer": "output"})
    assert items and all(i["answer"] == "o" + i["prompt"][1:] for i in items)
    with pytest.raises(ValueError, match="text_fields"):
        load_items(str(g), None, "train")
    with pytest.raises(FileNotFoundError):
        load_items(str(tmp_path / "missing.jsonl"), None, "train")
    assert load_items("task:sort", 7, "eval") == task_items("sort", 7, "eval")
