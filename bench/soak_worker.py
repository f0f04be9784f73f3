"""A DiLoCo worker of bench/soak.py that may publish a well-formed but bad delta (silent data corruption, a diverged
worker): `python -m train.diloco.worker` itself, with the delta it writes transformed in the rounds the soak asks for.

    SOAK_BAD_DELTAS=DIR python bench/soak_worker.py --config evolution.json --worker 2 ...

DIR/w002-r000017.json (`{"kind": "scale"}`, written by the soak before round 17 starts) makes this worker's delta of
round 17 one of:
    scale   100 x Δ                      (a worker whose update exploded)
    flip    −Δ                           (a sign error)
    noise   Gaussian noise of Δ's norm   (garbage of a plausible size)
The file is well-formed: the real writer (train/exchange/protocol.py write_delta) writes it, with its sha256 and
sidecar, so only the coordinator's screen (outer.screen) can tell. The worker's own model is untouched; a replay of
the round after a restart writes the same bad bytes (the noise is seeded by round and worker).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import train.diloco.worker as worker_mod  # noqa: E402

KINDS = ("scale", "flip", "noise")


def bad_kind(r: int, w: int) -> str | None:
    folder = os.environ.get("SOAK_BAD_DELTAS")
    if not folder:
        return None
    try:
        return json.loads((Path(folder) / f"w{w:03d}-r{r:06d}.json").read_text())["kind"]
    except (OSError, ValueError, KeyError):
        return None


def corrupt(kind: str, theta_r: dict, params: dict, r: int, w: int) -> dict:
    """params' such that θ_r − params' is the bad delta of `kind`."""
    gen = torch.Generator().manual_seed(1_000_003 * r + w)
    out = {}
    for name, p in params.items():
        t = theta_r[name].to(torch.float32)
        d = t - p.detach().to("cpu", torch.float32)
        if kind == "scale":
            bad = 100.0 * d
        elif kind == "flip":
            bad = -d
        else:
            noise = torch.randn(d.shape, generator=gen)
            bad = noise * (d.norm() / noise.norm().clamp_min(1e-30))
        out[name] = (t - bad).to(p.dtype)
    return out


_write_delta = worker_mod.write_delta


def write_delta(path, names, theta_r, params, codec, r, w, *args, **kwargs):
    """The worker's write_delta, whatever else it is passed (residual, phases, like: passed on as they come)."""
    kind = bad_kind(r, w)
    if kind in KINDS:
        worker_mod.log.warning("soak: round %d: publishing a bad delta on purpose (%s)", r, kind)
        params = corrupt(kind, theta_r, params, r, w)
    return _write_delta(path, names, theta_r, params, codec, r, w, *args, **kwargs)


worker_mod.write_delta = write_delta

if __name__ == "__main__":
    from train.core.errors import run_main
    run_main(worker_mod.main, "worker", background_log=True, fast_exit=True)
