"""Grouped GEMM on CPU: one small GEMM per (expert, block), shared among a few Python threads.

Legend: M = token rows (expert-major), K = input dim, N = output dim, E = experts, W = workers.

Why not ``F.grouped_mm``: on CPU it is a loop of ``mm`` calls, each spread over the intra-op
threads with an OpenMP fork/join. Expert GEMMs are thin (a fine-grained MoE gives each expert
~256 rows), so the per-call barriers cost 10-20% of the GEMM time on a quiet machine, and several
times that when another process shares the cores: a descheduled thread stalls every barrier
(benchmarks/RESULTS.md, "moe_layer", has the measurements). Here W workers each run whole block
GEMMs with ``intra-op threads / W`` threads (1 on a small machine) and take the next block from a
shared queue, so a stalled worker delays only its own block and there is one join per call.
``mm`` releases the GIL, so the workers overlap.

Every output block is written by exactly one GEMM of a fixed shape, whichever worker runs it, so
results do not depend on scheduling. The caller's thread settings are never touched: the workers
are pool threads and the caller waits.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

MAX_WORKERS = 8  # beyond this the Python dispatch of the blocks (under the GIL) would dominate
ROW_BLOCK = 512  # rows per block of the row GEMMs: thin enough to balance, fat enough to run fast
TASKS_PER_WORKER = 4  # aim for at least this many blocks per worker, for balance

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
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="meshfold-gmm")
        return pool


def _run(tasks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``torch.mm(a, b, out=c)`` for every (a, b, c), on up to W workers; operands detached."""
    run_tasks([functools.partial(torch.mm, a, b, out=c) for a, b, c in tasks])


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
    per call. When another process holds one of the cores, each join can wait for a scheduler
    tick (~4 ms): on this 2-core machine ``index_add_`` of [8192, 512] bf16 rows into 4096 rows
    took 80-88 ms with 2 threads while the other core was busy, 0.4-2.3 ms with 2 threads on idle
    cores and 0.7-0.9 ms with 1 (benchmarks/RESULTS.md, moe_layer). The ops used here compute the
    same values on any number of threads (the tests compare them). The caller's grad and
    inference modes carry over; its thread count is left as it was.
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
    (:func:`run_tasks`) for CPU tensors, as one piece elsewhere. Parts must write disjoint outputs.

    For memory-bound row-wise work between grouped GEMMs. As ATen ops on the caller's thread it
    would run in an OpenMP team, whose other threads then spin-wait for the next parallel region
    (libgomp's default, 300k spins: 7.0 ms of a core after every op here, 0.08 ms with
    ``OMP_WAIT_POLICY=passive``), taking a core from the next grouped GEMM's workers."""
    if device.type != "cpu":
        part(0, length)
    elif length:
        run_tasks([functools.partial(part, a, b) for a, b in blocks(length, max(1, size))])


def blocks(length: int, size: int) -> list[tuple[int, int]]:
    """[0, length) cut into ceil(length / size) near-equal (start, end) pieces."""
    n = -(-length // size)
    return [(length * i // n, length * (i + 1) // n) for i in range(n)]


def rows_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """c [M, N] = a [M, K] @ b [E, K, N] per expert row group; rows past offsets[-1] are zero.

    Each expert's rows are cut into blocks of at most ROW_BLOCK rows (fewer, near-equal ones
    when there are few experts, so every worker gets several blocks).
    """
    M, N = a.shape[0], b.shape[2]
    a, b = a.detach(), b.detach()
    ends = offsets.tolist()
    c = a.new_empty((M, N))
    c[ends[-1]:] = 0
    workers = min(torch.get_num_threads(), MAX_WORKERS)
    size = max(64, min(ROW_BLOCK, -(-ends[-1] // (TASKS_PER_WORKER * workers)))) if ends[-1] else 1
    tasks, start = [], 0
    for e, end in enumerate(ends):
        for s, t in blocks(end - start, size):
            tasks.append((a[start + s:start + t], b[e], c[start + s:start + t]))
        start = end
    _run(tasks)
    return c


def dw_mm(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw [E, K, N] = x_e^T [K, M_e] @ dy_e [M_e, N] per expert (zero for experts without rows).

    The reduction runs over an expert's rows, so blocks split the output rows K instead (each
    block owns its slice of dw; no two GEMMs add into one place).
    """
    K, N, E = x.shape[1], dy.shape[1], offsets.numel()
    x, dy = x.detach(), dy.detach()
    dw = x.new_empty((E, K, N))
    workers = min(torch.get_num_threads(), MAX_WORKERS)
    k_pieces = min(-(-TASKS_PER_WORKER * workers // E), max(1, K // 64))
    tasks, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        if end == start:
            dw[e] = 0
            continue
        for k0, k1 in blocks(K, -(-K // k_pieces)):
            tasks.append((x[start:end, k0:k1].t(), dy[start:end], dw[e, k0:k1]))
        start = end
    _run(tasks)
    return dw
