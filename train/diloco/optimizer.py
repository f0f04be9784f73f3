"""`DiLoCoOptimizer`: DiLoCo inside your own training loop, synchronised through the shared BASE_DIR.

    opt = DiLoCoOptimizer(model, base_dir="/nfs/runs", run_id="my-run", worker=rank, num_workers=2,
                          num_inner_steps=50, batch_size=tokens_per_step,
                          inner_optimizer=partial(torch.optim.AdamW, lr=4e-4),
                          outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
    for batch in loader:
        loss = model(batch).loss
        scaler.scale(loss).backward()
        opt.step(scaler=scaler)          # every num_inner_steps: exchange pseudo-gradients, continue from θ_{r+1}
        opt.zero_grad()

The same shape as OpenDiLoCo's `DiLoCoOptimizer` (inner/outer optimizer factories, `num_inner_steps`, `batch_size`,
`scheduler` factory, `averaging_timeout`, `step(scaler=...)`), with the hivemind DHT replaced by BASE_DIR and an
explicit worker id. It speaks the coordinator's protocol (train/core/store.py) under BASE_DIR/<run_id>/:

- Round r: the global parameters θ_r are rounds/rXXXXXX/global/model.safetensors (the named parameters, float32;
  plus config.json when the model is a Hugging Face model, so the folder is from_pretrained-loadable) with its
  MANIFEST.json, outer_state.safetensors, and the COMMITTED marker. Every file appears atomically.
- Every `num_inner_steps` inner steps a worker publishes Δ_w = θ_r − θ_w as rounds/r/deltas/wXXX.safetensors and
  its JSON sidecar (round, worker, inner_steps, tokens = batch_size × steps, loss, sha256, bytes, dtype).
- Who reduces: the worker `reducer` (default 0) — no extra process, so two notebooks or two scripts are a run. It
  waits for the deltas (all, or `min_workers` after `averaging_timeout`), then runs the coordinator's own code
  (train/exchange/reduce.py: the same validation — shape, dtype, round, sha256, finiteness — the same token-weighted
  average
  and the same commit). The other workers wait up to `averaging_timeout` for COMMITTED of r + 1. Then every worker
  copies θ_{r+1} into its parameters in place and goes on; the inner optimizer keeps its state (as in DiLoCo).
- The outer step is the user's outer optimizer, applied by the reducer tensor by tensor to the averaged
  pseudo-gradient (p = θ_r, p.grad = Δ̄, outer_opt.step()). Its per-parameter state (SGD: the momentum buffer)
  is saved as rounds/r/outer_state.safetensors — keyed by parameter name for `momentum_buffer`, which is the
  coordinator's layout, and `name::key` for any other state — and read back every round, so a restarted reducer
  (or a different one) resumes it. With SGD(lr, momentum, nesterov=True) this is exactly the coordinator's step
  (train/exchange/outer.py; tests/e2e/test_diloco_optimizer.py checks). Hyperparameter changes of the outer optimizer
  between restarts (lr schedules) are not persisted.
- Resume: constructing the optimizer again on the same base_dir/run_id continues at the latest committed round
  (its parameters are loaded into the model). The inner optimizer's state and the scheduler are the user's:
  save `opt.state_dict()` with your own checkpoint and pass it to `load_state_dict` after a restart; without it,
  AdamW restarts from zero moments. A worker whose delta of the current round was already published before the
  crash does not publish again: it waits for that round's commit. A worker too slow for `averaging_timeout`
  finds the round committed without it, drops its delta and rejoins at the latest round.
- run.json records the protocol version and an identity (kind, num_workers, reducer, delta dtype, parameter
  names and shapes); joining a run with another identity, or a coordinator run folder, fails with a ProtocolError.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import time
from typing import Any, Callable

import torch

from train.core.errors import NotFound, TimedOut
from train.core.heartbeat import Heartbeat
from train.core.model import WEIGHTS
from train.exchange.protocol import commit, delta_sidecar, publish_sidecar, round_record, write_delta
from train.exchange.reduce import arrived, param_order, prune_rounds, validate_and_reduce
from train.core import sharedfs
from train.core.store import (NO_LOCK, PROTOCOL_VERSION, ProtocolError, append_jsonl, base_path, ensure_run_manifest,
                              exclusive_lock, publish_dir, read_json, read_jsonl, wait_for)
from train.exchange.store import DiLoCoPaths
from train.core.tensorio import DTYPE_BY_NAME, StreamingWriter, iter_tensors

log = logging.getLogger("diloco_optimizer")
KIND = "diloco_optimizer"


def named_params(params: Any) -> dict[str, torch.nn.Parameter]:
    """{name: parameter} from a module, `named_parameters()`, or plain parameters (named param.0000, ...: every
    worker must then pass them in the same order). Shared (tied) tensors appear once."""
    if isinstance(params, torch.nn.Module):
        return dict(params.named_parameters())
    items = list(params)
    if not items:
        raise ValueError("DiLoCoOptimizer: params is empty")
    if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in items):
        out: dict[str, torch.nn.Parameter] = {}
        for name, p in items:
            if name in out:
                raise ValueError(f"DiLoCoOptimizer: parameter name {name!r} appears twice in params")
            out[name] = p
        return out
    if any(isinstance(x, dict) for x in items):
        raise ValueError("DiLoCoOptimizer: param groups (dicts) are not supported as params; pass the model or "
                         "model.named_parameters(), and give per-group options through the inner_optimizer factory")
    seen: set[int] = set()
    uniq = [p for p in items if not (id(p) in seen or seen.add(id(p)))]
    return {f"param.{i:04d}": p for i, p in enumerate(uniq)}


def _state_key(name: str, key: str) -> str:
    return name if key == "momentum_buffer" else f"{name}::{key}"


class DiLoCoOptimizer:
    """Inner optimizer every step, DiLoCo outer step through BASE_DIR every `num_inner_steps` (see the module doc).

    params: the model, `model.named_parameters()`, or `model.parameters()` (parameters only: buffers such as
        BatchNorm statistics stay local to each worker).
    base_dir / run_id: the shared folder and the run's name (the run lives in base_dir/run_id).
    worker / num_workers: this worker's id in 0..num_workers-1 and how many workers the run has.
    num_inner_steps: H, inner steps between synchronisations.
    inner_optimizer / outer_optimizer: factories called with a list of parameters (e.g. functools.partial).
    batch_size: what one step consumes (samples or tokens); tokens of a delta = batch_size x steps (its weight).
    scheduler: optional factory called with the inner optimizer (an LR scheduler); stepped after every step.
    averaging_timeout: seconds the reducer waits for deltas, and the others for the commit.
    min_workers: deltas the reducer needs after the timeout (default num_workers: wait for everyone, then fail).
    """

    def __init__(self, params: Any, *, base_dir: str | os.PathLike, run_id: str, worker: int, num_workers: int,
                 num_inner_steps: int, inner_optimizer: Callable[[list], torch.optim.Optimizer],
                 outer_optimizer: Callable[[list], torch.optim.Optimizer], batch_size: int = 1,
                 scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, averaging_timeout: float = 1800.0,
                 min_workers: int | None = None, reducer: int = 0, delta_dtype: str = "float32",
                 token_weighted: bool = True, keep_rounds: int = 2, poll_interval: float = 0.1):
        _check(num_workers >= 1, "num_workers", num_workers, "must be >= 1")
        _check(0 <= worker < num_workers, "worker", worker, f"must be in 0..{num_workers - 1}")
        _check(0 <= reducer < num_workers, "reducer", reducer, f"must be in 0..{num_workers - 1}")
        _check(num_inner_steps >= 1, "num_inner_steps", num_inner_steps, "must be >= 1")
        _check(batch_size > 0, "batch_size", batch_size, "must be > 0 (it weighs this worker's deltas)")
        _check(averaging_timeout > 0, "averaging_timeout", averaging_timeout, "must be > 0 seconds")
        _check(delta_dtype in DTYPE_BY_NAME, "delta_dtype", delta_dtype, f"must be one of {sorted(DTYPE_BY_NAME)}")
        _check(keep_rounds >= 1, "keep_rounds", keep_rounds, "must be >= 1")
        min_workers = num_workers if min_workers is None else min_workers
        _check(1 <= min_workers <= num_workers, "min_workers", min_workers, f"must be in 1..{num_workers}")
        _check(bool(run_id) and "/" not in str(run_id), "run_id", run_id, "must be a non-empty folder name")
        self.worker, self.num_workers, self.reducer = worker, num_workers, reducer
        self.num_inner_steps, self.batch_size = num_inner_steps, batch_size
        self.averaging_timeout, self.min_workers, self.poll = averaging_timeout, min_workers, poll_interval
        self.delta_dtype, self.token_weighted, self.keep_rounds = delta_dtype, token_weighted, keep_rounds
        self.paths = DiLoCoPaths(base_path(base_dir) / run_id)
        self._lock_f = NO_LOCK  # this worker's lock, taken when it first touches the run
        self._hb: Heartbeat | None = None  # its lease (workers/wXXX/progress.json), from the same moment
        self._source = params if isinstance(params, torch.nn.Module) else None
        self.params = named_params(params)
        self.inner_optimizer = inner_optimizer(list(self.params.values()))
        self.scheduler = scheduler(self.inner_optimizer) if scheduler is not None else None
        self._outer_factory = outer_optimizer
        self.local_step = 0  # inner steps in the current round
        self.total_steps = 0  # inner steps this process has taken
        self._losses: list = []  # this round's losses: floats, or detached 0-d tensors (no device sync per step)
        self._round_t0 = time.perf_counter()  # start of the current round (the sidecar's train_seconds)
        if worker == reducer:
            self._setup_outer()  # fail on a bad outer optimizer now, not after the first round of training
        self._join()

    # -- the torch.optim.Optimizer surface ------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner_optimizer.param_groups

    @property
    def state(self):
        return self.inner_optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, scaler: "torch.amp.GradScaler | None" = None,
             loss: "float | torch.Tensor | None" = None) -> Any:
        """One inner step (through `scaler` if given: scaler.step + scaler.update; to clip gradients first, call
        scaler.unscale_(opt.inner_optimizer)), then the scheduler; every num_inner_steps the outer round.
        `loss` (optional) is recorded in the delta's sidecar and the run's metrics.jsonl."""
        if scaler is not None:
            out = scaler.step(self.inner_optimizer)
            scaler.update()
        else:
            out = self.inner_optimizer.step(closure)
        if self.scheduler is not None:
            self.scheduler.step()
        if loss is not None:
            self._losses.append(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
        self.local_step += 1
        self.total_steps += 1
        if self._hb is not None:  # recorded here, written by the lease's thread (`status` shows it)
            self._hb.beat(status="training", round=self.round, step=self.local_step, steps=self.num_inner_steps,
                          loss=self._losses[-1] if self._losses else None)
        if self.local_step >= self.num_inner_steps:
            self.sync()
        return out

    def state_dict(self) -> dict:
        """Inner optimizer + scheduler + counters (for your own local checkpoint; the outer state is on BASE_DIR)."""
        return {"inner_optimizer": self.inner_optimizer.state_dict(), "total_steps": self.total_steps,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "round": self.round}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what state_dict saved. The parameters stay at the committed round loaded at construction; an
        unfinished round restarts from its beginning (local_step 0)."""
        self.inner_optimizer.load_state_dict(sd["inner_optimizer"])
        if self.scheduler is not None and sd.get("scheduler") is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        self.total_steps = int(sd.get("total_steps", 0))

    def close(self) -> None:
        """Release this worker id (its lock and lease); the process exiting does the same."""
        if self._hb is not None:
            self._hb.stop()
        self._lock_f.release()

    # -- joining the run ------------------------------------------------------------------------------------------
    def identity(self) -> dict:
        spec = [(n, list(p.shape)) for n, p in self.params.items()]
        digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:16]
        return {"kind": KIND, "num_workers": self.num_workers, "reducer": self.reducer, "delta_dtype": self.delta_dtype,
                "parameters": len(spec), "parameters_sha256": digest}

    def _join(self) -> None:
        paths = self.paths
        sharedfs.makedirs(paths.root)
        if sharedfs.is_file(paths.run_json) and read_json(paths.run_json).get("identity", {}).get("kind") != KIND:
            raise ProtocolError(f"{paths.root} holds a coordinator run (diloco.py), not a DiLoCoOptimizer run: "
                                f"use another run_id")
        ensure_run_manifest(paths, self.identity())
        self._lock()
        if paths.latest_committed() is None:
            if self.worker == self.reducer:
                self._write_round0()
            else:
                log.info("worker %d: waiting for worker %d to commit round 0 in %s", self.worker, self.reducer,
                         paths.root)
                self._wait(lambda: paths.latest_committed() is not None, "round 0")
        self._load(paths.latest_committed())
        # A delta of this round published before a restart stands; this process only waits for the commit.
        self._published = sharedfs.is_file(paths.delta_meta(self.round, self.worker))
        log.info("worker %d/%d joined %s at round %d%s", self.worker, self.num_workers, paths.root, self.round,
                 " (our delta of this round is already published)" if self._published else "")

    def _lock(self) -> None:
        """One live process per worker id: flock on workers/wXXX/lock, held until this process exits, and the
        worker's lease (workers/wXXX/progress.json, beaten about every second by a thread: train/core/heartbeat.py),
        which decides where the lock cannot (an object store, a disk without locks)."""
        progress = self.paths.progress(self.worker)
        self._lock_f = exclusive_lock(self.paths.worker_dir(self.worker) / "lock", f"worker {self.worker}",
                                      lease=progress)
        self._hb = Heartbeat(progress, self.worker)
        self._hb.beat(force=True, status="joining")
        self._hb.start_lease()
        atexit.register(self._hb.stop)  # a loop that ends without close(): its last record still says "exited"

    def _write_round0(self) -> None:
        """θ_0 = this worker's parameters (float32, named), written once with a manifest, then committed."""
        paths, names = self.paths, list(self.params)
        def fill(tmp) -> dict:
            config = getattr(self._source, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(str(tmp))  # Hugging Face model: the global folders load with from_pretrained
            specs = {n: (torch.float32, tuple(self.params[n].shape)) for n in names}
            with StreamingWriter(tmp / WEIGHTS, specs, {"format": "pt"}) as wr:
                for n in names:
                    wr.write(n, self.params[n].detach().to("cpu", torch.float32, copy=True))
            return {WEIGHTS: wr.digest}
        publish_dir(paths.global_dir(0), fill)
        commit(paths, 0, {"protocol": PROTOCOL_VERSION, "kind": KIND})
        log.info("round 0 committed: %d tensors, %.2fM parameters", len(names),
                 sum(p.numel() for p in self.params.values()) / 1e6)

    @torch.no_grad()
    def _load(self, r: int) -> None:
        """Copy θ_r into the parameters in place and keep a float32 CPU copy of it (the base of the next Δ)."""
        theta: dict[str, torch.Tensor] = {}
        for name, t in iter_tensors(self.paths.global_dir(r) / WEIGHTS):
            p = self.params.get(name)
            if p is None or tuple(p.shape) != tuple(t.shape):
                raise ProtocolError(f"{self.paths.global_dir(r)}: tensor {name} {tuple(t.shape)} does not match "
                                    f"this worker's parameters ({'absent' if p is None else tuple(p.shape)})")
            p.copy_(t)
            theta[name] = t
        missing = set(self.params) - set(theta)
        if missing:
            raise ProtocolError(f"{self.paths.global_dir(r)}: lacks parameters {sorted(missing)[:5]}")
        self._theta, self.round = theta, r
        self._names = param_order(self.paths, r)

    def _wait(self, pred: Callable[[], Any], what: str) -> Any:
        if self._hb is not None:
            self._hb.beat(status=f"waiting for the {what}", **({"round": self.round} if hasattr(self, "round") else {}))
        got = wait_for(pred, self.averaging_timeout, self.poll)
        if not got:
            raise TimedOut(f"worker {self.worker}: no {what} in {self.paths.root} after averaging_timeout = "
                           f"{self.averaging_timeout:g}s (is worker {self.reducer}, the reducer, running? "
                           f"raise averaging_timeout if the workers' speeds differ a lot)")
        return got

    # -- the outer round ------------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Publish Δ = θ_r − θ_w, reduce (reducer) or wait for the commit, continue from θ_{r+1}. step() calls it
        every num_inner_steps; call it yourself only to end a round early."""
        paths, r = self.paths, self.round
        if not self._published:
            self._publish(r)
        if self.worker == self.reducer and (paths.latest_committed() or 0) <= r:
            self._reduce(r)
        else:
            self._wait(lambda: (paths.latest_committed() or 0) > r, f"commit of round {r + 1}")
        self._load(paths.latest_committed())
        self.local_step, self._losses, self._published = 0, [], False
        self._round_t0 = time.perf_counter()
        log.info("worker %d: now at round %d", self.worker, self.round)

    @torch.no_grad()
    def _publish(self, r: int) -> None:
        paths = self.paths
        if (paths.latest_committed() or 0) > r:
            log.warning("worker %d: round %d was committed without us (too slow); dropping our delta and "
                        "rejoining at round %d", self.worker, r, paths.latest_committed())
            return
        try:
            if not sharedfs.exists(paths.round_dir(r)):  # a pruned round stays gone
                raise FileNotFoundError(paths.round_dir(r))
            sharedfs.makedirs(paths.deltas_dir(r))
            file = write_delta(paths.delta_file(r, self.worker), self._names, self._theta, self.params,
                               self.delta_dtype, r, self.worker)
        except FileNotFoundError:
            log.warning("worker %d: round %d disappeared (reduced without us); rejoining", self.worker, r)
            return
        steps = max(self.local_step, 1)
        losses = [float(x) for x in self._losses]  # one sync a round
        loss = sum(losses) / len(losses) if losses else None
        publish_sidecar(paths, delta_sidecar(r, self.worker, file, inner_steps=steps, tokens=self.batch_size * steps,
                                             loss=loss, last_loss=losses[-1] if losses else None,
                                             train_seconds=time.perf_counter() - self._round_t0))
        self._published = True

    def _setup_outer(self) -> None:
        """Scratch parameters for the outer optimizer (empty: each takes one tensor's data during the reduce) and
        the layout of its per-parameter state, probed on a two-element tensor."""
        self._scratch = {n: torch.nn.Parameter(torch.empty(0)) for n in self.params}
        self.outer_optimizer = self._outer_factory(list(self._scratch.values()))
        probe = torch.nn.Parameter(torch.zeros(2))
        opt = self._outer_factory([probe])
        probe.grad = torch.ones(2)
        opt.step()
        self._state_layout = {k: (v.dtype, v.dim() > 0) for k, v in opt.state[probe].items()
                              if isinstance(v, torch.Tensor)}

    def _outer_specs(self, name: str, dtype: torch.dtype, shape: tuple) -> dict:
        return {_state_key(name, k): (dt, shape if shaped else ()) for k, (dt, shaped) in self._state_layout.items()}

    def _outer_update(self, name: str, theta: torch.Tensor, grad: torch.Tensor, prev) -> tuple:
        """The user's outer optimizer on one tensor: p = θ_r, p.grad = Δ̄, state from outer_state of round r."""
        p, opt = self._scratch[name], self.outer_optimizer
        p.data = theta.to(torch.float32, copy=True)
        p.grad = grad
        state = {k: t.clone() for k in self._state_layout if (t := prev(_state_key(name, k))) is not None}
        opt.state.pop(p, None)
        if state:
            opt.state[p] = state
        opt.step()
        new_state = opt.state.pop(p, {})
        new = p.data.to(theta.dtype)
        p.data, p.grad = torch.empty(0), None
        return new, {_state_key(name, k): new_state[k].to(dt).reshape(new_state[k].shape if shaped else ())
                     for k, (dt, shaped) in self._state_layout.items()}

    def _reduce(self, r: int) -> None:
        paths, N = self.paths, self.num_workers
        t0 = time.perf_counter()
        got = wait_for(lambda: len(arrived(paths, r, N)) == N, self.averaging_timeout, self.poll)
        workers = arrived(paths, r, N)
        if not got:
            missing = [w for w in range(N) if w not in workers]
            if len(workers) < self.min_workers:
                raise TimedOut(f"round {r}: {len(workers)}/{N} deltas after averaging_timeout = "
                               f"{self.averaging_timeout:g}s (min_workers = {self.min_workers}); missing "
                               f"workers {missing}. Start them (the run resumes here) or lower min_workers.")
            log.warning("round %d: timeout; going on with %d/%d deltas, missing %s", r, len(workers), N, missing)
        t_wait = time.perf_counter() - t0
        ok, metas, rejected, io = validate_and_reduce(
            paths, r, workers, delta_dtype=self.delta_dtype, min_workers=self.min_workers,
            token_weighted=self.token_weighted, update=self._outer_update, state_specs=self._outer_specs)
        missing = [w for w in range(N) if w not in workers]
        prev = read_jsonl(paths.metrics)
        record = round_record(r, ok, metas, rejected, missing, io, prev[-1] if prev else None,
                              wait_s=round(t_wait, 3), reduce_s=round(time.perf_counter() - t0 - t_wait, 3))
        commit(paths, r + 1, {"workers": ok, "missing": missing, "rejected": record["rejected"]})
        append_jsonl(paths.metrics, record)
        prune_rounds(paths, r + 1, self.keep_rounds)
        log.info("round %d committed from %d deltas (train loss %s)", r + 1, len(ok), record["train_loss"])


def _check(ok: bool, arg: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"DiLoCoOptimizer: {arg} = {value!r} {rule}")


def load_global(base_dir: str | os.PathLike, run_id: str, round: int | None = None) -> tuple[int, dict]:
    """(round, {name: tensor}) of the latest (or the given) committed global parameters of a DiLoCoOptimizer run."""
    paths = DiLoCoPaths(base_path(base_dir) / run_id)
    r = paths.latest_committed() if round is None else round
    if r is None or not paths.is_committed(r):
        raise NotFound(f"{paths.root}: no committed round {'yet' if round is None else round}")
    return r, dict(iter_tensors(paths.global_dir(r) / WEIGHTS))

