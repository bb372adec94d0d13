"""Peak resident memory of one call, for the benchmarks (Linux: reads /proc/self).

``peak_rss_mib(fn)`` collects garbage, hands freed heap memory back to the OS (``malloc_trim``),
resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5), runs ``fn()`` once and
returns VmHWM - VmRSS-before in MiB: what the call added at its peak (activations, temporaries,
new gradients). Run it in a process whose glibc maps big blocks (a low ``M_MMAP_THRESHOLD``) so
that freed tensors really leave the resident set.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/self/status")


def peak_rss_mib(fn) -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    before = _status_kib("VmRSS:")
    fn()
    return (_status_kib("VmHWM:") - before) / 1024
