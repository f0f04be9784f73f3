"""mergekit's YAML, read and planned: which output tensor comes from which input tensors, with which parameters.

Follows mergekit 0.1.5 (config.py, parameter_resolver.py, plan.py): `models:` becomes one slice holding every model
over all its layers (the base model appended when it is not listed); embeddings (pre) read the first slice's
sources, the final norm and lm_head (post) the last slice's, both at t = 0; layer i of a slice of L layers reads
gradients at t = i / (L − 1) (t = 1 for L = 1). A parameter resolves, first found: the source's `parameters`, the
slice's, the top-level `parameters`, the method's default; a value is a number, a gradient list (piecewise linear in
t), or a list of {filter, value} (the first whose filter is a substring of the tensor name, `*` or none matching
all). Per-model parameters are matched against the input's own tensor name, shared ones against the output's.
With tokenizer_source (or a `tokenizer:` section) the vocabulary-indexed tensors are marked for train.merge.vocab's
remapping onto the output tokenizer, and their shapes compared past the vocabulary axis.
Everything here is checked from YAML, config.json and safetensors headers: nothing is read or written before the
plan is whole, and every refusal is one MergeError line.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core.errors import MergeError
from train.merge.stream import ModelFiles, _tokenizer_vocab

REQ = object()  # a required parameter
GTA = {  # name: (sparsification, consensus, default normalize, default rescale)
    "task_arithmetic": (None, None, False, False), "ties": ("magnitude", "sum", True, False),
    "dare_ties": ("random", "sum", False, True), "dare_linear": ("random", None, False, True),
    "breadcrumbs": ("magnitude_outliers", None, False, False),
    "breadcrumbs_ties": ("magnitude_outliers", "sum", False, False),
    "della": ("della", "sum", True, True), "della_linear": ("della", None, False, True)}


@dataclass(frozen=True)
class Method:
    base: str                      # required | optional | ignored (an ignored base is one more input)
    shared: dict                   # parameter -> default (REQ: required)
    per_model: dict = field(default_factory=dict)
    per_base_too: bool = False     # per-model parameters bind to the base input as well (mergekit's INPUT scope)
    inputs: tuple = (1, None)      # min, max inputs (base included)
    non_base: tuple = (0, None)    # min, max non-base inputs


def _gta(sparse):
    per = {"weight": REQ, "density": 1.0}
    per.update({"gamma": 0.01} if sparse == "magnitude_outliers" else {"epsilon": 0.15} if sparse == "della" else {})
    return per


METHODS: dict[str, Method] = {
    "linear": Method("ignored", {"normalize": True}, {"weight": REQ}, per_base_too=True),
    "slerp": Method("required", {"t": REQ}, inputs=(2, 2)),
    "nuslerp": Method("optional", {"nuslerp_row_wise": False, "nuslerp_flatten": True}, {"weight": REQ},
                      non_base=(2, 2)),
    "multislerp": Method("optional", {"normalize_weights": True, "eps": 1e-8}, {"weight": REQ}, non_base=(1, None)),
    "karcher": Method("ignored", {"max_iter": 10, "tol": 1e-5}),
    "model_stock": Method("required", {"filter_wise": False}, inputs=(3, None)),
    "sce": Method("required", {"int8_mask": False, "select_topk": 1.0}),
    "nearswap": Method("required", {"t": REQ}, inputs=(2, 2)),
    "arcee_fusion": Method("required", {}, inputs=(2, 2)),
    "passthrough": Method("ignored", {}, {"scale": None}, per_base_too=True, inputs=(1, 1)),
    "ram": Method("required", {"epsilon": 1e-5}),
    "ramplus_tl": Method("required", {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}),
    **{name: Method("required", {"int8_mask": False, "normalize": spec[2], "rescale": spec[3], "lambda": 1.0},
                    _gta(spec[0])) for name, spec in GTA.items()},
}
TOP_KEYS = {"models", "slices", "merge_method", "base_model", "parameters", "dtype", "out_dtype", "tokenizer_source",
            "chat_template", "name", "tokenizer"}
REFUSED_TOP_KEYS = {"modules": "per-module merges (`modules:`) are not supported; use `models:` or `slices:`",
                    "residual_weight": "residual_weight is not supported"}
DTYPES = {"float32", "float16", "bfloat16", "float64"}
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def evaluate(setting: Any, tensor_name: str, t: float, what: str) -> Any:
    """mergekit's evaluate_setting: a scalar; a gradient (numbers, piecewise linear in t; other scalars picked by
    int(t·(n−1))); or a list of {filter, value} conditions. None when no condition matches."""
    if isinstance(setting, dict):
        setting = [setting]
    if isinstance(setting, (bool, int, float, str)):
        return setting
    if isinstance(setting, list):
        if not setting:
            return None
        if all(isinstance(e, (bool, int, float, str)) for e in setting):
            if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in setting):
                return setting[int(t * (len(setting) - 1))]
            scaled = t * (len(setting) - 1)
            i0 = int(scaled)
            i1 = min(len(setting) - 1, i0 + 1)
            return (1 - (scaled - i0)) * setting[i0] + (scaled - i0) * setting[i1]
        for cond in setting:
            if not isinstance(cond, dict) or "value" not in cond or set(cond) - {"value", "filter"}:
                raise MergeError(f"parameter {what}: a list entry must be a number or {{filter, value}}, got {cond!r}")
            flt = cond.get("filter")
            if flt is None or flt == "*" or (tensor_name and flt in tensor_name):
                return evaluate(cond["value"], tensor_name, t, what)
        return None
    raise MergeError(f"parameter {what}: unexpected value {setting!r}")


@dataclass
class Source:
    ref: str                       # as written in the YAML
    files: ModelFiles
    layer_range: tuple[int, int]
    params: dict


@dataclass
class Slice:
    sources: list[Source]
    base: str | None
    params: dict


@dataclass
class OutTensor:
    name: str                      # output name
    inputs: list[tuple[Source, str]]   # (source, its tensor name)
    base_index: int | None
    shared: dict
    per_model: list[dict]          # one per input (non-base inputs only for NON_BASE parameters)
    vocab: bool = False            # rows are tokens: remapped onto the tokenizer_source vocabulary first
    vocab_base: int | None = None  # the input that is the slice's base model, whatever the method does with it


def resolve_model(ref: str, config_dir: Path) -> Path:
    """A model reference as mergekit reads it: a local directory (as written, then beside the YAML), else a hub id
    in the local Hugging Face cache (`id@revision` allowed). `model+lora` and downloads are refused."""
    if not isinstance(ref, str) or not ref:
        raise MergeError(f"model reference {ref!r} must be a path or hub id string")
    if "+" in ref:
        raise MergeError(f"model {ref!r}: LoRA references (model+lora) are not supported; merge the adapter first")
    path, _, revision = ref.partition("@")
    for cand in (Path(path).expanduser(), config_dir / path):
        if cand.is_dir():
            return cand
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(path, revision=revision or None, local_files_only=True))
    except Exception:  # noqa: BLE001 — any hub failure means: not here
        raise MergeError(f"model {ref!r}: no such directory, and not in the local Hugging Face cache (this command "
                         f"never downloads; download it first)") from None


def _params(d: Any, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise MergeError(f"{where}: parameters must be a mapping, got {d!r}")
    return d


def _num_layers(m: ModelFiles) -> int:
    n = m.config.get("num_hidden_layers")
    if not isinstance(n, int):
        raise MergeError(f"{m.label} ({m.dir}): config.json has no num_hidden_layers")
    return n


class Plan:
    """A parsed, checked YAML: `tensors` in output order, `out_config`, the donor of the tokenizer files."""

    def __init__(self, cfg: Any, config_dir: Path, allow_crimes: bool = False):
        if not isinstance(cfg, dict):
            raise MergeError("the YAML must be a mapping with merge_method and models or slices")
        for k in cfg:
            if k in REFUSED_TOP_KEYS:
                raise MergeError(f"key {k!r}: {REFUSED_TOP_KEYS[k]}")
            if k not in TOP_KEYS:
                raise MergeError(f"unknown key {k!r}; allowed: {', '.join(sorted(TOP_KEYS))}")
        self.method_name = cfg.get("merge_method")
        if self.method_name not in METHODS:
            raise MergeError(f"merge_method {self.method_name!r} is not one of {', '.join(sorted(METHODS))}")
        self.method = METHODS[self.method_name]
        if ("models" in cfg) == ("slices" in cfg):
            raise MergeError("exactly one of 'models' or 'slices' must be present")
        for k in ("dtype", "out_dtype"):
            if cfg.get(k) is not None and cfg[k] not in DTYPES:
                raise MergeError(f"{k} {cfg[k]!r} is not one of {', '.join(sorted(DTYPES))}")
        self.dtype, self.out_dtype = cfg.get("dtype"), cfg.get("out_dtype")
        self.params = _params(cfg.get("parameters"), "parameters")
        self.tokenizer_source, self.chat_template = cfg.get("tokenizer_source"), cfg.get("chat_template")
        self.tokens, self.pad_to_multiple_of = {}, None
        if cfg.get("tokenizer") is not None:
            self._tokenizer_section(cfg)
        self._files: dict[str, ModelFiles] = {}
        self.config_dir = config_dir
        self.base_ref = cfg.get("base_model")
        if self.base_ref is not None:
            self.open(self.base_ref)
        self.slices = self._slices(cfg)
        self._check_models(allow_crimes)
        self.vocab = self._vocabulary() if self.tokenizer_source is not None else None
        self.check_chat_template()
        self.tensors = self._plan()

    def open(self, ref: str) -> ModelFiles:
        if ref not in self._files:
            self._files[ref] = ModelFiles(resolve_model(ref, self.config_dir), f"model {ref!r}")
        return self._files[ref]

    @property
    def models(self) -> list[ModelFiles]:
        return list(self._files.values())

    def _slices(self, cfg) -> list[Slice]:
        if "models" in cfg:
            entries = cfg["models"]
            if not isinstance(entries, list) or not entries:
                raise MergeError("models: a non-empty list of {model, parameters} is required")
            sources = []
            for e in entries:
                if not isinstance(e, dict) or "model" not in e or set(e) - {"model", "parameters"}:
                    raise MergeError(f"models: each entry takes model and parameters only, got {e!r}")
                m = self.open(e["model"])
                sources.append(Source(e["model"], m, (0, _num_layers(m)), _params(e.get("parameters"), e["model"])))
            counts = {s.ref: s.layer_range[1] for s in sources}
            if self.base_ref is not None and self.base_ref not in counts:
                b = self.open(self.base_ref)
                sources.append(Source(self.base_ref, b, (0, _num_layers(b)), {}))
                counts[self.base_ref] = _num_layers(b)
            if len(set(counts.values())) > 1:
                raise MergeError(f"layer counts differ ({', '.join(f'{k}: {v}' for k, v in counts.items())}): "
                                 f"use `slices:` with layer_range to say which layers merge")
            return [Slice(sources, self.base_ref, {})]
        out = []
        if not isinstance(cfg["slices"], list) or not cfg["slices"]:
            raise MergeError("slices: a non-empty list of {sources: [...]} is required")
        for i, s in enumerate(cfg["slices"]):
            if not isinstance(s, dict) or "sources" not in s or set(s) - {"sources", "base_model", "parameters"}:
                bad = sorted(set(s) - {"sources", "base_model", "parameters"}) if isinstance(s, dict) else s
                raise MergeError(f"slices[{i}]: takes sources, base_model, parameters; got {bad!r}")
            sources = []
            for src in s["sources"] or []:
                if not isinstance(src, dict) or "model" not in src or "layer_range" not in src or \
                        set(src) - {"model", "layer_range", "parameters"}:
                    raise MergeError(f"slices[{i}].sources: each takes model, layer_range, parameters; got {src!r}")
                m = self.open(src["model"])
                lr = src["layer_range"]
                n = _num_layers(m)
                if not (isinstance(lr, list) and len(lr) == 2 and all(isinstance(x, int) for x in lr)
                        and 0 <= lr[0] < lr[1] <= n):
                    raise MergeError(f"slices[{i}]: layer_range {lr!r} of {src['model']!r} must be [start, end] "
                                     f"with 0 <= start < end <= {n} (its layer count)")
                sources.append(Source(src["model"], m, tuple(lr), _params(src.get("parameters"), src["model"])))
            if not sources:
                raise MergeError(f"slices[{i}]: no sources")
            if len({s.layer_range[1] - s.layer_range[0] for s in sources}) > 1:
                raise MergeError(f"slices[{i}]: every source must span the same number of layers")
            base = s.get("base_model", self.base_ref)
            if base is not None:
                self.open(base)
            out.append(Slice(sources, base, _params(s.get("parameters"), f"slices[{i}]")))
        return out

    def _check_models(self, allow_crimes: bool) -> None:
        models = self.models
        first = models[0]
        for m in models[1:]:
            where = f"{m.label} vs {first.label}"
            if not allow_crimes:
                for key in ("model_type", "architectures"):
                    if m.config.get(key) != first.config.get(key):
                        raise MergeError(f"{where}: different architectures ({key} {m.config.get(key)!r} vs "
                                         f"{first.config.get(key)!r}); --allow-crimes merges them anyway")
            tv, tv0 = _tokenizer_vocab(m.dir), _tokenizer_vocab(first.dir)  # None: no tokenizer.json to compare
            if self.tokenizer_source is None and (m.config.get("vocab_size") != first.config.get("vocab_size") or
                                                  (tv is not None and tv0 is not None and tv != tv0)):
                sizes = [(x.config.get("vocab_size"), _tokenizer_vocab(x.dir)) for x in (m, first)]
                raise MergeError(f"{where}: vocabularies differ (vocab_size {sizes[0][0]} vs {sizes[1][0]}, "
                                 f"tokenizer {sizes[0][1]} vs {sizes[1][1]} tokens): set "
                                 f"`tokenizer_source: base` (or union, or a model) to merge them on one vocabulary")
            if bool(m.config.get("tie_word_embeddings")) != bool(first.config.get("tie_word_embeddings")):
                raise MergeError(f"{where}: tie_word_embeddings differs")
        if self.tokenizer_source not in (None, "base", "union") and not isinstance(self.tokenizer_source, str):
            raise MergeError(f"tokenizer_source {self.tokenizer_source!r} must be base, union or a model")
        if self.tokenizer_source == "base" and self.base_ref is None:
            raise MergeError("tokenizer_source: base needs a base_model")

    def _tokenizer_section(self, cfg: dict) -> None:
        """mergekit's `tokenizer: {source (union), tokens, pad_to_multiple_of}`, instead of tokenizer_source."""
        from train.merge.vocab import parse_tokens
        sec = cfg["tokenizer"]
        if self.tokenizer_source is not None:
            raise MergeError("tokenizer_source and tokenizer: give one of them (tokenizer.source says the same)")
        if not isinstance(sec, dict) or set(sec) - {"source", "tokens", "pad_to_multiple_of"}:
            bad = sorted(set(sec) - {"source", "tokens", "pad_to_multiple_of"}) if isinstance(sec, dict) else sec
            raise MergeError(f"tokenizer: takes source, tokens, pad_to_multiple_of; got {bad!r}")
        self.tokenizer_source = sec.get("source", "union")
        self.tokens = parse_tokens(sec.get("tokens"))
        pad = sec.get("pad_to_multiple_of")
        if pad is not None and (type(pad) is not int or pad < 1):
            raise MergeError(f"tokenizer.pad_to_multiple_of {pad!r} must be a positive integer")
        self.pad_to_multiple_of = pad

    def _vocabulary(self):
        from train.merge.vocab import Vocabulary
        base = self.open(self.base_ref) if self.base_ref is not None else self.slices[0].sources[0].files
        base_ref = self.base_ref if self.base_ref is not None else self.slices[0].sources[0].ref
        src = self.tokenizer_source
        src_dir = None if src in ("base", "union") else resolve_model(src, self.config_dir)
        refs = {s.ref: s.files for sl in self.slices for s in sl.sources}
        return Vocabulary(src, base_ref, base.dir, base.config, [(r, f.dir, f.config) for r, f in refs.items()],
                          src_dir, self.tokens, self.pad_to_multiple_of)

    def is_vocab_tensor(self, sources: list[Source], in_names: list[str]) -> bool:
        """Outside the layers, its first dimension each model's vocab_size: embed_tokens, an untied lm_head."""
        return self.vocab is not None and all(
            len(s.files.info[n][2]) >= 1 and s.files.info[n][2][0] == s.files.config.get("vocab_size")
            for s, n in zip(sources, in_names))

    # -- the tensor plan ---------------------------------------------------------------------------------------------
    def _param(self, name: str, default, scopes: list[dict], tensor: str, t: float, who: str):
        for scope in scopes:
            if name in scope:
                v = evaluate(scope[name], tensor, t, name)
                if v is not None:
                    return v
        if default is REQ:
            raise MergeError(f"missing required parameter {name!r} for {who}{tensor} ({self.method_name})")
        return default

    def _check_values(self, name: str, v, where: str) -> None:
        if name in ("weight", "density", "t", "lambda", "gamma", "epsilon", "select_topk", "scale", "r",
                    "alpha") and v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise MergeError(f"parameter {name} = {v!r} for {where}: must be a finite number")
        if name in ("density", "select_topk", "gamma") and not 0 <= v <= 1:
            raise MergeError(f"parameter {name} = {v!r} for {where}: must lie in [0, 1]")
        if name == "epsilon" and not 0 <= v < (1 if self.method_name.startswith("della") else math.inf):
            raise MergeError(f"parameter epsilon = {v!r} for {where}: must lie in "
                             f"{'[0, 1)' if self.method_name.startswith('della') else '[0, inf)'}")

    def _tensor(self, out_name: str, sl: Slice, in_names: list[str], t: float, outside: bool = False
                ) -> OutTensor | None:
        meth = self.method
        sources = sl.sources
        present = [n in s.files.info for s, n in zip(sources, in_names)]
        if out_name == "lm_head.weight" and not any(present):
            return None  # tied embeddings: no lm_head tensor (mergekit skips the optional weight)
        for (s, n), ok in zip(zip(sources, in_names), present):
            if not ok:
                raise MergeError(f"{s.files.label}: tensor {n!r} is missing")
        vocab = outside and self.is_vocab_tensor(sources, in_names)
        shapes = {tuple(s.files.info[n][2])[1 if vocab else 0:] for s, n in zip(sources, in_names)}
        if len(shapes) > 1:
            raise MergeError(f"tensor {out_name}: input shapes differ {sorted(shapes)} "
                             f"({', '.join(s.ref for s in sources)}): different architectures or sizes")
        base_index = None
        if meth.base != "ignored" and sl.base is not None:
            refs = [s.ref for s in sources]
            if sl.base not in refs:
                raise MergeError(f"base model {sl.base!r} is not among the inputs of {out_name} ({self.method_name})")
            base_index = refs.index(sl.base)
        if meth.base == "required" and base_index is None:
            raise MergeError(f"merge_method {self.method_name} needs a base_model")
        n_in, n_nb = len(sources), len(sources) - (base_index is not None)
        for (lo, hi), got, what in ((meth.inputs, n_in, "inputs"), (meth.non_base, n_nb, "non-base inputs")):
            if got < lo or (hi is not None and got > hi):
                want = f"exactly {lo}" if lo == hi else f"at least {lo}" if got < lo else f"at most {hi}"
                raise MergeError(f"merge_method {self.method_name} takes {want} {what}, got {got} for {out_name}")
        shared_scopes = [sl.params, self.params]
        shared = {}
        for p, d in meth.shared.items():
            shared[p] = self._param(p, d, shared_scopes, out_name, t, "")
            self._check_values(p, shared[p], out_name)
        unknown = {k for s in [*shared_scopes, *(x.params for x in sources)] for k in s} - set(meth.shared) - \
            set(meth.per_model)
        if unknown:
            raise MergeError(f"parameter(s) {sorted(unknown)} are not {self.method_name}'s (it takes: "
                             f"{', '.join([*meth.shared, *meth.per_model]) or 'none'})")
        per = []
        for i, (s, n) in enumerate(zip(sources, in_names)):
            if i == base_index and not meth.per_base_too:
                per.append({})
                continue
            vals = {p: self._param(p, d, [s.params, *shared_scopes], n, t, f"{s.ref}.") for p, d in
                    meth.per_model.items()}
            for p, v in vals.items():
                self._check_values(p, v, f"{s.ref} {n}")
            per.append(vals)
        refs = [s.ref for s in sources]
        return OutTensor(out_name, list(zip(sources, in_names)), base_index, shared, per, vocab,
                         refs.index(sl.base) if vocab and sl.base in refs else None)

    def _plan(self) -> list[OutTensor]:
        first = self.slices[0].sources[0].files
        layer_names = [n for n in first.order if _LAYER.search(n)]
        template = list(dict.fromkeys(_LAYER.sub(r"\1layers.{}.", n, count=1) for n in layer_names))
        outside = [n for n in first.order if not _LAYER.search(n)]
        if "lm_head.weight" not in outside and any("lm_head.weight" in s.files.info for sl in self.slices
                                                   for s in sl.sources):
            outside.append("lm_head.weight")
        pre = [n for n in outside if "embed" in n]
        post = [n for n in outside if n not in pre]
        out: list[OutTensor | None] = []
        for n in pre:
            out.append(self._tensor(n, self.slices[0], [n] * len(self.slices[0].sources), 0.0, outside=True))
        layer = 0
        for sl in self.slices:
            length = sl.sources[0].layer_range[1] - sl.sources[0].layer_range[0]
            for off in range(length):
                t = off / (length - 1) if length > 1 else 1.0
                for tpl in template:
                    out.append(self._tensor(tpl.format(layer), sl,
                                            [tpl.format(s.layer_range[0] + off) for s in sl.sources], t))
                layer += 1
        for n in post:
            out.append(self._tensor(n, self.slices[-1], [n] * len(self.slices[-1].sources), 0.0, outside=True))
        self.num_layers = layer
        return [x for x in out if x is not None]

    def out_config(self) -> dict:
        donor = self.open(self.base_ref) if self.base_ref is not None else self.slices[0].sources[0].files
        cfg = json.loads(json.dumps(donor.config))
        cfg["num_hidden_layers"] = self.num_layers
        if self.vocab is not None:
            cfg["vocab_size"] = self.vocab.size
        if self.out_dtype or self.dtype:
            cfg["torch_dtype" if "torch_dtype" in cfg or "dtype" not in cfg else "dtype"] = self.out_dtype or self.dtype
        return cfg

    def tokenizer_donor(self) -> ModelFiles:
        """Whose tokenizer (and generation_config.json) files the output gets without tokenizer_source: the base
        model's, else the first model's (mergekit's donor)."""
        if self.base_ref is not None:
            return self.open(self.base_ref)
        return self.slices[0].sources[0].files

    def check_chat_template(self) -> None:
        """`auto`, one of mergekit's names (train.merge.chat_templates) or a Jinja string of ≥ 20 characters with
        a `{`, as mergekit accepts."""
        from train.merge.chat_templates import CHAT_TEMPLATES, named_template
        tpl = self.chat_template
        if tpl is None or tpl == "auto" or (isinstance(tpl, str) and named_template(tpl) is not None):
            return
        if not isinstance(tpl, str) or len(tpl) < 20 or "{" not in tpl:
            raise MergeError(f"chat_template {tpl!r}: give auto, one of {', '.join(sorted(CHAT_TEMPLATES))}, or a "
                             f"Jinja template (20 characters or more)")
