"""Round 0's deltas of two workers, written as workers write them, for tests that drive a coordinator in-process
(tests/e2e/test_kill.py, test_s3.py): small random Δs, their sidecars naming the data slice each trained on."""
from __future__ import annotations

import torch

from train.core import sharedfs
from train.core.store import PROTOCOL_VERSION, atomic_write_json
from train.core.tensorio import load_tensors, save_streaming
from train.exchange.protocol import write_delta


def publish_round0_deltas(co, codec: str = "none", workers=(0, 1)) -> None:
    """Deltas of round 0 from `workers` into the run of coordinator `co` (set up): codec "none" a plain Δ, else
    θ_0 − θ_w encoded by the run's delta codec, as a worker writes it."""
    paths = co.paths
    theta = load_tensors(paths.global_dir(0) / "model.safetensors")
    for w in workers:
        g = torch.Generator().manual_seed(w)
        d = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in theta.items()}
        if codec == "none":
            sha = save_streaming(paths.delta_file(0, w), d)
        else:
            sha = write_delta(paths.delta_file(0, w), list(theta), theta, {k: theta[k] - d[k] for k in theta},
                              co.master.delta_codec, 0, w)["sha256"]
        off, n = co.layout.slice(0, w)  # the data slice the delta says it was trained on
        atomic_write_json(paths.delta_meta(0, w), {"protocol": PROTOCOL_VERSION, "round": 0, "worker": w,
                                                   "inner_steps": 5, "tokens": 100, "loss": 1.0, "sha256": sha,
                                                   "bytes": sharedfs.stat(paths.delta_file(0, w)).st_size,
                                                   "data": {"segment": 0, "offset": off, "windows": n, "read": n}})
