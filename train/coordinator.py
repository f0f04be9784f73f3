"""The DiLoCo coordinator: prepare the run, then per round wait for deltas, validate, reduce, commit.

Why a coordinator computes the outer step rather than every worker: one writer commits each global model once
(N workers would read N deltas each, N² traffic on NFS, and race to commit); workers only ever write their own
delta and state, so no two processes write the same file. The coordinator is light (streaming, one model of
memory) and can run on any host, including one of the workers'.

Commit of round r + 1 (DESIGN.md invariants):
  rounds/r+1/global/ (temp dir → manifest → rename) and outer_state.safetensors (atomic), then COMMITTED (atomic).
A crash before COMMITTED leaves nothing a reader trusts; rerunning recomputes the same round from the same deltas.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
import torch

from train.config import RunConfig
from train.data import TokenData, prepare_data
from train.inner import evaluate
from train.logs import make_metric_logger
from train.model import (WEIGHTS, build_model, load_tokenizer, load_weights_into, pick_device, save_model_dir)
from train.outer import outer_step_tensor
from train.store import (PROTOCOL_VERSION, RunPaths, atomic_publish_dir, atomic_write_json, ensure_run_manifest,
                         new_tmp_dir, read_json, read_jsonl, verify_manifest, write_manifest)
from train.tensorio import DTYPE_BY_NAME, SequentialReader, StreamingWriter, read_header

log = logging.getLogger("coordinator")


class RejectedDelta(Exception):
    def __init__(self, worker: int, reason: str):
        super().__init__(f"w{worker:03d}: {reason}")
        self.worker, self.reason = worker, reason


def run_identity(cfg: RunConfig) -> dict:
    """What may not change when a run is resumed (rounds, timeouts, lrs may)."""
    return {"model": cfg.model.name, "tokenizer": cfg.model.tokenizer, "dataset": cfg.data.dataset,
            "fake_data": cfg.data.fake_data, "seq_length": cfg.data.seq_length, "num_workers": cfg.outer.num_workers,
            "seed": cfg.seed, "delta_dtype": cfg.outer.delta_dtype}


class Coordinator:
    def __init__(self, cfg: RunConfig, progress: bool = True, monitor=None):
        self.cfg = cfg
        self.paths = RunPaths(cfg.run_dir)
        self.progress = progress and cfg.logging.progress
        self.monitor = monitor or (lambda: None)  # called while waiting (the simulator checks its children)

    # -- setup ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, paths = self.cfg, self.paths
        paths.root.mkdir(parents=True, exist_ok=True)
        ensure_run_manifest(paths, run_identity(cfg))
        atomic_write_json(paths.config_json, cfg.to_dict())
        self.tokenizer = load_tokenizer(cfg) if not cfg.data.fake_data or cfg.model.tokenizer else None
        model = build_model(cfg)
        vocab = model.get_input_embeddings().weight.shape[0]
        if self.tokenizer is not None and len(self.tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary is {vocab}:"
                             f" set vocab_size >= {len(self.tokenizer)} in the model config")
        data_dir = prepare_data(cfg, self.tokenizer, vocab, progress=self.progress)
        atomic_write_json(paths.data / "current.json", {"key": data_dir.name})
        self.data = TokenData.open(data_dir, cfg.data.seq_length, cfg.data.eval_fraction)
        for w in range(cfg.outer.num_workers):
            self.data.shard(w, cfg.outer.num_workers)  # fail now, clearly, if the data is too small
        self.eval_windows = torch.from_numpy(self.data.eval_windows(cfg.eval.batches * cfg.eval.batch_size))
        self.device = pick_device(cfg.inner.device)
        self.model = model.to(self.device)
        if paths.latest_committed() is None:
            log.info("initialising round 0 (%s, %.2fM parameters)", cfg.model.name,
                     sum(p.numel() for p in model.parameters()) / 1e6)
            save_model_dir(model, paths.global_dir(0))
            eval0 = evaluate(self.model, self.eval_windows, cfg.eval.batch_size, self.device, cfg.inner.precision)
            atomic_write_json(paths.committed(0), {"round": 0, "time": time.time(), "protocol": PROTOCOL_VERSION,
                                                   "eval_loss": eval0})
            self.logger = make_metric_logger(cfg.logging.metrics, paths.root, cfg.project_name, cfg.to_dict())
            self.logger.log({"round": 0, "time": time.time(), "eval_loss": eval0, "tokens": 0, "inner_steps": 0})
            log.info("round 0: eval loss of the initial model %.4f", eval0)
        else:
            self.logger = make_metric_logger(cfg.logging.metrics, paths.root, cfg.project_name, cfg.to_dict())
        self.names = self._param_order(0)

    def _param_order(self, r: int) -> list[str]:
        header, _ = read_header(self.paths.global_dir(r) / WEIGHTS)
        return sorted(header, key=lambda k: header[k]["data_offsets"][0])

    # -- waiting for deltas ---------------------------------------------------------------------------------------
    def arrived(self, r: int) -> list[int]:
        return [w for w in range(self.cfg.outer.num_workers) if self.paths.delta_meta(r, w).is_file()]

    def wait_for_deltas(self, r: int) -> list[int]:
        """Block until every worker's delta of round r arrived, or the timeout passed with >= min_workers."""
        from tqdm import tqdm

        oc = self.cfg.outer
        N, H = oc.num_workers, oc.local_steps
        t0 = time.monotonic()
        bar = tqdm(total=N * H, desc=f"round {r + 1}/{oc.rounds} inner steps", unit="step", leave=False,
                   disable=not self.progress, dynamic_ncols=True)
        warned, shown = False, -1
        while True:
            self.monitor()
            got = self.arrived(r)
            done_steps = min(N * H, sum(H if w in got else self._worker_step(w, r) for w in range(N)))
            if done_steps != bar.n or len(got) != shown:
                bar.n, shown = done_steps, len(got)
                bar.set_postfix_str(f"deltas {len(got)}/{N}")  # refreshes the bar
            if len(got) == N:
                break
            waited = time.monotonic() - t0
            if waited >= oc.round_timeout_s:
                if len(got) >= oc.min_workers:
                    missing = [w for w in range(N) if w not in got]
                    log.warning("round %d: timeout after %.0fs; going on with %d/%d deltas, missing workers %s",
                                r, waited, len(got), N, missing)
                    break
                if not warned:
                    log.warning("round %d: %.0fs and only %d deltas (min_workers = %d): still waiting", r, waited,
                                len(got), oc.min_workers)
                    warned = True
            time.sleep(oc.poll_interval_s)
        bar.close()
        return got

    def _worker_step(self, w: int, r: int) -> int:
        try:
            p = read_json(self.paths.progress(w))
        except (OSError, ValueError):
            return 0
        return int(p.get("step", 0)) if p.get("round") == r and p.get("status") == "training" else 0

    # -- validation -----------------------------------------------------------------------------------------------
    def check_sidecar(self, r: int, w: int) -> dict:
        """Cheap checks before reading tensors: sidecar fields, round, worker, size, header shapes and dtypes."""
        try:
            meta = read_json(self.paths.delta_meta(r, w))
        except (OSError, ValueError) as e:
            raise RejectedDelta(w, f"unreadable sidecar ({e})")
        for key in ("round", "worker", "tokens", "sha256", "bytes", "inner_steps", "loss"):
            if key not in meta:
                raise RejectedDelta(w, f"sidecar lacks {key!r}")
        if meta["round"] != r:
            raise RejectedDelta(w, f"sidecar says round {meta['round']}, expected {r}")
        if meta["worker"] != w:
            raise RejectedDelta(w, f"sidecar says worker {meta['worker']}, file belongs to worker {w}")
        if meta.get("protocol") != PROTOCOL_VERSION:
            raise RejectedDelta(w, f"protocol {meta.get('protocol')}, expected {PROTOCOL_VERSION}")
        if not isinstance(meta["tokens"], (int, float)) or meta["tokens"] <= 0:
            raise RejectedDelta(w, f"tokens = {meta['tokens']!r} (must be > 0)")
        f = self.paths.delta_file(r, w)
        if not f.is_file():
            raise RejectedDelta(w, "sidecar present but the delta file is missing")
        if f.stat().st_size != meta["bytes"]:
            raise RejectedDelta(w, f"file has {f.stat().st_size} bytes, sidecar says {meta['bytes']}")
        try:
            header, _ = read_header(f)
        except (ValueError, OSError) as e:
            raise RejectedDelta(w, f"not a safetensors file ({e})")
        expect = read_header(self.paths.global_dir(r) / WEIGHTS)[0]
        if set(header) != set(expect):
            diff = sorted(set(header) ^ set(expect))
            raise RejectedDelta(w, f"tensor names differ from the global model (e.g. {diff[:3]})")
        want = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[
            DTYPE_BY_NAME[self.cfg.outer.delta_dtype]]
        for name, info in header.items():
            if info["shape"] != expect[name]["shape"]:
                raise RejectedDelta(w, f"{name}: shape {info['shape']}, global model has {expect[name]['shape']}")
            if info["dtype"] != want:
                raise RejectedDelta(w, f"{name}: dtype {info['dtype']}, expected {want} (outer.delta_dtype)")
        return meta

    # -- the outer step, streaming --------------------------------------------------------------------------------
    def reduce(self, r: int, workers: list[int], metas: dict[int, dict]) -> dict:
        """Stream θ_r, m_r and the deltas tensor by tensor; write θ_{r+1}, m_{r+1} to temp files. Raises
        RejectedDelta when a delta turns out non-finite or its bytes do not match the sidecar's sha256."""
        cfg, paths = self.cfg, self.paths
        oc = cfg.outer
        weights = [float(metas[w]["tokens"]) if oc.token_weighted else 1.0 for w in workers]
        total = sum(weights)
        g_reader = SequentialReader(paths.global_dir(r) / WEIGHTS, hash_bytes=False)
        m_path = paths.outer_state(r)
        m_reader = SequentialReader(m_path, hash_bytes=False) if m_path.is_file() else None
        d_readers = {w: SequentialReader(paths.delta_file(r, w)) for w in workers}
        names = g_reader.names_in_order
        for w, rd in d_readers.items():
            if rd.names_in_order != names:
                raise RejectedDelta(w, "tensors are not stored in the global model's order")
        specs = {n: (g_reader.dtype_of(n), tuple(g_reader.header[n]["shape"])) for n in names}
        m_specs = {n: (torch.float32, s) for n, (_, s) in specs.items()}
        new_dir = paths.global_dir(r + 1)
        tmp_dir = new_tmp_dir(new_dir)
        bytes_read = sum(p.stat().st_size for p in [g_reader.path] + [d.path for d in d_readers.values()]) + (
            m_path.stat().st_size if m_reader else 0)
        try:
            for fname in ("config.json", "generation_config.json"):
                if (paths.global_dir(r) / fname).is_file():
                    shutil.copy2(paths.global_dir(r) / fname, tmp_dir / fname)
            with StreamingWriter(tmp_dir / WEIGHTS, specs, {"format": "pt"}) as pw, \
                    StreamingWriter(paths.outer_state(r + 1), m_specs, {"round": str(r + 1)}) as mw:
                for n in names:
                    theta = g_reader.read(n)
                    mom = m_reader.read(n) if m_reader else None
                    grad, ds = None, {}
                    for w, wt in zip(workers, weights):
                        ds[w] = d = d_readers[w].read(n)
                        grad = d.to(torch.float32, copy=True).mul_(wt / total) if grad is None else \
                            grad.add_(d.to(torch.float32), alpha=wt / total)
                    # NaN/inf in any delta makes the weighted sum non-finite: one cheap screen per tensor,
                    # the per-worker check only when it trips (a finite overflow of the sum is not a rejection).
                    if not torch.isfinite(grad.sum()):
                        for w in workers:
                            if not torch.isfinite(ds[w]).all():
                                raise RejectedDelta(w, f"{n}: non-finite values (NaN/inf)")
                        raise RejectedDelta(workers[0], f"{n}: the averaged delta overflows float32")
                    new, buf = outer_step_tensor(theta, grad, mom, oc.lr, oc.momentum, oc.nesterov)
                    pw.write(n, new)
                    mw.write(n, buf)
                for w, rd in d_readers.items():
                    if rd.finish() != metas[w]["sha256"]:
                        raise RejectedDelta(w, "sha256 of the file differs from its sidecar (torn or corrupt)")
                    rd.close()
            write_manifest(tmp_dir, hashes={WEIGHTS: pw.sha256})
            atomic_publish_dir(tmp_dir, new_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            paths.outer_state(r + 1).unlink(missing_ok=True)
            raise
        finally:
            for rd in [g_reader, *d_readers.values()] + ([m_reader] if m_reader else []):
                rd.close()
        bytes_written = pw.nbytes + mw.nbytes
        return {"bytes_read": bytes_read, "bytes_written": bytes_written}

    # -- one round ------------------------------------------------------------------------------------------------
    def run_round(self, r: int) -> dict:
        cfg, paths, oc = self.cfg, self.paths, self.cfg.outer
        t0 = time.perf_counter()
        workers = self.wait_for_deltas(r)
        t_wait = time.perf_counter() - t0
        rejected: dict[int, str] = {}
        metas: dict[int, dict] = {}
        for w in workers:
            try:
                metas[w] = self.check_sidecar(r, w)
            except RejectedDelta as e:
                rejected[w] = e.reason
                log.error("round %d: rejected delta of worker %d: %s", r, w, e.reason)
        while True:
            ok = [w for w in workers if w not in rejected]
            if len(ok) < oc.min_workers:
                raise RuntimeError(f"round {r}: only {len(ok)} valid deltas (min_workers = {oc.min_workers}); "
                                   f"rejected: {rejected}. Fix the workers and rerun: the run resumes here.")
            t1 = time.perf_counter()
            try:
                io = self.reduce(r, ok, metas)
                break
            except RejectedDelta as e:
                rejected[e.worker] = e.reason
                log.error("round %d: rejected delta of worker %d: %s", r, e.worker, e.reason)
        t_reduce = time.perf_counter() - t1
        t2 = time.perf_counter()
        eval_loss = float("nan")
        if (r + 1) % cfg.eval.every == 0 or r + 1 == oc.rounds:
            load_weights_into(self.model, paths.global_dir(r + 1))
            eval_loss = evaluate(self.model, self.eval_windows, cfg.eval.batch_size, self.device,
                                 cfg.inner.precision)
        t_eval = time.perf_counter() - t2
        missing = [w for w in range(oc.num_workers) if w not in workers]
        prev = self._last_metrics()
        tokens_round = sum(metas[w]["tokens"] for w in ok)
        record = {
            "round": r + 1, "time": time.time(), "eval_loss": eval_loss,
            "train_loss": sum(metas[w]["loss"] * metas[w]["tokens"] for w in ok) / tokens_round,
            "worker_loss": {f"w{w:03d}": metas[w]["loss"] for w in ok},
            "tokens": (prev.get("tokens", 0) if prev else 0) + tokens_round,
            "inner_steps": (prev.get("inner_steps", 0) if prev else 0) + oc.local_steps,
            "workers_used": ok, "missing": missing, "rejected": {f"w{w:03d}": why for w, why in rejected.items()},
            "bytes_read": io["bytes_read"], "bytes_written": io["bytes_written"],
            "bytes_deltas": sum(metas[w]["bytes"] for w in ok),
            "wait_s": round(t_wait, 3), "reduce_s": round(t_reduce, 3), "eval_s": round(t_eval, 3),
        }
        t3 = time.perf_counter()
        atomic_write_json(paths.committed(r + 1), {"round": r + 1, "time": time.time(), "workers": ok,
                                                   "missing": missing, "rejected": record["rejected"],
                                                   "eval_loss": None if math.isnan(eval_loss) else eval_loss})
        record["commit_s"] = round(time.perf_counter() - t3, 3)
        self.logger.log(record)
        self.cleanup(r + 1)
        return record

    def _last_metrics(self) -> dict | None:
        recs = read_jsonl(self.paths.metrics)
        return recs[-1] if recs else None

    def cleanup(self, latest: int) -> None:
        """Delete rounds older than the last `keep_rounds` committed ones (θ_0 stays: it is the run's template)."""
        keep = self.cfg.outer.keep_rounds
        for r in self.paths.committed_rounds():
            if r <= latest - keep and r != 0:
                d = self.paths.round_dir(r)
                trash = d.with_name(f".{d.name}.deleting")
                try:
                    d.rename(trash)
                    shutil.rmtree(trash, ignore_errors=True)
                except OSError:
                    pass
            elif r == 0 and latest - keep >= 0:
                # θ_0 stays: workers build the architecture from its config; its deltas can go.
                shutil.rmtree(self.paths.deltas_dir(0), ignore_errors=True)

    # -- the whole run --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from tqdm import tqdm

        self.setup()
        cfg, paths = self.cfg, self.paths
        start = paths.latest_committed()
        if start:
            log.info("resuming at round %d of %d (committed state in %s)", start, cfg.outer.rounds, paths.root)
        bar = tqdm(total=cfg.outer.rounds, initial=min(start, cfg.outer.rounds), desc="DiLoCo rounds",
                   unit="round", disable=not self.progress, dynamic_ncols=True)
        last = None
        for r in range(start, cfg.outer.rounds):
            rec = self.run_round(r)
            last = rec
            bar.update(1)
            bar.set_postfix(train=f"{rec['train_loss']:.3f}", eval=f"{rec['eval_loss']:.3f}")
            log.info("round %d committed: train loss %.4f, eval loss %.4f, %d deltas%s", r + 1, rec["train_loss"],
                     rec["eval_loss"], len(rec["workers_used"]),
                     f", missing {rec['missing']}" if rec["missing"] else "")
        bar.close()
        self.finalize()
        self.logger.close()
        return last or (self._last_metrics() or {})

    def finalize(self) -> None:
        """final/ = the last global model + tokenizer (from_pretrained-loadable), and loss.png."""
        cfg, paths = self.cfg, self.paths
        last = paths.latest_committed()
        src = paths.global_dir(last)
        verify_manifest(src)
        tmp = new_tmp_dir(paths.final)
        for f in src.iterdir():
            if f.is_file() and f.name != "MANIFEST.json":
                shutil.copy2(f, tmp / f.name)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(tmp))
        write_manifest(tmp)
        atomic_publish_dir(tmp, paths.final)
        if self.tokenizer is not None:
            log.info("sample from the final model: %r", self.sample(paths.final))
        if cfg.logging.plot:
            from train.plot import plot_losses
            plot_losses(read_jsonl(paths.metrics), paths.plot, title=f"{cfg.project_name}: DiLoCo")
        log.info("final model in %s", paths.final)


    def sample(self, model_dir, prompt: str = "\n", tokens: int = 40) -> str:
        """A short greedy-free sample (top-k 40, seeded) to show the model generates text."""
        load_weights_into(self.model, model_dir)
        self.model.eval()
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
        torch.manual_seed(self.cfg.seed)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=tokens, do_sample=True, top_k=40,
                                      pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.decode(out[0][ids.shape[1]:], skip_special_tokens=True)


def config_summary(cfg: RunConfig) -> str:
    oc = cfg.outer
    return (f"{cfg.project_name}: {oc.num_workers} workers x {oc.rounds} rounds x H={oc.local_steps}, outer lr "
            f"{oc.lr} momentum {oc.momentum}{' nesterov' if oc.nesterov else ''}, model {cfg.model.name}, data "
            f"{'fake' if cfg.data.fake_data else cfg.data.dataset} -> {cfg.run_dir}")

