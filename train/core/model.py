"""Build, load and save Hugging Face causal LMs; the model directory format of the BASE_DIR protocol.

`model.name` may be a config JSON (random init from the seed: pretraining from scratch, the embedded default), a
local HF model directory, or a hub id. The hub path is the ordinary `from_pretrained` call; it needs network access
(or a populated HF cache) and fails with a clear message when it has neither.

A model directory on BASE_DIR is what `save_pretrained` writes (config.json, generation_config.json,
model.safetensors) plus MANIFEST.json; its tensors are exactly `model.named_parameters()` (tied weights once).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from train.core.errors import ConfigError, EnvironmentProblem, ModelError, NotFound
from train.config import RunConfig
from train.core.store import publish_dir
from train.core.tensorio import iter_tensors

WEIGHTS = "model.safetensors"


def quiet_transformers() -> None:
    """No per-call progress bars from transformers / datasets inside workers (our own bars say more).

    `datasets` is not imported here: its import costs a few seconds of CPU and only the processes that read a
    dataset (the coordinator tokenizing, EvoMerge task loading) need it. When it is not loaded yet, the variables it
    reads at import quiet it (children inherit them); when it is, it is told directly."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    datasets = sys.modules.get("datasets")
    if datasets is not None:
        datasets.utils.logging.disable_progress_bar()
        datasets.utils.logging.set_verbosity_error()
    import logging
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # offline retries: our error says it once


def model_source(cfg: RunConfig, name: str | None = None) -> tuple[str, str]:
    """('config', path) | ('dir', path) | ('hub', id) for a model spec."""
    spec = cfg.resolve_path(name or cfg.model.name)
    p = Path(spec)
    if p.is_file() and p.suffix == ".json":
        return "config", str(p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise NotFound(f"model {spec}: a directory without config.json is not a HF model directory")
        return "dir", str(p)
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise NotFound(f"model {spec!r}: no such file or directory (model.name in the config)")
    return "hub", spec


def hub_error(what: str, spec: str, e: Exception) -> ModelError:
    reason = " ".join(str(e).split())  # transformers' messages span lines; ours is one
    return ModelError(
        f"could not load {what} {spec!r} from the Hugging Face hub ({type(e).__name__}: {reason}). Without network "
        f"access, download it elsewhere (`huggingface-cli download {spec} --local-dir DIR`) and point the config "
        f"at DIR, or use a config JSON such as configs/tiny-llama.json to train from scratch.")


def build_model(cfg: RunConfig, name: str | None = None, seed: int | None = None) -> torch.nn.Module:
    """The model of round 0 (float32 master weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, spec = model_source(cfg, name)
    kw = {"trust_remote_code": cfg.model.trust_remote_code}
    if kind == "config":
        mcfg = AutoConfig.from_pretrained(spec, **kw)
        torch.manual_seed(cfg.seed if seed is None else seed)
        return AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32, **kw)
    if kind == "dir":
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32, **kw)
    try:
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32, revision=cfg.model.revision, **kw)
    except OSError as e:
        raise hub_error("model", spec, e) from e


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    spec = cfg.resolve_path(cfg.model.tokenizer) if cfg.model.tokenizer else None
    if not spec:
        kind, spec = model_source(cfg)
        if kind == "config":
            raise ConfigError(f"model.tokenizer is empty but model.name {cfg.model.name!r} is a config JSON with no "
                             f"tokenizer: set model.tokenizer (e.g. data/tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(spec, revision=cfg.model.revision,
                                             trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:
        raise hub_error("tokenizer", spec, e) from e


def check_model_fits(cfg: RunConfig, model: torch.nn.Module, tokenizer=None) -> int:
    """The model's vocabulary size, after checking the tokenizer and data.seq_length fit it (ConfigError if not)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ConfigError(f"{cfg.source}: the tokenizer {cfg.model.tokenizer or cfg.model.name!r} has {len(tokenizer)} "
                          f"tokens but the model's vocabulary is {vocab}: set vocab_size >= {len(tokenizer)} in the "
                          f"model config or use the model's own tokenizer")
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(max_pos, int) and cfg.data.seq_length > max_pos:
        raise ConfigError(f"{cfg.source}: data.seq_length = {cfg.data.seq_length} exceeds the model's "
                          f"max_position_embeddings = {max_pos} ({cfg.model.name}): lower data.seq_length or raise "
                          f"max_position_embeddings in the model config")
    return vocab


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The canonical tensors of a model: named_parameters (tied weights once), detached, sharing storage."""
    return {n: p.detach() for n, p in model.named_parameters()}


def save_model_dir(model: torch.nn.Module, final_dir: Path, tokenizer=None, records: dict | None = None) -> None:
    """save_pretrained into a temp dir (+ the tokenizer, + `records`: {file name: JSON object} written next to the
    weights, so the manifest covers them), write the manifest, then move it into place atomically."""
    def fill(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        for name, obj in (records or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=1))
    publish_dir(final_dir, fill)


def load_weights_into(model: torch.nn.Module, model_dir: Path) -> dict[str, torch.Tensor]:
    """Copy the tensors of a model directory into `model` in place; returns them (float32 CPU copies)."""
    params = params_of(model)
    seen = {}
    for name, t in iter_tensors(model_dir / WEIGHTS):
        if name not in params:
            raise ModelError(f"{model_dir}: tensor {name!r} is not a parameter of the model")
        if tuple(t.shape) != tuple(params[name].shape):
            raise ModelError(f"{model_dir}: {name} has shape {tuple(t.shape)}, model has {tuple(params[name].shape)}")
        params[name].copy_(t)
        seen[name] = t
    missing = set(params) - set(seen)
    if missing:
        raise ModelError(f"{model_dir}: missing tensors {sorted(missing)[:5]}")
    return seen


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentProblem(f"inner.device = {spec!r} but CUDA is not available on {os.uname().nodename}: set "
                                 f"inner.device to auto or cpu (--device cpu), or run on a machine with a GPU")
    return torch.device(spec)
