"""Keep freed CPU memory in the process for reuse, instead of handing it back to the OS.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a request of 32 MiB or
more (fp32 [16384, 512], one fine-grained MoE layer's expert rows) with a fresh ``mmap`` and
unmaps it on ``free``, so every such tensor is page-faulted in again, 4 KiB at a time, by the
kernel zeroing each page, which can cost more than the op that filled it. A training step
allocates the same large buffers every step, so it pays this every step. The CUDA side has a
caching allocator; the CPU side does not, and PyTorch's CPU tuning guide recommends swapping in
jemalloc or tcmalloc for this reason.

:func:`retain_freed_memory` gets the same effect from glibc itself, with three ``mallopt`` calls:
requests below ``threshold`` come from the heap (not ``mmap``); freed heap memory is kept (the
heap top is never trimmed); and every thread allocates from the one main heap (one arena), so a
buffer freed by one thread is reused by another (meshfold's expert-GEMM and combine workers
allocate on pool threads; with an arena per thread, their heaps are unmapped and faulted in again
as they empty and fill); benchmarks/bench_moe_layer.py counts the page faults a step takes with
and without them. The cost: the process keeps its peak CPU memory until it exits, as the CUDA
caching allocator does, plus fragmentation, and threads share one allocator lock.

    >>> from meshfold.runtime.malloc import retain_freed_memory
    >>> retain_freed_memory()  # True on glibc (Linux); False, and nothing changed, elsewhere
    True

It affects the whole process and cannot be undone (glibc then stops adapting its threshold),
so meshfold calls it only in entry points it owns (``meshfold train``, the benchmarks), never
on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["retain_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
DEFAULT_THRESHOLD = 1 << 30  # 1 GiB: a single larger tensor still gets its own mapping


def retain_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve allocations below ``threshold`` bytes from one heap, shared by all threads, and
    never trim it.

    Returns True when glibc accepted all three settings, False when the C library is not glibc
    (nothing changed) or refused one of them (each setting is independent and harmless alone).
    """
    if not isinstance(threshold, int) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold!r}")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: musl and macOS differ in what mallopt means
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = min(threshold, 2**31 - 1)  # an int in C
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok_arena = mallopt(_M_ARENA_MAX, 1) == 1
    return ok_mmap and ok_trim and ok_arena
