"""Thread pools kept for the life of the process, one per (purpose, size).

meshfold runs work on Python threads in two places: the CPU kernels' parts
(:mod:`meshfold.kernels.cpu_pool`) and micro-batches taking turns (:mod:`meshfold.runtime.overlap`).
Both keep their threads from one call to the next: starting threads costs, and torch keeps some
caches per thread (DTensor's sharding propagation), which fresh threads would find cold. A forked
child gets the pool objects without their threads, so it starts with none.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["kept_pool"]

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _reset_in_child() -> None:
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_in_child)


def kept_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The pool of ``workers`` threads named ``meshfold-<name>``, created on first use."""
    with _pools_lock:
        pool = _pools.get((name, workers))
        if pool is None:
            pool = _pools[(name, workers)] = ThreadPoolExecutor(workers, thread_name_prefix=f"meshfold-{name}")
        return pool
