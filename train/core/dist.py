"""Workers that span several processes (a torchrun group): rank info, process group, collectives, model wrapping.

One code path for one process and many (nanochat's `get_dist_info()`): without torchrun's environment everything
reports rank 0 of 1 and every collective here is a no-op, so the single-process worker runs exactly as before.

Inside a group (docs/protocol.md is unchanged): rank 0 alone reads and writes the protocol files
(markers, global models, deltas, worker state, heartbeat, lock) and tells the other ranks what to do through small
JSON messages broadcast as byte tensors (no pickle, even in memory); parameters and optimizer state reach them by
broadcast. The other ranks only memory-map the token cache. Gradients are averaged by DDP, or reduce-scattered by
FSDP2 (`inner.parallel = "fsdp"`) when a model does not fit one device. CUDA uses NCCL, CPU uses gloo (how the
tests run it).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from train.config import ConfigError, RunConfig

# Rank 0 may wait a long time for a round (other workers still training) while the other ranks wait for it in a
# broadcast: the collective timeout must outlast any sane round, or the group would abort itself.
GROUP_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def get_dist_info() -> DistInfo:
    """Rank / world size / local rank from torchrun's environment; rank 0 of 1 without it."""
    try:
        return DistInfo(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                        int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers (set by torchrun): {e}") from None


def pick_group_device(spec: str, info: DistInfo) -> torch.device:
    """The device of this rank: cuda:<local rank> when CUDA is used, else the CPU."""
    from train.core.model import pick_device

    if not info.enabled:
        return pick_device(spec)
    if spec.startswith("cuda:"):
        raise ConfigError(f"inner.device = {spec!r} with a group of {info.world} processes: each process uses "
                          f"cuda:<local rank>; set inner.device to auto or cuda (CUDA_VISIBLE_DEVICES picks the GPUs)")
    device = pick_device(spec)
    if device.type == "cuda":
        if info.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {info.local_rank} needs a GPU but only {torch.cuda.device_count()} are "
                              f"visible: lower --nproc_per_node / inner.nproc_per_node")
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    return device


def init_group(cfg: RunConfig) -> tuple[DistInfo, torch.device]:
    """Join the torchrun group (if any) and check that the worker's batch splits evenly over its ranks."""
    info = get_dist_info()
    if info.world != cfg.inner.nproc_per_node:
        raise ConfigError(f"inner.nproc_per_node = {cfg.inner.nproc_per_node}, but this worker runs as {info.world} "
                          f"process(es): set inner.nproc_per_node = {info.world}, or start it with `python -m "
                          f"torch.distributed.run --nproc_per_node {cfg.inner.nproc_per_node} "
                          f"-m train.diloco.worker ...` "
                          f"(diloco_sim.py and launch_to_machines.py do that)")
    device = pick_group_device(cfg.inner.device, info)
    if info.enabled:  # (the config checked that total_batch_size splits over nproc_per_node processes)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
    return info, device


def close_group() -> None:
    """Leave the group together (a rank that tears down its gloo pairs while a peer still uses them aborts)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# -- collectives (no-ops in a single process) ------------------------------------------------------------------------
def comm_device(device: torch.device) -> torch.device:
    """Where collective buffers live: NCCL needs CUDA tensors, gloo takes CPU ones."""
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_json(obj, info: DistInfo, device: torch.device):
    """Rank 0's JSON-able `obj` on every rank (others pass anything, e.g. None)."""
    if not info.enabled:
        return obj
    dev = comm_device(device)
    payload = json.dumps(obj).encode() if info.main else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    dist.broadcast(size, 0)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev) if info.main else \
        torch.empty(int(size), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()).decode()) if not info.main else obj


def broadcast_full(full: torch.Tensor | None, shape, dtype, info: DistInfo, device: torch.device) -> torch.Tensor:
    """Rank 0's full tensor on every rank (on the collective's device)."""
    dev = comm_device(device)
    buf = full.to(dev, dtype) if info.main else torch.empty(tuple(shape), dtype=dtype, device=dev)
    dist.broadcast(buf, 0)
    return buf


def all_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of `t` over the group (t itself in one process)."""
    if not info.enabled:
        return t
    dev = comm_device(t.device)
    out = t.detach().to(dev).clone()
    dist.all_reduce(out)
    return (out / info.world).to(t.device)


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathers an FSDP2 shard (a collective: every rank must call it), else `t`."""
    return t.full_tensor() if is_sharded(t) else t


def load_full(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor (identical on every rank) into a parameter or its FSDP2 shard."""
    if is_sharded(dst):
        from torch.distributed.tensor import distribute_tensor
        full = distribute_tensor(full.to(dst.device_mesh.device_type), dst.device_mesh, dst.placements)
    dst.copy_(full)


def like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """A new tensor holding `full` laid out like `param` (a DTensor shard for FSDP2 params)."""
    if is_sharded(param):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements)
    return full.to(param.device)


# -- model wrapping -------------------------------------------------------------------------------------------------
def parallelize(model: torch.nn.Module, info: DistInfo, device: torch.device, mode: str) -> torch.nn.Module:
    """The module the inner loop runs forward/backward through: `model` itself in one process, DDP around it, or
    `model` after FSDP2 `fully_shard` (per decoder layer, then the root) whose parameters become DTensor shards."""
    if not info.enabled:
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (info.world,))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ConfigError(f"inner.parallel = {mode!r}: must be ddp or fsdp")


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers of a HF causal LM (model.model.layers, transformer.h, ...); [] if none."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


class RankBatches:
    """This rank's slice of every optimizer step's windows, with the single-process data order.

    One process draws `total_batch_size` windows per step from the worker's ShardSampler. In a group of W, rank k
    takes windows [k*T/W, (k+1)*T/W) of that same block and skips the rest, so the group together sees exactly the
    1-process batch and the sampler's `position` advances identically on every rank (rank 0 saves it)."""

    def __init__(self, sampler, info: DistInfo, step_windows: int):
        self.sampler, self.info = sampler, info
        self.per_rank = step_windows // info.world
        self._left = 0

    def next_batch(self, n: int) -> torch.Tensor:
        if self._left == 0:  # a new optimizer step: skip the ranks before us
            self.sampler.position += self.info.rank * self.per_rank
            self._left = self.per_rank
        batch = self.sampler.next_batch(n)
        self._left -= n
        if self._left == 0:  # and the ranks after us
            self.sampler.position += (self.info.world - self.info.rank - 1) * self.per_rank
        return batch
