"""Rank 0's progress line: step, loss, tokens/s, MFU, the busiest rank's memory, the worst MoE
layer's expert-parallel load (busiest ep rank's rows over the mean) and ETA; after a step that
re-placed experts, a line of its own saying what the re-placement did and, with hot-expert
copies, which experts are copied to which ep ranks.

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


def replacement_line(r: dict) -> str:
    """What a re-placement step did (empty for other steps): the worst MoE layer's busiest ep rank
    over the mean before and after (on the loads it was decided from), the bytes moved and, with
    copies, where the worst layer's copies are (every layer's: ``metrics.jsonl``)."""
    placed = r.get("expert_placement")
    if not placed:
        return ""
    line = (f"step {r['step']}: experts re-placed, ep load max/mean {placed['max_over_mean_before']:.2f} -> "
            f"{placed['max_over_mean_after']:.2f} (worst moe layer), {placed['moved_bytes']:,} bytes moved")
    copies = placed.get("copies")
    if copies and r.get("ep_rank_rows"):
        from meshfold.train.expert_load import describe_copies

        ep = len(r["ep_rank_rows"][0])
        ratios = r.get("ep_max_over_mean") or [0.0] * len(copies)
        worst = max(range(len(copies)), key=lambda i: ratios[i])
        line += f"; copies (moe layer {worst}): {describe_copies(copies[worst], ep) or 'none'}"
    return line


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
        placed = replacement_line(r)
        if placed:
            self.note(placed)
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
