"""The machine a timing comes from: the CPU's model, whether it has AMX (bf16 GEMMs several
times the fp32 rate) or only AVX-512 BF16 (about half the fp32 rate), and the kernel level
torch dispatches to. A bf16 figure means nothing without them, so every timing benchmark
prints :func:`describe` first (to stderr, beside the figures it prints)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

from meshfold.runtime import compat

__all__ = ["describe", "print_machine"]

AMX = ("amx_bf16", "amx_tile")  # what oneDNN needs for AMX bf16 GEMMs


def describe(cpuinfo: str | None = None) -> str:
    """One line: CPU model and count, its bf16 matrix instructions (AMX, AVX-512 BF16 or
    neither), a oneDNN ISA cap if one is set (``ONEDNN_MAX_CPU_ISA`` can keep AMX unused), and
    torch's version and CPU kernel level. ``cpuinfo``: ``/proc/cpuinfo``'s text (read when
    None; on a machine without it, the model is ``platform``'s and the flags unknown)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())  # the first CPU's; all are alike
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "flags" not in fields:
        bf16 = "bf16 instructions unknown (no CPU flags readable)"
    else:
        flags = set(fields["flags"].split())
        bf16 = ("AMX (amx_bf16, amx_tile)" if all(f in flags for f in AMX) else
                "avx512_bf16, no AMX" if "avx512_bf16" in flags else "no AMX, no avx512_bf16")
    cap = next((f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if k in os.environ), None)
    return (f"{model}, {os.cpu_count()} CPUs; {bf16}{f' ({cap})' if cap else ''}; torch {compat.torch_version()}, "
            f"CPU kernels {torch.backends.cpu.get_cpu_capability()}")


def print_machine() -> None:
    """Print :func:`describe` to stderr, as ``machine: ...``."""
    print(f"machine: {describe()}", file=sys.stderr, flush=True)
