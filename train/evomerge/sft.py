"""EvoMerge mutation: supervised fine-tuning on chat data, loss on the assistant's tokens only.

A chat is rendered with the tokenizer's chat template (hub models bring theirs; the embedded tokenizer ships
`DEFAULT_CHAT_TEMPLATE`, plain-text markers its byte-level BPE encodes, so the vocabulary stays as it is). The
rendering is split at each assistant turn (the template rendered up to the turn with `add_generation_prompt=True`
must be a prefix of the template rendered with the turn) and each piece is tokenized on its own, so the label mask
is exact and the prompt tokens at evaluation are the very tokens seen in training. Labels cover every assistant
turn's text up to and including its end-of-turn token; trailing whitespace after that token is not learned.

`SFTMixture` samples the DNA's data mix reproducibly: sample k is drawn by a generator seeded with (seed, k), so a
resumed mutation continues from `position` without replaying anything. `train_sft` runs full fine-tuning by default;
with `lora=...` it trains peft LoRA adapters and merges them back (`merge_and_unload`), so a member is always a plain
model whose full weights crossover can merge.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from train.core.errors import ConfigError, DataError, missing_package
from train.core.inner import autocast_for, lr_at
from train.evomerge.tasks import to_messages

log = logging.getLogger(__name__)
IGNORE = -100

# <|user|>\n{prompt}\n<|assistant|>\n{answer}<|endoftext|>\n  (eos_token is the template's end-of-turn token)
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def ensure_chat_template(tokenizer):
    """Give a tokenizer without a chat template the default one (logged); returns the tokenizer."""
    if not getattr(tokenizer, "chat_template", None):
        log.info("tokenizer %s has no chat template: using the default <|user|>/<|assistant|> template",
                 getattr(tokenizer, "name_or_path", "?"))
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    ensure_chat_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat followed by the generation prompt (what the model answers at evaluation)."""
    return _ids(tokenizer, render(tokenizer, messages, add_generation_prompt=True))


def encode_sft(tokenizer, item: dict, max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one item, cut to `max_length` tokens (its first ones; its last ones when the first
    would hold no answer token); labels are -100 except on assistant turns (their text and end-of-turn token).
    Labels are aligned with input_ids (the loss shifts them)."""
    msgs = to_messages(item)
    ids: list[int] = []
    labels: list[int] = []
    done = ""  # the text encoded so far
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(tokenizer, msgs[:i], add_generation_prompt=True)
        full = render(tokenizer, msgs[: i + 1], add_generation_prompt=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')} does not render an "
                            f"assistant turn as an extension of its prompt; cannot mask the loss exactly")
        answer = full[len(prompt):]
        answer_learned = answer.rstrip()
        p_ids = _ids(tokenizer, prompt[len(done):])
        a_ids = _ids(tokenizer, answer_learned)
        tail = _ids(tokenizer, answer[len(answer_learned):])
        ids += p_ids + a_ids + tail
        labels += [IGNORE] * len(p_ids) + a_ids + [IGNORE] * len(tail)
        done = full
    if len(ids) > max_length and all(t == IGNORE for t in labels[:max_length]):
        return ids[-max_length:], labels[-max_length:]  # a long prompt: keep its end and the last answer
    return ids[:max_length], labels[:max_length]


def pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / labels / attention_mask of (ids, labels) rows."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, lab) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[r, : len(lab)] = torch.tensor(lab, dtype=torch.long)
        mask[r, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class SFTMixture:
    """Items of several sources sampled by weight (the DNA's data mix). Sample k (k = position, position + 1, ...)
    picks its source and item with a generator seeded by (seed, k): deterministic, resumable from `position`."""

    def __init__(self, sources: dict[str, list[dict]], weights: dict[str, float], tokenizer, max_length: int,
                 seed: int, position: int = 0):
        unknown = set(weights) - set(sources)
        if unknown:
            raise ConfigError(f"data mix weights name unknown sources {sorted(unknown)}; sources: {sorted(sources)}")
        names = [n for n in sources if weights.get(n, 0.0) > 0]
        if any(w < 0 or not math.isfinite(w) for w in weights.values()) or not names:
            raise ConfigError(f"data mix weights {weights}: need finite weights >= 0 and one > 0 on a source")
        empty = [n for n in names if not sources[n]]
        if empty:
            raise ConfigError(f"data mix sources {empty} have no items")
        self.names = names
        w = np.array([weights[n] for n in names], dtype=np.float64)
        self.probs = w / w.sum()
        self.sources, self.tokenizer, self.max_length = sources, tokenizer, max_length
        self.seed, self.position = seed, position
        self.pad_id = pad_id_of(tokenizer)
        self._cache: dict[tuple[str, int], tuple[list[int], list[int]]] = {}

    def pick(self, k: int) -> tuple[str, int]:
        """(source, item index) of sample k."""
        rng = np.random.default_rng([self.seed, k])
        s = self.names[int(rng.choice(len(self.names), p=self.probs))]
        return s, int(rng.integers(len(self.sources[s])))

    def encoded(self, source: str, index: int) -> tuple[list[int], list[int]]:
        key = (source, index)
        if key not in self._cache:
            self._cache[key] = encode_sft(self.tokenizer, self.sources[source][index], self.max_length)
        return self._cache[key]

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        rows = [self.encoded(*self.pick(k)) for k in range(self.position, self.position + batch_size)]
        self.position += batch_size
        return pad_batch(rows, self.pad_id)


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy on the labelled (answer) tokens: their mean, or their sum with reduction='sum'."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits, targets = logits[:, :-1], batch["labels"][:, 1:]
    if reduction == "mean" and not bool((targets != IGNORE).any()):
        return logits.sum() * 0.0  # no answer token in the batch: a zero loss (and gradient), not NaN
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _wrap_lora(model: torch.nn.Module, lora: dict) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise missing_package("peft", "LoRA mutation (evomerge.lora)", "lora") from None
    known = {"r", "alpha", "dropout", "target_modules"}
    if set(lora) - known:
        raise ConfigError(f"evomerge.lora: options {sorted(set(lora) - known)} unknown; known: {sorted(known)}")
    cfg = LoraConfig(r=int(lora.get("r", 8)), lora_alpha=float(lora.get("alpha", 16)),
                     lora_dropout=float(lora.get("dropout", 0.0)),
                     target_modules=list(lora.get("target_modules") or DEFAULT_LORA_TARGETS), bias="none")
    return get_peft_model(model, cfg)


def _optimizer_tensors(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """AdamW state in the inner loop's safetensors layout: '<param>::exp_avg' / '::exp_avg_sq' / '::step'."""
    out = {}
    for name, p in params.items():
        st = opt.state.get(p)
        if st:
            out[f"{name}::exp_avg"] = st["exp_avg"].detach().cpu().clone()
            out[f"{name}::exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().clone()
            out[f"{name}::step"] = torch.tensor([float(st["step"])], dtype=torch.float32)
    return out


def _load_optimizer_tensors(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                            state: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        if f"{name}::exp_avg" not in state:
            continue
        opt.state[p] = {"exp_avg": state[f"{name}::exp_avg"].to(p.device, p.dtype).clone(),
                        "exp_avg_sq": state[f"{name}::exp_avg_sq"].to(p.device, p.dtype).clone(),
                        "step": torch.tensor(float(state[f"{name}::step"].item()))}


def train_sft(model: torch.nn.Module, mixture: SFTMixture, steps: int, lr: float, *, batch_size: int,
              warmup: int = 0, min_lr_ratio: float = 0.1, weight_decay: float = 0.0, grad_clip: float = 1.0,
              device: str | torch.device = "cpu", precision: str = "fp32", lora: dict | None = None,
              optimizer_state: dict[str, torch.Tensor] | None = None,
              on_step: Callable[[int, float], None] | None = None) -> dict:
    """`steps` AdamW steps of SFT on `mixture` batches (warmup + cosine to lr * min_lr_ratio), in place on `model`
    (left on `device`). Full fine-tuning by default; `lora={"r", "alpha", "dropout", "target_modules"}` trains LoRA
    adapters and merges them into the weights at the end (the model stays a plain model; no optimizer state then).
    `optimizer_state` (full fine-tuning): the '<param>::exp_avg' tensors a previous call returned, to continue.
    Returns {"train_loss" (mean of the last min(10, steps) steps), "first_loss", "steps", "tokens" (non-pad),
    "answer_tokens", "position", "seconds", "lora", "optimizer_state" (None with LoRA)}."""
    device = torch.device(device)
    model.to(device)
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}  # peft freezes the base: restored below
    net = _wrap_lora(model, lora) if lora else model
    net.train()
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=weight_decay)
    if optimizer_state and not lora:
        _load_optimizer_tensors(opt, params, optimizer_state)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16-mixed")
    losses: list[float] = []
    tokens = answer_tokens = 0
    t0 = time.perf_counter()
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, lr, warmup, steps, min_lr_ratio)
        batch = {k: v.to(device) for k, v in mixture.next_batch(batch_size).items()}
        with autocast_for(precision, device):
            loss = sft_loss(net, batch)
        scaler.scale(loss).backward()
        if grad_clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params.values(), grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(batch["attention_mask"].sum())
        answer_tokens += int((batch["labels"][:, 1:] != IGNORE).sum())
        if on_step:
            on_step(i, losses[-1])
    opt_state = None if lora else _optimizer_tensors(opt, params)
    if lora:
        net.merge_and_unload()  # folds B @ A * alpha / r into the base weights, restores the plain modules in place
        for n, p in model.named_parameters():
            p.requires_grad_(trainable.get(n, True))
    model.eval()
    tail = losses[-min(10, len(losses)):] if losses else [float("nan")]
    return {"train_loss": float(np.mean(tail)), "first_loss": losses[0] if losses else float("nan"),
            "steps": steps, "tokens": tokens, "answer_tokens": answer_tokens, "position": mixture.position,
            "seconds": time.perf_counter() - t0, "lora": bool(lora), "optimizer_state": opt_state}
