"""Multi-token prediction (MTP): DeepSeek-V3's extra prediction depths (arXiv 2412.19437, section 2.2).

Legend: B = sequences, S = sequence length (this rank's tokens), H = hidden, V = vocab, D = depths.

Depth ``k`` (1..D) at position ``i`` reads the previous depth's hidden state ``h^{k-1}_i`` and
the embedding of token ``t_{i+k}``, and predicts token ``t_{i+k+1}``::

    x_i   = proj([emb_norm(embed(t_{i+k})); hidden_norm(h^{k-1}_i)])     # 2H -> H
    h^k   = head_norm(block(x))                                           # one transformer block
    p^k_i = softmax(head(h^k_i))                                          # the model's own head

``h^0`` is what the main head reads: the last block's output through the model's final norm.
Each depth's output is normed the same way (``head_norm``, DeepSeek-V3's ``shared_head.norm``)
before both the head and the next depth read it, as Megatron-Core, transformers' ``MtpLayer`` and
the inference engines that serve DeepSeek-V3's MTP weights chain them. ``embed`` and ``head`` are
the main model's (shared, not copies). The concatenation puts the embedding first, as DeepSeek-V3's
released weights and transformers' ``MtpLayer`` do (the paper writes the hidden state first; only
the order of ``proj``'s input columns differs).

The shifted tokens come from the targets: with ``targets[:, i] = t_{i+1}`` (the next token),
``t_{i+k} = targets[:, i+k-1]`` and the depth-k target ``t_{i+k+1} = targets[:, i+k]``.
:func:`mtp_targets` lays them side by side, ``[B, S] -> [B, S, 1 + D]`` (column j: the targets
shifted left by j, -100 past the end), so every depth's inputs and targets are per-position data
that a fold shards like the tokens (no shift across ranks). A depth-k prediction counts only where
both the token it reads and the token it predicts are known (neither is -100).

The objective (:func:`mtp_objective`)::

    loss = L_main + mtp_loss_weight * (1 / D) * sum_k L_k

with ``L_main`` the mean cross-entropy of the main head over targets != -100 and ``L_k`` the mean
cross-entropy of depth k over its own counted positions (DeepSeek-V3's ``lambda / D * sum_k``).
"""

from __future__ import annotations

import torch
from torch import nn

from meshfold.models import init
from meshfold.models.layers import RMSNorm

__all__ = ["MTPDepth", "mtp_targets", "depth_inputs", "counted", "mtp_objective"]


class MTPDepth(nn.Module):
    """One prediction depth: ``forward(h [B, S, H], e [B, S, H], positions) -> h^k [B, S, H]``.

    ``h`` is the previous depth's output (depth 1: the main model's normed last hidden state),
    ``e`` the embeddings of the tokens k ahead. ``block`` is a transformer block of the model's
    kind (built by the model: GQA or MLA, dense or MoE as layer ``cfg.layers + k - 1`` would be).
    The output is normed by ``head_norm``: what the shared head and the next depth read.
    """

    def __init__(self, hidden: int, eps: float, block: nn.Module, dtype: torch.dtype | None = None):
        super().__init__()
        self.emb_norm = RMSNorm(hidden, eps, dtype)
        self.hidden_norm = RMSNorm(hidden, eps, dtype)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)  # weight [H, 2H]
        init.normal_(self.proj.weight, std=(2 * hidden) ** -0.5)
        self.block = block
        self.head_norm = RMSNorm(hidden, eps, dtype)

    def forward(self, h: torch.Tensor, e: torch.Tensor, positions, rope=None) -> torch.Tensor:
        x = self.proj(torch.cat([self.emb_norm(e), self.hidden_norm(h)], dim=-1))  # [B, S, H]
        return self.head_norm(self.block(x, positions, rope))


def mtp_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """Next-token ``targets`` [B, S] -> [B, S, 1 + depth]: column j is ``targets`` shifted left by
    j positions, -100 where that runs past the sequence's end. Column 0 is the main head's target,
    column k the depth-k target, column k - 1 the token depth k reads."""
    B, S = targets.shape
    cols = [targets]
    for j in range(1, depth + 1):
        pad = targets.new_full((B, min(j, S)), -100)
        cols.append(torch.cat([targets[:, j:], pad], dim=1))
    return torch.stack(cols, dim=-1)


def depth_inputs(targets_bsd: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, S] depth k reads, its targets [B, S])`` from :func:`mtp_targets`' output:
    a read token that is unknown (-100) becomes id 0 and its position's target -100."""
    read, want = targets_bsd[..., k - 1], targets_bsd[..., k]
    known = read != -100
    return torch.where(known, read, 0), torch.where(known, want, -100)


def counted(targets_bsd: torch.Tensor) -> torch.Tensor:
    """Which positions each term of the objective counts, bool [B, S, 1 + D] of :func:`mtp_targets`'
    output: column 0 the main head's (its target known), column k depth k's (the token it reads
    and the one it predicts both known, as :func:`depth_inputs` masks them)."""
    known = targets_bsd != -100
    return torch.cat([known[..., :1], known[..., :-1] & known[..., 1:]], dim=-1)


def mtp_objective(main: torch.Tensor, depth_losses: list[torch.Tensor], weight: float) -> torch.Tensor:
    """``main + weight * mean(depth_losses)``: the training objective with D = len(depth_losses)."""
    if not depth_losses:
        return main
    return main + weight * torch.stack(depth_losses).mean()
