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


def lanes() -> int:
    """Python threads ('lanes') for arithmetic split by hand beside I/O threads that mostly wait (a reader or an
    O_DIRECT writer waits on the disk most of its time): every core, at most 4. Each lane runs torch with one
    intra-op thread (ordered_map), so no kernel waits on a descheduled part of itself."""
    return max(1, min(4, cores()))


def ordered_map(fn, items, lanes: int, ahead: int = 8):
    """fn(item) for each item, on `lanes` threads when lanes > 1 (torch's kernels release the GIL, so the lanes
    run at once), the results yielded in the items' order with at most `ahead` items in flight. Call it inside
    intra_op_threads(1): each lane starts with torch's threads as they are then (OpenMP keeps a thread's setting
    from its first op). An error in fn is raised where its result is taken; items not yet started are then
    cancelled and those running are waited for, so no item is left half done behind the caller's back."""
    if lanes <= 1:
        for it in items:
            yield fn(it)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    n = torch.get_num_threads()
    pending: deque = deque()
    with ThreadPoolExecutor(lanes, thread_name_prefix="lane", initializer=torch.set_num_threads,
                            initargs=(n,)) as pool:
        try:
            for it in items:
                pending.append(pool.submit(fn, it))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
