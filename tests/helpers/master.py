"""The coordinator's OuterMaster driven by hand over a few rounds (tests/unit/test_master_coded.py,
tests/unit/test_fused.py): a run folder at round 0, and each round two workers' deltas written, published and added
the way workers and the coordinator do it."""
from __future__ import annotations

import torch

from train.core.model import build_model, save_model_dir
from train.core.store import atomic_write_json
from train.exchange.master import OuterMaster
from train.exchange.protocol import check_sidecar, delta_sidecar, publish_sidecar, write_delta
from train.exchange.store import DiLoCoPaths
from train.exchange.theta import file_order


def master_at_round_0(cfg, rounds: int) -> tuple[OuterMaster, DiLoCoPaths, list[str]]:
    """θ_0 of the micro model (seed 0) committed in cfg's run folder; the master resumed there; the file order."""
    paths = DiLoCoPaths(cfg.run_dir)
    torch.manual_seed(0)
    save_model_dir(build_model(cfg), paths.global_dir(0))
    atomic_write_json(paths.committed(0), {"round": 0})
    m = OuterMaster(paths, cfg.outer, rounds)
    m.resume(0)
    return m, paths, file_order(paths.global_dir(0) / "model.safetensors")


def two_deltas(m: OuterMaster, paths: DiLoCoPaths, r: int, names: list[str]):
    """Round r's accumulator with workers 0 and 1's deltas (seeded by round and worker) published and added."""
    theta = {k: v.clone() for k, v in m.theta.tensors.items()}
    acc = m.new_accumulator(r, 2)
    for w in range(2):
        g = torch.Generator().manual_seed(10 * r + w)
        params = {k: theta[k] - torch.randn(theta[k].shape, generator=g) * 1e-2 for k in names}
        f = write_delta(paths.delta_file(r, w), names, theta, params, m.delta_codec, r, w)
        publish_sidecar(paths, delta_sidecar(r, w, f, inner_steps=5, tokens=100 + 7 * w, loss=1.0))
        acc.add(w, check_sidecar(paths, r, w, m.delta_codec))
    return acc
