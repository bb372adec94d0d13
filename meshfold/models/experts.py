"""Routed experts (grouped GEMM) and shared experts.

Shapes: N = expert-major rows, H = hidden, F = ffn per expert (its local slice under ETP),
E = experts (local ones under EP).

``w_gate_up`` is [E, H, 2, F]: gate and up projections fused, kept as a separate axis so that
sharding F over ``etp`` gives every rank matching gate and up columns (a flat [E, H, 2F] split
would hand one rank all gates and another all ups). ``w_down`` is [E, F, H]. Both go through
:func:`meshfold.kernels.grouped_mm`, whose offsets are the cumulative row counts per expert.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable
import torch.nn.functional as F
from torch import nn

from meshfold.kernels import cpu_grouped, grouped_mm

__all__ = ["Experts", "SharedExpert", "expert_ffn", "gelu", "swiglu", "swiglu_reference"]


def expert_ffn(x_NH, w_gate_up, w_down, offsets_E, kind: str, masks=(None, None)):
    """Grouped expert MLP: swiglu ``down(silu(gate x) * up x)`` or gelu ``down(gelu(up x))``.

    ``w_gate_up`` [E, H, 2, F] (gelu: [E, H, 1, F]), ``w_down`` [E, F, H], ``offsets_E`` int32.
    ``masks`` are optional tile masks for the two weights (tile-sparse experts).
    """
    E, H, two, Fl = w_gate_up.shape
    h = grouped_mm(x_NH, w_gate_up.reshape(E, H, two * Fl), offsets_E, tile_mask=masks[0])
    if kind == "swiglu":
        a = swiglu(h.view(-1, 2, Fl))
    else:
        a = gelu(h)
    return grouped_mm(a, w_down, offsets_E, tile_mask=masks[1])


def swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of h [N, 2, F] (gate, up) -> [N, F]: :func:`swiglu_reference`'s
    values, with a backward that keeps only h (not ``silu(gate)`` too: one [N, F] buffer less)
    and writes both halves of dh into one [N, 2, F] tensor (no stack of the two halves)."""
    return _SwiGLU.apply(h_N2F)


def swiglu_reference(h_N2F: torch.Tensor) -> torch.Tensor:
    gate, up = h_N2F.unbind(1)
    return F.silu(gate) * up


PART_ELEMENTS = 1 << 19  # elements of h per part of swiglu / gelu on CPU: 1-2 MiB, kept in cache


class _SwiGLU(torch.autograd.Function):
    """On CPU both passes run in row parts on the expert-GEMM pool (:func:`cpu_grouped.in_parts`):
    silu and the products between two grouped GEMMs would otherwise leave OpenMP threads
    spinning on the cores the GEMM workers need (fine bf16 layer: 173-177 -> 146-159 ms a step,
    benchmarks/RESULTS.md, session 5). Elementwise, so the split does not change a value."""

    @staticmethod
    def forward(ctx, h_N2F):
        ctx.save_for_backward(h_N2F)
        a_NF = h_N2F.new_empty((h_N2F.shape[0], h_N2F.shape[2]))

        def part(n0, n1):
            gate, up = h_N2F[n0:n1].unbind(1)
            torch.mul(F.silu(gate), up, out=a_NF[n0:n1])

        _in_row_parts(part, h_N2F)
        return a_NF

    @staticmethod
    @once_differentiable
    def backward(ctx, da_NF):
        (h,) = ctx.saved_tensors
        da_NF = da_NF.contiguous()
        dh_N2F = torch.empty_like(h, memory_format=torch.contiguous_format)

        def part(n0, n1):
            gate, up = h[n0:n1].unbind(1)
            da = da_NF[n0:n1]
            torch.mul(da, F.silu(gate), out=dh_N2F[n0:n1, 1])
            torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh_N2F[n0:n1, 0])

        _in_row_parts(part, h)
        return dh_N2F


def _in_row_parts(part, h: torch.Tensor) -> None:
    """``part(n0, n1)`` over h's rows, in parts of ~PART_ELEMENTS elements (on the pool on CPU)."""
    rows = max(1, PART_ELEMENTS // max(1, math.prod(h.shape[1:])))  # h may have no rows
    cpu_grouped.in_parts(part, h.shape[0], rows, h.device)


def gelu(h_NF: torch.Tensor) -> torch.Tensor:
    """``F.gelu`` (erf form) of h [N, F] and its gradient; on CPU in row parts on the
    expert-GEMM pool, for the same reason as :func:`swiglu`. h is contiguous, so ATen runs each
    part as one vector loop with a scalar tail: an element at a part's end may take the scalar
    erf and differ from one whole ``F.gelu`` by a few ulps (as ``F.gelu``'s own split over OpenMP
    threads does). The parts are fixed by the shape, so results are deterministic."""
    return _GeLU.apply(h_NF)


class _GeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NF):
        ctx.save_for_backward(h_NF)
        a_NF = torch.empty_like(h_NF, memory_format=torch.contiguous_format)

        def part(n0, n1):
            torch.ops.aten.gelu.out(h_NF[n0:n1], out=a_NF[n0:n1])

        _in_row_parts(part, h_NF)
        return a_NF

    @staticmethod
    def backward(ctx, da_NF):
        (h,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a gradient that can itself be differentiated
            return torch.ops.aten.gelu_backward(da_NF, h)
        da_NF = da_NF.contiguous()
        dh_NF = torch.empty_like(h, memory_format=torch.contiguous_format)

        def part(n0, n1):
            torch.ops.aten.gelu_backward.grad_input(da_NF[n0:n1], h[n0:n1], grad_input=dh_NF[n0:n1])

        _in_row_parts(part, h)
        return dh_NF


class Experts(nn.Module):
    """E routed experts' weights. Computation is :func:`expert_ffn` on the local shards."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, kind: str = "swiglu",
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.kind = kind
        two = 2 if kind == "swiglu" else 1
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, hidden, two, ffn, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn, hidden, dtype=dtype))
        nn.init.normal_(self.w_gate_up, std=hidden ** -0.5)
        nn.init.normal_(self.w_down, std=ffn ** -0.5)

    def forward(self, x_MH, offsets_E, local=lambda name, p: p, local_mask=lambda name, m: m):
        """:func:`expert_ffn` on ``local(name, weight)``, this rank's shards (the layer's comm),
        with this rank's slices of the tile masks if there are any. The weights are read here,
        inside the module call, so module hooks (FSDP2's all-gather of expert weights over
        ``edp``) see it."""
        masks = (None, None)
        if hasattr(self, "mask_gate_up"):
            m1 = local_mask("experts.mask_gate_up", self.mask_gate_up)  # [E, H/bk, two, F/bn]
            masks = (m1.reshape(m1.shape[0], m1.shape[1], -1), local_mask("experts.mask_down", self.mask_down))
        return expert_ffn(x_MH, local("experts.w_gate_up", self.w_gate_up), local("experts.w_down", self.w_down),
                          offsets_E, self.kind, masks)

    # ---- tile-sparse experts ---------------------------------------------------------------
    def add_tile_masks(self, sp, etp: int = 1) -> None:
        """Per-expert tile masks of ``sp`` (an ExpertSparsity): gate_up [E, H/bk, two, F/bn]
        (gate and up tiles kept apart, so an ETP shard of F takes matching tiles of both) and
        down [E, F/bk, H/bn]; ``etp`` checks that the tiles divide every ETP shard of F."""
        E, H, two, Fn = self.w_gate_up.shape
        gate_up = sp.new_mask(E, H, Fn, etp=etp, etp_dim="N")  # checks tiles vs. F and its shards
        self.register_buffer("mask_gate_up", gate_up.unsqueeze(2).expand(-1, -1, two, -1).contiguous())
        self.register_buffer("mask_down", sp.new_mask(E, Fn, H, etp=etp, etp_dim="K"))

    def sparse_layers(self) -> dict:
        """``{name: (weight parameter, mask [E, Kt, Nt])}`` for ``meshfold.sparsity.TilePruner``:
        ``w_down`` [E, F, H]; ``w_gate_up`` [E, H, 2, F], which the pruner reads as [E, H, 2F]
        (gate columns, then up), with its mask [E, H/bk, 2, F/bn] viewed the same way."""
        m = self.mask_gate_up
        return {"w_gate_up": (self.w_gate_up, m.view(m.shape[0], m.shape[1], -1)),
                "w_down": (self.w_down, self.mask_down)}


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through (Qwen2-MoE / DeepSeek shared experts).

    ``kind="qwen2"`` scales its output by ``sigmoid(gate(x))`` (a [1, H] linear); ``"deepseek"``
    is ungated. Laid out like a dense TP MLP on the attention mesh (see moe_parallel).
    """

    def __init__(self, hidden: int, ffn: int, kind: str = "qwen2", dtype: torch.dtype | None = None):
        super().__init__()
        self.kind = kind
        self.w_gate_up = nn.Parameter(torch.empty(hidden, 2, ffn, dtype=dtype))  # [H, 2, F]
        self.w_down = nn.Parameter(torch.empty(ffn, hidden, dtype=dtype))  # [F, H]
        nn.init.normal_(self.w_gate_up, std=hidden ** -0.5)
        nn.init.normal_(self.w_down, std=ffn ** -0.5)
        if kind == "qwen2":
            self.gate = nn.Parameter(torch.empty(1, hidden, dtype=dtype))
            nn.init.normal_(self.gate, std=hidden ** -0.5)
        else:
            self.gate = None


def shared_expert_ffn(x_TH, w_gate_up, w_down):
    """SwiGLU on [T, H] with w_gate_up [H, 2, F], w_down [F, H] (F may be a TP slice)."""
    H, _, Fl = w_gate_up.shape
    return swiglu((x_TH @ w_gate_up.reshape(H, 2 * Fl)).view(-1, 2, Fl)) @ w_down
