"""Grouped GEMM on CPU: one small GEMM per (expert, block), shared among the CPU pool's workers.

Legend: M = token rows (expert-major), K = input dim, N = output dim, E = experts, W = workers.

Why not ``F.grouped_mm``: on CPU it is a loop of ``mm`` calls, each spread over the intra-op
threads with an OpenMP fork/join. Expert GEMMs are thin (a fine-grained MoE gives each expert
~256 rows), so the per-call barriers are a real share of the GEMM time on a quiet machine, and
far more when another process shares the cores: a descheduled thread stalls every barrier
(benchmarks/bench_moe_layer.py measures it). Here W workers each run whole block
GEMMs on the CPU pool (:mod:`.cpu_pool`), with ``intra-op threads / W`` threads each, taking the
next block from a shared queue, so a stalled worker delays only its own block and there is one
join per call.

Every output block is written by exactly one GEMM of a fixed shape, whichever worker runs it, so
results do not depend on scheduling.
"""

from __future__ import annotations

import functools

import torch

from meshfold.kernels.cpu_pool import MAX_WORKERS, blocks, run_tasks

ROW_BLOCK = 512  # rows per block of the row GEMMs: thin enough to balance, fat enough to run fast
TASKS_PER_WORKER = 4  # aim for at least this many blocks per worker, for balance


def _run(tasks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``torch.mm(a, b, out=c)`` for every (a, b, c), on up to W workers; operands detached."""
    run_tasks([functools.partial(torch.mm, a, b, out=c) for a, b, c in tasks])


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
