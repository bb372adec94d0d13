"""What a GPU cluster offers the planner: peak compute, memory, links, and how fast kernels run.

Every efficiency is a function of the work's shape (GEMM rows and columns, attention sequence
length and head dim, message size and whether a group leaves its node), read off a public kernel
or collective measurement cited beside it (and in benchmarks/RESULTS.md, "Planner: the time
model away from Table 1"); none is fitted to the paper's Table 1. Figures are per GPU; bandwidths are one
direction.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, replace
from functools import lru_cache

__all__ = ["Hardware", "HARDWARE", "hardware", "ATTENTION_KERNELS", "attention_tflops"]

GIB = 2**30

# Causal and non-causal attention throughput on one H100 80GB SXM5, BF16, TFLOP/s at each sequence
# length of _ATTN_SEQ, per kernel and head dim: the bar labels of FlashAttention-3 (Shah et al.,
# arXiv 2407.08608), Fig. 5 (forward, with and without causal mask) and Fig. 6 (backward, no mask),
# which measure FlashAttention-2 alongside (batch x seqlen = 16k tokens, hidden 2048). FLOPs as
# FlashAttention counts them: forward 4 s^2 n d (halved with a causal mask), backward 2.5x that.
_ATTN_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
_ATTN_TFLOPS = {  # (kernel, head dim): {"causal": fwd, "full": fwd, "bwd": bwd without mask}
    ("fa3", 64): {"causal": (197, 265, 371, 420, 460, 473), "full": (333, 392, 460, 476, 496, 497),
                  "bwd": (272, 363, 422, 453, 472, 474)},
    ("fa3", 128): {"causal": (292, 423, 521, 579, 602, 616), "full": (467, 565, 625, 638, 646, 648),
                   "bwd": (316, 424, 501, 542, 559, 561)},
    ("fa2", 64): {"causal": (180, 229, 262, 284, 295, 299), "full": (282, 306, 318, 321, 322, 324),
                  "bwd": (198, 238, 264, 279, 287, 291)},
    ("fa2", 128): {"causal": (191, 260, 298, 319, 333, 335), "full": (309, 350, 362, 368, 370, 370),
                   "bwd": (214, 260, 291, 310, 318, 322)},
}
ATTENTION_KERNELS = ("fa3", "fa2")
# The attention kernel meshfold itself runs on CUDA: the ring's blocks call torch's flash kernel,
# FlashAttention-2; the attention layers call scaled_dot_product_attention, which on sm_90 with
# torch 2.14 takes cuDNN attention first (its own priority; the fake-CUDA dry run reports it),
# charged here at FlashAttention-2's rate too, unmeasured for cuDNN.
# The presets keep "fa3", the rate of the Megatron-Core runs the paper's Table 1 measured.
MESHFOLD_ATTENTION_KERNEL = "fa2"


def _interp_log2(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear in log2(x) through (xs, ys), held flat outside the measured range."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect_right(xs, x) - 1
    t = (math.log2(x) - math.log2(xs[i])) / (math.log2(xs[i + 1]) - math.log2(xs[i]))
    return ys[i] + t * (ys[i + 1] - ys[i])


@lru_cache(maxsize=65536)  # the search asks for a few lengths many times
def attention_tflops(kernel: str, seq: float, head_dim: float, causal: bool, backward: bool) -> float:
    """Measured attention TFLOP/s on H100 at one kernel call of ``seq`` queries and keys.

    Interpolated in log2(seq) between the measured lengths (512 .. 16k) and held flat outside them
    (the curves have flattened by 8k-16k); interpolated in log2(head_dim) between 64 and 128 and
    held at 128 above it (FlashAttention-3's causal head dim 256 is within 4% of 128, Fig. 5). The
    backward with a causal mask is not in the figures: it is the unmasked backward scaled by the
    forward's causal/unmasked ratio at the same length (masking wastes the same share of tiles).
    """
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} unknown; valid: {list(ATTENTION_KERNELS)}")

    def at(d: int) -> float:
        tab = _ATTN_TFLOPS[(kernel, d)]
        fwd = _interp_log2(_ATTN_SEQ, tab["causal" if causal else "full"], seq)
        if not backward:
            return fwd
        bwd = _interp_log2(_ATTN_SEQ, tab["bwd"], seq)
        return bwd * (fwd / _interp_log2(_ATTN_SEQ, tab["full"], seq)) if causal else bwd

    return _interp_log2((64, 128), (at(64), at(128)), head_dim)


@dataclass(frozen=True)
class Hardware:
    """One GPU type in a cluster of identical nodes.

    Args:
        name: preset name, e.g. ``"h100"``.
        peak_tflops: dense BF16 peak per GPU (TFLOP/s); MFU is measured against it.
        memory_gib: memory per GPU the allocator can hand out (GiB).
        nvlink_gbps: intra-node bandwidth per GPU, one direction (GB/s).
        internode_gbps: inter-node bandwidth per GPU, one direction (GB/s); one NIC per GPU.
        gpus_per_node: GPUs sharing one NVLink domain; ranks ``[k*n, (k+1)*n)`` form node ``k``.
        hbm_tbps: memory bandwidth per GPU (TB/s); memory-bound kernels (norms, SwiGLU, token
            permutation) run at this rate.
        gemm_efficiency: fraction of peak a large dense GEMM reaches (projections, head).
        gemm_launch_us: fixed time each dense GEMM costs on top of ``flops / (eff * peak)``
            (launch, prologue, the last partial wave).
        grouped_gemm_efficiency: fraction of peak the expert GEMMs reach for large experts.
        grouped_gemm_tail: output elements' worth of work each expert's GEMM (one problem of a
            grouped GEMM) loses to the partial last wave of its tiles: an expert of ``rows x n``
            outputs runs at ``eff * rows n / (rows n + tail)``; it is what makes small
            (fine-grained) expert GEMMs slow per FLOP, and it costs time in proportion to ``k``.
        gemm_row_tile: rows a GEMM tile covers; an expert's rows are padded up to a multiple.
        attention_kernel: whose measured attention throughput applies (``"fa3"``, ``"fa2"``).
        nvlink_efficiency, internode_efficiency: fraction of each link's line rate a large
            collective reaches.
        alltoall_internode_efficiency: fraction of the NIC line rate that the off-node share of
            an all-to-all-v reaches. Lower than a ring's: every rank sends to every off-node peer
            at once (many fragmented point-to-point transfers, receivers see fan-in), where a
            ring streams to one neighbour; and an all-to-all cannot aggregate several NICs.
        nvlink_latency_us, internode_latency_us: fixed time of one collective call (or one ring
            step) inside a node and across nodes; with it a collective of ``n`` bytes reaches
            ``n / (latency + n / bandwidth)``, half its bandwidth at ``latency * bandwidth`` bytes.
        reserved_gib: memory per GPU taken before the model allocates anything (CUDA context,
            NCCL buffers, allocator fragmentation).
    """

    name: str
    peak_tflops: float
    memory_gib: float
    nvlink_gbps: float
    internode_gbps: float
    hbm_tbps: float = 3.35
    gpus_per_node: int = 8
    gemm_efficiency: float = 0.806
    gemm_launch_us: float = 2.3
    grouped_gemm_efficiency: float = 0.71
    grouped_gemm_tail: float = 1.2e6
    gemm_row_tile: int = 64
    attention_kernel: str = "fa3"
    nvlink_efficiency: float = 0.82
    internode_efficiency: float = 0.96
    alltoall_internode_efficiency: float = 0.5
    nvlink_latency_us: float = 12.5
    internode_latency_us: float = 25.0
    reserved_gib: float = 4.0

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "memory_gib", "nvlink_gbps", "internode_gbps", "hbm_tbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f} must be positive, got {getattr(self, f)!r}")
        for f in ("gpus_per_node", "gemm_row_tile"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"Hardware.{f} must be a positive integer, got {v!r}")
        for f in ("gemm_efficiency", "grouped_gemm_efficiency", "nvlink_efficiency", "internode_efficiency",
                  "alltoall_internode_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"Hardware.{f} must be in (0, 1], got {getattr(self, f)!r}")
        for f in ("gemm_launch_us", "grouped_gemm_tail", "nvlink_latency_us", "internode_latency_us"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"Hardware.{f} must be >= 0, got {getattr(self, f)!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"Hardware.attention_kernel = {self.attention_kernel!r}; valid: {list(ATTENTION_KERNELS)}")

    @property
    def usable_bytes(self) -> float:
        """Bytes per GPU left for parameters, gradients, optimizer state and activations."""
        return (self.memory_gib - self.reserved_gib) * GIB

    # ---- compute ------------------------------------------------------------------------------
    def gemm_time(self, flops: float, problems: float = 1.0) -> float:
        """Seconds for ``problems`` dense GEMMs doing ``flops`` in all: ``flops / (eff peak) + problems t0``."""
        return flops / (self.peak_tflops * 1e12 * self.gemm_efficiency) + problems * self.gemm_launch_us * 1e-6

    def grouped_gemm_time(self, rows: float, n: float, k: float, problems: float) -> float:
        """Seconds for a grouped GEMM of ``problems`` experts, each [rows, k] @ [k, n].

        Each expert's rows are padded to a multiple of ``gemm_row_tile`` (a tile computes whole
        rows), and each expert loses ``grouped_gemm_tail`` outputs' worth of work to its last
        partial wave: per-expert time is ``2 (ceil(rows / tile) tile n + tail) k / (eff peak)``.
        ``rows`` is the balanced mean.
        """
        if rows <= 0 or problems <= 0:
            return 0.0
        padded = math.ceil(rows / self.gemm_row_tile - 1e-9) * self.gemm_row_tile
        return problems * 2 * (padded * n + self.grouped_gemm_tail) * k / (
            self.peak_tflops * 1e12 * self.grouped_gemm_efficiency)

    def grouped_gemm_fraction(self, rows: float, n: float, k: float) -> float:
        """Fraction of peak an expert GEMM of [rows, k] @ [k, n] reaches (its useful FLOPs / time)."""
        return 2 * rows * n * k / (self.grouped_gemm_time(rows, n, k, 1) * self.peak_tflops * 1e12)

    def attention_fraction(self, seq: float, head_dim: float, causal: bool = True, backward: bool = False) -> float:
        """Fraction of peak one flash-attention call over ``seq`` tokens reaches (see attention_tflops)."""
        return attention_tflops(self.attention_kernel, seq, head_dim, causal, backward) / self.peak_tflops

    def attention_time(self, flops: float, seq: float, head_dim: float, causal: bool, backward: bool) -> float:
        """Seconds for ``flops`` (as FlashAttention counts them) in calls over ``seq`` tokens."""
        if flops <= 0:
            return 0.0
        return flops / (self.attention_fraction(seq, head_dim, causal, backward) * self.peak_tflops * 1e12)

    def hbm_time(self, nbytes: float) -> float:
        """Seconds a memory-bound kernel needs to move ``nbytes`` (at the HBM line rate)."""
        return nbytes / (self.hbm_tbps * 1e12)

    # ---- communication ------------------------------------------------------------------------
    def link_bytes_per_s(self, intra_node: bool) -> float:
        """Achieved bytes/s of a large collective on NVLink or on the inter-node network."""
        if intra_node:
            return self.nvlink_gbps * 1e9 * self.nvlink_efficiency
        return self.internode_gbps * 1e9 * self.internode_efficiency

    def alltoall_bytes_per_s(self, intra_node: bool) -> float:
        """Achieved bytes/s per GPU for the on-node (NVLink) or off-node share of an all-to-all-v."""
        if intra_node:
            return self.nvlink_gbps * 1e9 * self.nvlink_efficiency
        return self.internode_gbps * 1e9 * self.alltoall_internode_efficiency

    def latency(self, intra_node: bool) -> float:
        """Seconds of one collective call (or ring step) that do not depend on its size."""
        return 1e-6 * (self.nvlink_latency_us if intra_node else self.internode_latency_us)

    def collective_time(self, nbytes: float, intra_node: bool, steps: int = 1) -> float:
        """Seconds for a ring collective moving ``nbytes`` per rank in ``steps`` messages."""
        if nbytes <= 0:
            return 0.0
        return steps * self.latency(intra_node) + nbytes / self.link_bytes_per_s(intra_node)

    def bus_bandwidth(self, nbytes: float, intra_node: bool) -> float:
        """Bytes/s one collective of ``nbytes`` per rank reaches (nccl-tests' busbw)."""
        return nbytes / self.collective_time(nbytes, intra_node)


# Sources (docs/plan.md, "Assumptions"; benchmarks/RESULTS.md, "Planner: the time model away from Table 1"):
# * peak 989.5 TFLOP/s, NVLink 450 GB/s one way, IB 400 Gb/s = 50 GB/s per GPU, 8 GPUs per node:
#   the DGX H100 setup of arXiv 2504.14960. H200 (NVIDIA's H200 datasheet): same compute and links,
#   141 GB HBM3e; its kernels are taken at H100's measured rates (same SMs and clocks).
# * memory: H100 80GB reports 81559 MiB in nvidia-smi; H200: 141 GB nominal (141e9 bytes).
# * gemm_efficiency 0.806, gemm_launch_us 2.3: square BF16 torch.matmul on an H100 80GB HBM3
#   (torch 2.7, zzc0721/torch-performance-test-data#79): 788.7 TFLOP/s at 4096^3 and 797.5 at
#   8192^3; t = W / (eff peak) + t0 through both gives t0 = 2.3 us, eff = 797.5 / 989.5 = 0.806 at
#   8192^3 (2048^3 is then predicted at 744 against 677 measured; 1024^3, 32 output tiles for 132
#   SMs, at 430 against 177: GEMMs with fewer tiles than SMs are outside this form).
# * grouped_gemm_efficiency 0.71: torch._grouped_mm bf16 on H200, 16 x (128000 x 7168 x 7168) in
#   298.7 ms (pytorch#156203), the large-expert limit.
# * grouped_gemm_tail 2.4e6: Transformer Engine 2.2's grouped GEMM (the multi-stream cuBLAS path of
#   GroupedLinear, which Megatron-Core's TEGroupedMLP runs) on H100, NVIDIA/TransformerEngine#2045:
#   508.77 TFLOP/s at 8 x (M 4096, N 768, K 2048) and 398.81 at 16 x (2048, 768, 2048). With
#   eff = 0.71 M N / (M N + tail) both give tail = 2.40e6 (2.398e6 and 2.397e6; 36.6 tiles of
#   128 x 256). Checks: TE 2.7's figures in the same PR (627.9, 553.9) give 0.75e6 and 0.85e6
#   (a newer TE loses less per expert, same form); tgale96/grouped_gemm PR #37 (CUTLASS SM90,
#   128 x (512, 1536, 2048), 160.5 TFLOP/s) is 42% below this form (0.28 of peak predicted, 0.16
#   measured): a slower kernel.
# * gemm_row_tile 64: Hopper's warpgroup MMA computes 64-row tiles (wgmma.m64nNk16).
# * attention: FlashAttention-3 (arXiv 2407.08608) Fig. 5 and 6, the tables above.
# * hbm_tbps: 3.35 TB/s (H100 SXM), 4.8 TB/s (H200), NVIDIA's H100 and H200 datasheets; no efficiency factor
#   is applied (memory-bound kernels are a small term; line rate is an optimistic bound).
# * nvlink_efficiency 0.82: NCCL reaches about 370 GB/s of the 450 GB/s NVLink line rate ("~20%
#   protocol overhead", NVIDIA/nccl-tests#212).
# * internode_efficiency 0.96: a ConnectX-7 NIC at NDR 400 Gb/s reaches 48-49 GB/s of its 50 GB/s
#   (NVIDIA/nccl-tests#267); 48 / 50 = 0.96.
# * nvlink_latency_us 12.5: nccl-tests all_reduce_perf at 4-16 bytes on 8 NVLink-connected
#   Hopper GPUs (H20, same NVLink 4 as H100) takes 12.5 us (deepseek-ai/DeepEP#303).
# * internode_latency_us 25: NCCL's own tuning model on an H100 InfiniBand cluster prices a small
#   inter-node all-reduce at 25.2 us (its "128 Bytes -> Algo 0 proto 0 time 25.214764" log line,
#   NVIDIA/nccl#1453; that cluster measured 62 us, attributed there to its misconfiguration).
# * alltoall_internode_efficiency 0.5: NCCL's all-to-all is bounded by one NIC per GPU and its
#   off-node share sets the time (NVIDIA/nccl-tests#130, #267); a fragmented all-to-all-v across
#   nodes typically uses about 50% of a 400 Gb/s NIC (25 GB/s; the latency-bandwidth model of
#   impala-blog.pages.dev/widgets/comm-roofline). Cross-check, not a fit: with it the paper's
#   ablation (arXiv 2504.14960 sec. 4.4: communication > 70% of a G8T8 MoE layer once EP x ETP
#   leaves the node) is reproduced; at the ring efficiency 0.96 it would not be.
# * reserved_gib 4: CUDA context + NCCL communicator buffers + allocator slack; an assumption
#   (order of magnitude of a CUDA context plus a few NCCL communicators), not a measurement.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", peak_tflops=989.5, memory_gib=81559 / 1024, nvlink_gbps=450.0, internode_gbps=50.0),
    "h200": Hardware("h200", peak_tflops=989.5, memory_gib=141e9 / GIB, nvlink_gbps=450.0, internode_gbps=50.0,
                     hbm_tbps=4.8),
}


def hardware(name: str | Hardware, **overrides: float) -> Hardware:
    """A preset by name (``"h100"``, ``"h200"``), optionally with fields replaced."""
    if isinstance(name, Hardware):
        base = name
    else:
        key = str(name).lower()
        if key not in HARDWARE:
            raise ValueError(f"unknown GPU {name!r}; valid choices: {sorted(HARDWARE)}")
        base = HARDWARE[key]
    return replace(base, **overrides) if overrides else base
