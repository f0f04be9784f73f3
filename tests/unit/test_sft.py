"""SFT mutation: exact answer-only label mask, the data-mix sampler, full and LoRA fine-tuning on a micro Llama."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers import pin_threads
from train.evomerge.sft import (DEFAULT_CHAT_TEMPLATE, IGNORE, SFTMixture, encode_sft, ensure_chat_template, render,
                                sft_loss, train_sft)
from train.evomerge.tasks import task_items

REPO = Path(__file__).resolve().parents[2]


def micro_model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(REPO / "configs" / "micro-llama.json")))


def test_embedded_tokenizer_ships_the_default_template(tok):
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    chat = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    assert render(tok, chat, False) == "<|user|>\n12+30=\n<|assistant|>\n42<|endoftext|>\n"
    assert render(tok, chat[:1], True) == "<|user|>\n12+30=\n<|assistant|>\n"


def test_missing_template_falls_back(tok):
    import copy
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    assert ensure_chat_template(bare).chat_template == DEFAULT_CHAT_TEMPLATE


@pytest.mark.parametrize("name", ["addition", "reverse", "sort"])
def test_labels_are_exactly_the_answer(tok, name):
    for item in task_items(name, 20, "train"):
        ids, labels = encode_sft(tok, item, 128)
        assert len(ids) == len(labels)
        learned = [t for t in labels if t != IGNORE]
        assert tok.decode(learned) == item["answer"] + tok.eos_token
        assert learned[-1] == tok.eos_token_id
        # the labelled tokens are the input tokens at the same positions, and one contiguous span
        pos = [i for i, t in enumerate(labels) if t != IGNORE]
        assert pos == list(range(pos[0], pos[-1] + 1)) and [ids[i] for i in pos] == learned
        assert tok.decode(ids[: pos[0]]) == render(tok, [{"role": "user", "content": item["prompt"]}], True)


def test_multi_turn_labels_every_assistant_turn(tok):
    item = {"task": "c", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"}]}
    ids, labels = encode_sft(tok, item, 256)
    assert tok.decode([t for t in labels if t != IGNORE]) == "hello<|endoftext|>ciao<|endoftext|>"
    assert tok.decode(ids) == render(tok, item["messages"], False)
    cut = [i for i, t in enumerate(labels) if t != IGNORE][0] + 2  # keeps 2 answer tokens
    short_ids, short_labels = encode_sft(tok, item, cut)
    assert short_ids == ids[:cut] and short_labels == labels[:cut]
    # a prompt longer than max_length: the end is kept, so the item still has its answer to learn
    tail_ids, tail_labels = encode_sft(tok, item, 10)
    assert tail_ids == ids[-10:] and tail_labels == labels[-10:] and any(t != IGNORE for t in tail_labels)


def test_mixture_follows_weights_and_resumes(tok):
    sources = {n: task_items(n, 50, "train") for n in ("addition", "reverse", "sort")}
    weights = {"addition": 0.6, "reverse": 0.3, "sort": 0.1}
    mix = SFTMixture(sources, weights, tok, 64, seed=5)
    counts = Counter(mix.pick(k)[0] for k in range(4000))
    for n, w in weights.items():
        assert abs(counts[n] / 4000 - w) < 0.03
    assert Counter(SFTMixture(sources, {"sort": 1.0, "reverse": 0.0}, tok, 64, 0).pick(k)[0]
                   for k in range(100)) == {"sort": 100}

    a = SFTMixture(sources, weights, tok, 64, seed=5)
    first = [a.next_batch(4) for _ in range(3)]
    assert a.position == 12
    b = SFTMixture(sources, weights, tok, 64, seed=5, position=8)  # resume at the third batch
    third = b.next_batch(4)
    for k in third:
        assert torch.equal(third[k], first[2][k])
    batch = first[0]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tok.pad_token_id).all()
    assert batch["attention_mask"][:, 0].all()  # right padding
    with pytest.raises(ValueError, match="unknown sources"):
        SFTMixture(sources, {"division": 1.0}, tok, 64, 0)
    with pytest.raises(ValueError, match="one > 0"):
        SFTMixture(sources, {"sort": 0.0}, tok, 64, 0)


def _heldout_loss(model, tok, items):
    mix = SFTMixture({"s": items}, {"s": 1.0}, tok, 64, seed=0)
    model.eval()
    with torch.no_grad():
        return sft_loss(model, mix.next_batch(len(items))).item()


def test_full_finetuning_lowers_the_loss(tok):
    pin_threads()
    model = micro_model()
    items = task_items("sort", 200, "train")
    before = _heldout_loss(model, tok, items[:32])
    mix = SFTMixture({"sort": items}, {"sort": 1.0}, tok, 64, seed=0)
    seen = []
    res = train_sft(model, mix, 25, 1e-2, batch_size=16, warmup=2, on_step=lambda i, loss: seen.append(loss))
    after = _heldout_loss(model, tok, items[:32])
    assert after < before - 1.0, (before, after)
    assert res["steps"] == 25 == len(seen) and res["position"] == 400 and res["answer_tokens"] > 0
    assert res["train_loss"] < res["first_loss"]
    st = res["optimizer_state"]
    assert st and all(k.split("::")[1] in ("exp_avg", "exp_avg_sq", "step") for k in st)
    # continuing with the returned optimizer state starts from those moments
    res2 = train_sft(model, mix, 1, 1e-2, batch_size=16, optimizer_state=st)
    assert res2["optimizer_state"]["model.norm.weight::step"].item() == 26


def test_lora_trains_adapters_then_merges_into_a_plain_model(tok):
    pytest.importorskip("peft")
    pin_threads()
    model = micro_model()
    # LoRA adapts a trained model (on a random init the frozen tied embeddings leave it nothing to work with):
    # full fine-tuning on `sort` first, then LoRA on `reverse`
    sort_items = task_items("sort", 200, "train")
    train_sft(model, SFTMixture({"sort": sort_items}, {"sort": 1.0}, tok, 64, seed=0), 25, 1e-2, batch_size=16)
    cls = type(model)
    names = set(model.state_dict())
    base = {k: v.clone() for k, v in model.state_dict().items()}
    items = task_items("reverse", 200, "train")
    before = _heldout_loss(model, tok, items[:32])
    mix = SFTMixture({"reverse": items}, {"reverse": 1.0}, tok, 64, seed=0)
    Q = "model.layers.0.self_attn.q_proj.weight"
    q = model.model.layers[0].self_attn.q_proj.weight  # the base Parameter peft wraps (merge writes into it)
    unchanged_during = []
    res = train_sft(model, mix, 30, 2e-2, batch_size=16,
                    lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
                    on_step=lambda i, loss: unchanged_during.append(torch.equal(q, base[Q])))
    assert res["lora"] and res["optimizer_state"] is None
    assert len(unchanged_during) == 30 and all(unchanged_during)  # adapters train, the base weights wait
    assert type(model) is cls and set(model.state_dict()) == names  # plain model, no lora_A/lora_B left
    assert all(p.requires_grad for p in model.parameters())  # a later full fine-tune trains every weight again
    after = model.state_dict()
    changed = {k for k in names if not torch.equal(after[k], base[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")) for k in changed)
    assert _heldout_loss(model, tok, items[:32]) < before - 0.5


def test_batch_without_answer_tokens_gives_zero_loss_not_nan(tok):
    model = micro_model()
    batch = SFTMixture({"s": task_items("sort", 4, "train")}, {"s": 1.0}, tok, 64, seed=0).next_batch(2)
    batch["labels"][:] = IGNORE
    loss = sft_loss(model, batch)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
