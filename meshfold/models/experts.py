"""Routed experts (their weights and tile masks) and shared experts.

Shapes: N = expert-major rows, H = hidden, F = ffn per expert (its local slice under ETP),
E = experts (local ones under EP).

``w_gate_up`` is [E, H, 2, F]: gate and up projections fused, kept as a separate axis so that
sharding F over ``etp`` gives every rank matching gate and up columns (a flat [E, H, 2F] split
would hand one rank all gates and another all ups). ``w_down`` is [E, F, H]. How they compute is
:func:`meshfold.kernels.expert_ffn` (grouped GEMMs whose offsets are the cumulative row counts
per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.kernels import expert_ffn, swiglu
from meshfold.models import init

__all__ = ["Experts", "SharedExpert", "shared_expert_ffn"]


class Experts(nn.Module):
    """E routed experts' weights. Computation is :func:`expert_ffn` on the local shards.

    MoELayer's default experts; ones of the user's own follow the same
    :class:`~meshfold.models.interfaces.MoEExperts` contract (call signature, shapes, etp sums)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, kind: str = "swiglu",
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.kind = kind
        two = 2 if kind == "swiglu" else 1
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, hidden, two, ffn, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn, hidden, dtype=dtype))
        init.normal_(self.w_gate_up, std=hidden ** -0.5)
        init.normal_(self.w_down, std=ffn ** -0.5)

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
        self.register_buffer("mask_gate_up", init.ones_(gate_up.unsqueeze(2).expand(-1, -1, two, -1).contiguous()))
        self.register_buffer("mask_down", init.ones_(sp.new_mask(E, Fn, H, etp=etp, etp_dim="K")))

    def sparse_layers(self) -> dict:
        """``{name: (weight parameter, mask [E, Kt, Nt])}`` for ``meshfold.train.sparsity.TilePruner``:
        ``w_down`` [E, F, H]; ``w_gate_up`` [E, H, 2, F], which the pruner reads as [E, H, 2F]
        (gate columns, then up), with its mask [E, H/bk, 2, F/bn] viewed the same way."""
        m = self.mask_gate_up
        return {"w_gate_up": (self.w_gate_up, m.view(m.shape[0], m.shape[1], -1)),
                "w_down": (self.w_down, self.mask_down)}


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through (Qwen2-MoE / DeepSeek shared experts).

    ``kind="qwen2"`` scales its output by ``sigmoid(gate(x))`` (a [1, H] linear); ``"deepseek"``
    is ungated. Laid out like a dense TP MLP on the attention mesh (``meshfold.parallel.layouts.MOE_LAYOUT``).
    """

    def __init__(self, hidden: int, ffn: int, kind: str = "qwen2", dtype: torch.dtype | None = None):
        super().__init__()
        self.kind = kind
        self.w_gate_up = nn.Parameter(torch.empty(hidden, 2, ffn, dtype=dtype))  # [H, 2, F]
        self.w_down = nn.Parameter(torch.empty(ffn, hidden, dtype=dtype))  # [F, H]
        init.normal_(self.w_gate_up, std=hidden ** -0.5)
        init.normal_(self.w_down, std=ffn ** -0.5)
        if kind == "qwen2":
            self.gate = nn.Parameter(torch.empty(1, hidden, dtype=dtype))
            init.normal_(self.gate, std=hidden ** -0.5)
        else:
            self.gate = None

    def forward(self, x_TH, comm):
        """[T, H] -> [T, H] through ``comm`` (the MoE layer's: the TP entry / exit and this rank's
        weight shards). The weights are read inside this module's call, so module hooks (FSDP2's
        all-gather, when the shared expert is a group of its own) see it."""
        x_full = comm.shared_in(x_TH)
        y = comm.shared_out(shared_expert_ffn(x_full, comm.local("shared.w_gate_up", self.w_gate_up),
                                              comm.local("shared.w_down", self.w_down)))
        if self.gate is not None:
            y = y * torch.sigmoid(F.linear(x_TH, comm.local("shared.gate", self.gate)))
        return y


def shared_expert_ffn(x_TH, w_gate_up, w_down):
    """SwiGLU on [T, H] with w_gate_up [H, 2, F], w_down [F, H] (F may be a TP slice)."""
    H, _, Fl = w_gate_up.shape
    return swiglu((x_TH @ w_gate_up.reshape(H, 2 * Fl)).view(-1, 2, Fl)) @ w_down
