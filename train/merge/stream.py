"""Merges of Hugging Face model directories on disk, streaming: peak memory stays near one tensor per input.

    check_compatible([dir_a, dir_b], base_model_dir)   # headers + config only; MergeError before any tensor read
    merge_model_dirs(Recipe("ties", density=0.5), [dir_a, dir_b], out_dir, base_model_dir=base)

Reads: a model directory holds model.safetensors, or shards listed in model.safetensors.index.json. Tensors are read
chunk by chunk (train.merge.methods.CHUNK elements) with os.preadv into buffers we own, deliberately not through
safe_open's memory map: touched pages of a mapped file count in the process's RSS until the map closes
(reclaimable page cache, but what ru_maxrss and schedulers see); pread leaves those bytes in the page cache only.
Working memory: the output tensor plus a few chunks per input, plus what glibc's heap keeps after frees. A ties
merge of three 150 MB or three 300 MB models (largest tensor 16 MB) grows RSS by ~100-110 MB either way, ~60 MB live;
mallopt(M_MMAP_THRESHOLD, 1 MB) cut the rest away but made a SmolLM2-135M ties merge 1.7x slower (page faults),
so it is not done. mmap-reading the same 150 MB models instead grew RSS by ~500 MB.
Writes: train.core.tensorio.StreamingWriter into a temp directory, MANIFEST.json, then one atomic rename
(train.core.store).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch

from train.merge.crossover import TIED, count_layers
from train.merge import methods as merge_methods
from train.merge.methods import MergeError, Recipe, check_density, merge_tensor
from train.core.store import atomic_publish_dir, new_tmp_dir, write_manifest
from train.core.tensorio import TORCH_DTYPES, StreamingWriter, read_header
from train.core.threads import intra_op_threads

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# small files copied from the first model next to the merged weights (config.json always)
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


class ModelFiles:
    """The weights of one HF model directory: every tensor's file, dtype, shape and byte offset, from the
    safetensors headers alone; `source(name)` reads flat element ranges of one tensor with pread."""

    def __init__(self, model_dir: Path, label: str):
        self.dir, self.label = Path(model_dir), label
        if not (self.dir / "config.json").is_file():
            raise MergeError(f"{label} ({self.dir}): no config.json — not a Hugging Face model directory")
        self.config = json.loads((self.dir / "config.json").read_text())
        if (self.dir / WEIGHTS).is_file():
            files = [self.dir / WEIGHTS]
        elif (self.dir / INDEX).is_file():
            wmap = json.loads((self.dir / INDEX).read_text()).get("weight_map", {})
            files = [self.dir / f for f in dict.fromkeys(wmap.values())]
        else:
            raise MergeError(f"{label} ({self.dir}): neither {WEIGHTS} nor {INDEX}")
        self.info: dict[str, tuple[Path, torch.dtype, tuple, int, int]] = {}  # name -> file, dtype, shape, off, nbytes
        self.order: list[str] = []
        for f in files:
            if not f.is_file():
                raise MergeError(f"{label} ({self.dir}): shard {f.name} listed in {INDEX} is missing")
            try:
                header, _ = read_header(f)
            except ValueError as e:
                raise MergeError(f"{label} ({self.dir}): {e}") from e
            with open(f, "rb") as fh:
                base = 8 + int.from_bytes(fh.read(8), "little")
            size = f.stat().st_size
            for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
                h = header[name]
                if h["dtype"] not in {"F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"}:
                    raise MergeError(f"{label} ({f}): tensor {name!r} has unsupported dtype {h['dtype']}")
                s, e = h["data_offsets"]
                if base + e > size:
                    raise MergeError(f"{label} ({f}): tensor {name!r} lies past the end of the file (truncated?)")
                self.info[name] = (f, TORCH_DTYPES[h["dtype"]], tuple(h["shape"]), base + s, e - s)
                self.order.append(name)
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    @property
    def tied(self):
        return self.config.get("tie_word_embeddings")

    def resolve(self, name: str) -> str | None:
        if name in self.info:
            return name
        return TIED[name] if name in TIED and TIED[name] in self.info else None

    def source(self, name: str):
        f, dtype, _, off, _ = self.info[self.resolve(name)]
        item = torch.empty((), dtype=dtype).element_size()
        fd = self._fds.get(f)
        if fd is None:
            fd = self._fds[f] = os.open(f, os.O_RDONLY)

        raw: list = []  # one buffer per source, reused chunk after chunk (no allocation churn, see above)
        f32: list = []

        def read(start: int, stop: int) -> torch.Tensor:
            n = stop - start
            if not raw or len(raw[0]) < n * item:
                raw[:] = [bytearray(n * item)]
            view, pos = memoryview(raw[0])[: n * item], off + start * item
            while view:
                got = os.preadv(fd, [view], pos)
                if got <= 0:
                    raise MergeError(f"{self.label} ({f}): unexpected end of file in {name!r}")
                view, pos = view[got:], pos + got
            self.bytes_read += n * item
            if n == 0:
                return torch.empty(0, dtype=torch.float32)
            t = torch.frombuffer(raw[0], dtype=dtype, count=n)
            if dtype == torch.float32:
                return t
            if not f32 or f32[0].numel() < n:
                f32[:] = [torch.empty(n, dtype=torch.float32)]
            return f32[0][:n].copy_(t)
        return read

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _tokenizer_vocab(model_dir: Path) -> int | None:
    p = model_dir / "tokenizer.json"
    if not p.is_file():
        return None
    tok = json.loads(p.read_text())
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids |= {a["id"] for a in tok.get("added_tokens") or []}
    return len(ids)


def _open_all(model_dirs: Sequence[Path], base_model_dir: Path | None) -> tuple[list[ModelFiles], ModelFiles | None]:
    if not model_dirs:
        raise MergeError("no models to merge")
    models = [ModelFiles(d, f"model {i}") for i, d in enumerate(model_dirs)]
    base = ModelFiles(base_model_dir, "base model") if base_model_dir is not None else None
    first = models[0]
    for m in models[1:] + ([base] if base else []):
        where = f"{m.label} ({m.dir}) vs model 0 ({first.dir})"
        for key in ("model_type", "architectures", "vocab_size", "tie_word_embeddings"):
            if m.config.get(key) != first.config.get(key):
                raise MergeError(f"{where}: config.json field {key!r} differs: {m.config.get(key)!r} vs "
                                 f"{first.config.get(key)!r} (only models of one architecture and vocabulary merge)")
        tv, tv0 = _tokenizer_vocab(m.dir), _tokenizer_vocab(first.dir)
        if tv is not None and tv0 is not None and tv != tv0:
            raise MergeError(f"{where}: tokenizer.json vocabulary sizes differ: {tv} vs {tv0}")
        for name in first.order:
            r = m.resolve(name)
            if r is None:
                raise MergeError(f"{where}: tensor {name!r} is missing")
            shape, shape0 = m.info[r][2], first.info[name][2]
            if shape != shape0:
                raise MergeError(f"{where}: tensor {name!r} has shape {list(shape)} vs {list(shape0)}")
        used = {m.resolve(n) for n in first.order}
        extra = [n for n in m.order if n not in used and not (n in TIED and first.resolve(n))]
        if extra:
            raise MergeError(f"{where}: tensor(s) {extra[:5]} are not in model 0")
    return models, base


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in t: min and max of each chunk are finite (aminmax propagates NaN). A reduction allocates
    nothing, where torch.isfinite(t).all() on a whole 113 MB embedding peaked at ~2x the tensor."""
    flat = t.reshape(-1)
    step = merge_methods.CHUNK
    for s in range(0, flat.numel(), step):
        lo, hi = torch.aminmax(flat[s:s + step].float())
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            return False
    return True


def check_compatible(model_dirs: Sequence[Path], base_model_dir: Path | None = None) -> dict:
    """Check that the models (and the base) merge: same model_type / architectures / vocab_size /
    tie_word_embeddings, same tokenizer vocabulary size where tokenizer.json is present, the same tensor names
    (tied lm_head resolved) with the same shapes. Reads config.json and safetensors headers only; raises MergeError
    naming the model, its path and the field or tensor. Returns a summary of model 0 (the output's layout)."""
    models, base = _open_all([Path(d) for d in model_dirs], None if base_model_dir is None else Path(base_model_dir))
    first = models[0]
    return {"models": [str(m.dir) for m in models], "base": None if base is None else str(base.dir),
            "names": list(first.order), "shapes": {n: list(first.info[n][2]) for n in first.order},
            "dtypes": {n: str(first.info[n][1]).replace("torch.", "") for n in first.order},
            "bytes": sum(first.info[n][4] for n in first.order), "num_layers": count_layers(first.order),
            "model_type": first.config.get("model_type"), "tie_word_embeddings": first.tied}


def merge_model_dirs(recipe: Recipe, model_dirs: Sequence[Path], out_dir: Path, base_model_dir: Path | None = None,
                     dtype: torch.dtype | None = None, progress: bool = False, threads: int | None = 1) -> dict:
    """Merge HF model directories into out_dir (model.safetensors with model 0's names and order, config.json and
    tokenizer files copied from model 0, MANIFEST.json), streaming tensor by tensor; out_dir appears atomically.
    `dtype` overrides the output dtype of floating tensors (default: model 0's). Everything is checked before any
    tensor is read. `threads`: torch intra-op threads while merging (None: leave torch's setting). One is the
    default because the chunk kernels are memory-bound and share the CPU with the writer's hashing thread: on 2
    shared cores a SmolLM2-135M slerp took 4.6 s with 1 thread and 20.6 s with 2 (OpenMP workers spin-waiting on
    preempted peers). Returns {bytes_read, bytes_written, sha256, seconds, finite}."""
    t0 = time.perf_counter()
    model_dirs = [Path(d) for d in model_dirs]
    use_base = recipe.method in Recipe.NEEDS_BASE
    recipe.check_models(len(model_dirs), base_model_dir is not None)
    models, base = _open_all(model_dirs, Path(base_model_dir) if base_model_dir is not None and use_base else None)
    first, out_dir = models[0], Path(out_dir)
    specs = {}
    for n in first.order:
        dt = first.info[n][1]
        specs[n] = (dtype if dtype is not None and dt.is_floating_point else dt, first.info[n][2])
        if dt.is_floating_point:  # a ties density that keeps nothing of a small tensor: refused before any read
            check_density(recipe, n, torch.Size(first.info[n][2]).numel())
    num_layers = count_layers(first.order)
    tmp = new_tmp_dir(out_dir)
    finite = True
    try:
        config = dict(first.config)
        if dtype is not None:
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = str(dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for fname in SIDE_FILES:
            if (first.dir / fname).is_file():
                shutil.copy2(first.dir / fname, tmp / fname)
        names = first.order
        if progress:
            from tqdm import tqdm
            names = tqdm(names, desc=f"merge ({recipe.method})", unit="tensor")
        with intra_op_threads(threads), StreamingWriter(tmp / WEIGHTS, specs, metadata={"format": "pt"}) as w:
            for name in names:
                out_dtype, shape = specs[name]
                numel = torch.Size(shape).numel()
                if not first.info[name][1].is_floating_point:  # integer buffers: model 0's, as they are
                    f, dt, _, off, nb = first.info[name]
                    with open(f, "rb") as fh:
                        fh.seek(off)
                        raw = bytearray(fh.read(nb))
                    t = torch.frombuffer(raw, dtype=dt).reshape(shape) if nb else torch.empty(shape, dtype=dt)
                else:
                    t = merge_tensor(recipe, name, [m.source(name) for m in models],
                                     base.source(name) if use_base else None, numel, shape, out_dtype, num_layers)
                    finite = finite and _all_finite(t)
                w.write(name, t)
                del t
        write_manifest(tmp, hashes={WEIGHTS: w.digest})
        atomic_publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for m in models + ([base] if base else []):
            m.close()
    return {"bytes_read": sum(m.bytes_read for m in models + ([base] if base else [])), "bytes_written": w.nbytes,
            "sha256": w.digest, "seconds": time.perf_counter() - t0, "finite": finite}
