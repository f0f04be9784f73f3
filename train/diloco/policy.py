"""The worker-loop policy of a run (`oc`: its outer section), asked by the coordinator and the worker: streaming
DiLoCo's (train/diloco/streaming.py: outer.fragments / fragment_delay / fragment_mix, which refuse an outer.overlap)
or outer.overlap's (train/diloco/overlap.py: none, delayed, eager)."""
from __future__ import annotations

from train.diloco.overlap import POLICIES, Synchronous
from train.diloco.streaming import Streaming


def for_config(oc) -> Synchronous:
    if getattr(oc, "streaming", False):
        return Streaming(oc)
    return POLICIES[oc.overlap](oc)
