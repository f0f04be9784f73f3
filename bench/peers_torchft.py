"""One torchft DiLoCo worker of bench/peers.py (a replica group of one process), started by it as an OS process:

    python bench/peers_torchft.py SPEC_JSON WORKER

The job is EDT's DiLoCo worker, step for step, driven by torchft instead of BASE_DIR:
  - θ_0: the weights bench/peers.py saved from `build_model` with the run's seed (what EDT's coordinator commits);
  - the inner loop is EDT's own (`train.core.inner.InnerTrainer`: AdamW, warmup + cosine, grad clip, fp32), so
    hyperparameters and schedule are the same objects, not copies;
  - data: round r of worker w reads the stream slice `Layout.single(N, H x batch).slice(r, w)` of
    `StreamSampler(seed)`, what EDT's worker reads, where r = torchft's `manager.current_step()` (committed outer
    steps), so a worker that healed from a peer goes on with the round it healed into;
  - `torchft.local_sgd.DiLoCo` over torchft's reconfigurable `ProcessGroupGloo` (loopback), quorum from the
    lighthouse bench/peers.py runs; the outer optimizer is torch's SGD (Nesterov or plain averaging), on every
    replica, as torchft does it.

Writes one JSON line per sync to OUT/tf-wWORKER.jsonl (time, committed step, participants, bytes its process wrote
during the sync, from /proc/self/io) and, for worker 0 (or the `eval` worker of the spec), the final eval loss on
the held-out windows EDT's coordinator scores.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def io_bytes() -> tuple[int, int]:
    """(wchar, rchar) of this process: bytes passed to write()/read()-family calls, gloo's socket writes included."""
    try:
        f = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(f["wchar"]), int(f["rchar"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def main(spec_path: str, worker: int) -> int:
    import torch
    from safetensors.torch import load_model
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from train.config import load_config
    from train.core.data import StreamSampler, TokenData
    from train.core.inner import InnerTrainer, evaluate
    from train.core.model import build_model, quiet_transformers
    from train.exchange.layout import Layout

    spec = json.loads(Path(spec_path).read_text())
    quiet_transformers()
    torch.set_num_threads(spec["threads"])
    cfg = load_config(spec["config"], spec["overrides"])
    ic, oc = cfg.inner, cfg.outer
    N, H, R = oc.num_workers, oc.local_steps, oc.rounds
    model = build_model(cfg)
    load_model(model, spec["theta0"])  # the θ_0 EDT's run starts from
    trainer = InnerTrainer(cfg, model, torch.device("cpu"))
    data = TokenData.open(Path(spec["data_dir"]), cfg.data.seq_length, cfg.data.eval_fraction)
    sampler = StreamSampler(data, cfg.seed)
    layout = Layout.single(N, H * ic.total_batch_size)
    nesterov = oc.nesterov and oc.momentum > 0
    outer = torch.optim.SGD(model.parameters(), lr=oc.lr, momentum=oc.momentum, nesterov=nesterov)

    def state_dict():
        return {"model": model.state_dict(), "inner": trainer.opt.state_dict(), "step": trainer.step}

    def load_state_dict(sd):  # a restarted replica heals from a peer: model, AdamW moments, schedule position
        model.load_state_dict(sd["model"])
        trainer.opt.load_state_dict(sd["inner"])
        trainer.step = int(sd["step"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's own store
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=spec["pg_timeout_s"])), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=spec.get("min_replicas", 1), use_async_quorum=False,
        replica_id=f"peer_{worker}",
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, lighthouse_addr=spec["lighthouse"],
        hostname="127.0.0.1", timeout=timedelta(seconds=spec["pg_timeout_s"]),
        quorum_timeout=timedelta(seconds=spec["quorum_timeout_s"]), init_sync=False)
    out = open(Path(spec["out"]) / f"tf-w{worker}.jsonl", "a", buffering=1)
    out.write(json.dumps({"event": "start", "time": time.time(), "pid": os.getpid()}) + "\n")

    with DiLoCo(manager, [model], trainer.opt, outer, sync_every=H, pin_memory=False) as _diloco:
        # the H-th optimizer.step() of a round runs torchft's quorum + allreduce + outer step in DiLoCo's post-hook;
        # these hooks, registered after DiLoCo's, bracket it (AdamW's own step on this model is ~1 ms)
        step_t: list[float] = []
        trainer.opt.register_step_pre_hook(lambda *a: step_t.append(time.perf_counter()))
        trainer.opt.register_step_post_hook(lambda *a: step_t.append(time.perf_counter()))
        while manager.current_step() < R:
            r = manager.current_step()
            sampler.begin(*layout.slice(r, worker))
            trainer.step = r * H  # the schedule position of round r (after a heal or a failed commit too)
            io0 = [0, 0]

            def before(i):
                if i == H - 1:
                    io0[:] = io_bytes()

            step_t.clear()
            stats = trainer.train_steps(sampler.next_batch, H, before_step=before)
            sync_s = step_t[-1] - step_t[-2]
            io1 = io_bytes()
            out.write(json.dumps({
                "event": "sync", "time": time.time(), "round": r, "step": manager.current_step(),
                "committed": manager.current_step() > r, "participants": manager.num_participants(),
                "loss": stats["loss"], "sync_s": sync_s, "train_s": stats["seconds"] - sync_s,
                "wchar": io1[0] - io0[0], "rchar": io1[1] - io0[1]}) + "\n")
    if worker == spec["eval_worker"]:
        windows = torch.from_numpy(data.eval_windows(cfg.eval.batches * cfg.eval.batch_size))
        loss = evaluate(model, windows, cfg.eval.batch_size, torch.device("cpu"))
        out.write(json.dumps({"event": "eval", "time": time.time(), "eval_loss": loss,
                              "step": manager.current_step()}) + "\n")
    out.write(json.dumps({"event": "done", "time": time.time()}) + "\n")
    out.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    os._exit(main(sys.argv[1], int(sys.argv[2])))  # _exit: torchft's server threads never hold the exit up
