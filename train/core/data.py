"""Data: tokenize once into a memory-mapped token file on BASE_DIR, shard it, batch it, hold out eval windows.

The token cache `BASE_DIR/<project>/data/<key>/tokens.bin` (uint16 or uint32) plus `meta.json` is built once by
the coordinator; `<key>` hashes the dataset spec and the tokenizer, so a changed tokenizer never reuses stale
tokens. Documents are joined with the EOS token.

Windows have seq_length + 1 tokens (inputs and shifted labels) at a stride of seq_length. The last
`eval_fraction` of the tokens is held out; evaluation uses its first `eval.batches * eval.batch_size` windows,
always the same ones. The training windows are split into `num_workers` contiguous, disjoint shards. Worker w
visits its shard in a permutation seeded by (seed, w, epoch); its position is one integer (windows consumed),
saved with the worker state, so a resumed worker neither replays nor skips data.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train.core import sharedfs
from train.core.errors import DataError, EnvironmentProblem, NotFound, TimedOut, UserError
from train.config import RunConfig
from train.core.store import atomic_write_json, read_json, wait_for

log = logging.getLogger("data")

LOCAL_EXTS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _local_files(cfg: RunConfig) -> list[str] | None:
    """The local files a dataset spec names, or None when it is not a local path (a hub name)."""
    spec = cfg.resolve_path(cfg.data.dataset)
    if any(ch in spec for ch in "*?["):
        files = sorted(glob.glob(spec, recursive=True))
        if not files:
            raise NotFound(f"data.dataset = {cfg.data.dataset!r}: the pattern matches no file")
    elif os.path.isdir(spec):
        files = sorted(str(p) for p in Path(spec).rglob("*") if p.suffix in LOCAL_EXTS and p.is_file())
        if not files:
            raise NotFound(f"data.dataset = {spec}: no {'/'.join(LOCAL_EXTS)} files in this folder")
    elif os.path.isfile(spec):
        files = [spec]
    elif spec.startswith((".", "/", "~")) or Path(spec).suffix in LOCAL_EXTS:
        raise NotFound(f"data.dataset = {cfg.data.dataset!r}: no such file or folder")
    else:
        return None
    kinds = {LOCAL_EXTS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(f"data.dataset = {cfg.data.dataset!r}: mixes or contains unsupported file types "
                         f"({sorted({Path(f).suffix for f in files})}); use one of {sorted(LOCAL_EXTS)}")
    return files


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()[:16]


def cache_key(cfg: RunConfig, tok_fp: str, vocab_size: int) -> str:
    d = cfg.data
    if d.fake_data or d.dataset == "fake":
        spec = {"fake": True, "n": d.fake_tokens, "vocab": vocab_size, "seed": cfg.seed}
    else:
        files = _local_files(cfg)
        stamp = [(Path(f).name, os.path.getsize(f)) for f in files] if files else None
        spec = {"dataset": d.dataset if files is None else stamp, "config": d.dataset_config, "split": d.split,
                "field": d.text_field, "max_tokens": d.max_tokens, "tokenizer": tok_fp}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def iter_texts(cfg: RunConfig):
    from datasets import load_dataset

    d = cfg.data
    files = _local_files(cfg)
    if files is not None:
        kind = LOCAL_EXTS[Path(files[0]).suffix]
        kw = {"sample_by": "document"} if kind == "text" else {}
        ds = load_dataset(kind, data_files=files, split="train", cache_dir=str(cfg.run_dir / "data" / "hf_cache"),
                          **kw)
    else:
        try:
            ds = load_dataset(d.dataset, d.dataset_config, split=d.split, streaming=True)
        except Exception as e:
            raise DataError(f"could not open dataset {d.dataset!r} ({type(e).__name__}: {' '.join(str(e).split())}). "
                            f"Without network "
                               f"access, point data.dataset at local .txt/.jsonl/.parquet files.") from e
    field = "text" if files is not None and LOCAL_EXTS[Path(files[0]).suffix] == "text" else d.text_field
    for row in ds:
        if field not in row:
            raise DataError(f"data.text_field = {field!r} is not a column of {d.dataset!r} (columns: {list(row)})")
        yield row[field]


def build_token_cache(cfg: RunConfig, tokenizer, vocab_size: int, out_dir: Path, progress: bool = True) -> dict:
    """Tokenize the dataset (or draw fake tokens) into out_dir/tokens.bin + meta.json, atomically."""
    from tqdm import tqdm

    sharedfs.makedirs(out_dir)
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    tmp = out_dir / f".tokens.bin.tmp-{os.getpid()}"
    n = 0
    d = cfg.data
    with sharedfs.SequentialFile(tmp) as f:
        if d.fake_data or d.dataset == "fake":
            rng = np.random.default_rng(cfg.seed)
            arr = rng.integers(0, vocab_size, size=d.fake_tokens, dtype=np.int64).astype(dtype)
            f.write(arr.tobytes())
            n = len(arr)
        else:
            eos = tokenizer.eos_token_id
            if eos is None:
                raise DataError("the tokenizer has no eos_token; documents could not be separated")
            batch: list[str] = []
            bar = tqdm(desc="tokenizing", unit="tok", unit_scale=True, disable=not progress)

            def flush() -> bool:
                nonlocal n
                ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
                batch.clear()
                for seq in ids:
                    arr = np.asarray(seq + [eos], dtype=dtype)
                    if d.max_tokens and n + len(arr) > d.max_tokens:
                        arr = arr[: d.max_tokens - n]
                    f.write(arr.tobytes())
                    n += len(arr)
                    bar.update(len(arr))
                    if d.max_tokens and n >= d.max_tokens:
                        return True
                return False

            done = False
            for text in iter_texts(cfg):
                if text:
                    batch.append(text)
                if len(batch) >= 64 and (done := flush()):
                    break
            if batch and not done:
                flush()
            bar.close()
    sharedfs.replace(tmp, out_dir / "tokens.bin")
    meta = {"tokens": n, "dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "dataset": d.dataset,
            "fake": bool(d.fake_data or d.dataset == "fake")}
    atomic_write_json(out_dir / "meta.json", meta)  # last: marks the cache complete
    return meta


@dataclass
class TokenData:
    """The token file (read window by window with retried preads) and the window arithmetic (shards, eval)."""
    tokens: np.ndarray
    seq_length: int
    eval_fraction: float

    @classmethod
    def open(cls, cache_dir: Path, seq_length: int, eval_fraction: float) -> "TokenData":
        meta = read_json(cache_dir / "meta.json")
        toks = sharedfs.PreadArray(cache_dir / "tokens.bin", meta["dtype"], meta["tokens"])  # not memmap: see there
        return cls(toks, seq_length, eval_fraction)

    @property
    def n_eval_tokens(self) -> int:
        return int(len(self.tokens) * self.eval_fraction)

    @property
    def n_train_windows(self) -> int:
        return max(0, (len(self.tokens) - self.n_eval_tokens - 1) // self.seq_length)

    def window(self, start: int) -> np.ndarray:
        return np.asarray(self.tokens[start: start + self.seq_length + 1], dtype=np.int64)

    def shard(self, worker: int, num_workers: int) -> tuple[int, int]:
        """[first, last) training-window indices of a worker's disjoint shard."""
        n = self.n_train_windows
        lo, hi = worker * n // num_workers, (worker + 1) * n // num_workers
        if hi <= lo:
            raise DataError(f"the dataset has {n} training windows of {self.seq_length} tokens, too few for "
                             f"{num_workers} workers: use more data or a smaller data.seq_length")
        return lo, hi

    def eval_windows(self, count: int) -> np.ndarray:
        """The fixed held-out windows: (count, seq_length + 1) int64, identical for every evaluation."""
        start = len(self.tokens) - self.n_eval_tokens
        avail = (self.n_eval_tokens - 1) // self.seq_length
        if avail < 1:
            raise DataError(f"the held-out split ({self.n_eval_tokens} tokens) holds no window of "
                             f"{self.seq_length + 1} tokens: raise data.eval_fraction or lower data.seq_length")
        count = min(count, avail)
        return np.stack([self.window(start + i * self.seq_length) for i in range(count)])


class ShardSampler:
    """Deterministic batches from one worker's shard; `position` (windows consumed) is the whole state."""

    def __init__(self, data: TokenData, worker: int, num_workers: int, seed: int, position: int = 0):
        self.data = data
        self.lo, self.hi = data.shard(worker, num_workers)
        self.worker, self.seed = worker, seed
        self.position = position
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.worker, epoch])
            self._perm, self._epoch = rng.permutation(self.hi - self.lo), epoch
        return self._perm

    def next_batch(self, batch_size: int) -> torch.Tensor:
        n = self.hi - self.lo
        rows = []
        for _ in range(batch_size):
            epoch, i = divmod(self.position, n)
            idx = self.lo + int(self._order(epoch)[i])
            rows.append(self.data.window(idx * self.data.seq_length))
            self.position += 1
        return torch.from_numpy(np.stack(rows))


class StreamSampler:
    """Windows of one global stream: epoch e is a seeded permutation of every training window, and stream offset g
    is window perm_{g // n}[g % n]. DiLoCo hands each (round, worker) a disjoint slice of the stream
    (train/exchange/layout.py), so a window is read once per epoch whatever the number of workers, and the data a
    worker reads in a round depends on the round alone (a restart or a replay reads the same windows).

    `begin(offset, count)` points it at a slice; `next_batch` reads from it and refuses to read past its end.
    `begin(..., before=[(offset, count), ...])`: ranges read first, in order (windows a worker carries over from its
    earlier rounds, train/diloco/pace.py); `reads()` and `unread()` say what was and was not read of them all."""

    def __init__(self, data: TokenData, seed: int):
        if data.n_train_windows < 1:
            raise DataError(f"the dataset holds no training window of {data.seq_length + 1} tokens: use more data "
                            f"or a smaller data.seq_length")
        self.data, self.seed = data, seed
        self.position = 0  # the next stream offset
        self.end = 0
        self._ranges: list[tuple[int, int]] = [(0, 0)]  # the slice: (first, end) offsets, read in order
        self._k = 0  # the range being read
        self._epoch, self._perm = -1, None

    def begin(self, offset: int, count: int, before=()) -> None:
        self._ranges = [(int(o), int(o) + int(n)) for o, n in before if n > 0] + [(offset, offset + count)]
        self._k = 0
        self.position, self.end = self._ranges[0]

    def reads(self) -> list[tuple[int, int]]:
        """(first offset, windows read) of each range of the slice, in order (0 for a range not reached)."""
        out = []
        for k, (lo, hi) in enumerate(self._ranges):
            n = hi - lo if k < self._k else (self.position - lo if k == self._k else 0)
            out.append((lo, n))
        return out

    def unread(self) -> list[tuple[int, int]]:
        """(first offset, windows) of what the slice's ranges hold past the last read, in order."""
        ranges = self._ranges
        out = [(self.position, self.end - self.position)] + [(lo, hi - lo) for lo, hi in ranges[self._k + 1:]]
        return [(o, n) for o, n in out if n > 0]

    def window_index(self, g: int) -> int:
        epoch, i = divmod(g, self.data.n_train_windows)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, 0x5EED, epoch])
            self._perm, self._epoch = rng.permutation(self.data.n_train_windows), epoch
        return int(self._perm[i])

    def next_batch(self, batch_size: int) -> torch.Tensor:
        rows, need = [], batch_size
        while need:
            if self.position >= self.end and self._k + 1 < len(self._ranges):
                self._k += 1  # the next range of the slice
                self.position, self.end = self._ranges[self._k]
            take = min(need, self.end - self.position)
            if take <= 0:
                raise DataError(f"stream slice exhausted: {batch_size} windows asked at offset {self.position}, "
                                f"the slice ends at {self.end} (a worker may not read another worker's data)")
            rows += [self.data.window(self.window_index(g) * self.data.seq_length)
                     for g in range(self.position, self.position + take)]
            self.position += take
            need -= take
        return torch.from_numpy(np.stack(rows))


def prepare_data(cfg: RunConfig, tokenizer, vocab_size: int, progress: bool = True) -> Path:
    """Build the token cache if missing (coordinator); returns its folder."""
    key = cache_key(cfg, tokenizer_fingerprint(tokenizer) if tokenizer is not None else "none", vocab_size)
    out = cfg.run_dir / "data" / key
    shared = Path(os.path.expanduser(cfg.data.cache_dir)) / key if cfg.data.cache_dir else None
    if not sharedfs.exists(out / "meta.json") and shared is not None and sharedfs.exists(shared / "meta.json"):
        _copy_cache(shared, out)  # data.cache_dir: tokenized before, by this or another run
        log.info("token cache %s copied from data.cache_dir (%s)", key, shared.parent)
    if not sharedfs.exists(out / "meta.json"):
        # tokenizing calls into `datasets`, whose cache lives on BASE_DIR too: a transient shared-disk error in there
        # starts the (idempotent: temp file + rename) build again rather than ending the run
        try:
            sharedfs.retry("build the token cache in", out,
                           lambda: build_token_cache(cfg, tokenizer, vocab_size, out, progress=progress),
                           transient=sharedfs.is_transient_any, watch=False)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (only a disk error is turned into a user error; the rest re-raised)
            err = _disk_error(e)
            if err is None:
                raise
            where = f" ({err.filename})" if getattr(err, "filename", None) else ""
            raise EnvironmentProblem(
                f"{out}: cannot build the token cache there: {err.strerror or err}{where}. Check that base_dir is on "
                f"a writable disk with space: the token cache and the dataset's own cache "
                f"({cfg.run_dir / 'data' / 'hf_cache'}) live there") from e
        if shared is not None and not sharedfs.exists(shared / "meta.json"):
            try:
                _copy_cache(out, shared)
            except OSError as e:  # the shared cache is a convenience: the run has its own copy
                log.warning("could not leave the token cache in data.cache_dir (%s): %s", shared, e)
    return out


def _copy_cache(src: Path, dst: Path) -> None:
    """Copy a complete token cache (tokens.bin, then meta.json last: what marks it complete), each file atomically,
    so that a reader, or two runs copying at once, never see half of one."""
    sharedfs.makedirs(dst)
    for name in ("tokens.bin", "meta.json"):
        tmp = dst / f".{name}.tmp-{os.getpid()}"
        sharedfs.retry("copy the token cache to", tmp, lambda: shutil.copyfile(src / name, tmp))
        sharedfs.replace(tmp, dst / name)


def _disk_error(e: BaseException) -> OSError | None:
    """The OSError that `e` is, or that `datasets` wrapped into its own error (DatasetGenerationError ... from e)."""
    if isinstance(e, OSError):
        return e
    if not type(e).__module__.startswith("datasets"):
        return None
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def find_data(cfg: RunConfig, timeout: float | None = None) -> Path:
    """The token cache the coordinator recorded in run state (workers wait for it)."""
    pointer = cfg.run_dir / "data" / "current.json"
    got = wait_for(lambda: sharedfs.exists(pointer), timeout, cfg.outer.poll_interval_s)
    if not got:
        raise TimedOut(f"{pointer}: the coordinator has not prepared the data after {timeout:g} s: is it running? "
                       f"(its log: {cfg.run_dir / 'logs' / 'coordinator.log'})")
    return cfg.run_dir / "data" / read_json(pointer)["key"]
