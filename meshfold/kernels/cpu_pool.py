"""The CPU worker pool every CPU kernel of meshfold runs its parts on.

Legend: W = workers.

Expert work on CPU is many short ATen ops (one small GEMM per expert block, elementwise passes
over row parts). Run on the caller's thread, each op forks and joins the OpenMP team: on a
shared machine a descheduled thread stalls every join (a scheduler tick, ~4 ms), and between
parallel regions libgomp's idle team threads spin-wait (300k spins by default) on the cores the
next op needs. So CPU kernels hand their parts to a few Python pool threads instead, each with
``intra-op threads / W`` threads (1 on a small machine), taking the next part from a shared
queue: a stalled worker delays only its own part, there is one join per call, and no OpenMP team
is left spinning between ops. ATen ops release the GIL, so the workers overlap.
(benchmarks/bench_moe_layer.py measures each choice.)

Tasks must write disjoint outputs, and every output element is written by exactly one task of a
fixed shape whichever worker runs it, so results do not depend on scheduling. The caller's
thread settings are never touched: the workers are pool threads and the caller waits; they run
in the caller's grad and inference modes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["MAX_WORKERS", "run_tasks", "single_threaded", "serial", "in_parts", "blocks"]

MAX_WORKERS = 8  # beyond this the Python dispatch of the parts (under the GIL) would dominate

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _reset_pools_in_child() -> None:  # a forked child has the pool objects but not their threads
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_pools_in_child)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="meshfold-cpu")
        return pool


def run_tasks(tasks: list) -> None:
    """Call every zero-argument task once, on up to W pool workers with ``intra-op threads / W``
    threads each, in the caller's grad and inference modes; the caller waits. Tasks must write
    disjoint outputs (their order is not fixed)."""
    threads = torch.get_num_threads()
    workers = min(threads, MAX_WORKERS, len(tasks))
    if workers <= 1:
        for task in tasks:
            task()
        return
    per_worker = max(1, threads // workers)
    lock = threading.Lock()
    queue = iter(tasks)

    modes = _callers_modes()

    def drain() -> None:
        if torch.get_num_threads() != per_worker:  # thread-local (OpenMP ICV, MKL local threads)
            torch.set_num_threads(per_worker)
        with modes():
            while True:
                with lock:
                    task = next(queue, None)
                if task is None:
                    return
                task()

    pool = _pool(workers)
    for f in [pool.submit(drain) for _ in range(workers)]:
        f.result()
    # set_num_threads also records its value process-wide, for threads created later; every
    # worker has set its own by now, so put the caller's value back there.
    torch.set_num_threads(threads)


def _callers_modes():
    """A context manager factory: the calling thread's grad and inference modes, for a pool
    thread (both are thread-local). Without them a worker would write with grad mode on (``out=``
    ops refuse inputs that require grad, as a backward with ``create_graph`` passes) and outside
    inference mode (tensors made under ``torch.inference_mode`` may only be written inside it)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    return lambda: _modes(grad, inference)


@contextlib.contextmanager
def _modes(grad: bool, inference: bool):
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        yield


def single_threaded(fn, *args):
    """``fn(*args)`` on a pool thread with one intra-op thread; the caller waits.

    For short memory-bound ATen ops that fork and join the OpenMP team, some of them many times
    per call (``index_add_``): when another process holds one of the cores, each join can wait
    for a scheduler tick, so on a shared machine one thread is faster than a team. The ops used
    here compute the same values on any number of threads (the tests compare them). The
    caller's grad and inference modes carry over; its thread count is left as it was.
    """
    if torch.get_num_threads() <= 1:
        return fn(*args)
    threads, modes = torch.get_num_threads(), _callers_modes()

    def call():
        if torch.get_num_threads() != 1:  # thread-local; the pool thread keeps it
            torch.set_num_threads(1)
        with modes():
            return fn(*args)

    try:
        return _pool(1).submit(call).result()
    finally:
        torch.set_num_threads(threads)  # the process-wide value, as in _run


def in_parts(part, length: int, size: int, device) -> None:
    """``part(start, end)`` over [0, length) cut into pieces of about ``size`` rows: on the pool
    (:func:`run_tasks`) for CPU tensors, as one piece elsewhere; never with zero rows. Parts must
    write disjoint outputs.

    For memory-bound row-wise work between grouped GEMMs. As ATen ops on the caller's thread it
    would run in an OpenMP team, whose other threads then spin-wait for the next parallel region
    (libgomp's default), taking a core from the next grouped GEMM's workers."""
    if not length:
        return  # no rows: a part of zero rows may not even have a shape (an empty expert's view)
    if device.type != "cpu":
        part(0, length)
    else:
        run_tasks([functools.partial(part, a, b) for a, b in blocks(length, max(1, size))])


def blocks(length: int, size: int) -> list[tuple[int, int]]:
    """[0, length) cut into ceil(length / size) near-equal (start, end) pieces."""
    n = -(-length // size)
    return [(length * i // n, length * (i + 1) // n) for i in range(n)]


def serial(fn, *args):
    """``fn(*args)``: on one pool thread with one intra-op thread (:func:`single_threaded`) when
    the first argument is a CPU tensor, directly elsewhere."""
    if args[0].device.type == "cpu":
        return single_threaded(fn, *args)
    return fn(*args)
