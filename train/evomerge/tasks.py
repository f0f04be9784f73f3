"""Instruction data for EvoMerge: deterministic synthetic tasks generated in code, and loaders for chat data.

Every source yields the same item dicts:

    {"task": "addition", "prompt": "37+45=", "answer": "82"}          # a synthetic task or a prompt/answer file
    {"task": "no_robots", "messages": [{"role": "user", ...}, ...]}    # chat data (the last turn is the assistant's)

`to_messages` turns either into a chat; `train/evomerge/sft.py` renders it with the tokenizer's chat template.

Synthetic tasks (`TASKS`) are small enough for the embedded ~1M-parameter model to learn on a CPU in minutes:

    addition  "37+45="          -> "82"        two 2-digit numbers
    reverse   "reverse: c a t"  -> "t a c"     3-5 lowercase letters, space separated (one token per letter: the
                                               byte-level BPE merges letters of a plain word, and a tiny model cannot
                                               spell its tokens)
    sort      "sort: 5 2 9"     -> "2 5 9"     3-6 integers 0-9, ascending

Train and eval splits are disjoint by construction: a prompt belongs to `eval` iff a stable hash of it falls in
the first 1/8 of the hash range, so no eval question is ever trained on, whatever the seeds. Items are sampled
without repetition from a generator seeded by (task, split, seed): the same call always returns the same items,
which is what makes fitness comparable across members.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from train.core.errors import DataError, NotFound
from train.config import ConfigError

EVAL_BUCKETS = 8  # 1 of 8 hash buckets is the eval split
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt, answer)
    doc: str


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    letters = [chr(ord("a") + rng.randrange(26)) for _ in range(rng.randint(3, 5))]
    return "reverse: " + " ".join(letters), " ".join(reversed(letters))


def _sort(rng: random.Random) -> tuple[str, str]:
    nums = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
    return "sort: " + " ".join(map(str, nums)), " ".join(map(str, sorted(nums)))


TASKS: dict[str, Task] = {
    "addition": Task("addition", _addition, "sum of two 2-digit numbers"),
    "reverse": Task("reverse", _reverse, "reverse 3-5 space-separated lowercase letters"),
    "sort": Task("sort", _sort, "sort 3-6 integers 0-9 ascending"),
}


def split_of(key: str) -> str:
    """'eval' for 1/EVAL_BUCKETS of all keys, else 'train' (a stable hash: the same on every machine and run)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "eval" if h % EVAL_BUCKETS == 0 else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: expected one of {SPLITS}")


def task_items(name: str, n: int, split: str, seed: int = 0) -> list[dict]:
    """`n` distinct items of synthetic task `name` from `split` ('train' | 'eval'); deterministic in (name, split,
    seed). Raises ConfigError for an unknown task and ValueError when the split has fewer than `n` distinct items."""
    if name not in TASKS:
        raise ConfigError(f"task {name!r}: unknown synthetic task; known: {sorted(TASKS)}")
    _check_split(split)
    task = TASKS[name]
    rng = random.Random(f"{name}|{split}|{seed}")
    seen: set[str] = set()
    items: list[dict] = []
    tries = 0
    while len(items) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise ConfigError(f"task {name!r} split {split!r}: only {len(items)} distinct items found, {n} asked: "
                              f"ask for fewer items")
        prompt, answer = task.make(rng)
        if prompt in seen or split_of(f"{name}|{prompt}") != split:
            continue
        seen.add(prompt)
        items.append({"task": name, "prompt": prompt, "answer": answer})
    return items


def to_messages(item: dict) -> list[dict]:
    """The chat of an item: its "messages", or a user turn (prompt) and an assistant turn (answer)."""
    if "messages" in item:
        return item["messages"]
    return [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": item["answer"]}]


def prompt_and_answer(item: dict) -> tuple[list[dict], str]:
    """(the chat up to the last assistant turn, that turn's text): what exact-match generation asks and expects."""
    msgs = to_messages(item)
    if not msgs or msgs[-1].get("role") != "assistant":
        raise DataError(f"item of task {item.get('task')!r} does not end with an assistant turn: {msgs[-1:]}")
    return msgs[:-1], msgs[-1]["content"]


# -- chat / instruction data from files or the hub ------------------------------------------------------------------
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "user": "user",
                 "assistant": "assistant", "system": "system"}


def _normalize(row: dict, source: str, text_fields: dict | None) -> dict | None:
    """One row -> an item dict, or None when it has no assistant turn to learn from. `text_fields` renames columns:
    {"messages": "conversations"} or {"prompt": "instruction", "answer": "output"}."""
    f = {"messages": "messages", "prompt": "prompt", "answer": "answer", **(text_fields or {})}
    if f["messages"] in row and row[f["messages"]] is not None:
        msgs = []
        for m in row[f["messages"]]:
            role = m.get("role", m.get("from"))
            content = m.get("content", m.get("value"))
            if role not in _ROLE_ALIASES or not isinstance(content, str):
                raise DataError(f"{source}: a message has role {role!r} / content {type(content).__name__}; "
                                f"expected role in {sorted(_ROLE_ALIASES)} and text content")
            msgs.append({"role": _ROLE_ALIASES[role], "content": content})
        while msgs and msgs[-1]["role"] != "assistant":  # a trailing user turn has no answer to learn
            msgs.pop()
        return {"task": source, "messages": msgs} if msgs else None
    if f["prompt"] in row and f["answer"] in row:
        return {"task": source, "prompt": str(row[f["prompt"]]), "answer": str(row[f["answer"]])}
    raise DataError(f"{source}: a row has columns {sorted(row)}; expected {f['messages']!r} (a chat) or "
                    f"{f['prompt']!r} + {f['answer']!r} (set text_fields to map other column names)")


def _read_rows(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid {path.suffix[1:].upper()} ({e})") from None
    if isinstance(data, dict):  # {"data": [...]} / {"train": [...]} style files: the first list value
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows (or an object holding one)")
    return data


def _hub_rows(name: str, split: str) -> tuple[list[dict], bool]:
    """(rows, whether they need the hash split). When the hub set has a test/validation split, our 'eval' is that
    split and our 'train' is its whole train split; otherwise both come from its train split by the hash rule."""
    from datasets import get_dataset_split_names, load_dataset

    try:
        names = get_dataset_split_names(name)
    except Exception as e:  # noqa: BLE001  (offline, unknown name, ...: one clear message)
        raise DataError(f"could not open dataset {name!r} ({type(e).__name__}: {' '.join(str(e).split())}). Without "
                        f"network access, point the task's data at a local .jsonl/.json file") from e
    held_out = next((c for c in ("test", "validation", "eval") if c in names), None)
    train = "train" if "train" in names else names[0]
    if held_out is None:
        return list(load_dataset(name, split=train)), True
    return list(load_dataset(name, split=held_out if split == "eval" else train)), False


def load_items(spec: str, n: int | None, split: str, seed: int = 0, text_fields: dict | None = None) -> list[dict]:
    """Items of one source. `spec`: "task:<name>" (generated; `n` required), a local .jsonl/.json file of
    {"messages": [...]} or {"prompt", "answer"} rows, or a `datasets` hub name (e.g. "HuggingFaceH4/no_robots").
    Files are split by the same stable hash as the tasks (1/8 eval); the result is shuffled by `seed` and cut to
    `n` (None: all)."""
    _check_split(split)
    if spec.startswith("task:"):
        if n is None:
            raise ConfigError(f"data {spec!r}: a synthetic task needs an item count")
        return task_items(spec[len("task:"):], n, split, seed)
    path = Path(spec).expanduser()
    if path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise NotFound(f"data {spec!r}: no such file (a .jsonl/.json of chat or prompt/answer rows)")
        rows, source, by_hash = _read_rows(path), path.stem, True
    elif spec.startswith((".", "/", "~")) or path.exists():
        raise ConfigError(f"data {spec!r}: expected task:<name> ({sorted(TASKS)}), a .jsonl/.json file or a hub name")
    else:
        (rows, by_hash), source = _hub_rows(spec, split), spec.split("/")[-1]
    items = []
    for row in rows:
        item = _normalize(row, source, text_fields)
        if item is None:
            continue
        if by_hash and split_of(json.dumps(to_messages(item), sort_keys=True)) != split:
            continue
        items.append(item)
    random.Random(f"{spec}|{split}|{seed}").shuffle(items)
    return items if n is None else items[:n]
