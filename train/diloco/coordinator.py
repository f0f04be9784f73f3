"""The DiLoCo coordinator: prepare the run, then per round wait for deltas, validate, reduce, commit.

Why a coordinator computes the outer step rather than every worker: one writer commits each global model once
(N workers would read N deltas each, N² traffic on NFS, and race to commit); workers only ever write their own
delta and state, so no two processes write the same file. The coordinator is light (streaming, one model of
memory) and can run on any host, including one of the workers'.

Validation, the streaming reduce and the commit live in train/exchange/reduce.py (shared with DiLoCoOptimizer's in-loop
reducer); this module adds the run around them: setup, waiting with progress, evaluation, metrics, final model.
"""
from __future__ import annotations

import logging
import math
import shutil
import time

import torch

from train.core.config import RunConfig
from train.core.data import TokenData, prepare_data
from train.core.inner import evaluate
from train.core.logs import make_metric_logger
from train.core.model import (build_model, check_model_fits, load_tokenizer, load_weights_into, pick_device,
                              save_model_dir)
from train.exchange.accumulate import Accumulator
from train.exchange.master import OuterMaster
from train.exchange.membership import Membership
from train.exchange.protocol import RejectedDelta, check_sidecar, commit, round_record
from train.exchange.reduce import arrived, prune_rounds
from train.core.store import (
    PROTOCOL_VERSION,
    RunPaths,
    atomic_publish_dir,
    atomic_write_json,
    ensure_run_manifest,
    exclusive_lock,
    new_tmp_dir,
    prepare_run_dir,
    read_json,
    read_jsonl,
    verify_manifest,
    write_manifest,
)

log = logging.getLogger("coordinator")


def run_identity(cfg: RunConfig) -> dict:
    """What may not change when a run is resumed (rounds, timeouts, lrs may)."""
    return {"model": cfg.model.name, "tokenizer": cfg.model.tokenizer, "dataset": cfg.data.dataset,
            "fake_data": cfg.data.fake_data, "seq_length": cfg.data.seq_length, "num_workers": cfg.outer.num_workers,
            "seed": cfg.seed, "delta_dtype": cfg.outer.delta_dtype,
            **({"compression": cfg.outer.compression, "block_size": cfg.outer.block_size}
               if cfg.outer.compression != "none" else {})}


class Coordinator:
    def __init__(self, cfg: RunConfig, progress: bool = True, monitor=None):
        self.cfg = cfg
        self.paths = RunPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        self.progress = progress and cfg.logging.progress
        self.monitor = monitor or (lambda: None)  # called while waiting (the simulator checks its children)

    # -- setup ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, paths = self.cfg, self.paths
        # one coordinator per run: a second one (a forgotten `diloco.py`, a second launch) would race on commits
        self._lock_f = exclusive_lock(paths.root / "coordinator.lock", "the coordinator")
        # every check a user can fail comes before the run's identity is written (a fixed config then starts clean)
        self.tokenizer = load_tokenizer(cfg) if not cfg.data.fake_data or cfg.model.tokenizer else None
        model = build_model(cfg)
        vocab = check_model_fits(cfg, model, self.tokenizer)
        ensure_run_manifest(paths, run_identity(cfg))
        atomic_write_json(paths.config_json, cfg.to_dict())
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
        self.membership = Membership(paths, cfg.outer.num_workers, cfg.outer)
        self.master = OuterMaster(paths, cfg.outer, cfg.outer.rounds)
        self.master.resume(paths.latest_committed())
        self.names = self.master.names

    # -- waiting for deltas ---------------------------------------------------------------------------------------
    def arrived(self, r: int) -> list[int]:
        return arrived(self.paths, r, self.cfg.outer.num_workers)

    def collect(self, r: int) -> tuple[Accumulator, dict[int, str], list[int], float]:
        """Wait for round r's deltas and add each as it arrives (train/exchange/accumulate.py), until every worker's
        is in (accepted or rejected) or the timeout passed with >= min_workers accepted.
        Returns (the accumulator, {worker: rejection reason}, missing workers, time of the last arrival)."""
        from tqdm import tqdm

        oc = self.cfg.outer
        N, H = oc.num_workers, oc.local_steps
        acc = self.master.new_accumulator(r)
        rejected: dict[int, str] = {}
        t0 = time.monotonic()
        t_last = time.perf_counter()
        bar = tqdm(total=N * H, desc=f"round {r + 1}/{oc.rounds} inner steps", unit="step", leave=False,
                   disable=not self.progress, dynamic_ncols=True)
        warned, shown = False, -1
        while True:
            self.monitor()
            got = self.arrived(r)
            for w in got:
                if w in acc.metas or w in rejected:
                    continue
                try:
                    acc.add(w, check_sidecar(self.paths, r, w, self.master.delta_codec))
                except RejectedDelta as e:
                    rejected[w] = e.reason
                    log.error("round %d: rejected delta of worker %d: %s", r, w, e.reason)
                t_last = time.perf_counter()
            done_steps = min(N * H, sum(H if w in got else self._worker_step(w, r) for w in range(N)))
            if done_steps != bar.n or len(got) != shown:
                bar.n, shown = done_steps, len(got)
                bar.set_postfix_str(f"deltas {len(got)}/{N}")  # refreshes the bar
            if len(got) == N:
                why = {}
                break
            d = self.membership.poll(set(got))
            if d.close:
                why = d.missing
                log.warning("round %d: %s; going on with %d/%d deltas, missing workers %s (%s)", r, d.why,
                            len(got), N, sorted(d.missing), d.summary())
                break
            if not warned and time.monotonic() - t0 >= oc.round_timeout_s:
                log.warning("round %d: %.0fs and only %d deltas (min_workers = %d): still waiting (%s)", r,
                            time.monotonic() - t0, len(got), oc.min_workers, d.summary())
                warned = True
            time.sleep(oc.poll_interval_s)
        bar.close()
        self.membership.record_round()
        self.missing_why = {f"w{w:03d}": v for w, v in why.items()}
        if len(acc.workers) < oc.min_workers:
            raise RuntimeError(f"round {r}: only {len(acc.workers)} valid deltas (min_workers = {oc.min_workers}); "
                               f"rejected: {rejected}. Fix the workers and rerun: the run resumes here.")
        missing = [w for w in range(N) if w not in got]
        return acc, rejected, missing, t_last

    def _worker_step(self, w: int, r: int) -> int:
        try:
            p = read_json(self.paths.progress(w))
        except (OSError, ValueError):
            return 0
        return int(p.get("step", 0)) if p.get("round") == r and p.get("status") == "training" else 0

    # -- one round ------------------------------------------------------------------------------------------------
    def run_round(self, r: int) -> dict:
        cfg, paths, oc = self.cfg, self.paths, self.cfg.outer
        t0 = time.perf_counter()
        acc, rejected, missing, t_last = self.collect(r)
        t_wait = t_last - t0
        t1 = time.perf_counter()
        try:
            fields = self.master.step(r, acc)
        except BaseException:
            self.master.discard_uncommitted(r)
            raise
        t_reduce = time.perf_counter() - t1
        t2 = time.perf_counter()
        eval_loss = float("nan")
        if (r + 1) % cfg.eval.every == 0 or r + 1 == oc.rounds:
            self.master.theta.load_into(self.model)
            eval_loss = evaluate(self.model, self.eval_windows, cfg.eval.batch_size, self.device,
                                 cfg.inner.precision)
        t_eval = time.perf_counter() - t2
        ok, metas = acc.workers, acc.metas
        io = {"bytes_read": acc.bytes_read + self.master.theta.take_bytes(), "bytes_written": fields["bytes_written"]}
        record = round_record(r, sorted(ok), metas, rejected, missing, io, self._last_metrics(), eval_loss=eval_loss,
                              wait_s=round(t_wait, 3), reduce_s=round(t_reduce, 3), eval_s=round(t_eval, 3))
        record.update(codec=fields["codec"], checkpoint=fields["checkpoint"], missing_why=self.missing_why)
        t3 = time.perf_counter()
        commit(paths, r + 1, {"workers": ok, "missing": missing, "missing_why": self.missing_why,
                              "rejected": record["rejected"],
                              "eval_loss": None if math.isnan(eval_loss) else eval_loss,
                              **{k: fields[k] for k in ("update_sha256", "theta_sha256", "codec", "checkpoint")
                                 if k in fields}})
        record["commit_s"] = round(time.perf_counter() - t3, 3)
        record["tail_s"] = round(time.perf_counter() - t_last, 3)  # last arrival -> committed
        self.logger.log(record)
        self.cleanup(r + 1)
        return record

    def _last_metrics(self) -> dict | None:
        recs = read_jsonl(self.paths.metrics)
        return recs[-1] if recs else None

    def cleanup(self, latest: int) -> None:
        """Delete rounds older than the last `keep_rounds` committed ones (θ_0 stays: it is the run's template)."""
        # delayed overlap: workers start a segment from θ_{r−1} while round r is open: keep one round more
        prune_rounds(self.paths, latest, self.cfg.outer.keep_rounds + (self.cfg.outer.overlap == "delayed"))

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
        self.close()
        return last or (self._last_metrics() or {})

    def close(self) -> None:
        """Give up the coordinator role (its lock), as the end of the process does."""
        if getattr(self, "_lock_f", None) is not None:
            self._lock_f.close()
            self._lock_f = None

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
            from train.core.plot import plot_losses
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

