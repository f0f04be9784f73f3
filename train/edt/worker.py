"""The EDT worker process: claim a mutation job from BASE_DIR, run it, publish the mutated member; repeat.

    python -m train.edt.worker --config evolution.json --worker 0 [--set inner.device=cuda ...]

One job = one member of one generation (generations/gXXX/jobs/mYYY/, written by the coordinator):
  1. claim it (O_CREAT|O_EXCL of jobs/mYYY.claim; a background thread renews the lease while we work)
  2. load the child's weights and, when inherited, its first parent's inner AdamW state
  3. mutate: `steps` inner AdamW steps with the DNA's hyperparameters (peak lr; data mix) on the member's shard,
     from the member slot's saved data position, on the run's cosine schedule at step generation x steps
  4. evaluate on the run's fixed held-out windows
  5. publish members/mYYY/ whole (model, optimizer state, result.json with the new data position, MANIFEST.json)
     by one create-once rename: if two attempts of a re-queued job finish, exactly one is kept
Any number of workers serve any population size: free workers take whatever job is unclaimed. A worker that dies
leaves a claim that the coordinator re-queues as soon as the worker's heartbeat says it is gone (or the claim's
lease expires; a restarted worker re-queues its own at once). SIGTERM = leave: the worker drops the job it runs
(its claim is released, the job queued for another worker) at the next inner step and exits 0.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import torch

from train.config import ConfigError, RunConfig
from train.edt.protocol import publish_member, read_claim, release_claim, renew_lease, requeue, try_claim
from train.edt.store import EDTPaths
from train.edt.modes import mode_of
from train.core.model import WEIGHTS, load_weights_into, pick_device
from train.core import sharedfs
from train.core.store import (
    PROTOCOL_VERSION,
    ProtocolError,
    exclusive_lock,
    prepare_run_dir,
    read_json,
    wait_for,
)
from train.core.tensorio import StreamingWriter, read_header
from train.core.coordinator_lease import CoordinatorWatch
from train.core.heartbeat import Heartbeat

log = logging.getLogger("edt-worker")


class JobLost(Exception):
    """Our claim was re-queued (we were presumed dead): drop the job, another worker has it."""


class LeaseKeeper:
    """Renew a claim's lease from a background thread (liveness even during long saves / evaluations)."""

    def __init__(self, paths: EDTPaths, g: int, m: int, attempt: str, every: float):
        self.args, self.every = (paths, g, m, attempt), every
        self.lost = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if not renew_lease(*self.args):
                self.lost = True
                return

    def __enter__(self) -> "LeaseKeeper":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    def check(self) -> None:
        if self.lost:
            raise JobLost()


class EDTWorker:
    def __init__(self, cfg: RunConfig, worker_id: int):
        if worker_id < 0:
            raise ConfigError(f"--worker {worker_id}: must be >= 0")
        if cfg.inner.nproc_per_node > 1:
            raise ConfigError(f"inner.nproc_per_node = {cfg.inner.nproc_per_node}: EDT workers run one process each "
                              f"(torchrun groups are for DiLoCo workers); start one EDT worker per GPU instead")
        self.cfg, self.w = cfg, worker_id
        self.paths = EDTPaths(prepare_run_dir(cfg.run_dir, cfg.source))
        self.poll = cfg.outer.poll_interval_s
        self.hb = Heartbeat(self.paths.progress(worker_id), worker_id)
        self.monitor = CoordinatorWatch.of(cfg, "edt")  # called while waiting: says when the coordinator dies
        self.model = None
        self.started = time.time()

    def lock(self) -> None:
        """One live process per worker id (flock on workers/wXXX/lock, held until exit)."""
        self._lock_f = exclusive_lock(self.paths.worker_dir(self.w) / "lock", f"EDT worker {self.w}",
                                     lease=self.paths.progress(self.w))

    def setup(self) -> None:
        cfg, paths = self.cfg, self.paths
        self.lock()
        if cfg.inner.threads:
            torch.set_num_threads(cfg.inner.threads)
        log.info("waiting for the EDT coordinator to commit generation 0 in %s", paths.root)
        self.hb.beat(force=True, status="waiting for generation 0")
        from transformers import AutoModelForCausalLM  # noqa: F401  (slow first import, overlapped with the wait)
        wait_for(lambda: paths.latest_generation() is not None, None, self.poll, on_poll=self.monitor)
        run = read_json(paths.run_json)
        if run.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"{paths.run_json}: protocol {run.get('protocol')}, this worker speaks "
                                f"{PROTOCOL_VERSION}")
        if run.get("identity", {}).get("strategy") != "edt":
            raise ProtocolError(f"{paths.root} is not an EDT run (a DiLoCo run?): use another project_name")
        self.device = pick_device(cfg.inner.device)
        self.mutation = mode_of(cfg).mutation(cfg, paths, self.device)
        log.info("EDT worker %d (%s) on %s, device %s", self.w, cfg.edt.mode, socket.gethostname(), self.device)

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        released_old = set()
        while True:
            self.hb.leave_point()  # SIGTERM: leave here, holding no claim (train/core/heartbeat.py)
            if self.run_is_done():
                log.info("the run is complete (%s)", self.paths.done)
                self.hb.beat(force=True, status="done")
                return
            g = self.paths.latest_generation()
            with self.hb.busy():  # a claim is written whole before a SIGTERM can end us
                if g not in released_old:
                    self.release_predecessor_claims(g)
                    released_old.add(g)
                job = self.claim_next(g)
            if job is None:
                self.hb.beat(status="waiting for a job", generation=g)
                self.monitor()
                time.sleep(self.poll)
                continue
            m, attempt = job
            try:
                self.run_job(g, m, attempt)
            except JobLost:
                log.warning("job g%d/m%d was re-queued while we ran it (lease lost): dropped", g, m)
            except (OSError, ValueError) as e:
                if not (self.paths.has_result(g, m) or self.paths.latest_generation() != g):
                    raise
                # a re-queued duplicate whose inputs were cleaned up after the original attempt finished
                log.warning("job g%d/m%d failed (%s) but it is already done: dropped", g, m, e)

    def run_is_done(self) -> bool:
        """DONE.json says so, unless it is a finished run's marker that our config extends (more generations): then
        the coordinator removes it and goes on."""
        if not sharedfs.exists(self.paths.done):  # a listing: DONE.json appears once, late (NFS lookup cache)
            return False
        try:
            done = read_json(self.paths.done)
        except (OSError, ValueError):
            return False
        return done.get("generations", 0) >= self.cfg.edt.max_generations or done.get("time", 0) >= self.started

    def release_predecessor_claims(self, g: int) -> None:
        """Claims that name our worker id but another process: our predecessor died holding them."""
        for name in sharedfs.names(self.paths.jobs_dir(g)):
            if not (name.startswith("m") and name.endswith(".claim")):
                continue
            m = int(name[1:].split(".")[0])
            c = read_claim(self.paths, g, m)
            if c and c.get("worker") == self.w and (c.get("pid"), c.get("host")) != (os.getpid(),
                                                                                     socket.gethostname()):
                requeue(self.paths, g, m, f"worker {self.w} restarted")
                log.info("re-queued job g%d/m%d, claimed by our previous process", g, m)

    def claim_next(self, g: int) -> tuple[int, str] | None:
        """Claim the first free job, starting at our own slot (spreads workers over jobs)."""
        pop = self.paths.population(g)
        for k in range(pop):
            m = (self.w + k) % pop
            attempt = try_claim(self.paths, g, m, self.w)
            if attempt:
                return m, attempt
        return None

    # -- one job --------------------------------------------------------------------------------------------------
    def run_job(self, g: int, m: int, attempt: str) -> None:
        cfg, paths = self.cfg, self.paths
        try:
            with LeaseKeeper(paths, g, m, attempt, cfg.edt.job_lease_s / 4) as lease:
                job = read_json(paths.job_json(g, m))
                log.info("job g%d/m%d (attempt %s): %d steps, genes %s", g, m, attempt, job["steps"],
                         {k: round(v, 5) if isinstance(v, float) else v for k, v in job["hyper"].items()})
                result, published = publish_member(
                    paths, g, m, attempt, lambda tmp: self._mutate_and_evaluate(g, m, attempt, job, lease, tmp),
                    check=lease.check)
            if published:
                log.info("job g%d/m%d done: eval loss %.4f, train loss %s", g, m, result["eval_loss"],
                         "-" if result["train_loss"] is None else f"{result['train_loss']:.4f}")
            else:
                log.warning("job g%d/m%d was already published by another attempt: ours dropped", g, m)
        finally:
            release_claim(paths, g, m, attempt)
            self.hb.beat(force=True, status="idle", generation=g)

    def _mutate_and_evaluate(self, g: int, m: int, attempt: str, job: dict, lease: LeaseKeeper,
                             tmp) -> tuple[dict, dict]:
        """Mutate the job's model into `tmp` (members/mXXX/ before its rename); returns (result, known hashes)."""
        cfg, paths = self.cfg, self.paths
        job_dir = paths.job_dir(g, m)
        if self.model is None:
            from transformers import AutoConfig, AutoModelForCausalLM
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
                str(sharedfs.local_copy(job_dir / "config.json").parent)),
                                                          dtype=torch.float32)
        load_weights_into(self.model, job_dir)
        steps = int(job["steps"])
        torch.manual_seed(cfg.seed * 1_000_003 + g * 1009 + m)

        def on_step(i: int, loss) -> None:
            lease.check()
            self.hb.beat(status="training", generation=g, member=m, step=i + 1, steps=steps, loss=loss)

        self.hb.beat(force=True, status="training", generation=g, member=m, step=0, steps=steps)
        out = self.mutation(self.model.to(self.device), job, g, m, on_step, tmp)

        # members/mYYY/: the job's config files, the mutated weights (in the job file's order), optimizer state.
        for fname in ("config.json", "generation_config.json"):
            if sharedfs.exists(job_dir / fname):
                sharedfs.copy_file(job_dir / fname, tmp / fname)
        header = read_header(job_dir / WEIGHTS)[0]
        names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        params = dict(self.model.named_parameters())
        specs = {n: (params[n].dtype, tuple(params[n].shape)) for n in names}
        with StreamingWriter(tmp / WEIGHTS, specs, metadata={"format": "pt"}) as wr:
            for n in names:
                wr.write(n, params[n].detach().to("cpu", copy=True))
        finite = all(v is None or bool(np.isfinite(v)) for v in (out["eval_loss"], out["train_loss"]))
        result = {"protocol": PROTOCOL_VERSION, "generation": g, "member": m, "attempt": attempt, "worker": self.w,
                  "host": socket.gethostname(), **out, "steps": steps, "hyper": job["hyper"], "finite": finite,
                  "weights_sha256": wr.digest, "bytes_read": sharedfs.stat(job_dir / WEIGHTS).st_size +
                  out["bytes_read"], "bytes_written": wr.nbytes + out["bytes_written"], "time": time.time()}
        return result, {WEIGHTS: wr.digest}


def main(argv: list[str] | None = None) -> int:
    from train.core.entry import worker_main
    return worker_main("edt", EDTWorker, __doc__.split("\n")[0], argv)


if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(main, "edt-worker", background_log=True, fast_exit=True)
