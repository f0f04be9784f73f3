"""torch's intra-op threads around a block that runs beside I/O threads.

torch's CPU kernels split an op across their intra-op threads and wait for the slowest part: when the reader, writer
and hashing threads of a streamed file (train/core/tensorio.py) hold some of the cores, an op whose threads outnumber
the cores left waits for a descheduled part, every op. Measured on 2 cores (bench/outer_step.py, issue #38): the
outer step of a 135M-parameter model took 0.28 s alone and 1.8 s beside two writers with 2 intra-op threads, 0.7 s
with 1. So a block that streams files sets the threads to the cores its I/O threads leave, and restores them.
"""
from __future__ import annotations

import contextlib
import os

import torch


def cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, cgroups' cpusets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """torch's intra-op threads set to n for the block (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def beside_io(io_threads: int) -> int:
    """Intra-op threads for arithmetic that runs beside `io_threads` busy I/O threads: the cores they leave, at least
    one, and never more than torch has now."""
    return max(1, min(torch.get_num_threads(), cores() - io_threads))
