"""The routed experts' MLP: grouped GEMM, activation, grouped GEMM, over expert-major rows.

Legend: N = expert-major rows, H = hidden, F = ffn per expert (its local slice under ETP),
E = experts (local ones under EP).

``expert_ffn(x [N, H], w_gate_up [E, H, two, F], w_down [E, F, H], offsets [E] int32, kind)`` is
the op the MoE layer calls; ``backend`` chooses its implementation the way :func:`grouped_mm`'s
does:

* ``"auto"``: :func:`grouped_mm` (Triton on CUDA, the CPU pool's block GEMMs on CPU) with the
  fused activations below. On CPU the activations run in row parts on the CPU pool
  (:mod:`.cpu_pool`), so no OpenMP team is left spin-waiting between the two grouped GEMMs on
  the cores their workers need; elsewhere each pass is one part. Elementwise work, so the split
  does not change a value (GELU: up to a few ulps, see :func:`gelu`).
* ``"reference"``: :func:`grouped_mm_reference` and the plain activations
  (:func:`swiglu_reference`, ``F.gelu``), differentiated by autograd: the definition the fast
  path is tested against.

``w_gate_up`` keeps gate and up as a separate axis (``two`` = 2 for SwiGLU, 1 for GELU), so that
sharding F over ``etp`` gives every rank matching gate and up columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from meshfold.kernels.cpu_pool import in_parts
from meshfold.kernels.grouped_mm import grouped_mm
from meshfold.kernels.reference import grouped_mm_reference
from meshfold.runtime import spmd

__all__ = ["expert_ffn", "swiglu", "swiglu_reference", "gelu", "PART_ELEMENTS"]

FFN_BACKENDS = ("auto", "reference")


@spmd.per_rank_op  # under LocalTensorMode: once per simulated rank (its rows per expert differ)
def expert_ffn(x_NH, w_gate_up, w_down, offsets_E, kind: str, masks=(None, None), backend: str = "auto"):
    """Grouped expert MLP: swiglu ``down(silu(gate x) * up x)`` or gelu ``down(gelu(up x))``.

    ``w_gate_up`` [E, H, 2, F] (gelu: [E, H, 1, F]), ``w_down`` [E, F, H], ``offsets_E`` int32.
    ``masks`` are optional tile masks for the two weights (tile-sparse experts). -> [N, H].
    """
    if backend not in FFN_BACKENDS:
        raise ValueError(f"backend={backend!r}; valid: {', '.join(FFN_BACKENDS)}")
    E, H, two, Fl = w_gate_up.shape
    if backend == "reference":
        mm, act = grouped_mm_reference, (swiglu_reference if kind == "swiglu" else F.gelu)
    else:
        mm, act = grouped_mm, (swiglu if kind == "swiglu" else gelu)
    h = mm(x_NH, w_gate_up.reshape(E, H, two * Fl), offsets_E, tile_mask=masks[0])
    a = act(h.view(-1, 2, Fl) if kind == "swiglu" else h)
    return mm(a, w_down, offsets_E, tile_mask=masks[1])


def swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of h [N, 2, F] (gate, up) -> [N, F]: :func:`swiglu_reference`'s
    values, with a backward that keeps only h (not ``silu(gate)`` too: one [N, F] buffer less)
    and writes both halves of dh into one [N, 2, F] tensor (no stack of the two halves)."""
    return _SwiGLU.apply(h_N2F)


def swiglu_reference(h_N2F: torch.Tensor) -> torch.Tensor:
    gate, up = h_N2F.unbind(1)
    return F.silu(gate) * up


PART_ELEMENTS = 1 << 19  # elements of h per part of swiglu / gelu on CPU: 1-2 MiB, kept in cache


def _in_row_parts(part, h: torch.Tensor) -> None:
    """``part(n0, n1)`` over h's rows, in parts of ~PART_ELEMENTS elements (on the pool on CPU)."""
    rows = max(1, PART_ELEMENTS // max(1, math.prod(h.shape[1:])))  # h may have no rows
    in_parts(part, h.shape[0], rows, h.device)


class _SwiGLU(torch.autograd.Function):
    """Both passes in row parts (:func:`_in_row_parts`)."""

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


def gelu(h_NF: torch.Tensor) -> torch.Tensor:
    """``F.gelu`` (erf form) of h [N, F] and its gradient, in row parts like :func:`swiglu`.
    h is contiguous, so ATen runs each part as one vector loop with a scalar tail: an element at
    a part's end may take the scalar erf and differ from one whole ``F.gelu`` by a few ulps (as
    ``F.gelu``'s own split over OpenMP threads does). The parts are fixed by the shape, so results
    are deterministic."""
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
