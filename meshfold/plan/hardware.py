"""What a GPU cluster offers the planner: peak compute, memory and the two link speeds.

Every efficiency factor is global (the same for every model and layout) and carries its source,
so an estimate can be checked by hand. Figures are per GPU; bandwidths are one direction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Hardware", "HARDWARE", "hardware"]

GIB = 2**30


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
        gemm_efficiency: fraction of peak a large GEMM reaches (every GEMM and attention).
        gemm_overhead_us: fixed time each GEMM problem costs on top of ``flops / (eff * peak)``
            (prologue, epilogue, last partial wave); it is what makes small expert GEMMs slow.
        nvlink_efficiency, internode_efficiency: fraction of each link's line rate a large
            collective reaches.
        alltoall_internode_efficiency: fraction of the NIC line rate that the off-node share of
            an all-to-all-v reaches. Lower than a ring's: every rank sends to every off-node peer
            at once (many fragmented point-to-point transfers, receivers see fan-in), where a
            ring streams to one neighbour; and an all-to-all cannot aggregate several NICs.
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
    gemm_efficiency: float = 0.71
    gemm_overhead_us: float = 15.5
    nvlink_efficiency: float = 0.82
    internode_efficiency: float = 0.96
    alltoall_internode_efficiency: float = 0.5
    reserved_gib: float = 4.0

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "memory_gib", "nvlink_gbps", "internode_gbps", "hbm_tbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f} must be positive, got {getattr(self, f)!r}")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ValueError(f"Hardware.gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        for f in ("gemm_efficiency", "nvlink_efficiency", "internode_efficiency", "alltoall_internode_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"Hardware.{f} must be in (0, 1], got {getattr(self, f)!r}")

    @property
    def usable_bytes(self) -> float:
        """Bytes per GPU left for parameters, gradients, optimizer state and activations."""
        return (self.memory_gib - self.reserved_gib) * GIB

    def gemm_time(self, flops: float, problems: float = 1.0) -> float:
        """Seconds for ``problems`` GEMMs doing ``flops`` in all: ``flops / (eff * peak) + problems * t0``."""
        return flops / (self.peak_tflops * 1e12 * self.gemm_efficiency) + problems * self.gemm_overhead_us * 1e-6

    def hbm_time(self, nbytes: float) -> float:
        """Seconds a memory-bound kernel needs to move ``nbytes`` (at the HBM line rate)."""
        return nbytes / (self.hbm_tbps * 1e12)

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


# Sources (see docs/plan.md, "Assumptions"):
# * peak 989.5 TFLOP/s, NVLink 450 GB/s one way, IB 400 Gb/s = 50 GB/s per GPU, 8 GPUs per node:
#   the DGX H100 setup of arXiv 2504.14960. H200 (REFERENCE.md section 5): same compute and links,
#   141 GB HBM3e.
# * memory: H100 80GB reports 81559 MiB in nvidia-smi; H200: 141 GB nominal (141e9 bytes).
# * gemm_efficiency 0.71: torch._grouped_mm bf16 on H200 for large balanced shapes (pytorch#156203).
# * gemm_overhead_us 15.5: the best grouped GEMM of tgale96/grouped_gemm PR #37 reaches 160.5 TFLOP/s
#   (16.2% of H100 peak) on 128 experts x (M=512, K=2048, N=1536). With t = W / (0.71 peak) + t0 per
#   expert problem, W = 2*512*2048*1536 FLOPs: t0 = W / 160.5e12 - W / (0.71 * 989.5e12) = 15.5 us.
# * hbm_tbps: 3.35 TB/s (H100 SXM), 4.8 TB/s (H200), REFERENCE.md section 5; no efficiency factor
#   is applied (memory-bound kernels are a small term; line rate is an optimistic bound).
# * nvlink_efficiency 0.82: NCCL reaches about 370 GB/s of the 450 GB/s NVLink line rate ("~20%
#   protocol overhead", NVIDIA/nccl-tests#212).
# * internode_efficiency 0.96: a ConnectX-7 NIC at NDR 400 Gb/s reaches 48-49 GB/s of its 50 GB/s
#   (NVIDIA/nccl-tests#267); 48 / 50 = 0.96.
# * alltoall_internode_efficiency 0.5: NCCL's all-to-all is bounded by one NIC per GPU and its
#   off-node share sets the time (NVIDIA/nccl-tests#130, #267); a fragmented all-to-all-v across
#   nodes typically uses about 50% of a 400 Gb/s NIC (25 GB/s; the latency-bandwidth model of
#   impala-blog.pages.dev/widgets/comm-roofline). Cross-check, not a fit: with it the paper's
#   ablation (arXiv 2504.14960 sec. 4.4: communication > 70% of a G8T8 MoE layer once EP x ETP
#   leaves the node) is reproduced (74%); at the ring efficiency 0.96 it would be 60%.
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
