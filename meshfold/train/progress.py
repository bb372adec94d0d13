"""Rank 0's progress line: step, loss, tokens/s, MFU, the busiest rank's memory, the worst MoE
layer's expert-parallel load (busiest ep rank's rows over the mean) and ETA.

On a terminal the line rewrites itself; in a log (not a TTY) it prints about twenty lines per run
so a CI log or a redirected file stays readable.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


def _utilization(r: dict) -> str:
    """MFU against the hardware peak where one is known; else the share of the GEMM rate these
    ranks measured, named so it is never read as MFU."""
    if r.get("mfu") is not None:
        return f"MFU {100 * r['mfu']:.1f}%"
    return f"{100 * r['mfu_of_measured_gemm']:.1f}% of measured GEMM"


def _memory(r: dict) -> str:
    """The busiest rank's memory peak of the step, and which rank that is (and the same of the
    tensor peak, where it is recorded)."""
    m = r.get("memory")
    if not m:
        return ""
    tensors = (f", tensors {m['tensor_mib'][m['tensor_peak_rank']]:,.1f} MiB (rank {m['tensor_peak_rank']})"
               if "tensor_mib" in m else "")
    return f"  mem {m['mib'][m['peak_rank']]:,.0f} MiB (rank {m['peak_rank']}){tensors}"


def _ep_load(r: dict) -> str:
    """The worst MoE layer's busiest ep rank's rows over the mean, and which MoE layer (counted
    from 0 among the MoE layers) that is."""
    ratios = r.get("ep_max_over_mean")
    if not ratios:
        return ""
    worst = max(range(len(ratios)), key=lambda i: ratios[i])
    return f"  ep load max/mean {ratios[worst]:.2f} (moe layer {worst})"


class Progress:
    def __init__(self, total: int, start: int = 0, stream=None):
        self.total, self.start = total, start
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.every = max(1, (total - start) // 20)

    def update(self, r: dict) -> None:
        step = r["step"]
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        width = 24
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        val = f" val {r['val_loss']:.3f}" if "val_loss" in r else ""
        line = (f"[{bar}] step {step}/{self.total}  loss {r['loss']:.4f}{val}  "
                f"{r['tokens_per_s']:,.0f} tok/s  {_utilization(r)}{_memory(r)}{_ep_load(r)}  ETA {eta:5.0f}s")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")  # clear what a longer line left behind
        elif done % self.every == 0 or step == self.total or "val_loss" in r:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (a skipped step): on a terminal it takes the progress line's place,
        and the next update draws the progress line below it."""
        self.stream.write(f"\r{text}\033[K\n" if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()
