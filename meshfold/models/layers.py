"""Dense building blocks: RMSNorm and the SwiGLU MLP.

Shapes: T = tokens (any leading dims), H = hidden, F = ffn.
"""

from __future__ import annotations

import torch
from torch import nn

from meshfold.models import init
from meshfold.models.experts import shared_expert_ffn

__all__ = ["RMSNorm", "MLP", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, the statistics in at least fp32 (see :class:`RMSNorm`)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim (size ``dim``).

    The statistics run in at least fp32 (bf16 inputs are upcast, as Hugging Face does); an fp64
    input stays fp64, where HF would round it through fp32, so fp64 gradient checks stay exact.

    ``norm`` is the function that computes it, :func:`rms_norm`; a runtime wrapper may set a
    compiled one on an instance from outside (:mod:`meshfold.parallel.compile`), taking the weight
    as an argument, so the weight is read (and laid out) outside the compiled code.
    """

    norm = staticmethod(rms_norm)

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = init.ones_(nn.Parameter(torch.empty(dim, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class MLP(nn.Module):
    """Dense SwiGLU MLP ``down(silu(gate x) * up x)``, the same layout as the shared expert:
    ``w_gate_up`` [H, 2, F] (0 = gate, 1 = up; sharding F keeps gate and up columns together),
    ``w_down`` [F, H]. ``ffn`` computes it from the weights (:func:`shared_expert_ffn`; set from
    outside on an instance to replace it, e.g. with a compiled SwiGLU, :mod:`meshfold.parallel.compile`)."""

    ffn = staticmethod(shared_expert_ffn)

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(hidden, 2, ffn, dtype=dtype))  # [H, 2, F]
        self.w_down = nn.Parameter(torch.empty(ffn, hidden, dtype=dtype))  # [F, H]
        init.normal_(self.w_gate_up, std=hidden ** -0.5)
        init.normal_(self.w_down, std=ffn ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.ffn(x.reshape(-1, shape[-1]), self.w_gate_up, self.w_down).reshape(shape)
