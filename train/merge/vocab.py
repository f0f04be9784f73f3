"""`tokenizer_source` (base | union | a model): the output tokenizer and each model's embedding rows on its vocabulary.

Follows mergekit 0.1.5 (tokenizer/build.py, tokenizer/embed.py; LGPL, read, not copied), in our own code:

* The base tokenizer is the base model's (else the first model's); its tokens must all have ids below the model's
  `vocab_size` (mergekit strips the others from a BPE tokenizer; that is refused here). A model other than the base
  with no loadable tokenizer is taken to have the base's vocabulary, as mergekit does.
* The output tokenizer: `base`, the base tokenizer; a model reference, that model's tokenizer; `union`, the base
  tokenizer plus every other model's tokens below its `vocab_size` that the base lacks, each added as a plain
  token (`add_tokens`), then every model's added (special) tokens with their own settings, first model first.
  mergekit adds the plain tokens in an order that changes from run to run (set and hash-map order); here it is the
  base, then the models in YAML order, each by token id. A token's embedding row is the same either way; only the
  new tokens' ids differ.
* Each input's vocabulary-indexed tensor (a tensor outside the layers whose first dimension is its model's
  `vocab_size`: embed_tokens, an untied lm_head) becomes one row per output token: the model's own row for a
  token it has; for a token it lacks, the row of the only model that has it, else the base model's row (when the
  base is an input of that tensor and has the token), else the mean of the rows of the inputs that have it, else
  zeros. The merge method then merges these rows like any tensor. Rows past the output vocabulary (padding) go.
* config.json's `vocab_size` becomes the output vocabulary's size; the tokenizer is written with
  `save_pretrained`, whatever `--copy-tokenizer` says (mergekit does the same).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from train.core.errors import MergeError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _load_tokenizer(path: Path, what: str, required: bool = True):
    from transformers import AutoTokenizer
    try:
        if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"none of {', '.join(TOKENIZER_FILES)} is there")
        return AutoTokenizer.from_pretrained(str(path), use_fast=True)
    except Exception as e:  # noqa: BLE001 — any load failure: no usable tokenizer there
        if not required:
            return None
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MergeError(f"{what} ({path}): no tokenizer could be loaded for tokenizer_source ({msg}); "
                         f"give the model its tokenizer files") from None


def _vocab_size(config: dict, what: str) -> int:
    n = config.get("vocab_size")
    if not isinstance(n, int) or n <= 0:
        raise MergeError(f"{what}: config.json has no vocab_size, which tokenizer_source needs")
    return n


@dataclass(frozen=True)
class TokenSpec:
    """One entry of `tokenizer.tokens`: where a token's row comes from (kind model | model_token | zero)."""
    kind: str
    model: str | None = None
    token_id: int | None = None
    token: str | None = None
    force: bool = False


def parse_tokens(tokens) -> dict[str, TokenSpec]:
    """mergekit's `tokenizer.tokens`: {token: {source: MODEL | {kind: model_token, model, token | token_id} |
    {kind: zero}, force: bool}}."""
    if tokens is None:
        return {}
    if not isinstance(tokens, dict):
        raise MergeError(f"tokenizer.tokens must be a mapping of token -> {{source, force}}, got {tokens!r}")
    out = {}
    for tok, cfg in tokens.items():
        where = f"tokenizer.tokens[{tok!r}]"
        if not isinstance(tok, str) or not isinstance(cfg, dict) or set(cfg) - {"source", "force"}:
            raise MergeError(f"{where}: takes source and force, got {cfg!r}")
        src, force = cfg.get("source"), cfg.get("force", False)
        if not isinstance(force, bool):
            raise MergeError(f"{where}: force must be true or false, got {force!r}")
        if src is None:  # fine while every model has the token and it is not forced; else an error when merging
            out[tok] = TokenSpec("none", force=force)
        elif isinstance(src, str):
            out[tok] = TokenSpec("model", src, force=force)
        elif isinstance(src, dict) and src.get("kind") == "zero" and set(src) == {"kind"}:
            out[tok] = TokenSpec("zero", force=force)
        elif isinstance(src, dict) and src.get("kind") == "model_token" and isinstance(src.get("model"), str) and \
                not set(src) - {"kind", "model", "token", "token_id"} and \
                (src.get("token") is None) != (src.get("token_id") is None) and \
                (src.get("token_id") is None or type(src["token_id"]) is int):
            out[tok] = TokenSpec("model_token", src["model"], src.get("token_id"), src.get("token"), force)
        else:
            raise MergeError(f"{where}: source must be a model, {{kind: zero}} or {{kind: model_token, model, "
                             f"token or token_id}}, got {src!r}")
    return out


class Vocabulary:
    """The output tokenizer of a tokenizer_source merge and, per model reference, the map output id -> its row."""

    def __init__(self, source: str, base_ref: str, base_dir: Path, base_config: dict,
                 models: Sequence[tuple[str, Path, dict]], source_dir: Path | None, tokens: dict | None = None,
                 pad_to_multiple_of: int | None = None):
        base_tok = _load_tokenizer(base_dir, f"model {base_ref!r}")
        base_n = _vocab_size(base_config, f"model {base_ref!r}")
        over = sorted(i for i in base_tok.get_vocab().values() if i >= base_n)
        if over:
            raise MergeError(f"model {base_ref!r}: its tokenizer has {len(over)} token(s) with ids >= its vocab_size "
                             f"{base_n} (first {over[0]}); mergekit strips them, this command does not: remove them "
                             f"from the base's tokenizer")
        toks = {base_ref: base_tok}
        sizes = {base_ref: base_n}
        for ref, d, cfg in models:
            if ref in sizes:
                continue
            sizes[ref] = _vocab_size(cfg, f"model {ref!r}")
            tok = _load_tokenizer(d, f"model {ref!r}", required=False)
            if tok is not None:  # none: the base's vocabulary, as mergekit assumes
                toks[ref] = tok
        if source == "base":
            out = _load_tokenizer(base_dir, f"model {base_ref!r}")  # a copy: added tokens stay out of the base's
        elif source == "union":
            out = self._union(base_dir, toks, sizes)
        else:
            out = _load_tokenizer(source_dir, f"tokenizer_source {source!r}")
        tokens = tokens or {}
        for tok in tokens:
            if tok not in out.get_vocab():
                out.add_tokens(tok)
        self.tokenizer = out
        vocab = out.get_vocab()
        self.n_tokens = len(vocab)
        if sorted(vocab.values()) != list(range(self.n_tokens)):
            raise MergeError(f"tokenizer_source {source!r}: the output tokenizer's ids are not "
                             f"0..{self.n_tokens - 1}")
        self.size = self.n_tokens
        if pad_to_multiple_of and self.size % pad_to_multiple_of:
            self.size += pad_to_multiple_of - self.size % pad_to_multiple_of
        self.own_vocab = {ref: t.get_vocab() for ref, t in toks.items()}
        self.tokens = {vocab[t]: (t, spec) for t, spec in tokens.items()}  # output id -> (token, TokenSpec)
        self.perm: dict[str, torch.Tensor] = {}
        for ref, n in sizes.items():
            own = (toks.get(ref) or base_tok).get_vocab()
            p = torch.full((self.n_tokens,), -1, dtype=torch.long)
            for tok, new in vocab.items():
                old = own.get(tok)
                if old is None:
                    continue
                if old >= n:
                    raise MergeError(f"model {ref!r}: token {tok!r} has id {old} >= its vocab_size {n}; mergekit "
                                     f"fails on this too: give the model a tokenizer that fits its embeddings")
                p[new] = old
            self.perm[ref] = p

    @staticmethod
    def _union(base_dir: Path, toks: dict, sizes: dict):
        out = _load_tokenizer(base_dir, "base model")  # a fresh copy: the base's own stays as it is
        have = set(out.get_vocab())
        plain: dict[str, None] = {}
        added: dict[str, object] = {}
        for ref, tok in toks.items():
            n = sizes[ref]
            for content, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
                if idx < n and content not in have:
                    plain.setdefault(content)
            for idx, info in sorted(tok.added_tokens_decoder.items()):
                if idx < n:
                    added.setdefault(info.content, info)
        for content in plain:
            if content not in added:
                out.add_tokens(content)
        for info in added.values():
            out.add_tokens(info)
        return out

    def remap(self, xs: Sequence[torch.Tensor], refs: Sequence[str], base_index: int | None) -> list[torch.Tensor]:
        """Each input's rows on the output vocabulary (see the module docstring), float32, one row per token."""
        perms = torch.stack([self.perm[r] for r in refs]).to(xs[0].device)  # models x out
        has = perms >= 0
        count = has.sum(0)
        rows = [x[p.clamp(min=0)] for x, p in zip(xs, perms)]       # models x out x ...
        tail = (1,) * (xs[0].dim() - 1)
        fill = torch.zeros_like(rows[0])
        total = torch.zeros_like(rows[0])
        for r, h in zip(rows, has):
            total = total + r * h.reshape(-1, *tail)
        avg = count > 1
        fill[avg] = total[avg] / count[avg].reshape(-1, *tail).to(total.dtype)
        for r, h in zip(rows, has):  # the one model that has it
            one = (count == 1) & h
            fill[one] = r[one]
        if base_index is not None:
            use_base = avg & has[base_index]
            fill[use_base] = rows[base_index][use_base]
        own = has.clone()
        for i, (tok, spec) in self.tokens.items():  # `tokenizer.tokens`: their own rule instead of the above
            if spec.force:
                own[:, i] = False
            if bool(own[:, i].all()):
                continue
            fill[i] = self._token_row(tok, i, spec, xs, rows, has, list(refs))
        outs = [torch.where(h.reshape(-1, *tail), r, fill) for r, h in zip(rows, own)]
        if self.size > self.n_tokens:  # pad_to_multiple_of: the new rows are the mean row
            outs = [torch.cat([o, o.mean(0, keepdim=True).expand(self.size - self.n_tokens, *o.shape[1:])])
                    for o in outs]
        return outs

    def _token_row(self, tok: str, i: int, spec: "TokenSpec", xs, rows, has, refs: list[str]) -> torch.Tensor:
        if spec.kind == "zero":
            return torch.zeros_like(rows[0][i])
        if spec.kind == "none":
            raise MergeError(f"tokenizer.tokens[{tok!r}]: some input lacks this token (or force is set) and no "
                             f"source is given: add source (a model, kind: model_token or kind: zero)")
        if spec.model not in refs:
            raise MergeError(f"tokenizer.tokens[{tok!r}]: its source model {spec.model!r} is not an input of "
                             f"this tensor (inputs: {', '.join(refs)})")
        k = refs.index(spec.model)
        if spec.kind == "model":
            if not bool(has[k, i]):
                raise MergeError(f"tokenizer.tokens[{tok!r}]: model {spec.model!r} has no token {tok!r}; name "
                                 f"another source (kind: model_token with token or token_id, or kind: zero)")
            return rows[k][i]
        src = spec.token_id
        if src is None:
            vocab = self.own_vocab.get(spec.model)
            if vocab is None or spec.token not in vocab:
                raise MergeError(f"tokenizer.tokens[{tok!r}]: token {spec.token!r} is not in the tokenizer of "
                                 f"{spec.model!r}")
            src = vocab[spec.token]
        if not 0 <= src < xs[k].shape[0]:
            raise MergeError(f"tokenizer.tokens[{tok!r}]: token_id {src} is outside model {spec.model!r}'s "
                             f"{xs[k].shape[0]} rows")
        return xs[k][src]

    def save(self, out_dir: Path) -> None:
        self.tokenizer.save_pretrained(str(out_dir))
